"""Bytes per collective kind the train step issues, per device and step, and their time.

Two conventions (the same as `jaxpar bench comm`, which checks them against the compiled HLO):
result bytes = the op's result on one device; wire bytes = what a ring algorithm sends per
device over a group of N:  all-reduce 2(N-1)/N S,  all-gather (N-1)/N S_out,
reduce-scatter (N-1)/N S_in,  all-to-all (N-1)/N S,  collective-permute S.

  gradient sync   exact per param for the plan's specs and ZeRO stage (grad_sync_bytes: the
                  data-parallel all-reduce, ZeRO-1/2 reduce-scatter + all-gather, ZeRO-3's
                  per-microbatch gathers forward and backward); a compressed or local SGD sync
                  replaces the sum over the batch axes with its own collectives (planner/sync.py)
  tensor          Megatron activations [tokens, D] per layer and microbatch: 2 all-reduces in the
                  forward and, as XLA partitions the backward, tp_backward_all_reduces there
                  + 2 at the embedding/head (2/p a stage); remat "full" repeats the
                  attention's; float32 on XLA:CPU (all_reduce_itemsize). Sequence
                  parallel (sp_collectives): per layer 6 all-gathers (2 forward, the output
                  gradients of the 2 reduce-scatters, the 2 norm outputs again for the weight
                  gradients, or under remat "full" the recomputed forward's gathers serve those)
                  and 2 + tp_backward_all_reduces reduce-scatters (+ 1 recomputed under "full":
                  the attention's; the MLP's is the layer's output, which the backward does not
                  read); the head 2 all-gathers, 1 reduce-scatter. XLA:CPU has no
                  ReduceScatterCreator pass: its reduce-scatter is an all-reduce of the whole
                  activation and a slice
  pipeline        collective-permutes of stage activations (forward) and their gradients
                  (backward) on each tick of the timetable on which some device receives; with
                  the "dataflow" clock (Megatron-LM's runtime, timing.CLOCKS) one send per op
                  that crosses a stage boundary, of 1/tensor of the activation, all-gathered over
                  tensor after the receive (the paper's scatter/gather optimization)
  expert          4 all-to-alls per MoE layer and microbatch (dispatch and combine, forward and
                  backward) of top_k x capacity_factor x tokens x D
  context         ring: per layer and microbatch the collective-permutes of the K and V chunks
                  (C-1 hops forward, C-1 backward) and of their float32 gradients (C hops);
                  all_to_all: per layer 4 all-to-alls forward (q, k, v to a head split, the
                  output back) and 4 backward. Capacity MoE: per MoE layer 2 all-to-alls a pass
                  of every expert's slots for the whole sequences (split over context, put
                  back). The gradients are all-reduced over context too (every device computed
                  a part of each sequence's loss)
"""
from __future__ import annotations

import dataclasses
import math

import jax

from jaxpar.collectives.local_sgd import LocalSGD
from jaxpar.collectives.reducer import GradientReducer
from jaxpar.metrics import COLLECTIVE_KINDS
from jaxpar.parallel.pipeline.schedule import SPLIT
from jaxpar.planner.layout import abstract_plan
from jaxpar.planner.sync import local_sgd_ops, planned_sync
from jaxpar.sharding import ZERO_AXIS as ZERO, Plan, entry_axes
from jaxpar.xla import jaxlib_version

TP_BACKWARD_ALL_REDUCES = 5  # per layer, measured on XLA:CPU's partitioning of the backward


def tp_backward_all_reduces(platform: str) -> int:
    """Activation all-reduces per layer in the backward over `tensor`. XLA partitions each
    column-parallel matmul's input gradient as its own partial sum: q, k, v (3, summed at the
    norm) and the SwiGLU's gate and up (2): 5, what the XLA:CPU HLO has (one tuple all-reduce of
    3 and one of 2, their results added right after). XLA:GPU's collective pipeline runs
    AllReduceReassociate, add(all-reduce(a), all-reduce(b)) -> all-reduce(a + b): one per block,
    2, Megatron-LM's count (its fused QKV and single MLP input matmul). Other platforms: 5."""
    return 2 if platform == "gpu" else TP_BACKWARD_ALL_REDUCES


def all_reduce_itemsize(itemsize: int, platform: str) -> int:
    """Bytes per element of an activation all-reduce: XLA:CPU runs those of 16-bit floats in
    float32 (AllReducePromotion: the compiled step's bf16 all-reduces are f32, their reductions
    `add..._promoted`); other platforms in the compute dtype."""
    return max(itemsize, 4) if platform == "cpu" else itemsize


def permute_itemsize(itemsize: int, platform: str, jaxlib: tuple[int, ...] | None = None) -> int:
    """Bytes per element of a pipeline send: XLA:CPU before jaxlib 0.11 runs collective-permutes
    of 16-bit floats in float32 (the lowered step sends bf16, the compiled one f32; read off the
    HLO of jaxlib 0.10.2, bf16 from 0.11.2 on); other platforms and versions in the dtype."""
    old = (jaxlib if jaxlib is not None else jaxlib_version()) < (0, 11)
    return max(itemsize, 4) if platform == "cpu" and old else itemsize


def sp_collectives(remat: str, platform: str, split_backward: bool = False) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of [tokens, D] per layer with sequence parallelism. Forward:
    each block gathers its normed input and scatters its output (2 + 2). Backward: the scatters'
    gradients are gathers (2), the gathers' are scatters (tp_backward_all_reduces, one per
    column-parallel partial sum), and the weight gradients read the gathered norm outputs, which
    the step gathers again (2; Megatron-LM's SP does the same) unless remat "full" has just
    recomputed them: its recomputed forward gathers 2 and scatters 1 (the attention's output;
    the MLP's is the layer's output, which nothing in the backward reads). Read off the XLA:CPU
    HLO (2026-12-03): 6 and 7 per layer with and without remat full, 8 scatters with it. A
    backward split in two (zb_h1's Bx and W) gathers the norm outputs for W's weight gradients
    once more (2; XLA:CPU HLO of a p=2 pipeline, 2026-12-06)."""
    scatters = 2 + tp_backward_all_reduces(platform) + (1 if remat == "full" else 0)
    return 6 + (2 if split_backward else 0), scatters


def wire_bytes(kind: str, result_bytes: float, n: int) -> float:
    """Ring-algorithm bytes sent per device for one op of `kind` over a group of n devices."""
    if n <= 1:
        return 0.0
    f = (n - 1) / n
    if kind == "all-reduce":
        return 2 * f * result_bytes
    if kind == "reduce-scatter":
        return f * result_bytes * n  # input = n * result
    if kind == "collective-permute":
        return float(result_bytes)
    return f * result_bytes  # all-gather (result = gathered), all-to-all


def reduced_axes(plan: Plan) -> tuple[str, ...]:
    """The mesh axes (of size > 1) a gradient is summed over: the batch axes, and `context`,
    whose devices each computed the loss of a part of every sequence."""
    mesh = plan.mesh.shape
    axes = (*plan.batch_axes, *(("context",) if mesh.get("context", 1) > 1 else ()))
    return tuple(a for a in axes if mesh[a] > 1)


def grad_sync_bytes(plan: Plan, axes_tree, shapes_tree, *, grad_accum: int, param_itemsize: int,
             compute_itemsize: int, grad_itemsize: int | None = None, skip: tuple[str, ...] = (),
             within: tuple[str, ...] = ()) -> dict[str, dict]:
    """The minimum per-device result and wire bytes per kind for `plan` (see module doc);
    gradients reduced in `grad_itemsize` bytes (train.grad_reduce_dtype; default param_itemsize).
    `skip`: kinds another sync issues instead (a compressed one: the sum over the batch axes
    left, ZeRO-1's scatter); `within`: axes the gradient is not summed over (local SGD's
    `data`: each replica keeps its own)."""
    gsz = grad_itemsize or param_itemsize
    mesh = plan.mesh.shape
    batch = tuple(a for a in reduced_axes(plan) if a not in within)
    size = lambda axes: math.prod(mesh[a] for a in axes)
    out = {k: {"result_bytes": 0.0, "wire_bytes": 0.0} for k in COLLECTIVE_KINDS}

    def add(kind, result, n, times=1):
        if kind in skip or (kind == "reduce-scatter" and "zero1-scatter" in skip and plan.zero_stage == 1):
            return
        if n > 1:
            out[kind]["result_bytes"] += times * result
            out[kind]["wire_bytes"] += times * wire_bytes(kind, result, n)

    leaves = zip(jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple)),
                 jax.tree.leaves(shapes_tree))
    for ax, sds in leaves:
        shape = sds.shape
        # batch axes that shard the param itself (experts over `expert`) own it: no reduction there
        owned = {a for e in plan.spec(ax, shape, "param") for a in entry_axes(e) if a in batch and a != ZERO}
        reduce_over = tuple(a for a in batch if a not in owned)
        full = plan.spec(ax, shape, "act")  # every mesh axis the rules give this param
        local = [d // size(tuple(a for a in entry_axes(e) if a not in reduce_over))
                 for d, e in zip(shape, (*full, *(None,) * (len(shape) - len(full))))]
        elems = math.prod(local)
        opt = plan.spec(ax, shape, "opt")
        z = tuple(a for e in opt for a in entry_axes(e) if a in reduce_over)
        nz, rest = size(z), tuple(a for a in reduce_over if a not in z)
        if plan.zero_stage == 0 or nz == 1:
            add("all-reduce", elems * gsz, size(reduce_over))
        elif plan.zero_stage in (1, 2):
            add("reduce-scatter", elems * gsz / nz, nz, grad_accum if plan.zero_stage == 2 else 1)
            add("all-reduce", elems * gsz / nz, size(rest))
            add("all-gather", elems * param_itemsize, nz)
        else:
            L = elems * compute_itemsize
            add("all-gather", L, nz, 2 * grad_accum)
            add("reduce-scatter", elems * gsz / nz, nz, grad_accum)
            add("all-reduce", elems * gsz / nz, size(rest))
    return out




def add_op(out: dict, kind: str, result: float, n: int, times: float = 1, link: str = "intra") -> None:
    """Count `times` ops of `kind` with `result` bytes over a group of n devices."""
    if n > 1 and times > 0:
        row = out.setdefault(kind, {"result_bytes": 0.0, "wire_bytes": 0.0, "ops": 0.0, "steps": 0.0,
                                    "links": {}})
        row["result_bytes"] += times * result
        wire = times * wire_bytes(kind, result, n)
        row["wire_bytes"] += wire
        row["ops"] += times
        row["links"][link] = row["links"].get(link, 0.0) + wire
        # ring steps (latency terms): all-reduce 2(N-1), gathers/scatters N-1, permute 1
        row["steps"] += times * (2 * (n - 1) if kind == "all-reduce" else 1 if kind == "collective-permute"
                                 else n - 1)


def step_collectives(cfg, layout, model, plan: Plan, cache: dict | None = None, platform: str = "cpu",
                     clock: str = "lockstep") -> dict[str, dict]:
    """Per kind: result / wire bytes, ops and ring steps per device per step, with the wire bytes
    split by link ("intra" / "inter" host, by the layout's dcn factors), grouped by purpose
    under key "purpose" -> {grad_sync, zero3_gather, tensor, pipeline, expert: wire bytes}, and
    under "sync" what the gradient sync is (its describe(): the buckets of a compressed one).
    `cache` keeps the gradient sync's bytes per mesh, ZeRO stage and microbatch count;
    `platform` the cluster's (XLA's passes differ); `clock` how the pipeline runs."""
    from jaxpar.planner.memory import itemsize, param_gather_itemsize
    t, m = cfg.train, cfg.model
    out: dict = {}
    purpose = {"grad_sync": 0.0, "zero3_gather": 0.0, "tensor": 0.0, "pipeline": 0.0, "expert": 0.0,
               "context": 0.0}
    link = lambda axes: "inter" if any(layout.dcn.get(a, 1) > 1 for a in axes) else "intra"

    # gradient sync (and ZeRO-3's gathers): exact per param
    mesh = plan.mesh.shape
    cache = {} if cache is None else cache
    own = planned_sync(cfg, layout, model, plan, cache)  # a compressed / local SGD sync, or None
    compressed, local = isinstance(own, GradientReducer), isinstance(own, LocalSGD)
    batch = tuple(a for a in reduced_axes(plan) if not (local and a == "data"))
    accum = layout.micro
    key = (tuple(mesh.items()), plan.zero_stage, accum)
    if key not in cache:
        # local SGD all-reduces each replica's gradient whole (the ZeRO-0 sum) at ZeRO-1 too
        whole = local and plan.zero_stage == 1
        gplan = abstract_plan(cfg, dataclasses.replace(layout, zero_stage=0)) if whole else plan
        cache[key] = grad_sync_bytes(gplan, model.axes, model.shapes, grad_accum=accum,
                                     param_itemsize=param_gather_itemsize(itemsize(t.param_dtype), platform),
                                     compute_itemsize=itemsize(t.compute_dtype),
                                     grad_itemsize=itemsize(t.grad_reduce_dtype),
                                     skip=("all-reduce", "zero1-scatter") if compressed else (),
                                     within=("data",) if local else ())
    sync = cache[key]
    leaves = len(jax.tree.leaves(model.shapes))
    for kind, row in sync.items():  # `out` is empty here: one row per kind
        if row["result_bytes"]:
            # the group: the batch axes (ZeRO's over fsdp; close enough for the link choice)
            n = math.prod(mesh[a] for a in batch) if kind == "all-reduce" else mesh.get("fsdp", 1)
            n = max(n, 2)
            row_out = out.setdefault(kind, {"result_bytes": 0.0, "wire_bytes": 0.0, "ops": 0.0, "steps": 0.0,
                                            "links": {}})
            row_out["result_bytes"] += row["result_bytes"]
            row_out["wire_bytes"] += row["wire_bytes"]
            lk = link(batch if kind == "all-reduce" else ("fsdp",))
            row_out["links"][lk] = row_out["links"].get(lk, 0.0) + row["wire_bytes"]
            per_step = (2 * accum if kind == "all-gather" and plan.zero_stage >= 3
                        else accum if kind == "reduce-scatter" and plan.zero_stage >= 2 else 1)
            ops = leaves * per_step
            row_out["ops"] += ops
            row_out["steps"] += ops * (2 * (n - 1) if kind == "all-reduce" else n - 1)
            gathered = plan.zero_stage >= 3 and kind == "all-gather"
            purpose["zero3_gather" if gathered else "grad_sync"] += row["wire_bytes"]
    before = sum(r["wire_bytes"] for r in out.values())
    if compressed:  # the compressed reduction's own collectives (planner/sync.py)
        for kind, result, axes, n, times in own.wire_ops():
            add_op(out, kind, result, n, times, link(axes))
    elif local:
        ops_key = ("local_sgd_ops", *key)  # per mesh and ZeRO stage, like the sync's bytes
        if ops_key not in cache:
            gather = param_gather_itemsize(itemsize(t.param_dtype), platform)
            cache[ops_key] = local_sgd_ops(own, plan, model, gather)
        for kind, result, axes, n, times in cache[ops_key]:
            add_op(out, kind, result, n, times, link(axes))
    purpose["grad_sync"] += sum(r["wire_bytes"] for r in out.values()) - before

    c = itemsize(t.compute_dtype)
    micro = layout.micro
    cp = layout.size("context")
    # per device, one microbatch: its part of each sequence
    tokens = t.global_batch / plan.batch_size_divisor / micro * t.seq_len / cp
    act = tokens * m.dim * c
    layers = m.n_layers / layout.size("pipeline")
    tp = layout.size("tensor")
    if tp > 1:
        before = sum(r["wire_bytes"] for r in out.values())
        # remat "full" recomputes the attention's all-reduce, not the MLP's (the layer's output:
        # the backward does not read it, XLA drops it)
        fwd = 2 + (1 if layout.remat == "full" else 0)
        per_layer = fwd + tp_backward_all_reduces(platform)
        # the embedding's (forward) and the head's (backward) all-reduce: on the first and the
        # last stage of a pipeline, 2/p per device on average
        ends = 2 / layout.size("pipeline")
        ar = act * all_reduce_itemsize(c, platform) / c
        lk = link(("tensor",))
        if cfg.sharding.sequence_parallel:
            split = layout.size("pipeline") > 1 and layout.schedule in SPLIT
            gathers, scatters = sp_collectives(layout.remat, platform, split)
            # the embedding's and the head's: on a pipeline's first and last stage (1/p on average)
            ends = 1 / layout.size("pipeline")
            add_op(out, "all-gather", act, tp, micro * (layers * gathers + 2 * ends), lk)
            if platform == "gpu":
                add_op(out, "reduce-scatter", act / tp, tp, micro * (layers * scatters + ends), lk)
            else:  # no ReduceScatterCreator: all-reduce, then each device slices its part
                add_op(out, "all-reduce", ar, tp, micro * (layers * scatters + ends), lk)
        else:
            add_op(out, "all-reduce", ar, tp, micro * (layers * per_layer + ends), lk)
        purpose["tensor"] = sum(r["wire_bytes"] for r in out.values()) - before
    p = layout.size("pipeline")
    if p > 1:
        before = sum(r["wire_bytes"] for r in out.values())
        from jaxpar.planner.layout import timetable
        v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
        # with sequence parallelism a device's part of the activation is 1/tensor of it
        part = act / tp if cfg.sharding.sequence_parallel else act
        if clock == "dataflow":
            # every op but the last stage's forwards and the first stage's backwards sends once,
            # 1/tensor of the activation each, gathered over tensor on arrival (unless sequence
            # parallel: the stage reads it split)
            sends = 2 * micro * v * (p * v - 1) / (p * v)
            add_op(out, "collective-permute", act / tp, p, sends, link(("pipeline",)))
            if not cfg.sharding.sequence_parallel:
                add_op(out, "all-gather", act, tp, sends, link(("tensor",)))
        else:
            tt = timetable(layout.schedule, p, micro, v, layout.recompute)
            # the runner permutes on the ticks on which some device receives (no sends when idle)
            sends = int((tt.recv_x >= 0).any(axis=1).sum() + (tt.recv_g >= 0).any(axis=1).sum())
            add_op(out, "collective-permute", part * permute_itemsize(c, platform) / c, p, sends,
                   link(("pipeline",)))
        purpose["pipeline"] = sum(r["wire_bytes"] for r in out.values()) - before
    e = layout.size("expert")
    if e > 1 and m.moe.num_experts:
        before = sum(r["wire_bytes"] for r in out.values())
        moe_layers = layers / m.moe.every_n
        add_op(out, "all-to-all", act * m.moe.top_k * m.moe.capacity_factor, e, 4 * micro * moe_layers,
               link(("expert",)))
        purpose["expert"] = sum(r["wire_bytes"] for r in out.values()) - before
    if cp > 1:
        before = sum(r["wire_bytes"] for r in out.values())
        hd, c_link = m.resolved_head_dim, link(("context",))
        kv = tokens * m.n_kv_heads * hd / tp  # one K (or V) chunk's elements, heads split by tensor
        passes = 3 if layout.remat == "full" else 2  # forward, backward (+ the recomputed forward)
        if p > 1 and layout.recompute:  # each backward tick runs its stage's forward again, but
            passes += (p - 1) / p       # the last stage's, whose forward is its backward's
        if cfg.context.strategy == "ring":
            add_op(out, "collective-permute", 2 * kv * c, cp, micro * layers * passes * (cp - 1), c_link)
            add_op(out, "collective-permute", 2 * kv * 4, cp, micro * layers * cp, c_link)
        elif cfg.context.strategy == "all_gather":  # every chunk's K and V a pass, dK and dV home
            add_op(out, "all-to-all", cp * kv * c, cp, 2 * micro * layers * passes, c_link)
            add_op(out, "all-to-all", cp * kv * 4, cp, 2 * micro * layers, c_link)
        else:
            q = tokens * m.n_heads * hd / tp
            for x in (q, kv, kv, q):  # q, k, v to the head split; the output back
                add_op(out, "all-to-all", x * c, cp, passes * micro * layers, c_link)
        if m.moe.num_experts and m.moe.dispatch == "capacity":
            # each expert's slots for the whole sequence split C ways and put back together
            # (parallel/expert._capacity_moe): two all-to-alls of [seqs, E, slots, D] a pass
            from jaxpar.parallel.expert import capacity
            slots = -(-capacity(t.seq_len, m.moe.top_k, m.moe.num_experts, m.moe.capacity_factor) // cp) * cp
            seqs = tokens * cp / t.seq_len
            add_op(out, "all-to-all", seqs * m.moe.num_experts * slots * m.dim * c, cp,
                   2 * passes * micro * layers / m.moe.every_n, c_link)
        purpose["context"] = sum(r["wire_bytes"] for r in out.values()) - before
    return {"kinds": out, "purpose": purpose, "sync": own.describe() if own is not None else "psum"}
