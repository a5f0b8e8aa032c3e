"""Pre-flight: a run that cannot fit in device memory stops with one clear error before anything
is allocated, instead of dying in the first step (an out-of-memory traceback, or on some hosts a
signal and no message: train.seq_len=262144 on the quickstart needs 144 GiB per device).

Two checks, both on the path of `jaxpar train` only (benchmarks compile layouts too big for this
host on purpose): `check_attention_fits` before compiling, from the shapes alone, for the one
buffer that grows with seq_len squared (the xla attention's float32 scores; compiling such a
step can itself take minutes); `check_step_fits` on the compiled step's memory_analysis (the
compile the run needs anyway: no extra cost).
"""
from __future__ import annotations

from jaxpar.attention import resolve
from jaxpar.config import Config, ConfigError
from jaxpar.metrics.memory import compiled_memory, device_memory_bytes
from jaxpar.sharding import Plan

GIB = 2**30


def _fixes(cfg: Config, plan: Plan, attention: str) -> str:
    t = cfg.train
    fixes = []
    if attention == "xla":
        fixes.append("model.attention=blockwise (O(seq x block) attention memory)")
    if local_rows(cfg, plan) > 1:
        fixes.append(f"fewer sequences per device at once (train.global_batch < {t.global_batch}, or "
                     f"train.grad_accum > {t.grad_accum})")
    if t.remat != "full":
        fixes.append("train.remat=full")
    fixes.append("a shorter train.seq_len, or the sequence split over devices (context parallelism, "
                 "mesh.context, once it exists)")
    return "; ".join(fixes)


def local_rows(cfg: Config, plan: Plan) -> int:
    """Sequences one device runs at once (a microbatch's rows on it)."""
    return max(1, cfg.train.global_batch // (plan.batch_size_divisor * cfg.train.grad_accum))


def check_attention_fits(cfg: Config, plan: Plan) -> None:
    """ConfigError when the xla attention's float32 [rows, heads, seq, seq] scores of one layer
    alone exceed a device's memory (before compiling)."""
    m, t = cfg.model, cfg.train
    device = plan.mesh.devices.flat[0]
    budget, where = device_memory_bytes(device)
    name = resolve(m.attention, platform=device.platform, dtype=t.compute_dtype, seq_len=t.seq_len,
                   head_dim=m.resolved_head_dim, threshold=m.attention_threshold)
    if budget is None or name != "xla":
        return
    heads = max(1, m.n_heads // plan.mesh.shape.get("tensor", 1))
    rows = local_rows(cfg, plan)
    scores = rows * heads * t.seq_len**2 * 4
    if scores > budget:
        raise ConfigError(
            f"train.seq_len={t.seq_len} does not fit: the xla attention's float32 scores [{rows}, {heads}, "
            f"{t.seq_len}, {t.seq_len}] take {scores / GIB:.1f} GiB per device for one layer, above the "
            f"{budget / GIB:.1f} GiB a device has ({where}); use {_fixes(cfg, plan, name)}")


def check_step_fits(cfg: Config, plan: Plan, compiled) -> None:
    """ConfigError when the compiled step's arguments + outputs + temporaries (XLA's plan, per
    device) exceed a device's memory (after compiling, before the state is allocated)."""
    mem = compiled_memory(compiled)
    device = plan.mesh.devices.flat[0]
    budget, where = device_memory_bytes(device)
    if budget is None or "total_bytes" not in mem or mem["total_bytes"] <= budget:
        return
    t, m = cfg.train, cfg.model
    name = resolve(m.attention, platform=device.platform, dtype=t.compute_dtype, seq_len=t.seq_len,
                   head_dim=m.resolved_head_dim, threshold=m.attention_threshold)
    raise ConfigError(
        f"train.seq_len={t.seq_len} x {local_rows(cfg, plan)} sequence(s) per device does not fit: the "
        f"compiled step needs {mem['total_bytes'] / GIB:.1f} GiB per device (temporaries "
        f"{mem['temp_bytes'] / GIB:.1f} GiB, arguments {mem['argument_bytes'] / GIB:.2f} GiB; "
        f"model.attention={m.attention}: {name}), above the {budget / GIB:.1f} GiB a device has "
        f"({where}); use {_fixes(cfg, plan, name)}")
