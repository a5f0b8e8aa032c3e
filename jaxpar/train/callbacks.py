"""Hooks into the training loop, so checkpointing, exporters and watchdogs stay out of it.

A callback implements any of these; the loop calls them in order on process 0 and others alike
(a callback that must act on process 0 only checks `jax.process_index()` itself).
"""
from __future__ import annotations

from typing import Any


class Callback:
    def on_start(self, trainer: Any, step: int, state: Any) -> None:
        """Before the first step (`step` is where the loop starts)."""

    def on_step_end(self, trainer: Any, step: int, state: Any, metrics: Any) -> None:
        """After each step (`step`: steps completed); `metrics` are device arrays (reading them
        syncs the device)."""

    def on_log(self, trainer: Any, record: dict) -> None:
        """For each logged record (floats: step, loss, tokens_per_s, ...)."""

    def on_end(self, trainer: Any, step: int, state: Any) -> None:
        """After the loop, also when it stops early or fails (`step`: steps completed)."""
