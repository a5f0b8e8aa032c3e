"""Step time of a layout on a cluster: compute + exposed communication + pipeline bubble.

  compute   model FLOPs per device (6N + attention, PaLM's count; MoE: the active params) times
            the recompute factor (remat full: a second forward, 4/3; dots_saveable: 1.05)
            / (peak FLOP/s of the compute dtype x efficiency.matmul)
  comm      per collective: wire bytes / (link bandwidth x efficiency.comm) + ring steps x
            latency, on the intra- or inter-host link by the layout's dcn split; gradient sync
            hidden by efficiency.overlap, ZeRO-3 gathers by efficiency.gather_overlap; tensor,
            pipeline, expert and context (ring / all-to-all) collectives sit on the critical path
  overhead  efficiency.layer_overhead_us per layer and microbatch (launches, loop steps)
  bubble    a pipeline's timetable (jaxpar/parallel/pipeline/schedule.py) in lockstep: its ticks
            over the stage work 3m (idle ticks, the last stage's forward folded into its
            backward, pipeline.recompute's second forward), as a stretch of the critical path
MFU = model FLOPs (no recompute) per step / (step time x devices x peak).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from jaxpar.metrics import llama_flops_per_token
from jaxpar.planner.cluster import Cluster
from jaxpar.planner.layout import Layout

RECOMPUTE = {"none": 1.0, "dots_saveable": 1.05, "dots_with_no_batch_dims_saveable": 1.05, "full": 4 / 3}


def model_flops_per_token(cfg, model) -> float:
    """Training FLOPs per token of the model (no recompute): 6N (+ attention), N without the
    input embedding, with the head; MoE counts the experts a token visits."""
    from models.moe import active_param_count
    m = cfg.model
    n = active_param_count(m) if m.moe.num_experts else model.n_params
    non_embed = n - m.vocab_size * m.dim + (m.vocab_size * m.dim if m.tie_embeddings else 0)
    return llama_flops_per_token(non_embed, m.n_layers, cfg.train.seq_len, m.n_heads * m.resolved_head_dim)


def recompute_factor(layout: Layout) -> float:
    """Work per step over the model's (remat); a pipeline's own recompute is in its timetable."""
    return RECOMPUTE[layout.remat]


@functools.lru_cache(maxsize=4096)
def timetable(schedule: str, p: int, m: int, v: int, recompute: bool):
    from jaxpar.parallel.pipeline.schedule import build_timetable
    return build_timetable(schedule, p, m, v, recompute)


def pipeline_stretch(layout: Layout, microbatches: int) -> float:
    """The pipeline runner's lockstep time (its timetable: bubble, the last stage's forward
    folded into its backward, recompute) over the stage work without them, 3m (forward 1,
    backward 2)."""
    p = layout.size("pipeline")
    if p == 1:
        return 1.0
    v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
    tt = timetable(layout.schedule, p, microbatches, v, layout.recompute)
    return tt.lockstep_time(1.0, 2.0) / (3.0 * microbatches)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: dict[str, float]       # exposed seconds by purpose
    bubble_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    model_flops_per_step: float


def link_time(cluster: Cluster, kinds: dict) -> float:
    """Seconds the given collectives take on the cluster's links (wire bytes and ring steps)."""
    total = 0.0
    eff = cluster.efficiency.comm
    for row in kinds.values():
        for lk, wire in row["links"].items():
            total += wire / (getattr(cluster, lk).bandwidth_gbps * 1e9 * eff)
        lat = max(getattr(cluster, lk).latency_us for lk in row["links"]) if row["links"] else 0.0
        total += row["steps"] * lat * 1e-6
    return total


def step_time(cfg, layout: Layout, model, cluster: Cluster, comm: dict) -> StepTime:
    t = cfg.train
    tokens = t.global_batch * t.seq_len
    per_token = model_flops_per_token(cfg, model)
    model_flops = per_token * tokens
    devices = layout.devices
    peak = cluster.peak(t.compute_dtype)
    compute = model_flops * recompute_factor(layout) / devices / (peak * cluster.efficiency.matmul)
    by_purpose = comm["purpose"]
    total_wire = sum(by_purpose.values()) or 1.0
    whole = link_time(cluster, comm["kinds"])
    share = {k: whole * v / total_wire for k, v in by_purpose.items()}  # time split like the bytes
    eff = cluster.efficiency
    exposed = {"grad_sync": share["grad_sync"] * (1 - eff.overlap),
               "zero3_gather": max(0.0, share["zero3_gather"] - eff.gather_overlap * compute),
               "tensor": share["tensor"], "pipeline": share["pipeline"], "expert": share["expert"],
               "context": share["context"]}
    micro = layout.micro
    overhead = micro * cfg.model.n_layers / layout.size("pipeline") * eff.layer_overhead_us * 1e-6
    critical = (compute + overhead + exposed["tensor"] + exposed["pipeline"] + exposed["expert"]
                + exposed["context"] + exposed["zero3_gather"])
    bubble = (pipeline_stretch(layout, micro) - 1.0) * critical
    step = critical + bubble + exposed["grad_sync"]
    return StepTime(compute + overhead, exposed, bubble, step, tokens / step,
                    model_flops / (step * devices * peak),
                    model_flops)
