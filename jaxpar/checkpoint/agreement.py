"""Every process's verdict on a step, so one host's damaged file never splits the group across
two steps: a step is used only when every process could read it.
"""
from __future__ import annotations

from typing import Any, Callable

from jaxpar import distributed  # looked up at call time: tests stand in for other processes
from jaxpar.checkpoint.errors import damage, short


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn(), None), or (None, why) when fn fails with a damage error."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised unless it means damage
        cause = damage(e)
        if cause is None:
            raise
        return None, short(cause, 500)


def agree(problem: str | None) -> list[str]:
    """Every process's verdict on the same step: why it cannot be used, one reason per process
    that cannot (naming the process when there are several), [] when all can. One process: its
    own verdict, nothing sent."""
    verdicts = distributed.allgather_json(problem, "checkpoint verdict")
    if len(verdicts) == 1:
        return [v for v in verdicts if v is not None]
    return [f"on process {i}: {v}" for i, v in enumerate(verdicts) if v is not None]


def steps_anywhere(mine: list[int]) -> list[int]:
    """Every step any process has, newest first (a step missing on one fails there, for all)."""
    lists = distributed.allgather_json(sorted(mine), "checkpoint steps")
    return sorted({s for steps in lists for s in steps}, reverse=True)
