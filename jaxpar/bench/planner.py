"""`jaxpar bench planner`: how well the planner's step-time model ranks layouts on this machine,
and how long planning a large model takes.

  ranking   for LAYOUTS (>= 10 layouts of the quickstart model on the machine's devices): the
            predicted step time (cluster `cpu8`, or planner.cluster's file) beside the median of
            `steps` steps (the layouts' steps taken in turns), in wall and process CPU seconds;
            Spearman rank correlation (target >= 0.8) against CPU seconds / compute units when
            the cluster's CPU devices share compute units (then CPU seconds are the work, which
            other processes' load moves much less), else against wall time
  planning  seconds to plan the 70B preset on 1024 GPUs (h100_80gb_x8; target < 10 s)
"""
from __future__ import annotations

import os
import time
from typing import Callable

import jax
import numpy as np

from jaxpar.bench.common import describe_config, table, with_overrides
from jaxpar.config import Config
from jaxpar.planner.cluster import load_cluster
from jaxpar.planner.comm import step_collectives
from jaxpar.planner.layout import Layout, abstract_plan
from jaxpar.planner.memory import estimate
from jaxpar.planner.search import search
from jaxpar.planner.timing import step_time
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = ["data.source=synthetic", "checkpoint.enabled=false", "train.progress=false",
                     "eval.every=0", "data.eval_fraction=0"]
TOL = "sharding.replicated_tolerance=0.3"
LAYOUTS = [
    "mesh.data=8 sharding.zero_stage=0",
    "mesh.data=8 sharding.zero_stage=0 train.remat=full",
    "mesh.data=4 mesh.tensor=2",
    "mesh.data=2 mesh.tensor=2 mesh.fsdp=2",
    "mesh.data=1 mesh.fsdp=8 sharding.zero_stage=3",
    "mesh.data=2 mesh.fsdp=4 sharding.zero_stage=3 train.remat=full",
    "mesh.data=1 mesh.fsdp=8 sharding.zero_stage=2 train.grad_accum=2",
    "mesh.data=8 sharding.zero_stage=0 train.grad_accum=2",
    f"mesh.data=4 mesh.pipeline=2 train.grad_accum=4 {TOL}",
    f"mesh.data=2 mesh.pipeline=4 train.grad_accum=4 pipeline.schedule=gpipe {TOL}",
    "mesh.data=2 mesh.fsdp=4 sharding.zero_stage=1",
]


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


class Stepper:
    """One layout compiled, with its state: `step()` runs one step and returns its (wall, process
    CPU) seconds. CPU seconds count every thread's work, so on a CPU whose devices share cores
    they are the step's total work, and other processes' load moves them much less than wall time."""

    def __init__(self, cfg: Config):
        self.tr = Trainer(cfg, log=lambda s: None)
        self.fn = self.tr.compile()
        self.state = self.tr.init_state()
        self.i = 0

    def step(self) -> tuple[float, float]:
        batch = jax.block_until_ready(self.tr.loader.batch(self.i))
        self.i += 1
        t0, c0 = time.perf_counter(), time.process_time()
        self.state, metrics = self.fn(self.state, batch)
        jax.block_until_ready(metrics["loss"])
        return time.perf_counter() - t0, time.process_time() - c0


def measure(steppers: list[Stepper], steps: int) -> list[tuple[float, float]]:
    """(median wall, median CPU seconds) per step of each layout, their steps taken in turns (one
    step of each, `steps` + 1 rounds, the first left out: it may still pay for transfers and
    caches), so that the machine's changing load falls on every layout alike."""
    times: list[list[tuple[float, float]]] = [[] for _ in steppers]
    for r in range(steps + 1):
        for s, out in zip(steppers, times):
            t = s.step()
            if r:
                out.append(t)
    return [(float(np.median([w for w, _ in t])), float(np.median([c for _, c in t]))) for t in times]


RESET = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1", "mesh.expert=1"]


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, steps: int = 10,
        layouts: list[str] = LAYOUTS) -> dict:
    cluster = load_cluster(cfg.planner.cluster or "cpu8").with_devices(jax.device_count())
    # devices that share compute units: a step's wall time is all devices' work over the units,
    # which process CPU seconds measure without the other processes' load (wall time does not)
    by_cpu = cluster.platform == "cpu" and cluster.shared_compute
    rows, steppers = [], []
    for overrides in layouts:
        c = with_overrides(cfg, [*RESET, *overrides.split()])
        layout = Layout.of_config(c, jax.device_count())
        s = Stepper(c)
        comm = step_collectives(c, layout, s.tr.model, abstract_plan(c, layout), platform=cluster.platform)
        pred = step_time(c, layout, s.tr.model, cluster, comm).step_s
        rows.append({"layout": layout.label(), "predicted_s": pred,
                     "memory_bytes": estimate(c, layout, s.tr.model)["total"]})
        steppers.append(s)
        log(f"planner: compiled {layout.label()}")
    for row, (wall, cpu) in zip(rows, measure(steppers, steps)):
        row.update(measured_s=cpu / cluster.compute_units if by_cpu else wall, wall_s=wall, cpu_s=cpu)
        log(f"planner: {row['layout']}: predicted {row['predicted_s'] * 1e3:.1f} ms, measured "
            f"{row['measured_s'] * 1e3:.1f} ms (wall {wall * 1e3:.1f} ms, CPU {cpu * 1e3:.1f} ms)")
    del steppers
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    rho_wall = spearman([r["predicted_s"] for r in rows], [r["wall_s"] for r in rows])
    big = with_overrides(cfg, ["model.preset=70b", "model.n_layers=80", "model.dim=8192",
                               "model.n_heads=64", "model.n_kv_heads=8", "model.ffn_dim=28672",
                               "model.vocab_size=128256", "train.global_batch=1024", "train.seq_len=4096",
                               "train.compute_dtype=bfloat16", "model.attention=blockwise"])
    from jaxpar.train.builtin import llama_model_factory
    from jaxpar.train.model import ModelDef
    t0 = time.perf_counter()
    h100s = load_cluster("h100_80gb_x8").with_devices(1024)
    res = search(big, h100s, ModelDef.from_factory(llama_model_factory(big)))
    plan_s = time.perf_counter() - t0
    measured = (f"process CPU seconds per step / {cluster.compute_units} compute units (the devices "
                "share them)" if by_cpu else "wall seconds per step")
    return {"cluster": cluster.name, "measured": measured, "layouts": rows, "spearman": rho,
            "spearman_wall": rho_wall, "load_average": os.getloadavg()[0], "plan_70b_1024_s": plan_s,
            "plan_70b_best": res.ranked[0].layout.label() if res.ranked else None,
            "plan_70b_considered": res.considered, **describe_config(cfg)}


def format_result(r: dict) -> str:
    rows = [[x["layout"], f"{x['predicted_s'] * 1e3:.1f} ms", f"{x['measured_s'] * 1e3:.1f} ms",
             f"{x['wall_s'] * 1e3:.1f} ms", f"{x['cpu_s'] * 1e3:.1f} ms",
             f"{x['memory_bytes'] / 2**20:.1f} MiB"] for x in r["layouts"]]
    return "\n".join([
        f"planner vs measured step time (cluster {r['cluster']}): Spearman {r['spearman']:.2f} "
        f"(target >= 0.8); against wall time {r['spearman_wall']:.2f} (load average "
        f"{r['load_average']:.1f})",
        f"measured: {r['measured']}",
        table(["layout", "predicted", "measured", "wall", "CPU", "predicted memory"], rows),
        f"planning the 70B preset on 1024 H100s: {r['plan_70b_1024_s']:.1f} s (target < 10 s), "
        f"{r['plan_70b_considered']} layouts, best: {r['plan_70b_best']}"])
