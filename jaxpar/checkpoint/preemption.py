"""SIGTERM / SIGINT during training: finish the step, save, exit 0 (within a grace period)."""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

import jax
from jax.experimental import multihost_utils


class Preemption:
    """SIGTERM / SIGINT: finish the current step, save, exit cleanly.

    With jax.distributed (more than one process), every process asks jax's preemption sync point
    (which learns of SIGTERM through the coordination service), so all agree on the step to save.
    Otherwise jaxpar installs its own handlers. A second signal is ignored with a message: it would
    interrupt the save it asked for, and the grace timer (started by the first) already bounds the
    wait, ending the process if saving takes longer than `grace_s`. A third exits at once, without
    the save (the previous complete checkpoint is kept), never with a traceback."""

    def __init__(self, grace_s: float = 60.0, log: Callable[[str], None] = print) -> None:
        self.grace_s = grace_s
        self.log = log
        self.requested: str | None = None
        self.distributed = jax.process_count() > 1
        self._old: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self.repeats = 0  # signals after the first

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is not threading.main_thread():
            return self
        sigs = (signal.SIGINT,) if self.distributed else (signal.SIGTERM, signal.SIGINT)
        for sig in sigs:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except (ValueError, OSError):
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError):
                pass
        self._old.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            self._again(name, signum)
            return
        self.requested = name
        print(f"jaxpar: {name} received: finishing this step, saving, exiting "
              f"(grace {self.grace_s:g}s)", file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.grace_s, self._expired)
        self._timer.daemon = True
        self._timer.start()

    def _again(self, name: str, signum: int) -> None:
        """A signal after the first: the second waits for the save, the third gives it up."""
        self.repeats += 1
        if self.repeats == 1:
            print(f"jaxpar: {name} again: still finishing the step and saving it (interrupting the "
                  f"save would lose it; at most {self.grace_s:g}s from the first signal); send it once "
                  f"more to exit now without saving", file=sys.stderr, flush=True)
            return
        print(f"jaxpar: error: {name} a third time: exiting without saving this step (the previous "
              f"complete checkpoint is kept)", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def _expired(self) -> None:
        print(f"jaxpar: error: the preemption grace period ({self.grace_s:g}s) ran out before the "
              f"save finished; exiting without it (the previous complete checkpoint is kept)",
              file=sys.stderr, flush=True)
        os._exit(1)

    def should_stop(self, step: int) -> bool:
        if self.requested is not None:
            return True
        if self.distributed:
            try:
                if multihost_utils.reached_preemption_sync_point(step):
                    self.requested = "preemption notice"
                    return True
            except Exception:  # no preemption service configured
                return False
        return False
