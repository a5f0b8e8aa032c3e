"""The pieces of Trainer.fit that keep state across steps: the non-finite flags, kept on the
devices until the loop has to look at them, and the log records (throughput, MFU) that go to the
writers, progress bar, event log (`progress`) and callbacks."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import jax

from jaxpar.checkpoint import truncate_metrics
from jaxpar.metrics import CompositeWriter, JsonlWriter, Progress, TensorBoardWriter, mfu


class NonfiniteWatch:
    """Each step's on-device `nonfinite` flag (the step itself already skipped the update). The
    flags wait on the devices until `resolve()` (at a log, a checkpoint, the end) fetches all of
    them in one transfer: reading each at once would stall the host on the devices every step.

    `resolve()` returns the bad steps it learned of and counts the streak of bad steps in a row;
    when the streak reaches `limit`, `tripped` is (that step, the streak) and the flags after it
    are dropped (the loop stops or rolls back to before the streak)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.pending: list[tuple[int, Any]] = []
        self.streak = 0    # bad steps in a row, up to the last resolved step
        self.tripped: tuple[int, int] | None = None

    def push(self, step: int, flag) -> None:
        if flag is not None:
            self.pending.append((step, flag))

    def resolve(self) -> list[int]:
        if not self.pending:
            return []
        steps = [n for n, _ in self.pending]
        # copies only, started together (one wait, not one per step); no device computation:
        # one (a stack of the flags) would queue behind the step dispatched since and wait for it
        flags = jax.device_get([f for _, f in self.pending])
        self.pending, bad = [], []
        for n, flag in zip(steps, flags):
            if not flag:
                self.streak = 0
                continue
            bad.append(n)
            self.streak += 1
            if self.limit is not None and self.streak >= self.limit:
                self.tripped = (n, self.streak)
                break
        return bad

    def reset(self) -> None:
        self.pending, self.streak, self.tripped = [], 0, None


class StepLog:
    """Logged steps as records: {"step", metrics..., tokens_per_s, step_time_s[, mfu]}, written to
    metrics.jsonl and TensorBoard under `out_dir` (process 0) and the configured writers."""

    def __init__(self, trainer, out_dir: Path | None, start_step: int, show_progress: bool):
        t = trainer.cfg.train
        self.trainer, self.out_dir = trainer, out_dir
        writers = list(trainer.writers)
        if out_dir is not None and jax.process_index() == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            truncate_metrics(out_dir / "metrics.jsonl", start_step)  # reads like one uninterrupted run
            writers += [JsonlWriter(out_dir / "metrics.jsonl"), TensorBoardWriter(out_dir / "tb")]
        self.writer = CompositeWriter(writers)
        self.bar = Progress(t.steps, start_step, enabled=show_progress and jax.process_index() == 0)
        self.tokens_per_step = t.global_batch * t.seq_len
        self.last, self.last_step = time.perf_counter(), start_step
        self.history: list[dict] = []

    def record(self, step: int, metrics: dict) -> dict:
        tr = self.trainer
        metrics = {k: float(v) for k, v in jax.device_get(
            {k: v for k, v in metrics.items() if k != "nonfinite"}).items()}
        now = time.perf_counter()
        dt, self.last, self.last_step = (now - self.last) / (step - self.last_step), now, step
        rec = {"step": step, **metrics, "tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt}
        if tr.cfg.train.skip_nonfinite:
            rec["skipped_steps"] = tr.skipped_steps
        u = mfu(rec["tokens_per_s"] / tr.mesh.devices.size, tr.flops_per_token, tr.peak)
        if u is not None:
            rec["mfu"] = u
        self.history.append(rec)
        self.writer.write(step, rec)
        self.bar.update(step, rec["loss"], rec["tokens_per_s"])
        if getattr(tr, "events", None) is not None:  # before the callbacks: the exporter reads it
            tr.events("progress", step=step)
        for cb in tr.callbacks:
            cb.on_log(tr, rec)
        return rec

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluation, a blocking checkpoint save) is no step's: step_time_s and
        tokens_per_s leave it out, so a step that evaluates reads like the others. The caller waits
        for the steps in flight first (their device time is training)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.last += time.perf_counter() - t0

    def truncate(self, step: int) -> None:
        """Forget what was logged after `step` (a rollback to it)."""
        self.history = [h for h in self.history if h["step"] <= step]
        if self.out_dir is not None and jax.process_index() == 0:
            truncate_metrics(self.out_dir / "metrics.jsonl", step)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
