"""Hang and straggler watchdog.

* Straggler: a step whose wall time exceeds `straggler_factor` x the median of the last `window`
  steps (after `min_steps` have been timed) is reported when it ends.
* Hang: a monitor thread reports when no step has finished within `timeout_s` (of the previous
  one, or of the loop's start). With `abort`, it then exits the process with `exit_code` so a
  launcher (torchrun-style restart, Slurm requeue, Kubernetes) can restart from the last checkpoint.

A report is a logging warning (logger `jaxpar.observe.watchdog`) holding the step, the elapsed time
and the Python stack of every thread (the training thread's stack shows where it waits: inside a
step's dispatch, a `device_get`, a checkpoint save...). It is also appended to `watchdog.log` in
the run dir, and kept in `Watchdog.reports`.

A step ends when its result is ready on the devices. The loop never waits for that (it
dispatches ahead, jaxpar/train/trainer.py): `on_step_end` queues the step's metrics and a second
thread (`jaxpar-watchdog-ready`) waits for each in turn, so step times are the times between
consecutive results (device time, or the host's when the host is slower), and a step stuck on
the devices (a collective waiting for a peer) or in the host loop stops the clock either way.
A step during which a checkpoint save was recorded (`record_checkpoint_save`), an evaluation ran
(eval.every) or a profile window started or stopped is not judged (`exempt_current_step`).
"""
from __future__ import annotations

import logging
import os
import queue
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any, Callable

import jax

from jaxpar.metrics import collective_ops
from jaxpar.train.callbacks import Callback

logger = logging.getLogger("jaxpar.observe.watchdog")

_exempt = [0]
# reports made in this process, by kind, and the step of the last one (the Prometheus exporter reads them)
report_counts: dict[str, int] = {"straggler": 0, "hang": 0}
last_report_step: dict[str, int] = {}


def exempt_current_step() -> None:
    """Mark the step now running (or its callbacks) as slow on purpose: a checkpoint save, a
    profiler start/stop. The straggler check skips it. Callable from any thread."""
    _exempt[0] += 1


def thread_stacks() -> str:
    """The current Python stack of every thread, innermost call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread {names.get(ident, "?")!r} (id {ident}):\n{stack}')
    return "\n".join(parts)


class Watchdog(Callback):
    def __init__(self, timeout_s: float = 900.0, straggler_factor: float = 3.0, window: int = 50,
                 min_steps: int = 5, abort: bool = False, exit_code: int = 3,
                 log_dir: str | Path | None = None, poll_s: float | None = None,
                 exit_fn: Callable[[int], Any] = os._exit) -> None:
        self.timeout_s, self.factor, self.min_steps = timeout_s, straggler_factor, min_steps
        self.abort, self.exit_code, self.exit_fn = abort, exit_code, exit_fn
        self.log_path = Path(log_dir) / "watchdog.log" if log_dir is not None else None
        self.poll_s = poll_s if poll_s is not None else min(max(timeout_s / 10, 0.05), 10.0)
        self.times: deque[float] = deque(maxlen=window)
        self.reports: list[dict] = []
        self._last = 0.0  # perf_counter at the last step's result (or the loop's start)
        self._step = 0  # steps whose results are ready
        self._exempt_seen = 0
        self._stalled_since: float | None = None  # a hang already reported for this wait
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue()  # (step, arrays, exempt) of dispatched steps
        self._first = True
        self._collectives = ""

    # -------------------------------------------------------------- callback hooks

    def on_start(self, trainer: Any, step: int, state: Any) -> None:
        self._step, self._last, self._first = step, time.perf_counter(), True
        self._collectives = _collective_summary(getattr(trainer, "compiled", None))
        self._exempt_seen = _exempt[0]
        self._stop.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._monitor, name="jaxpar-watchdog", daemon=True)
            self._thread.start()
        if self._ready is None:
            self._ready = threading.Thread(target=self._wait_results, name="jaxpar-watchdog-ready",
                                           daemon=True)
            self._ready.start()

    def on_step_end(self, trainer: Any, step: int, state: Any, metrics: Any) -> None:
        seen = _exempt[0]
        saved, self._exempt_seen = seen != self._exempt_seen, seen
        leaves = [x for x in jax.tree.leaves(metrics) if isinstance(x, jax.Array)]
        if self._ready is None:  # not started through on_start: judge at once
            self._finished(step, saved)
        else:
            self._queue.put((step, leaves, saved))

    def on_end(self, trainer: Any, step: int, state: Any) -> None:
        self.close()

    def close(self) -> None:
        """Judge the steps still queued (waiting for their results), then stop both threads."""
        if self._ready is not None:
            self._queue.put(None)
            self._ready.join(timeout=self.timeout_s)  # a step stuck on the devices: give up
            self._ready = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -------------------------------------------------------------- internals

    def _wait_results(self) -> None:
        while (item := self._queue.get()) is not None:
            step, leaves, saved = item
            try:
                jax.block_until_ready(leaves)  # this thread waits; the loop runs on
            except Exception:  # noqa: BLE001 (a failed step: the loop raises it)
                pass
            self._finished(step, saved)

    def _finished(self, step: int, saved: bool) -> None:
        now = time.perf_counter()
        dt, self._last, self._step = now - self._last, now, step
        self._stalled_since = None
        if self._first or saved:  # warm-up, a checkpoint save, a profiler start: not judged
            self._first = False
            return
        if len(self.times) >= self.min_steps:
            median = statistics.median(self.times)
            if dt > self.factor * median:
                self._report("straggler", step, dt,
                             f"step {step} took {dt:.3f}s, {dt / median:.1f}x the median "
                             f"{median:.3f}s of the last {len(self.times)} steps")
        self.times.append(dt)

    def _monitor(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = time.perf_counter() - self._last
            if waited > self.timeout_s and self._stalled_since != self._last:
                self._stalled_since = self._last
                self._report("hang", self._step + 1, waited,
                             f"no step finished within {self.timeout_s:g}s: step {self._step + 1} has "
                             f"been running for {waited:.1f}s (last finished step: {self._step})")
                if self.abort:
                    msg = f"watchdog: aborting with exit code {self.exit_code} so the launcher can restart"
                    logger.error(msg)
                    self._append(msg + "\n")
                    for h in logging.getLogger().handlers + logger.handlers:
                        h.flush()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    self.exit_fn(self.exit_code)

    def _report(self, kind: str, step: int, elapsed: float, message: str) -> None:
        stacks = thread_stacks()
        if kind == "hang" and self._collectives:
            message += f"\ncollectives in the compiled step (one of them may be waiting): {self._collectives}"
        report_counts[kind] = report_counts.get(kind, 0) + 1
        last_report_step[kind] = step
        rec = {"kind": kind, "step": step, "elapsed_s": elapsed, "message": message, "stacks": stacks,
               "process": jax.process_index(), "time": time.time()}
        self.reports.append(rec)
        text = (f"watchdog ({kind}, process {rec['process']}): {message}\n"
                f"Python stacks of all threads:\n{stacks}")
        logger.warning(text)
        self._append(time.strftime("%Y-%m-%d %H:%M:%S ") + text + "\n")

    def _append(self, text: str) -> None:
        if self.log_path is None:
            return
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            pass


def _collective_summary(compiled: Any) -> str:
    """`12 x all-reduce (3.1 MiB), 4 x all-gather (...)` from the compiled step's HLO ('' if none)."""
    if compiled is None:
        return ""
    try:
        ops = collective_ops(compiled.as_text(), count_loops=True)
    except Exception:
        return ""
    by_kind: dict[str, list[int]] = {}
    for op in ops:
        n, b = by_kind.setdefault(op.kind, [0, 0]), op.bytes
        n[0] += 1
        n[1] += b
    return ", ".join(f"{n} x {k} ({b / 2**20:.1f} MiB/step)" for k, (n, b) in by_kind.items())
