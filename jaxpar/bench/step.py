"""`jaxpar bench step`: the compiled train step per layout, for the config's model (default: the
quickstart) and for the 1B preset's shape, compiled from abstract state only (Trainer.compile:
ShapeDtypeStructs carrying the shardings; nothing is allocated, so the 1B shape needs no memory).

Per layout (dp, zero1, zero2, zero3, tp, pp on 8 devices; `layouts=` picks some):
  - model FLOPs per device per step: the Trainer's flops_per_token (metrics.flops.llama_flops_per_token,
    6N + attention; a MoE's active params) x the step's tokens / devices;
  - compiled FLOPs per device: the matmul FLOPs of the compiled step's dots, loop trips
    multiplied in (metrics.hlo.dot_flops); their excess over the model's is the recompute (remat;
    a pipeline backward that runs its stage forward again). A conditional counts its heaviest
    branch, so a pipeline counts every tick as its heaviest (the bubble as work): an upper bound.
    Below the model's: the formula's attention term counts the causal half that blockwise
    attention skips. Beside
    it XLA's own cost_analysis()["flops"], which counts every while body once (one layer of a
    layer scan, one microbatch), so it sits far below the model's for any scanned model;
  - gradient collectives (all-reduce, reduce-scatter; and all-gather) inside vs outside the
    while loops (metrics.hlo.loop_collectives: executed arrays per step, trips multiplied);
  - compiled temp memory per device (memory_analysis);
  - for the config's model only: step time and the loop thread's host time per step, from
    timers around a plain loop of `train.steps` steps (batch building, and the step call:
    dispatch, which waits only when the devices fall behind), after 2 warm-up steps.
"""
from __future__ import annotations

import time
from typing import Callable

import jax

from jaxpar.bench.common import describe_config, fmt_bytes, mesh_overrides, table, with_overrides
from jaxpar.config import Config, ConfigError
from jaxpar.metrics import loop_collectives
from jaxpar.metrics.hlo import dot_flops
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = []
LAYOUTS: dict[str, list[str]] = {
    "dp": [*mesh_overrides(data=8), "sharding.zero_stage=0"],
    "zero1": [*mesh_overrides(fsdp=8), "sharding.zero_stage=1"],
    "zero2": [*mesh_overrides(fsdp=8), "sharding.zero_stage=2"],
    "zero3": [*mesh_overrides(fsdp=8), "sharding.zero_stage=3"],
    "tp": [*mesh_overrides(data=4, tensor=2), "sharding.zero_stage=0"],
    # the first and last stages hold the embeddings and head whole: replicated on purpose
    "pp": [*mesh_overrides(data=4, pipeline=2), "sharding.zero_stage=0", "train.grad_accum=2",
           "sharding.replicated_tolerance=1.0"],
}
SHAPE_1B = ["model.preset=1b", "model.n_layers=16", "model.dim=2048", "train.seq_len=2048",
            "train.global_batch=16", "data.source=synthetic"]
KINDS = ("all-reduce", "reduce-scatter", "all-gather")


def model_flops(trainer: Trainer) -> float:
    """The model's training FLOPs per device per step: the trainer's own count per token (what its
    MFU uses: a MoE's active experts, attention's width n_heads x head_dim), not a second formula."""
    cfg = trainer.cfg
    return trainer.flops_per_token * cfg.train.global_batch * cfg.train.seq_len / trainer.mesh.devices.size


def compiled_figures(cfg: Config, log: Callable[[str], None], name: str) -> tuple[Trainer, dict]:
    t0 = time.perf_counter()
    trainer = Trainer(cfg, log=lambda s: None)
    compiled = trainer.compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = compiled.as_text()
    count, nbytes = loop_collectives(text), loop_collectives(text, "bytes")
    mf, flops = model_flops(trainer), dot_flops(text)
    out = {
        "model_flops": mf,
        "compiled_flops": flops,
        "cost_analysis_flops": float(cost.get("flops", 0.0)) if cost else None,
        "excess": flops / mf - 1.0,
        "collectives": {w: {k: {"count": count[w][k], "bytes": nbytes[w][k]} for k in KINDS}
                        for w in ("inside", "outside")},
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "compile_s": time.perf_counter() - t0,
    }
    log(f"step: {name}: compiled in {out['compile_s']:.1f} s")
    return trainer, out


def time_steps(trainer: Trainer, steps: int) -> dict:
    """Step time and the loop thread's time per step building batches and calling the step."""
    step, state = trainer.compiled, trainer.init_state()  # the executable compiled_figures read
    for i in range(2):  # warm-up
        state, _ = step(state, trainer.loader.batch(i))
    jax.block_until_ready(state)
    batch_s = call_s = 0.0
    start = time.perf_counter()
    for i in range(2, 2 + steps):
        t0 = time.perf_counter()
        tokens = trainer.loader.batch(i)
        t1 = time.perf_counter()
        state, _ = step(state, tokens)
        call_s += time.perf_counter() - t1
        batch_s += t1 - t0
    jax.block_until_ready(state)
    wall = time.perf_counter() - start
    return {"step_s": wall / steps, "host_batch_s": batch_s / steps, "host_call_s": call_s / steps}


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, layouts=None, shapes=("config", "1b"),
        timed: bool = True) -> dict:
    names = list(LAYOUTS) if layouts is None else list(layouts)
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        raise ConfigError(f"bench step: unknown layouts {bad}; valid: {', '.join(LAYOUTS)}")
    rows = []
    for shape in shapes:
        base = cfg if shape == "config" else with_overrides(cfg, SHAPE_1B)
        for name in names:
            lcfg = with_overrides(base, LAYOUTS[name])
            trainer, row = compiled_figures(lcfg, log, f"{shape} {name}")
            if shape == "config" and timed:
                row.update(time_steps(trainer, lcfg.train.steps))
            rows.append({"shape": shape, "layout": name, **row})
            log(f"step: {shape} {name}: " + ", ".join(
                f"{k} {v:.4g}" for k, v in row.items() if isinstance(v, float)))
    return {"devices": jax.device_count(), "backend": jax.default_backend(),
            "config": describe_config(cfg), "rows": rows}


def format_result(res: dict) -> str:
    ms = lambda x: "-" if x is None else f"{1e3 * x:.1f}"
    gf = lambda x: "-" if x is None else f"{x / 1e9:.2f}"

    def coll(r, where):
        c = r["collectives"][where]
        counts = "/".join(str(c[k]["count"]) for k in KINDS)
        return f"{counts} ({fmt_bytes(sum(c[k]['bytes'] for k in KINDS))})"

    rows = [[f"{r['shape']} {r['layout']}", gf(r["model_flops"]), gf(r["compiled_flops"]),
             f"{r['excess']:+.1%}", gf(r["cost_analysis_flops"]), coll(r, "inside"), coll(r, "outside"),
             fmt_bytes(r["temp_bytes"]), ms(r.get("step_s")), ms(r.get("host_batch_s")),
             ms(r.get("host_call_s"))]
            for r in res["rows"]]
    return "\n".join([
        f"compiled train step per layout ({res['devices']} {res['backend']} devices; per device; "
        "collectives: all-reduce/reduce-scatter/all-gather arrays executed per step, and their bytes)",
        table(["shape layout", "model GFLOP", "HLO dot GFLOP", "excess", "cost_analysis GFLOP", "in loops",
               "outside loops",
               "temp", "step ms", "host batch ms", "host call ms"], rows),
    ])
