"""XLA options: process-wide flags set before the backend starts (XLA reads XLA_FLAGS once, at
its first use), and per-program options given to each compile of the step (compiler_options)."""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import sys
import warnings
from typing import Callable

from jaxpar.config import Config, ConfigError

# GPU: what the large JAX GPU trainers set to overlap communication with compute. Each name was
# checked against the flag table in jaxlib 0.10.2, 0.11.0, 0.11.2 and 0.12.0.1 (an unknown name
# in XLA_FLAGS aborts the process; tests/test_loop_async.py starts the installed XLA with all of
# them). A flag of the same name in `xla.flags` (or already in XLA_FLAGS) replaces the default.
GPU_OVERLAP_FLAGS = {
    # reorder async collectives around the compute that does not depend on them
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
    # unroll loops by two so one iteration's collectives overlap the other's compute
    "--xla_gpu_enable_while_loop_double_buffering": "true",
    # combine small collectives up to these sizes (fewer, larger NCCL calls)
    "--xla_gpu_all_reduce_combine_threshold_bytes": str(512 * 2**20),
    "--xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "--xla_gpu_reduce_scatter_combine_threshold_bytes": str(64 * 2**20),
}
# The collective pipeliner: a while loop's (the layer scan's) all-gather for iteration i starts in
# iteration i-1, its reduce-scatter / all-reduce finishes in iteration i+1, overlapping the
# neighbouring layer. jaxlib >= 0.11.2 spells it --xla_gpu_pipeline_<kind>=on (the older
# --xla_gpu_enable_pipelined_<kind>=true is a deprecated alias there); older jaxlibs know only
# the boolean.
PIPELINED_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
PIPELINE_MODE_SINCE = (0, 11, 2)
# Dots on XLA:CPU through oneDNN (see XlaConfig.cpu_dots): faster than YNNPACK, the default, for
# bf16 steps on CPUs with and without bf16 instructions (docs/benchmarks.md). Per program (a
# compile option, not XLA_FLAGS): a script that made JAX computations before its Trainer, or
# trains float32 and bf16 in one process, still gets each step's own dots. jaxlib >= 0.10.2.
CPU_ONEDNN_DOTS = {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
}


def _gpu_plugin_present() -> bool:
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


@functools.cache
def jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's version, read from its metadata (importing it would start nothing,
    but this module must not import JAX); read once (the planner asks per layout)."""
    try:
        text = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return (0,)
    return tuple(int(p) for p in re.findall(r"\d+", text)[:4])


def gpu_overlap_flags(jaxlib: tuple[int, ...] | None = None) -> dict[str, str]:
    """The GPU overlap defaults (name -> value) in the spelling of `jaxlib` (default: installed)."""
    new = (jaxlib if jaxlib is not None else jaxlib_version()) >= PIPELINE_MODE_SINCE
    pipelined = [(f"--xla_gpu_pipeline_{k}", "on") if new else (f"--xla_gpu_enable_pipelined_{k}", "true")
                 for k in PIPELINED_COLLECTIVES]
    return {**GPU_OVERLAP_FLAGS, **dict(pipelined)}


def _name(flag: str) -> str:
    return flag.split("=")[0]


def xla_flags(cfg: Config) -> list[str]:
    """The XLA flags jaxpar wants for this config: platform defaults, replaced or extended by
    `xla.flags`."""
    defaults: dict[str, str] = {}
    if cfg.xla.gpu_overlap and _gpu_plugin_present():
        defaults.update(gpu_overlap_flags())
    own = {_name(f) for f in cfg.xla.flags}
    return [f"{k}={v}" for k, v in defaults.items() if k not in own] + list(cfg.xla.flags)


def compiler_options(cfg: Config, platform: str) -> dict[str, object]:
    """The XLA options of this config's step program on `platform` (its devices'), given to its
    compile (`lowered.compile(compiler_options=...)`): they apply whenever the step compiles,
    whatever XLA_FLAGS holds. On CPU the dots (XlaConfig.cpu_dots): `auto` takes oneDNN for
    16-bit compute and leaves float32 to XLA (or XLA_FLAGS); an explicit `default` turns oneDNN
    off for this program."""
    if platform != "cpu":
        return {}
    cpu_dots = cfg.xla.cpu_dots
    if cpu_dots == "auto":
        return dict(CPU_ONEDNN_DOTS) if cfg.train.compute_dtype in ("bfloat16", "float16") else {}
    return dict(CPU_ONEDNN_DOTS) if cpu_dots == "onednn" else {"xla_cpu_use_onednn": False}


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_TRIM_BYTES = 2**31 - 1  # free memory at the heap's top kept up to this (a C int)
_kept = False


def keep_host_memory() -> bool:
    """Make glibc serve large blocks from the heap and keep freed memory for reuse (no mmap per
    block, no trimming below KEEP_TRIM_BYTES), so a step's temporaries land on pages already
    mapped: on XLA:CPU a fresh mapping costs a page fault and a zeroed page per 4 KiB, every
    step (docs/benchmarks.md, "page faults"). Process-wide, from the next allocation on; False
    where the C library has no mallopt (not glibc). Limit: glibc still maps afresh a block of
    64 MiB or more asked for by a thread with its own arena (XLA:CPU's device threads), which
    no heap of such an arena can hold."""
    global _kept
    if _kept:
        return True
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_BYTES))
    return _kept


def apply_host_memory(cfg: Config) -> bool:
    """xla.host_memory: keep_host_memory() for `keep`, and for `auto` without a GPU plugin."""
    mode = cfg.xla.host_memory
    if mode == "auto":
        mode = "default" if _gpu_plugin_present() else "keep"
    return keep_host_memory() if mode == "keep" else False


def _names(flags: str) -> set[str]:
    return {_name(f) for f in flags.split()}


def apply_xla_flags(cfg: Config, log: Callable[[str], None] | None = None) -> list[str]:
    """Append the config's flags to XLA_FLAGS (flags already there win) and return those added.

    Once JAX's backend has started, XLA_FLAGS has been read: a flag the config names in
    `xla.flags` is then a ConfigError (the run would silently go without it); a missing default
    is a warning (`log` and `warnings.warn`) naming the flags. Also applies xla.host_memory (which
    may come at any time: it acts on the allocations after it)."""
    apply_host_memory(cfg)
    wanted = xla_flags(cfg)
    current = os.environ.get("XLA_FLAGS", "")
    added = [f for f in wanted if _name(f) not in _names(current)]
    if not added:
        return []
    if _backend_started():
        how = ("create the Trainer (or call jaxpar.xla.apply_xla_flags) before the first JAX "
               "computation, or put them in the XLA_FLAGS environment variable")
        explicit = [f for f in added if f in cfg.xla.flags]
        if explicit:
            raise ConfigError(f"xla.flags={explicit!r} cannot take effect: JAX's backend has already "
                              f"started and read XLA_FLAGS; {how}")
        msg = f"JAX started before jaxpar could set the XLA options {' '.join(added)}; {how}"
        warnings.warn(msg, stacklevel=2)
        if log is not None:
            log(f"warning: {msg}")
        return []
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # only once jax is loaded: this module must not load it
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started() if started else getattr(xla_bridge, "_backends", {}))
