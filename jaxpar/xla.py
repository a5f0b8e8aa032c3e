"""XLA options, set before the backend starts (XLA reads XLA_FLAGS once)."""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable

from jaxpar.config import Config

# Overlap collectives with compute on GPU: the latency-hiding scheduler reorders async
# collectives around independent compute. Flags that every supported jaxlib knows.
GPU_OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
)
# Dots on XLA:CPU through oneDNN (see XlaConfig.cpu_dots): YNNPACK, the default, leaves bf16
# dots with a transposed left operand (the weight gradients) to a naive loop. jaxlib >= 0.10.2.
CPU_ONEDNN_DOT_FLAGS = (
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
)


def _gpu_plugin_present() -> bool:
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def xla_flags(cfg: Config) -> list[str]:
    """The XLA flags jaxpar wants for this config: platform defaults, then `xla.flags`."""
    flags = []
    if cfg.xla.gpu_overlap and _gpu_plugin_present():
        flags += GPU_OVERLAP_FLAGS
    cpu_dots = cfg.xla.cpu_dots
    if cpu_dots == "auto":
        cpu_dots = "onednn" if cfg.train.compute_dtype in ("bfloat16", "float16") else "default"
    if cpu_dots == "onednn":  # only XLA:CPU reads these; harmless beside a GPU
        flags += CPU_ONEDNN_DOT_FLAGS
    return flags + list(cfg.xla.flags)


def _names(flags: str) -> set[str]:
    return {f.split("=")[0] for f in flags.split()}


def apply_xla_flags(cfg: Config, log: Callable[[str], None] | None = None) -> list[str]:
    """Append the config's flags to XLA_FLAGS (user-set flags of the same name win). Once the
    JAX backend has started, XLA_FLAGS is read already: then say so (through `log`) instead."""
    wanted = xla_flags(cfg)
    current = os.environ.get("XLA_FLAGS", "")
    added = [f for f in wanted if f.split("=")[0] not in _names(current)]
    if not added:
        return []
    if _backend_started():
        if log is not None:
            log(f"warning: JAX started before jaxpar could set XLA options {' '.join(added)}; "
                f"create the Trainer before the first JAX call, or put them in XLA_FLAGS")
        return []
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # only once jax is loaded: this module must not load it
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started() if started else getattr(xla_bridge, "_backends", {}))
