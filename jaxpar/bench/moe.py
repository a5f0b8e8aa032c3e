"""`jaxpar bench moe`: the bytes the expert all-to-alls move per step (from the compiled HLO)
beside the analytic figure, and the step time, for capacity vs dropless dispatch.

Default: the `moe_small` preset (8 experts, top-2), every device on the `expert` axis (so each
holds E/ep experts and its own slice of the batch), synthetic data, float32. Per device, with
G = sequences per device per microbatch, S = seq_len, k = top_k, D = dim, C = capacity slots
per expert per sequence, ep = mesh.expert, b = compute dtype bytes, L = MoE layers, A = grad_accum:
  capacity: 4 all-to-alls per MoE layer and microbatch (dispatch and combine, and their
            transposes in the backward), each of the [G, E, C, D] slot buffer: 4 L A G E C D b;
  dropless: the same 4 of a [ep, G S k, D] row buffer (worst case: every row may go to one
            device; XLA:CPU has no ragged all-to-all) plus 1 of the int32 expert ids [ep, G S k]:
            L A (4 ep G S k D b + 4 ep G S k).
A remat policy that recomputes the layer adds the 2 forward all-to-alls again in the backward.
Bytes are result bytes per device (what `jaxpar.metrics.collective_ops` reports); wire bytes
are (ep-1)/ep of them (the part leaving the device). `payload` is what the routed tokens
themselves need: 4 L A G S k D b (each (token, choice) carried there and back, both passes).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import numpy as np

from jaxpar.bench.common import (describe_config, fmt_bytes, fmt_ratio, mesh_overrides, ratio, table,
                                 with_overrides)
from jaxpar.config import Config, ConfigError
from jaxpar.mesh import describe
from jaxpar.metrics import collective_ops
from jaxpar.parallel.expert import capacity
from jaxpar.train.precision import DTYPES
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = [*mesh_overrides(expert=-1), "model.preset=moe_small", "data.source=synthetic",
                     "train.compute_dtype=float32", "sharding.replicated_tolerance=1.0"]
MODES = ("capacity", "dropless")
TIMED_STEPS = 10


def analytic(cfg: Config, plan) -> dict[str, float]:
    """Per-device all-to-all result bytes per step for each dispatch mode, and the payload."""
    m, t = cfg.model, cfg.train
    moe = m.moe
    ep = plan.mesh.shape.get("expert", 1)
    G = t.global_batch // (plan.batch_size_divisor * t.grad_accum)
    S, k, D, E = t.seq_len, moe.top_k, m.dim, moe.num_experts
    b = np.dtype(DTYPES[t.compute_dtype]).itemsize
    L, A = m.n_layers // moe.every_n, t.grad_accum
    passes = 4 + (2 if t.remat != "none" else 0)
    if ep == 1:
        return {"capacity": 0.0, "dropless": 0.0, "payload": 0.0}
    C = capacity(S, k, E, moe.capacity_factor)
    rows = ep * G * S * k
    return {"capacity": passes * L * A * G * E * C * D * b,
            "dropless": L * A * (passes * rows * D * b + (passes // 2 - 1) * rows * 4),
            "payload": passes * L * A * G * S * k * D * b}


def measure(cfg: Config, mode: str, log: Callable[[str], None]) -> dict:
    cfg = with_overrides(cfg, [f"model.moe.dispatch={mode}"])
    trainer = Trainer(cfg, log=lambda s: None)
    log(f"moe: {mode}: compiling")
    t0 = time.perf_counter()
    compiled = trainer.compile()
    compile_s = time.perf_counter() - t0
    ep = trainer.plan.mesh.shape.get("expert", 1)
    ops = [op for op in collective_ops(compiled.as_text(), count_loops=True) if op.kind == "all-to-all"]
    result_bytes = sum(op.bytes for op in ops)
    state = trainer.init_state()
    times, metrics = [], {}
    n = min(TIMED_STEPS, cfg.train.steps)
    log(f"moe: {mode}: timing {n} steps (+2 warm-up)")
    for i in range(n + 2):
        batch = trainer.loader.batch(i)
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    return {
        "all_to_all_arrays": len(ops),  # result arrays: XLA:CPU splits one all-to-all into ep
        "all_to_all_result_bytes": result_bytes,
        "all_to_all_wire_bytes": result_bytes * (ep - 1) / ep if ep > 1 else 0.0,
        "analytic_result_bytes": analytic(cfg, trainer.plan)[mode],
        "payload_bytes": analytic(cfg, trainer.plan)["payload"],
        "step_time_s": statistics.median(times) if times else None,
        "compile_s": compile_s,
        "dropped_fraction": metrics.get("moe/dropped_fraction"),
        "loss": metrics.get("loss"),
        "mesh": describe(trainer.plan.mesh),
    }


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, modes=MODES) -> dict:
    if not cfg.model.moe.num_experts:
        raise ConfigError("jaxpar bench moe needs a MoE model: model.moe.num_experts > 0 "
                          "(e.g. model.preset=moe_small)")
    rows = {mode: measure(cfg, mode, log) for mode in modes}
    moe = cfg.model.moe
    return {"config": {**describe_config(cfg),
                       "moe": {"num_experts": moe.num_experts, "top_k": moe.top_k, "every_n": moe.every_n,
                               "capacity_factor": moe.capacity_factor}},
            "mesh": next(iter(rows.values()))["mesh"], "modes": rows}


def format_result(result: dict) -> str:
    c = result["config"]
    head = (f"MoE all-to-all bytes and step time per device; mesh {result['mesh']}; "
            f"{c['moe']['num_experts']} experts top-{c['moe']['top_k']}, capacity_factor "
            f"{c['moe']['capacity_factor']}; batch {c['train']['global_batch']} x {c['train']['seq_len']}, "
            f"{c['train']['compute_dtype']}")
    rows = []
    for mode, r in result["modes"].items():
        rows.append([mode, r["all_to_all_arrays"], fmt_bytes(r["all_to_all_result_bytes"]),
                     fmt_bytes(r["analytic_result_bytes"]),
                     fmt_ratio(ratio(r["all_to_all_result_bytes"], r["analytic_result_bytes"])),
                     fmt_bytes(r["all_to_all_wire_bytes"]), fmt_bytes(r["payload_bytes"]),
                     "-" if r["step_time_s"] is None else f"{1e3 * r['step_time_s']:.1f} ms",
                     "-" if r["dropped_fraction"] is None else f"{r['dropped_fraction']:.2%}"])
    return head + "\n" + table(["dispatch", "a2a arrays", "HLO bytes", "analytic", "ratio", "wire",
                                "payload", "step", "dropped"], rows)
