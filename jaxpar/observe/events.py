"""The run's event log: `<run dir>/events.jsonl`, one JSON object per line, kept across restarts.

Everything that decides where a run's wall time went writes here: the trainer (start, compile,
first step, checkpoint save/restore blocking time, preemption, resume, end) and the launchers
(`jaxpar launch`, `jaxpar launch --ray`: restart, node lost, waiting for nodes). `jaxpar goodput`
reads it back. Each event is {"time": unix seconds, "event": kind, "source": who wrote it, ...}.

Appends are single `write` calls of one line on a file opened in append mode, so processes that
share the run dir (a launcher and its process 0) interleave whole lines; a line cut short by a
crash is skipped by `read_events`, never fatal. Only process 0 of a run writes (callers check).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

EVENTS_FILE = "events.jsonl"


def events_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / EVENTS_FILE


def record(run_dir: str | os.PathLike, event: str, source: str = "train", **fields: Any) -> dict:
    """Append one event (now) to the run dir's log; returns what was written."""
    entry = {"time": fields.pop("time", time.time()), "event": event, "source": source, **fields}
    path = events_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(entry, sort_keys=True, default=str) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return entry


def read_events(run_dir: str | os.PathLike) -> Iterator[dict]:
    """The events in the order they were written; lines that are not whole JSON objects skipped."""
    path = events_path(run_dir)
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and "event" in entry and "time" in entry:
                yield entry


def restart_count(environ: dict | None = None) -> int:
    """The launcher's attempt number (JAXPAR_RESTART_COUNT, 0 when unset or not a number)."""
    try:
        return max(0, int((environ if environ is not None else os.environ).get("JAXPAR_RESTART_COUNT", 0)))
    except ValueError:
        return 0


class RunEvents:
    """One writer's events into one run dir: `events("progress", step=10)`. With `run_dir` None
    (a process other than 0, a run without a run dir) every call does nothing, so callers never
    check."""

    def __init__(self, run_dir: str | os.PathLike | None, source: str = "train") -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.source = source
        self.started = False

    def __call__(self, event: str, **fields: Any) -> dict | None:
        if self.run_dir is None:
            return None
        return record(self.run_dir, event, source=self.source, **fields)

    def start(self, **fields: Any) -> None:
        """The `start` event (once per writer), with the launcher's restart count."""
        if not self.started:
            self.started = True
            self("start", restart_count=restart_count(), **fields)
