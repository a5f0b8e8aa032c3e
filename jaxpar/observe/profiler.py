"""Profiler window: a jax.profiler trace of steps `start..end` (inclusive, counted from 1).

The trace starts when step `start - 1` has finished (or at the loop's start) and stops once step
`end`'s result is ready, so it holds exactly those steps. Files land in
`<run dir>/profile/plugins/profile/<timestamp>/`: `*.xplane.pb` (TensorBoard's profile plugin /
XProf) and, with `perfetto`, `perfetto_trace.json.gz` (https://ui.perfetto.dev). Every process
traces its own devices (one `<host>.xplane.pb` each). `jaxpar profile RUN_DIR` says how to open them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import yaml

from jaxpar.observe.watchdog import exempt_current_step
from jaxpar.train.callbacks import Callback

HOW_TO_OPEN = """\
The trace of a `profile.steps: [start, end]` window is in RUN_DIR/profile/plugins/profile/<time>/.

  XProf (trace viewer, op profile, memory; the TensorBoard profile plugin's standalone form):
      pip install xprof
      xprof --logdir RUN_DIR/profile --port 8791      then open http://localhost:8791
  or TensorBoard:
      pip install xprof tensorboard
      tensorboard --logdir RUN_DIR/profile            then open http://localhost:6006/#profile

  Perfetto (timeline only, nothing to install):
      open https://ui.perfetto.dev and drag in perfetto_trace.json.gz
      (a *.trace.json.gz also opens in chrome://tracing)

To capture one: jaxpar train CONFIG profile.steps=[10,12]
"""


def run_profile_dir(run_dir: str | Path) -> str:
    """The run's `profile.dir` from its saved config.yaml (default `profile`; also for a dir that
    would leave the run dir, which the config refuses: a hand-edited file never points elsewhere)."""
    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
        sub = str((cfg.get("profile") or {}).get("dir") or "profile")
    except (OSError, ValueError, AttributeError):
        return "profile"
    return sub if inside(sub) else "profile"


def inside(sub: str) -> bool:
    """Whether the relative path `sub` stays inside the dir it is joined to (no '..' out, not absolute)."""
    return not os.path.isabs(sub) and os.path.normpath(sub).split(os.sep)[0] != ".."


def trace_files(run_dir: str | Path, sub: str = "profile") -> list[Path]:
    """Trace files under `run_dir/sub` (xplane protobufs and JSON traces), oldest window first."""
    root = Path(run_dir) / sub
    pats = ("*.xplane.pb", "*.trace.json.gz", "perfetto_trace.json.gz")
    return sorted({p for pat in pats for p in root.rglob(pat)})


class ProfileWindow(Callback):
    def __init__(self, start: int, end: int, log_dir: str | Path, perfetto: bool = True,
                 run_dir: str | Path | None = None) -> None:
        """`run_dir`: what `jaxpar profile` is told to open (default: log_dir's parent, which is
        the run dir only for a one-level profile.dir)."""
        if not 1 <= start <= end:
            raise ValueError(f"profile window must be 1 <= start <= end, got [{start}, {end}]")
        self.start, self.end, self.log_dir, self.perfetto = start, end, Path(log_dir), perfetto
        self.run_dir = Path(run_dir) if run_dir is not None else self.log_dir.parent
        self.active = False
        self.done = False

    def _begin(self, trainer: Any) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.log_dir), create_perfetto_trace=self.perfetto)
        exempt_current_step()
        self.active = True
        getattr(trainer, "log", print)(f"profiling steps {self.start}-{self.end} into {self.log_dir}")

    def _finish(self, trainer: Any) -> None:
        if self.active:
            jax.profiler.stop_trace()
            exempt_current_step()
            self.active, self.done = False, True
            getattr(trainer, "log", print)(
                f"profile written to {self.log_dir} (open it: jaxpar profile {self.run_dir})")

    def on_start(self, trainer: Any, step: int, state: Any) -> None:
        if not self.done and step == self.start - 1:
            self._begin(trainer)
        elif not self.done and self.start - 1 < step < self.end:  # resumed inside the window
            self.start = step + 1
            self._begin(trainer)

    def on_step_end(self, trainer: Any, step: int, state: Any, metrics: Any) -> None:
        if self.active and step >= self.end:
            jax.block_until_ready((state, metrics))
            self._finish(trainer)
        elif not self.active and not self.done and step == self.start - 1:
            self._begin(trainer)

    def on_end(self, trainer: Any, step: int, state: Any) -> None:
        self._finish(trainer)
