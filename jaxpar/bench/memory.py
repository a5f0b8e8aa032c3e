"""`jaxpar bench memory`: per-device bytes of model state per ZeRO stage, vs the ZeRO paper.

For each zero_stage 0..3 on the benchmark's mesh (default: fsdp over every device, i.e.
fsdp=8 on 8 devices), one Trainer and:
  - params, optimizer state: per-device bytes of the train state under its plan shardings
    (`jaxpar.sharding.per_device_bytes` on ShapeDtypeStructs carrying the shardings);
  - grads: per-device bytes of one gradient per param (param dtype) under the plan's grad
    specs (the gradient accumulator the step holds);
  - temp / args: XLA's compile-time buffer plan of the step (`compiled.memory_analysis()`):
    temp covers activations, gradients and gathered weights; args the state and the batch.

ZeRO paper formula (Rajbhandari et al. 2020, sec. 5), with Psi params, N_d = fsdp size, params
P Psi, grads G Psi, optimizer state K Psi; from the config (`itemsizes`): P = 4 and K = 8 (mu, nu)
in float32; with bf16 params P = 2 and K = 12 (float32 masters, mu, nu: the paper's mixed
precision), G = 4 when microbatches are accumulated (float32), else grad_reduce_dtype's size
(2 + 2 + 12 bytes/param with train.grad_reduce_dtype=bfloat16, as in the paper).
  stage 0: P + G + K;  stage 1: P + G + K/N_d;  stage 2: P + (G + K)/N_d;  stage 3: (P + G + K)/N_d.
Parameters the plan does not shard (norm scales: 1-D, no `embed` dim) stay replicated, so the
measured figures sit slightly above Psi/N_d.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import jax
import numpy as np

from jaxpar.bench.common import (abstract_with, describe_config, fmt_bytes, fmt_ratio, mesh_overrides, ratio,
                                 table, with_overrides)
from jaxpar.config import Config
from jaxpar.mesh import describe
from jaxpar.metrics import compiled_memory
from jaxpar.sharding import ZERO_AXIS, per_device_bytes
from jaxpar.train.precision import has_masters
from jaxpar.train.accumulate import grad_dtype
from jaxpar.train.precision import DTYPES
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = mesh_overrides(fsdp=-1)
STAGES = (0, 1, 2, 3)
QUANTITIES = ("params", "grads", "opt_state")


def itemsizes(cfg: Config) -> dict[str, int]:
    """Bytes per param of params, grads (as the step holds them) and AdamW state (K)."""
    t = cfg.train
    size = lambda name: np.dtype(DTYPES[name]).itemsize
    opt = (size(t.master_dtype) if has_masters(t) else 0) + size(cfg.optimizer.mu_dtype) + 4
    return {"params": size(t.param_dtype),
            "grads": np.dtype(grad_dtype(t.grad_accum, DTYPES[t.grad_reduce_dtype])).itemsize,
            "opt_state": opt}


def paper_formula(n_params: int, n_d: int, stage: int, sizes: dict[str, int]) -> dict[str, float]:
    """Per-device bytes by the ZeRO paper for params / grads / Adam state (`itemsizes`)."""
    p, g, o = (sizes[q] * n_params for q in QUANTITIES)
    return {"params": p / n_d if stage >= 3 else p,
            "grads": g / n_d if stage >= 2 else g,
            "opt_state": o / n_d if stage >= 1 else o}


def measure_stage(cfg: Config, stage: int) -> dict:
    """Plan and compile one stage; per-device bytes of each part of the state."""

    cfg = with_overrides(cfg, [f"sharding.zero_stage={stage}"])
    trainer = Trainer(cfg, log=lambda s: None)
    sh = trainer.spec.state_shardings
    state = trainer.abstract_state()
    grad_sh = jax.tree.map(trainer.plan.sharding, trainer.spec.grad_specs,
                           is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    gdt = grad_dtype(cfg.train.grad_accum, DTYPES[cfg.train.grad_reduce_dtype])
    grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, gdt), state["params"])
    t0 = time.perf_counter()
    mem = compiled_memory(trainer.compile())
    return {
        "trainer": trainer,
        "params": per_device_bytes(abstract_with(state["params"], sh["params"])),
        "grads": per_device_bytes(abstract_with(grads, grad_sh)),
        "opt_state": per_device_bytes(abstract_with(state["opt_state"], sh["opt_state"])),
        "compiled": {k: mem.get(k) for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                                             "total_bytes")},
        "compile_s": time.perf_counter() - t0,
    }


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, stages=STAGES) -> dict:
    rows = []
    out: dict = {}
    for stage in stages:
        log(f"memory: zero stage {stage}: compiling")
        m = measure_stage(cfg, stage)
        tr = m.pop("trainer")
        if not out:
            n = tr.model.n_params
            sizes = itemsizes(cfg)
            n_d = tr.mesh.shape[ZERO_AXIS]
            unsharded = unsharded_params(tr)
            out = {"mesh": describe(tr.mesh), "mesh_shape": dict(tr.mesh.shape), "n_params": n,
                   "itemsizes": sizes, "param_itemsize": sizes["params"], "n_d": n_d,
                   "unsharded_params": unsharded,
                   **describe_config(cfg)}
        formula = paper_formula(out["n_params"], out["n_d"], stage, out["itemsizes"])
        rows.append({
            "zero_stage": stage,
            **{q: {"measured": m[q], "formula": formula[q], "ratio": ratio(m[q], formula[q])}
               for q in QUANTITIES},
            "state_total": {"measured": sum(m[q] for q in QUANTITIES),
                            "formula": sum(formula.values())},
            "compiled": m["compiled"],
            "compile_s": m["compile_s"],
        })
    return {**out, "stages": rows}


def unsharded_params(trainer) -> int:
    """How many params have no dim the plan shards over fsdp (replicated even at ZeRO-3)."""
    plan, model = trainer.plan, trainer.model
    total = 0
    for ax, s in zip(jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, tuple)),
                     jax.tree.leaves(model.shapes)):
        if ZERO_AXIS not in _axes_of(plan.spec(ax, s.shape, "act")):  # "act": fsdp always kept
            total += math.prod(s.shape)
    return total


def _axes_of(spec) -> set[str]:
    names = set()
    for e in spec:
        if e is not None:
            names.update((e,) if isinstance(e, str) else e)
    return names


def format_result(res: dict) -> str:
    n, n_d, sz = res["n_params"], res["n_d"], res["itemsizes"]
    head = (f"memory per device: {res['mesh']}, {n:,} params (Psi), N_d = fsdp = {n_d}; "
            f"bytes/param: params {sz['params']}, grads {sz['grads']}, "
            f"optimizer state K = {sz['opt_state']}\n"
            f"{res['unsharded_params']:,} params ({res['unsharded_params'] / n:.2%}) have no dim the plan "
            f"shards over fsdp (norm scales) and stay replicated at every stage")
    rows = []
    for r in res["stages"]:
        for q in QUANTITIES:
            rows.append([f"stage {r['zero_stage']}", q, fmt_bytes(r[q]["measured"]),
                         fmt_bytes(r[q]["formula"]), fmt_ratio(r[q]["ratio"])])
        tot = r["state_total"]
        rows.append([f"stage {r['zero_stage']}", "total", fmt_bytes(tot["measured"]),
                     fmt_bytes(tot["formula"]), fmt_ratio(ratio(tot["measured"], tot["formula"]))])
    crow = [[f"stage {r['zero_stage']}", fmt_bytes(r["compiled"]["argument_bytes"]),
             fmt_bytes(r["compiled"]["output_bytes"]), fmt_bytes(r["compiled"]["alias_bytes"]),
             fmt_bytes(r["compiled"]["temp_bytes"]), fmt_bytes(r["compiled"]["total_bytes"])]
            for r in res["stages"]]
    return "\n".join([
        head, "",
        table(["stage", "state", "measured", "ZeRO formula", "ratio"], rows), "",
        "compiled step (XLA memory_analysis, per device; temp = activations, grads, gathered weights):",
        table(["stage", "args", "outputs", "aliased", "temp", "total"], crow),
    ])
