"""Step time of a layout on a cluster: compute and memory traffic + exposed communication +
fixed costs + pipeline bubble; on compute units shared by several devices, all devices' work.

  compute   model FLOPs per device (6N + attention, PaLM's count; MoE: the active params) times
            the recompute factor (remat full: a second forward, 4/3; dots_saveable: 1.05)
            / (peak FLOP/s of the compute dtype x efficiency.matmul)
  memory    bytes a device moves per step that no cache holds (memory.step_traffic: each
            microbatch's stash and logits written and read back, weights, gradients, the
            optimizer's pass, a pipeline tick's buffers) / memory_gbps; on a CPU also the
            step's fresh temporaries (activations, working set, logits) / fresh_gbps (first
            touches: page faults). Against compute by a roofline: efficiency.memory_overlap 1
            takes the longer, 0 adds both (XLA:CPU: why remat `full` beats none there); the
            optimizer's pass adds after the pipeline, outside the roofline (nothing hides it)
  comm      per collective: wire bytes / (link bandwidth x efficiency.comm) + latency per ring
            step (or per op: a `rendezvous` link), on the intra- or inter-host link by the
            layout's dcn split; gradient sync hidden by efficiency.overlap, ZeRO-3 gathers by
            efficiency.gather_overlap; tensor, pipeline, expert and context (ring /
            all-to-all) collectives sit on the critical path
  fixed     efficiency.layer_overhead_us per layer and microbatch (launches, loop steps),
            tick_overhead_us per pipeline tick (every device runs every tick)
  bubble    a pipeline's timetable (jaxpar/parallel/pipeline/schedule.py) in lockstep: its ticks
            over the stage work 3m (idle ticks, pipeline.recompute's second forward and the last
            stage's forward folded into its backward there; zb_h1's Bx and W ticks at their own
            costs, weight_share), as a stretch of the critical path; with clock "dataflow"
            (Megatron-LM's runtime, not jaxpar's) the same orders run op by op as inputs arrive:
            1F1B's (p-1)/m bubble, the interleaved schedule's (p-1)/(v m)
  shared    with devices_per_unit > 1 (8 forced CPU devices on 2 cores) the step lasts at least
            the work of every device (compute, memory, fixed; pipeline.recompute's forward
            again) over the units, plus the collectives: replicated work counts once per
            device, a device's idle tick is another's compute
MFU = model FLOPs (no recompute) per step / (step time x peak of the devices: a unit's peak x
compute units where devices share them, else x devices).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from jaxpar.metrics import llama_flops_per_token
from jaxpar.parallel.pipeline.schedule import SPLIT, Op, device_orders, op_inputs, op_key
from jaxpar.planner.cluster import Cluster
from jaxpar.planner.layout import Layout, timetable
from jaxpar.planner.memory import ModelShape, activation_terms, optimizer_traffic, state_terms, step_traffic

# how a pipeline's ops are timed: "lockstep", jaxpar's runner (one scan of ticks, a tick as long
# as its slowest device); "dataflow", each device's ops back to back as their inputs arrive
# (Megatron-LM's runtime: what published.check_run models for the paper's own layouts)
CLOCKS = ("lockstep", "dataflow")
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


def pipeline_stretch(cfg, layout: Layout, microbatches: int, clock: str = "lockstep") -> float:
    """The pipeline's time over the stage work without bubble, folding or recompute, 3m (forward
    1, backward 2; zb_h1's split backward: W by weight_share, Bx the rest). clock "lockstep":
    jaxpar's runner (its timetable's ticks, each as long as its slowest device);
    "dataflow": the same schedule run as Megatron-LM runs it (dataflow_time)."""
    p = layout.size("pipeline")
    if p == 1:
        return 1.0
    v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
    w = 2.0 * weight_share(cfg, layout) if layout.schedule in SPLIT else None
    if clock == "dataflow":
        w = None if w is None else round(w, 4)
        return dataflow_time(layout.schedule, p, microbatches, v, layout.recompute, w) / (3.0 * microbatches)
    if clock != "lockstep":
        raise ValueError(f"unknown pipeline clock {clock!r}; valid: {', '.join(CLOCKS)}")
    tt = timetable(layout.schedule, p, microbatches, v, layout.recompute)
    return tt.lockstep_time(1.0, 2.0, w) / (3.0 * microbatches)


def dataflow_orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """Each device's op order as Megatron-LM issues it: 1f1b with p-1-d warm-up forwards, then
    one forward one backward (its forward_backward_pipelining_without_interleaving); the
    interleaved order, gpipe and zb_h1 as jaxpar's runner orders them (the same orders)."""
    if schedule != "1f1b":
        return device_orders(schedule, p, m, v)
    orders = []
    for d in range(p):
        w = min(p - 1 - d, m)
        ops = [Op("F", i, 0) for i in range(w)]
        for i in range(m - w):
            ops += [Op("F", w + i, 0), Op("B", i, 0)]
        orders.append(ops + [Op("B", i, 0) for i in range(m - w, m)])
    return orders


@functools.lru_cache(maxsize=4096)
def dataflow_time(schedule: str, p: int, m: int, v: int = 1, recompute: bool = False,
                  weight: float | None = None) -> float:
    """Time of a pipeline whose devices each run their ops back to back, an op starting as soon
    as its device is free and its inputs have arrived (a blocking send / receive per op, no
    global ticks: how Megatron-LM runs 1F1B and its interleaved schedule), in units of a device's
    whole forward of one microbatch: F 1/v, B 2/v (+ 1/v with recompute), a split backward's W
    `weight` / v and its B the rest. Every stage, the last included, runs its own forward: 1f1b
    takes (m + p - 1) x 3, the interleaved schedule 3m + 3(p - 1) / v ((p - 1) / (v m) bubble)."""
    f, b = 1.0 / v, 2.0 / v
    w = 0.0 if weight is None else weight / v
    cost = {"F": f, "B": (b + f if recompute else b) - w, "W": w}
    orders = dataflow_orders(schedule, p, m, v)
    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * p, [0] * p
    todo, queued = list(range(p)), set(range(p))  # devices whose next op may have become ready
    while todo:
        d = todo.pop()
        queued.discard(d)
        while pos[d] < len(orders[d]):
            op = orders[d][pos[d]]
            deps = op_inputs(op, d, p, v)
            if any(k not in done for k in deps):
                break
            free[d] = done[op_key(op, d, p)] = max([free[d]] + [done[k] for k in deps]) + cost[op.kind]
            pos[d] += 1
            for n in ((d + 1) % p, (d - 1) % p):  # the devices that may wait on it
                if n not in queued:
                    todo.append(n)
                    queued.add(n)
    if any(pos[d] < len(orders[d]) for d in range(p)):
        raise RuntimeError(f"{schedule} p={p} m={m} v={v}: the op orders wait on each other")
    return max(free)


def weight_share(cfg, layout: Layout) -> float:
    """zb_h1's W as a part of a whole backward (Bx the rest): the layer's weight matmuls x^T dz,
    2 FLOPs per weight and token, over the backward, twice the forward (those weights' 2 a token
    and attention's scores and values, 4 S H hd): 0.48 for tests/test_pipeline_perf.py's model
    (S = 32), as XLA counts its branches there. The same under a train.remat policy: the
    recomputed forward lands in Bx (W reads what it recomputed), and is the remat factor's, as
    in 1f1b's backward (measured, tiny model: W 50.8 MFLOP without remat, 50.8 with full, 50.9
    with dots_saveable)."""
    ms = ModelShape.of(cfg.model)
    attention = 2 * cfg.train.seq_len * ms.heads * ms.head_dim
    return ms.layer_weights / (2 * (ms.layer_weights + attention))


def pipeline_ticks(layout: Layout, microbatches: int) -> int:
    """Ticks of the pipeline runner's scan (0 without a pipeline): each costs every device the
    runner's fixed work (efficiency.tick_overhead_us), whether it computes or idles."""
    if layout.size("pipeline") == 1:
        return 0
    v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
    return timetable(layout.schedule, layout.size("pipeline"), microbatches, v, layout.recompute).ticks


def roofline(compute: float, memory: float, overlap: float) -> tuple[float, float]:
    """(compute, memory) seconds as they add to the step: the longer whole, the shorter less the
    part hidden behind it (overlap 1: the roofline's max; 0: both add up)."""
    if compute >= memory:
        return compute, (1 - overlap) * memory
    return (1 - overlap) * compute, memory


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: dict[str, float]       # exposed seconds by purpose
    bubble_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    model_flops_per_step: float
    memory_s: float = 0.0          # memory traffic not hidden behind compute (a device's)
    overhead_s: float = 0.0        # per-layer and per-tick fixed costs (a device's)
    shared: bool = False           # the step is bound by all devices' work on shared compute units
    update_s: float = 0.0          # the optimizer's pass (a device's; in memory_s, after the roofline)
    # seconds of step_s by the constant that scales them: compute (1 / efficiency.matmul),
    # memory (1 / memory_gbps), fresh (1 / fresh_gbps), comm (1 / efficiency.comm and the links'
    # latency), fixed (the *_overhead_us); what `jaxpar plan fit` fits
    parts: dict[str, float] = field(default_factory=dict)


def link_time(cluster: Cluster, kinds: dict) -> float:
    """Seconds the given collectives take on the cluster's links (wire bytes, and ring steps or
    ops by the slowest link's latency)."""
    total = 0.0
    eff = cluster.efficiency.comm
    for row in kinds.values():
        for lk, wire in row["links"].items():
            total += wire / (getattr(cluster, lk).bandwidth_gbps * 1e9 * eff)
        if row["links"]:
            link = max((getattr(cluster, lk) for lk in row["links"]), key=lambda x: x.latency_us)
            waits = row["ops"] if link.collective == "rendezvous" else row["steps"]
            total += waits * link.latency_us * 1e-6
    return total


def step_time(cfg, layout: Layout, model, cluster: Cluster, comm: dict,
              state: dict[str, float] | None = None, clock: str = "lockstep") -> StepTime:
    """The step's seconds on `cluster` (module doc); `state`: this layout's memory.state_terms
    when already known (the search caches them); `clock`: how a pipeline runs (CLOCKS)."""
    t = cfg.train
    tokens = t.global_batch * t.seq_len
    per_token = model_flops_per_token(cfg, model)
    model_flops = per_token * tokens
    devices = layout.devices
    peak = cluster.peak(t.compute_dtype)
    eff = cluster.efficiency
    compute = model_flops * recompute_factor(layout) / devices / (peak * eff.matmul)
    memory = update = 0.0
    if cluster.memory_gbps:
        state = state if state is not None else state_terms(cfg, layout, model)
        ticks = pipeline_ticks(layout, layout.micro)
        update = optimizer_traffic(cfg, layout, state) / (cluster.memory_gbps * 1e9)
        memory = step_traffic(cfg, layout, state, ticks) / (cluster.memory_gbps * 1e9) - update
    fresh = 0.0
    if cluster.fresh_gbps:
        act = activation_terms(cfg, layout)
        temps = act["activations"] + act["working"] + act["w_kept"] + act["logits"]
        fresh = temps / (cluster.fresh_gbps * 1e9)
    part_c, part_m = roofline(compute, memory + fresh, eff.memory_overlap)
    part_f = part_m * fresh / (memory + fresh) if fresh else 0.0  # fresh's share, for the fit
    by_purpose = comm["purpose"]
    total_wire = sum(by_purpose.values()) or 1.0
    whole = link_time(cluster, comm["kinds"])
    share = {k: whole * v / total_wire for k, v in by_purpose.items()}  # time split like the bytes
    exposed = {"grad_sync": share["grad_sync"] * (1 - eff.overlap),
               "zero3_gather": max(0.0, share["zero3_gather"] - eff.gather_overlap * compute),
               "tensor": share["tensor"], "pipeline": share["pipeline"], "expert": share["expert"],
               "context": share["context"]}
    micro = layout.micro
    layer_fixed = micro * cfg.model.n_layers / layout.size("pipeline") * eff.layer_overhead_us * 1e-6
    tick_fixed = pipeline_ticks(layout, micro) * eff.tick_overhead_us * 1e-6
    on_path = (exposed["tensor"] + exposed["pipeline"] + exposed["expert"] + exposed["context"]
               + exposed["zero3_gather"])
    # one device's critical path, stretched by the pipeline's lockstep timetable
    stretch = pipeline_stretch(cfg, layout, micro, clock)
    critical = part_c + part_m + layer_fixed + on_path
    bubble = (stretch - 1.0) * critical
    step = critical + bubble + tick_fixed + exposed["grad_sync"] + update
    parts = {"compute": part_c * stretch, "memory": (part_m - part_f) * stretch + update,
             "fresh": part_f * stretch, "comm": on_path * stretch + exposed["grad_sync"],
             "fixed": layer_fixed * stretch + tick_fixed}
    shared = False
    if cluster.shared_compute:
        # every device's work queues for the shared units: replicated work counts once per
        # device, idle ticks cost nothing, pipeline.recompute's second forward does (+1/3 of
        # the compute; its bytes are in step_traffic)
        per_unit = devices / cluster.compute_units
        again = 4 / 3 if layout.size("pipeline") > 1 and layout.recompute else 1.0
        work = part_c * again + part_m + update + layer_fixed + tick_fixed
        busy = per_unit * work + on_path + exposed["grad_sync"]
        if busy > step:
            step, shared, bubble = busy, True, 0.0
            parts = {"compute": per_unit * again * part_c, "memory": per_unit * (part_m - part_f + update),
                     "fresh": per_unit * part_f, "comm": on_path + exposed["grad_sync"],
                     "fixed": per_unit * (layer_fixed + tick_fixed)}
    # the hardware's peak: peak_tflops is a compute unit's, which devices_per_unit devices share
    units = cluster.compute_units if cluster.shared_compute else devices
    return StepTime(part_c, exposed, bubble, step, tokens / step, model_flops / (step * units * peak),
                    model_flops, part_m + update, layer_fixed + tick_fixed, shared, update, parts)
