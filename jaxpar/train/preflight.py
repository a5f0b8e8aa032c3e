"""Pre-flight: a run that cannot fit in device memory stops with one clear error before anything
is allocated, instead of dying in the first step (an out-of-memory traceback, or on some hosts a
signal and no message: train.seq_len=262144 on the quickstart needs 144 GiB per device).

Checks on the path of `jaxpar train` only (benchmarks compile layouts too big for this host on
purpose): before tracing, from the shapes alone, `check_attention_fits` for the one buffer that
grows with seq_len squared (the xla attention's float32 scores; compiling such a step can itself
take minutes) and `check_activations_fit` for the least any step keeps for its backward (tracing
a step for a sequence far beyond memory can itself exhaust the host: blockwise attention's tile
table grows with seq_len squared too); `check_step_fits` on the compiled step's memory_analysis
(the compile the run needs anyway: no extra cost).
"""
from __future__ import annotations

import numpy as np

from jaxpar.attention import resolve
from jaxpar.config import Config, ConfigError
from jaxpar.metrics.memory import compiled_memory, device_memory_bytes
from jaxpar.parallel.context import ring_implementation
from jaxpar.sharding import Plan
from jaxpar.train.precision import DTYPES

GIB = 2**30


def _fixes(cfg: Config, plan: Plan, attention: str, remat: bool = True) -> str:
    t = cfg.train
    fixes = []
    if attention == "xla":
        fixes.append("model.attention=blockwise (O(seq x block) attention memory)")
    if local_rows(cfg, plan) > 1:
        fixes.append(f"fewer sequences per device at once (train.global_batch < {t.global_batch}, or "
                     f"train.grad_accum > {t.grad_accum})")
    if remat and t.remat != "full":
        fixes.append("train.remat=full")
    fixes.append("a shorter train.seq_len, or the sequence split over more devices (context "
                 f"parallelism: mesh.context, now {plan.mesh.shape.get('context', 1)})")
    return "; ".join(fixes)


def _attention(cfg: Config, device) -> str:
    """The attention implementation model.attention resolves to on `device` at train.seq_len."""
    m, t = cfg.model, cfg.train
    return resolve(m.attention, platform=device.platform, dtype=t.compute_dtype, seq_len=t.seq_len,
                   head_dim=m.resolved_head_dim, threshold=m.attention_threshold)


def local_rows(cfg: Config, plan: Plan) -> int:
    """Sequences one device runs at once (a microbatch's rows on it)."""
    return max(1, cfg.train.global_batch // (plan.batch_size_divisor * cfg.train.grad_accum))


def attention_scores(cfg: Config, plan: Plan, device) -> tuple[str, str, list[int]] | None:
    """(implementation, what, shape) of the largest float32 scores one layer's attention holds
    on a device, or None where it never holds O(seq^2) of them (blockwise, cudnn). Under context
    parallelism a device's share: the ring's (and all_gather's) [tile, tile] blocks of its runs,
    all_to_all's whole-sequence scores of its heads over context."""
    m, t = cfg.model, cfg.train
    sizes = plan.mesh.shape
    c, heads = sizes.get("context", 1), max(1, m.n_heads // sizes.get("tensor", 1))
    rows = local_rows(cfg, plan)
    if c > 1 and cfg.context.strategy in ("ring", "all_gather"):
        run = t.seq_len // (2 * c if cfg.context.layout == "zigzag" else c)
        if ring_implementation(m.attention, t.seq_len, m.attention_threshold) != "xla":
            return None  # blockwise tiles
        return "xla", f"{cfg.context.strategy} attention's float32 score tiles", [rows, heads, run, run]
    name = _attention(cfg, device)
    if name != "xla":
        return None
    if c > 1:  # all_to_all: whole sequences, the heads split over context
        heads = max(1, heads // c)
    return name, "xla attention's float32 scores", [rows, heads, t.seq_len, t.seq_len]


def check_attention_fits(cfg: Config, plan: Plan) -> None:
    """ConfigError when the attention's float32 scores of one layer alone (attention_scores)
    exceed a device's memory (before compiling)."""
    t = cfg.train
    device = plan.mesh.devices.flat[0]
    budget, where = device_memory_bytes(device)
    found = attention_scores(cfg, plan, device)
    if budget is None or found is None:
        return
    name, what, shape = found
    scores = int(np.prod(shape)) * 4
    if scores > budget:
        raise ConfigError(
            f"train.seq_len={t.seq_len} does not fit: the {what} {shape} take {scores / GIB:.1f} GiB per "
            f"device for one layer, above the {budget / GIB:.1f} GiB a device has ({where}); use "
            f"{_fixes(cfg, plan, name)}")


def check_activations_fit(cfg: Config, plan: Plan) -> None:
    """ConfigError when the layers' inputs alone, which every remat policy keeps for the backward
    ([sequences, tokens, dim] per layer of a device's stage, in the compute dtype, its tokens split
    over context and, at most, tensor), exceed a device's memory: a lower bound of the step's
    memory, from the shapes (before tracing)."""
    m, t = cfg.model, cfg.train
    device = plan.mesh.devices.flat[0]
    budget, where = device_memory_bytes(device)
    if budget is None:
        return
    sizes = plan.mesh.shape
    tokens = t.seq_len // (sizes.get("context", 1) * sizes.get("tensor", 1))
    layers = max(1, m.n_layers // sizes.get("pipeline", 1))
    rows = local_rows(cfg, plan)
    need = layers * rows * tokens * m.dim * np.dtype(DTYPES[t.compute_dtype]).itemsize
    if need > budget:
        name = _attention(cfg, device)
        raise ConfigError(
            f"train.seq_len={t.seq_len} does not fit: the inputs of the {layers} layer(s) a device runs, "
            f"kept for the backward whatever train.remat is ([{rows}, {tokens}, {m.dim}] each, "
            f"{t.compute_dtype}), take {need / GIB:.1f} GiB per device, above the {budget / GIB:.1f} GiB "
            f"a device has ({where}); use {_fixes(cfg, plan, name, remat=False)}")


def check_step_fits(cfg: Config, plan: Plan, compiled) -> None:
    """ConfigError when the compiled step's arguments + outputs + temporaries (XLA's plan, per
    device) exceed a device's memory (after compiling, before the state is allocated)."""
    mem = compiled_memory(compiled)
    device = plan.mesh.devices.flat[0]
    budget, where = device_memory_bytes(device)
    if budget is None or "total_bytes" not in mem or mem["total_bytes"] <= budget:
        return
    t, m = cfg.train, cfg.model
    name = _attention(cfg, device)
    raise ConfigError(
        f"train.seq_len={t.seq_len} x {local_rows(cfg, plan)} sequence(s) per device does not fit: the "
        f"compiled step needs {mem['total_bytes'] / GIB:.1f} GiB per device (temporaries "
        f"{mem['temp_bytes'] / GIB:.1f} GiB, arguments {mem['argument_bytes'] / GIB:.2f} GiB; "
        f"model.attention={m.attention}: {name}), above the {budget / GIB:.1f} GiB a device has "
        f"({where}); use {_fixes(cfg, plan, name)}")
