"""The run's event log: `<run dir>/events.jsonl`, one JSON object per line, kept across restarts.

Everything that decides where a run's wall time went writes here: the trainer (start, compile,
first step, checkpoint save/restore blocking time, preemption, resume, end) and the launchers
(`jaxpar launch`, `jaxpar launch --ray`: restart, node lost, waiting for nodes). `jaxpar goodput`
reads it back. Each event is {"time": unix seconds, "event": kind, "source": who wrote it, ...}.

Appends are single `write` calls of one line on a file opened in append mode, so processes that
share the run dir (a launcher and its process 0) interleave whole lines; a line cut short by a
crash, or one whose fields are not what the writers write (a hand edit: `"time": "abc"`), is
skipped by `read_events`, never fatal (`jaxpar goodput` names the skipped lines). Only process 0
of a run writes (callers check).
"""
from __future__ import annotations

import json
import math
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


def malformed(entry: Any) -> str | None:
    """Why `entry` (one parsed line) is not an event the readers can use; None when it is."""
    if not isinstance(entry, dict) or "event" not in entry or "time" not in entry:
        return "not an event object (needs \"time\" and \"event\")"
    if not isinstance(entry["event"], str):
        return f"\"event\": {entry['event']!r} is not a name"
    for key in ("time", "blocking_s"):
        v = entry.get(key)
        if key == "blocking_s" and v is None:
            continue
        try:
            ok = not isinstance(v, bool) and math.isfinite(float(v))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return f"\"{key}\": {v!r} is not a number of seconds"
    step = entry.get("step")
    if step is not None:
        try:
            int(step)
        except (TypeError, ValueError):
            return f"\"step\": {step!r} is not a step number"
    return None


def read_events(run_dir: str | os.PathLike, skipped: list[tuple[int, str]] | None = None) -> Iterator[dict]:
    """The events in the order they were written. A line that is not a whole, well-formed event (cut
    short by a crash, or with a field that is not what the writers write, e.g. `"time": "abc"`) is
    skipped, never fatal; `skipped` (when given) collects (line number, why) for each."""
    path = events_path(run_dir)
    if not path.exists():
        return
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                why: str | None = "not a whole JSON line (cut short?)"
            else:
                why = malformed(entry)
            if why is None:
                yield entry
            elif skipped is not None:
                skipped.append((n, why))


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
