"""Device-memory numbers: what XLA planned at compile time and what the allocator reports."""

from __future__ import annotations

import os
from typing import Any

import jax

_COMPILED_FIELDS: dict[str, str] = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
    "host_temp_bytes": "host_temp_size_in_bytes",
    "peak_bytes": "peak_memory_in_bytes",
}


def compiled_memory(compiled: Any) -> dict[str, int]:
    """Per-device buffer sizes XLA planned for a ``jax.stages.Compiled``; ``{}`` if unavailable.

    Keys (present when the backend reports them): ``argument_bytes``, ``output_bytes``,
    ``temp_bytes``, ``alias_bytes`` (outputs donated into arguments), ``generated_code_bytes``,
    ``host_temp_bytes``, ``peak_bytes``, and ``total_bytes`` = argument + output + temp - alias,
    the usual estimate of what one step needs resident (code size excluded).
    """
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends/versions raise instead of returning None
        return {}
    if isinstance(stats, (list, tuple)):  # older jax: one entry per device
        stats = stats[0] if stats else None
    if stats is None:
        return {}
    out: dict[str, int] = {}
    for key, attr in _COMPILED_FIELDS.items():
        value = getattr(stats, attr, None)
        if value is not None:
            out[key] = int(value)
    if {"argument_bytes", "output_bytes", "temp_bytes"} <= out.keys():
        out["total_bytes"] = (
            out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out.get("alias_bytes", 0)
        )
    return out


def device_memory_stats(device: Any) -> dict[str, int] | None:
    """Allocator counters (``bytes_in_use``, ``peak_bytes_in_use``, ``bytes_limit``, ...) or ``None``.

    ``None`` on backends without an allocator report (CPU returns nothing).
    """
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    if not stats:
        return None
    return {k: int(v) for k, v in stats.items() if isinstance(v, (int, float))}


def device_memory_bytes(device: Any) -> tuple[int | None, str]:
    """(bytes one device can hold, where the figure comes from): the allocator's limit where the
    backend reports one (GPU, TPU); on CPU the host's physical memory over this process's CPU
    devices (forced host devices share it); (None, why) when neither is known."""
    stats = device_memory_stats(device) or {}
    if stats.get("bytes_limit"):
        return stats["bytes_limit"], f"{device.platform} allocator limit"
    if device.platform == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None, "host memory unknown"
        n = max(1, sum(d.platform == "cpu" for d in jax.local_devices()))
        return total // n, f"host memory {total / 2**30:.1f} GiB shared by {n} CPU devices"
    return None, f"{device.platform} reports no memory limit"
