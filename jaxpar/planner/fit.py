"""`jaxpar plan fit RUN_DIRS... --cluster C [-o FILE]`: fit the cost model's constants to measured
step times, so predictions improve with use on the user's own hardware.

Each run dir holds its resolved config.yaml and metrics.jsonl (step_time_s per logged step; the
first logged record, which includes compilation, is left out; the median of the rest is the
measurement). The predicted step is a sum of parts, each scaled by one constant
(timing.StepTime.parts): compute (1 / efficiency.matmul), memory traffic (1 / memory_gbps),
first touches of fresh memory (1 / fresh_gbps), collectives (1 / efficiency.comm, and the
links' latency) and the fixed costs (efficiency.layer_overhead_us and
tick_overhead_us together). One factor per part is fitted by non-negative least squares, the
parts in that order, as many as there are runs (the others keep their constants; so does a part
fitted to 0, the rest fitted again beside it); an efficiency stays at most 1.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from jaxpar.config import ConfigError, load_config
from jaxpar.planner.cluster import Cluster
from jaxpar.planner.comm import step_collectives
from jaxpar.planner.layout import Layout, abstract_plan
from jaxpar.planner.timing import step_time

PARTS = ("compute", "memory", "fresh", "comm", "fixed")


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


def terms(cluster: Cluster, run_dir: Path, devices: int | None) -> tuple[dict[str, float], str]:
    """(the predicted step's parts on `cluster`, seconds by PARTS; the layout's label)."""
    from jaxpar.train.builtin import llama_model_factory
    from jaxpar.train.model import ModelDef
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"jaxpar plan fit: {run_dir} has no config.yaml")
    cfg = load_config(cfg_path)
    model = ModelDef.from_factory(llama_model_factory(cfg))
    layout = Layout.of_config(cfg, devices or cluster.devices)
    comm = step_collectives(cfg, layout, model, abstract_plan(cfg, layout), platform=cluster.platform)
    t = step_time(cfg, layout, model, cluster, comm)
    return {k: t.parts.get(k, 0.0) for k in PARTS}, layout.label()


def scaled(cluster: Cluster, factor: dict[str, float]) -> Cluster:
    """`cluster` with each part's time multiplied by factor[part]."""
    e = cluster.efficiency
    # collectives: their bandwidth by efficiency.comm (up to 1, then the links' own), their
    # latency by the links'
    comm = e.comm / factor["comm"]
    link = lambda k: k.model_copy(update={"bandwidth_gbps": k.bandwidth_gbps * max(comm, 1.0),
                                          "latency_us": k.latency_us * factor["comm"]})
    eff = e.model_copy(update={"matmul": min(1.0, e.matmul / factor["compute"]), "comm": min(1.0, comm),
                               "layer_overhead_us": e.layer_overhead_us * factor["fixed"],
                               "tick_overhead_us": e.tick_overhead_us * factor["fixed"]})
    update = {"efficiency": eff, "intra": link(cluster.intra), "inter": link(cluster.inter)}
    for k in ("memory", "fresh"):
        if getattr(cluster, f"{k}_gbps"):
            update[f"{k}_gbps"] = getattr(cluster, f"{k}_gbps") / factor[k]
    return cluster.model_copy(update=update)


def fit_cluster(cluster: Cluster, run_dirs: list[str]) -> tuple[Cluster, dict]:
    if not run_dirs:
        raise ConfigError("jaxpar plan fit: give one or more run dirs (with config.yaml and metrics.jsonl)")
    rows = []
    for d in map(Path, run_dirs):
        parts, label = terms(cluster, d, None)
        rows.append({"run": str(d), "layout": label, "measured_s": measured_step_s(d), "parts": parts})
    a = np.array([[r["parts"][k] for k in PARTS] for r in rows])
    y = np.array([r["measured_s"] for r in rows])
    # the parts the runs can tell apart: non-zero, in PARTS order, at most one per run
    free = [i for i in range(len(PARTS)) if a[:, i].any()][:len(rows)]
    kept = [i for i in range(len(PARTS)) if i not in free]
    factor = np.ones(len(PARTS))
    while free:
        # a part fitted to 0 (free of cost) has no constant to write: it keeps its own (1), and
        # the others are fitted again beside it, so the constants written are the fit reported
        factor[free], _ = nnls(a[:, free], y - a[:, kept].sum(axis=1))
        zero = [i for i in free if factor[i] <= 0]
        if not zero:
            break
        factor[zero] = 1.0
        free, kept = [i for i in free if i not in zero], sorted(kept + zero)
    fitted = scaled(cluster, dict(zip(PARTS, map(float, factor))))
    for r in rows:
        r.update(predicted_before_s=sum(r["parts"].values()),
                 predicted_after_s=float(np.dot([r["parts"][k] for k in PARTS], factor)))
    e0, e1 = cluster.efficiency, fitted.efficiency
    lines = [f"fitted: efficiency.matmul {e1.matmul:.3f} (was {e0.matmul:.3f}), comm {e1.comm:.3f} "
             f"(was {e0.comm:.3f}), memory_gbps {fitted.memory_gbps} (was {cluster.memory_gbps}), "
             f"fresh_gbps {fitted.fresh_gbps} (was {cluster.fresh_gbps}), "
             f"layer_overhead_us {e1.layer_overhead_us:.1f} (was {e0.layer_overhead_us:.1f}), "
             f"tick_overhead_us {e1.tick_overhead_us:.1f} (was {e0.tick_overhead_us:.1f})"]
    lines += [f"  {r['layout']}: measured {r['measured_s'] * 1e3:.1f} ms, predicted "
              f"{r['predicted_before_s'] * 1e3:.1f} -> {r['predicted_after_s'] * 1e3:.1f} ms" for r in rows]
    return fitted, {"efficiency": e1.model_dump(), "memory_gbps": fitted.memory_gbps,
                    "fresh_gbps": fitted.fresh_gbps,
                    "factors": dict(zip(PARTS, map(float, factor))), "runs": rows, "text": "\n".join(lines)}
