"""Metric sinks with one interface (``write(step, metrics)``, ``close()``), combined by CompositeWriter.

Metric values may be Python, numpy or jax scalars (size-1 arrays); they are turned into
Python ``float``/``int``/``bool`` before writing. Nested dicts are flattened with "/"
(``{"train": {"loss": 1}}`` -> ``"train/loss"``). Call the writers on process 0 only.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np


class MetricWriter(Protocol):
    def write(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def to_python(value: Any) -> Any:
    """numpy/jax scalars and size-1 arrays -> Python scalars; larger arrays -> nested lists."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "__array__"):  # jax.Array, np.ndarray (pulls jax arrays to host)
        arr = np.asarray(value)
        return arr.item() if arr.size == 1 else arr.tolist()
    return value


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> flat ``{"a/b": value}`` with Python scalars."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, prefix=f"{name}/"))
        else:
            out[name] = to_python(value)
    return out


def _json_safe(value: Any) -> Any:
    """Non-finite floats -> the strings "nan", "inf", "-inf" (JSON has no literal for them).

    Strings keep NaN distinct from inf, and ``float(s)`` reads them back.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, float):
        return value
    return str(value)


class JsonlWriter:
    """Appends one JSON object ``{"step": step, ...metrics}`` per line to ``path``.

    The file is flushed after every write, so a crashed run keeps every logged step;
    appending lets a resumed run continue the same file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": int(step)}
        record.update({k: _json_safe(v) for k, v in flatten(metrics).items()})
        self._f.write(json.dumps(record, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class TensorBoardWriter:
    """One TensorBoard scalar per numeric metric (tensorboardX); non-numeric values are skipped."""

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        from tensorboardX import SummaryWriter  # lazy: only runs that log to TensorBoard pay for it

        self._w = SummaryWriter(logdir=str(logdir))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in flatten(metrics).items():
            if isinstance(value, (int, float)):  # bool is an int: logged as 0/1
                self._w.add_scalar(key, float(value), global_step=int(step))
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class CompositeWriter:
    """Fans each write out to several writers (e.g. jsonl + TensorBoard)."""

    def __init__(self, writers: Iterable[MetricWriter]) -> None:
        self.writers = list(writers)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        for w in self.writers:
            w.write(step, metrics)

    def close(self) -> None:
        for w in self.writers:
            w.close()

    def __enter__(self) -> CompositeWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
