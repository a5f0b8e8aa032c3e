"""Goodput: where a run's wall time went, from its event log (observe/events.py).

Wall time is the time from the run's first event to its last (every source, every restart).
The events, sorted by time, cut it into intervals; each interval goes to exactly one bucket by
the run's phase after the event that opens it, so productive + the lost causes = wall time:

  wait_nodes   between `wait_nodes_start` and `wait_nodes_end` (a launcher waiting for nodes;
               it takes precedence over every other phase)
  startup      start-up and compile: from a `group_start` or a `start` to that session's
               `first_step` (process start, jax init, planning, compile, building the state),
               less the restore's blocking time
  checkpoint_restore
               each `checkpoint_restore`'s blocking_s (the restore, inside the start-up)
  productive   training: from `first_step` to the session's `end` / `preempted`, or to its last
               event when it crashed; less the saves and the redone steps
  checkpoint_save
               each `checkpoint_save`'s blocking_s: the time the loop was blocked by the save
               (the device-to-host copy, and at the end the wait for the write), not the async write
  redone       a crashed session's training after step R, the step the next session resumed
               from (its `resume` event; 0 when it started afresh): from the time the session had
               done step R (its first progress / checkpoint_save event at a step >= R; a save
               counted from its own start) to its last event, less the saves in that window.
               The whole session when R is at or before its own start step. Steps trained
               between the session's last event and the crash are not seen: they are "other".
  other        the rest: after `end` / `preempted` / `group_end`, or after a crashed session's
               last event, until the next start (teardown, crash detection, restart delay, a
               scheduler's requeue).

A session is the trainer's events from one `start` to its `end` or `preempted`; it crashed when
a `start` or a `group_end` (or a `group_start`) comes first. A log whose last session has no
end is a run still going (or one that died unseen): nothing in it is redone.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from jaxpar.config import ConfigError
from jaxpar.observe.events import EVENTS_FILE, read_events

CAUSES = ("startup", "checkpoint_save", "checkpoint_restore", "redone", "wait_nodes", "other")
LABELS = {"startup": "start-up and compile", "checkpoint_save": "checkpoint save (blocking)",
          "checkpoint_restore": "checkpoint restore (blocking)", "redone": "steps redone after a crash",
          "wait_nodes": "waiting for nodes", "other": "other (teardown, restarts, unaccounted)"}


@dataclass
class Goodput:
    """The accounting of one event log (seconds)."""

    wall_s: float
    productive_s: float
    lost_s: dict[str, float]
    first_time: float
    last_time: float
    sessions: int = 0
    crashes: int = 0
    preemptions: int = 0
    redone_steps: int = 0
    last_step: int | None = None
    status: str = "not started"  # finished | preempted | crashed | running | not started

    @property
    def ratio(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "productive_s": self.productive_s, "goodput": self.ratio,
                "lost_s": dict(self.lost_s), "first_time": self.first_time, "last_time": self.last_time,
                "sessions": self.sessions, "crashes": self.crashes, "preemptions": self.preemptions,
                "redone_steps": self.redone_steps, "last_step": self.last_step, "status": self.status}


@dataclass
class _Session:
    start_step: int = 0
    first_t: float | None = None
    train: list = field(default_factory=list)      # (t0, t1) training intervals
    saves: list = field(default_factory=list)      # (t, blocking_s) inside training
    steps: list = field(default_factory=list)      # (t the step was done, step)
    last_t: float | None = None
    ended: str | None = None                       # "end" | "preempted" | "crashed"
    resumed_by: int | None = None                  # R: the step the next session resumed from


def account(events: Iterable[dict]) -> Goodput:
    """The goodput of these events (any order; sorted by time). Pure: no clock, no files."""
    evs = sorted(events, key=lambda e: float(e["time"]))
    if not evs:
        raise ValueError("no events to account")
    lost: dict[str, float] = defaultdict(float)
    sessions: list[_Session] = []
    cur: _Session | None = None
    pending: _Session | None = None  # crashed, waiting for the session that resumes it
    phase, waiting, prev = "other", False, float(evs[0]["time"])
    out = {"preemptions": 0, "last_step": None}

    def crash() -> None:
        nonlocal cur, pending
        if cur is None:
            return
        cur.ended = "crashed"
        last = cur.last_t if cur.last_t is not None else cur.first_t
        keep = []
        for a, b in cur.train:  # after its last event nothing is seen: other
            if last is None or a >= last:
                lost["other"] += b - a
            else:
                keep.append((a, b))
        cur.train, cur = keep, None
        pending = sessions[-1]

    def new_session() -> _Session:
        nonlocal cur
        crash()
        cur = _Session()
        sessions.append(cur)
        return cur

    for e in evs:
        t, kind = float(e["time"]), e["event"]
        dt, a = t - prev, prev
        prev = t
        if waiting:
            lost["wait_nodes"] += dt
        elif phase == "startup":
            lost["startup"] += dt
        elif phase == "training" and cur is not None:
            cur.train.append((a, t))
        else:
            lost["other"] += dt
        blocking = float(e.get("blocking_s", 0.0) or 0.0)
        step = e.get("step")
        if kind == "wait_nodes_start":
            waiting = True
        elif kind == "wait_nodes_end":
            waiting = False
        elif kind == "group_start":
            crash()
            phase = "startup"
        elif kind == "group_end":
            crash()
            phase = "other"
        elif kind == "start":
            new_session()
            phase = "startup"
        elif e.get("source", "train") == "train" and kind in (
                "first_step", "progress", "checkpoint_save", "checkpoint_restore", "resume", "end",
                "preempted"):
            s = cur if cur is not None else new_session()  # a log without its `start`
            s.last_t = t
            if step is not None:
                out["last_step"] = int(step)
                if kind in ("progress", "checkpoint_save", "end", "preempted"):
                    s.steps.append((t - blocking if kind == "checkpoint_save" else t, int(step)))
            if kind in ("checkpoint_save", "checkpoint_restore"):
                bucket = kind
                lost[bucket] += blocking
                if phase == "training":
                    s.saves.append((t, blocking))
                else:
                    lost["startup" if phase == "startup" else "other"] -= blocking
            if kind == "resume" and step is not None:
                s.start_step = int(step)
            elif kind == "first_step":
                s.first_t = t
                phase = "training"
                if pending is not None:
                    pending.resumed_by, pending = s.start_step, None
            elif kind in ("end", "preempted"):
                s.ended = kind
                out["preemptions"] += kind == "preempted"
                cur, phase = None, "other"

    productive, redone_steps = 0.0, 0
    for s in sessions:
        trained = sum(b - a for a, b in s.train)
        saved = sum(blk for _, blk in s.saves)
        redone = 0.0
        if s.ended == "crashed" and s.resumed_by is not None and s.train:
            r = s.resumed_by
            after = [tt for tt, st in s.steps if st >= r]
            lo = s.first_t if r <= s.start_step or not after else min(after)
            hi = s.last_t
            if lo is not None and hi is not None and hi > lo:
                redone = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in s.train)
                redone -= sum(blk for tt, blk in s.saves if lo < tt <= hi)
                redone = max(0.0, redone)
                seen = max((st for _, st in s.steps), default=r)
                redone_steps += max(0, seen - max(r, s.start_step))
        lost["redone"] += redone
        productive += trained - saved - redone
    last = sessions[-1] if sessions else None
    status = ("not started" if last is None else "running" if last.ended is None
              else "finished" if last.ended == "end" else last.ended)
    first_t, last_t = float(evs[0]["time"]), float(evs[-1]["time"])
    return Goodput(wall_s=last_t - first_t, productive_s=productive,
                   lost_s={c: lost.get(c, 0.0) for c in CAUSES}, first_time=first_t, last_time=last_t,
                   sessions=len(sessions), crashes=sum(s.ended == "crashed" for s in sessions),
                   preemptions=out["preemptions"], redone_steps=redone_steps, last_step=out["last_step"],
                   status=status)


def goodput_of(run_dir: str | os.PathLike, skipped: list[tuple[int, str]] | None = None) -> Goodput:
    """The goodput of a run dir (`<run_dir>/<name>`); a bad dir is one ConfigError naming it.
    Lines of the log that are not well-formed events are left out, as a line cut short by a crash
    is (`skipped`, when given, gets their (line number, why))."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"jaxpar goodput: RUN_DIR {str(run_dir)!r} is not a directory; give a run's "
                          f"directory (<run_dir>/<name> of its config, e.g. runs/quickstart)")
    events = list(read_events(path, skipped))
    if not events:
        inner = sorted(p.parent.name for p in path.glob(f"*/{EVENTS_FILE}"))
        hint = (f"; runs inside it: {', '.join(str(path / n) for n in inner)}" if inner else
                "; `jaxpar train` (and `jaxpar launch`) write it from this version on")
        raise ConfigError(f"jaxpar goodput: {path / EVENTS_FILE} is missing or has no events{hint}")
    return account(events)


def skipped_note(path: str | os.PathLike, skipped: list[tuple[int, str]], show: int = 3) -> str:
    """One line naming the event log's skipped lines (the first `show` with the reason)."""
    lines = "; ".join(f"line {n}: {why}" for n, why in skipped[:show])
    more = f"; and {len(skipped) - show} more" if len(skipped) > show else ""
    return (f"jaxpar goodput: note: left out {len(skipped)} line{'s' * (len(skipped) != 1)} of "
            f"{path} that {'are' if len(skipped) != 1 else 'is'} not a well-formed event, as a line cut "
            f"short by a crash is: {lines}{more}")


def format_report(g: Goodput, run_dir: str | os.PathLike | None = None) -> str:
    when = lambda t: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
    pct = lambda s: f"{100 * s / g.wall_s:5.1f}%" if g.wall_s > 0 else "    -"
    lines = [f"goodput of {run_dir}" if run_dir is not None else "goodput",
             f"  wall time {g.wall_s:10.1f} s   ({when(g.first_time)} .. {when(g.last_time)})",
             f"  productive{g.productive_s:10.1f} s   {pct(g.productive_s)}   (goodput {g.ratio:.3f})",
             f"  lost      {sum(g.lost_s.values()):10.1f} s   {pct(sum(g.lost_s.values()))}"]
    for cause in CAUSES:
        s = g.lost_s[cause]
        extra = f"   ({g.redone_steps} steps)" if cause == "redone" and g.redone_steps else ""
        lines.append(f"    {LABELS[cause]:<40}{s:8.1f} s   {pct(s)}{extra}")
    lines.append(f"  {g.sessions} sessions, {g.crashes} crashed, {g.preemptions} preempted; "
                 f"last step {g.last_step}; {g.status}")
    return "\n".join(lines)
