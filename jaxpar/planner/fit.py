"""`jaxpar plan fit RUN_DIRS... --cluster C [-o FILE]`: fit the cost model's efficiency factors
to measured step times, so predictions improve with use on the user's own hardware.

Each run dir holds its resolved config.yaml and metrics.jsonl (step_time_s per logged step; the
first logged record, which includes compilation, is left out; the median of the rest is the
measurement). The model's step time is compute / efficiency.matmul + communication /
efficiency.comm (+ the fixed per-layer overhead); with the others at 1 those two terms are
linear in 1 / efficiency, fitted by non-negative least squares (one run: matmul alone).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxpar.config import ConfigError, load_config
from jaxpar.planner.cluster import Cluster, Efficiency
from jaxpar.planner.comm import step_collectives
from jaxpar.planner.layout import Layout, abstract_plan
from jaxpar.planner.timing import step_time


def measured_step_s(run_dir: Path) -> float:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"jaxpar plan fit: {run_dir} has no metrics.jsonl (a jaxpar run dir?)")
    times = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step_time_s" in rec:
            times.append(float(rec["step_time_s"]))
    if len(times) < 2:
        raise ConfigError(f"jaxpar plan fit: {path} has {len(times)} timed steps; need at least 2 "
                          "(the first includes compilation)")
    return float(np.median(times[1:]))


def terms(cluster: Cluster, run_dir: Path, devices: int | None) -> tuple[float, float, float, str]:
    """(compute s, communication s, fixed s) at efficiency 1, and the layout's label."""
    from jaxpar.train.builtin import llama_model_factory
    from jaxpar.train.model import ModelDef
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"jaxpar plan fit: {run_dir} has no config.yaml")
    cfg = load_config(cfg_path)
    model = ModelDef.from_factory(llama_model_factory(cfg))
    layout = Layout.of_config(cfg, devices or cluster.devices)
    ideal = cluster.model_copy(update={"efficiency": Efficiency(matmul=1.0, comm=1.0, overlap=0.0,
                                                                gather_overlap=0.0, layer_overhead_us=0.0)})
    comm = step_collectives(cfg, layout, model, abstract_plan(cfg, layout))
    t = step_time(cfg, layout, model, ideal, comm)
    layers = cfg.model.n_layers / layout.size("pipeline")
    fixed = layout.micro * layers * cluster.efficiency.layer_overhead_us * 1e-6
    # the bubble scales with the compute (idle devices wait for it)
    return t.compute_s + t.bubble_s, sum(t.comm_s.values()), fixed, layout.label()


def fit_cluster(cluster: Cluster, run_dirs: list[str]) -> tuple[Cluster, dict]:
    if not run_dirs:
        raise ConfigError("jaxpar plan fit: give one or more run dirs (with config.yaml and metrics.jsonl)")
    rows = []
    for d in map(Path, run_dirs):
        compute, comm, fixed, label = terms(cluster, d, None)
        rows.append({"run": str(d), "layout": label, "measured_s": measured_step_s(d),
                     "compute_s": compute, "comm_s": comm, "fixed_s": fixed})
    y = np.array([r["measured_s"] - r["fixed_s"] for r in rows])
    a = np.array([[r["compute_s"], r["comm_s"]] for r in rows])
    if len(rows) == 1 or not a[:, 1].any():
        inv = np.array([max(y.sum() / a[:, 0].sum(), 1.0), 1 / cluster.efficiency.comm])
    else:
        inv, *_ = np.linalg.lstsq(a, y, rcond=None)
        inv = np.maximum(inv, 1.0)  # an efficiency is at most 1
    eff = cluster.efficiency.model_copy(update={"matmul": float(1 / inv[0]), "comm": float(1 / inv[1])})
    fitted = cluster.model_copy(update={"efficiency": eff})
    e0 = cluster.efficiency
    before = [r["compute_s"] / e0.matmul + r["comm_s"] / e0.comm + r["fixed_s"] for r in rows]
    after = list(a @ inv + np.array([r["fixed_s"] for r in rows]))
    for r, b, f in zip(rows, before, after):
        r.update(predicted_before_s=b, predicted_after_s=float(f))
    lines = [f"fitted efficiency: matmul {eff.matmul:.3f} (was {cluster.efficiency.matmul:.3f}), "
             f"comm {eff.comm:.3f} (was {cluster.efficiency.comm:.3f})"]
    lines += [f"  {r['layout']}: measured {r['measured_s'] * 1e3:.1f} ms, predicted "
              f"{r['predicted_before_s'] * 1e3:.1f} -> {r['predicted_after_s'] * 1e3:.1f} ms" for r in rows]
    return fitted, {"efficiency": eff.model_dump(), "runs": rows, "text": "\n".join(lines)}
