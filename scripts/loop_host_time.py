"""Where the training loop's host time goes: `python scripts/loop_host_time.py [overrides...]`.

Runs the quickstart (checkpoints and eval off) through `Trainer.fit` and prints, per step after
the first 10: wall time, the loop thread's time building batches, its time inside the step call
(dispatch; and waiting, when dispatch has to wait for the devices), and its device-to-host reads
(every ArrayImpl._value read on the loop's thread). Works on this tree and on older ones (no
data.prefetch there), for before/after figures in docs/benchmarks.md.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax._src.array import ArrayImpl  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.train.callbacks import Callback  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

WARMUP = 10


class Clock(Callback):
    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, trainer, step, state, metrics):
        self.ends.append(time.perf_counter())


def main(overrides: list[str]) -> None:
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["train.steps=60", "train.progress=false",
                                                         "eval.every=0", "checkpoint.enabled=false",
                                                         *overrides])
    tr = Trainer(cfg, log=lambda s: None)
    compiled = tr.compile()
    timers = {"batch": 0.0, "step": 0.0}
    reads, counting, main_thread = [0], [False], threading.main_thread()

    def timed(name, fn):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if counting[0] and threading.current_thread() is main_thread:
                timers[name] += time.perf_counter() - t0
            return out
        return wrapped

    original = ArrayImpl._value

    def counted(self):
        if counting[0] and threading.current_thread() is main_thread:
            reads[0] += 1
        return original.fget(self)

    ArrayImpl._value = property(counted)
    tr.loader.batch = timed("batch", tr.loader.batch)
    tr.compiled = timed("step", compiled)
    clock = Clock()

    class StartCounting(Callback):
        def on_step_end(self, trainer, step, state, metrics):
            counting[0] = step >= WARMUP

    tr.callbacks = [clock, StartCounting()]
    tr.fit(tr.init_state(), progress=False)
    n = len(clock.ends) - WARMUP
    wall = (clock.ends[-1] - clock.ends[WARMUP - 1]) / n
    print(f"log_every={cfg.train.log_every} prefetch={getattr(cfg.data, 'prefetch', 'n/a')}: "
          f"wall {wall * 1e3:.1f} ms/step, loop thread building batches {timers['batch'] / n * 1e3:.2f} "
          f"ms/step, in the step call {timers['step'] / n * 1e3:.2f} ms/step, "
          f"device-to-host reads {reads[0] / n:.2f}/step")


if __name__ == "__main__":
    main(sys.argv[1:])
