"""XLA options, set before the backend starts (XLA reads XLA_FLAGS once)."""
from __future__ import annotations

import importlib.util
import os

from jaxpar.config import XlaConfig

# Overlap collectives with compute on GPU: the latency-hiding scheduler reorders async
# collectives around independent compute. Flags that every supported jaxlib knows.
GPU_OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
)


def _gpu_plugin_present() -> bool:
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def apply_xla_flags(cfg: XlaConfig) -> list[str]:
    """Append the configured flags to XLA_FLAGS (user-set flags of the same name win)."""
    flags = list(cfg.flags)
    if cfg.gpu_overlap and _gpu_plugin_present():
        flags = list(GPU_OVERLAP_FLAGS) + flags
    current = os.environ.get("XLA_FLAGS", "")
    have = {f.split("=")[0] for f in current.split()}
    added = [f for f in flags if f.split("=")[0] not in have]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
