"""Per-device memory of a layout, term by term, from first principles.

    state       params, optimizer state (mu, nu, float32 masters) under the plan's specs: exact
                (the same Plan.spec the step uses, on a device-less mesh)
    sync_state  what a compressed, 1-bit Adam or local SGD sync keeps in the train state
                (error-feedback residuals, PowerSGD's Q, a replica's params): planner/sync.py
    sync_working the new error-feedback residuals of the layers the backward scan reduces, a
                second buffer beside the old ones
    grads       the gradient the step holds (ZeRO-2/3: its fsdp shard), in float32 when
                microbatches are accumulated; plus one microbatch's unsharded gradient with
                accumulation (ZeRO-2 without a pipeline: of the params outside the layer stack
                and one layer, the stack's reduce-scattered in the backward layer scan; ZeRO-3
                without a pipeline: one microbatch's shard beside the sum)
    update      the optimizer's transients (Adam's update of the optimizer shard, float32)
    gathered    ZeRO-3: the embedding/head and two layers' weights gathered at once; ZeRO-1/2:
                the updated params, all-gathered from the optimizer's shards
    activations what the backward keeps, per token and layer, by remat policy and attention
                implementation, for the tokens of one microbatch on a device; a pipeline stage
                stashes its vjp's residual leaves (STASHED) in the runner's ring buffer, the
                timetable's slots (pipeline.recompute: false), or keeps each
                in-flight microbatch's input in its x ring (recompute: true)
    working     what is live while a backward recomputes: a share of one layer's activations
                (remat); a pipeline tick: the stage residuals it holds besides the ring
                (STASH_TICK; with recompute the stage vjp's own) and, under remat, the one
                layer its backward recomputes (a remat-free layer's residuals less the stashed),
                without remat that layer's residuals sliced out of the stage's stack
    boundary    a pipeline's [tokens, D] stage-boundary buffers: the x and g rings (their
                timetable slots; each filed under a cond, no spare slot since 2026-12-07) and
                a tick's reads, copies and zeros of them
    w_kept      zb_h1: per layer and microbatch between its Bx and its W, what W reads that Bx
                computed (w_kept_bytes), in the timetable's w slots (d + 1 on device d; the ring
                has no spare one); a tick's W_TICK more (Bx's new slot)
    logits      float32 [tokens, vocab / tensor] logits, their softmax and gradient
                (train.loss_chunk: only a chunk's)

With context parallelism (mesh.context = C) a device holds S / C tokens of each sequence: the
per-token terms count those; the batch term whole rows (the loader does not split them).

Per token and layer (compute dtype bytes c, D model dim, hd head dim, H and K query and KV
heads, F the MLP width, t = mesh.tensor, S the sequence length; tensor-parallel parts / t):
    see KEPT: elements of each kind kept per token and layer, measured on XLA:CPU
D-sized terms are / t as well with sharding.sequence_parallel (as many as without it).

On a GPU (platform "gpu", the cluster's) XLA:GPU's buffer assignment is counted instead where it
differs (read off the compiled step's live buffers at its peak, 8 H200 deviceless, jax 0.12):
    cast        the params in the compute dtype (ZeRO-0/1/2), cast once and kept for the backward
    activations GPU_KEPT: cuDNN attention (no scores), the fused layer's residuals
    logits      the float32 logits and their compute-dtype copy (the head's output)
    gathered    ZeRO-3 only: ZeRO-1/2's all-gather writes the donated params in place
    update      0: it runs after the backward freed the activations
and the peak is at the loss: the backward's gradient (and a remat's recomputed layer) is made
after the logits are freed, so the total counts the larger of logits and grads + working. A
pipeline's stage stash on a GPU is GPU_KEPT's leaves in its ring buffer, with GPU_STASH_TICK
stages more in a tick, and every term is summed.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import numpy as np

from jaxpar.collectives.reducer import LAYERS
from jaxpar.config import Config
from jaxpar.parallel.pipeline.schedule import SPLIT
from jaxpar.planner.layout import Layout, abstract_plan, shard_elems, timetable
from jaxpar.planner.sync import planned_sync, state_bytes as sync_state_bytes
from jaxpar.train.precision import DTYPES, has_masters

ADAM_TRANSIENT = 1.0     # float32 copies of the optimizer shard Adam's update holds at once
# pipeline.recompute false: one microbatch's stage residuals (the vjp's stashed leaves) a tick
# holds besides the runner's ring buffer: the slot a backward reads (sliced inside its branch)
# and the branches' zero residuals (a constant, live all the loop); a forward's new residuals
# go to the ring. (4 while the last stage's forward was folded into its backward, whose own
# residuals were live there: 80.6 -> 69.7 MiB compiled temp at data 4 x pipeline 2,
# 2026-12-03; 3 while the slot was sliced before the switch and copied as its operand, until
# 2026-12-07: runner.Slot.) Read off the compiled step's live buffers at its peak.
STASH_TICK = 2
# [tokens, D] stage-boundary buffers a tick holds besides the x and g ring buffers: the input
# and cotangent slots it reads (two slices) and their copies as the switch's operands, and the
# branches' zero activations.
BOUNDARY_TICK = 5
# zb_h1: slots of what Bx keeps for W that a tick holds besides the runner's w ring buffer: Bx's
# new one (its layer scan's stacked outputs, a switch output filed into the ring after it); the
# branches' zeros are one broadcast per distinct leaf shape, left out. W's layer scan slices each
# layer's share from the ring itself, and only Bx writes to it (no spare slot). (2 and the
# ring's spare one while the slot W reads was sliced before the switch and every tick filed its
# w_out: 40.07 -> 28.57 MiB compiled temp at data 4 x pipeline 2, remat full, 2026-12-03.)
W_TICK = 1
# XLA:GPU: a tick holds one stage's residuals besides the ring (its forward's new ones, or the
# slot its backward reads); beside tensor parallelism two: the backward's branch copies the
# slot it reads (the peak's live buffers: the slot's leaves as copies beside the slice). 1B
# preset, 8 H200 deviceless, twenty pipelines of p 2 and 4 (1f1b, gpipe, zb_h1, 1f1b_split,
# interleaved, recompute; remat none, dots, full; tensor 2, sequence parallel, context, ZeRO-3),
# 2026-12-07, the ring without a spare slot: 0.96-1.11 of XLA:GPU.
GPU_STASH_TICK = {False: 1, True: 2}  # by tensor > 1
WORKING = 0.55           # of one layer's remat-free activations, live while a remat backward runs
LOGIT_COPIES = 3.0       # logits, softmax, their gradient (float32)
# XLA:GPU (jax 0.12, cuDNN attention, 8 H200 deviceless, 2026-12-03): what the layer scan
# stacks per token and layer for the backward, read off the compiled step's live buffers at its
# peak (the loss). Compute-dtype values: "d" D-sized (full width under tensor), "q" H hd, "kv"
# K hd each, "mlp" F; "d32" float32 D-sized (the norms' inputs). dots_with_no_batch_dims: the
# q, k, v, o, gate, up, down projections' outputs; none: also the norms' float32 inputs, the
# attention output and the SwiGLU parts; full: the layer's input.
GPU_KEPT = {
    "none": {"d": 2.0, "d32": 4.0, "q": 3.0, "kv": 2.0, "mlp": 6.0},
    "dots_with_no_batch_dims_saveable": {"d": 2.0, "d32": 0.0, "q": 1.0, "kv": 2.0, "mlp": 2.0},
    "full": {"d": 1.0, "d32": 0.0, "q": 0.0, "kv": 0.0, "mlp": 0.0},
}
GPU_KEPT["dots_saveable"] = GPU_KEPT["dots_with_no_batch_dims_saveable"]


@functools.lru_cache(maxsize=64)
def itemsize(name: str) -> int:
    return np.dtype(DTYPES[name]).itemsize


def state_itemsizes(cfg: Config, grad_accum: int | None = None) -> dict[str, int]:
    """Bytes per param of params, of the gradient as the step holds it, and of AdamW's state."""
    t = cfg.train
    opt = (itemsize(t.master_dtype) if has_masters(t) else 0) + itemsize(cfg.optimizer.mu_dtype) + 4
    grads = 4 if (grad_accum or t.grad_accum) > 1 else itemsize(t.grad_reduce_dtype)
    return {"params": itemsize(t.param_dtype), "grads": grads, "opt_state": opt}


def _leaves(model):
    return list(zip(jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, tuple)),
                    jax.tree.leaves(model.shapes)))


@dataclass(frozen=True)
class ModelShape:
    """What the activation terms need of a model config."""

    dim: int
    head_dim: int
    heads: int
    kv_heads: int
    ffn: int          # MLP width per token (MoE: top_k experts' widths, plus a shared expert)
    layers: int
    vocab: int

    @classmethod
    def of(cls, m) -> "ModelShape":
        ffn = m.ffn_dim
        if m.moe.num_experts:  # every_n-th layer is MoE: average the per-token width
            moe_ffn = m.moe.top_k * (m.moe.expert_ffn_dim or m.ffn_dim) * m.moe.capacity_factor
            if m.moe.shared_expert:
                moe_ffn += m.moe.shared_ffn_dim or m.ffn_dim
            ffn = ((m.moe.every_n - 1) * m.ffn_dim + moe_ffn) / m.moe.every_n
        return cls(m.dim, m.resolved_head_dim, m.n_heads, m.n_kv_heads, int(ffn), m.n_layers, m.vocab_size)

    @property
    def layer_weights(self) -> int:
        """A layer's matmul weights: q, k, v, o and the MLP's three at the per-token width."""
        return self.dim * (2 * self.heads + 2 * self.kv_heads) * self.head_dim + 3 * self.dim * self.ffn


def attention_impl(cfg: Config) -> str:
    m = cfg.model
    return _attention_impl(m.attention, cfg.train.compute_dtype, cfg.train.seq_len, m.resolved_head_dim,
                           m.attention_threshold)


@functools.lru_cache(maxsize=256)
def _attention_impl(attention: str, compute_dtype: str, seq_len: int, head_dim: int, threshold) -> str:
    from jaxpar.attention import resolve
    return resolve(attention, platform="cpu", dtype=DTYPES[compute_dtype], seq_len=seq_len, head_dim=head_dim,
                   threshold=threshold)


# Measured on XLA:CPU (jax 0.12, f32, tests/test_planner.py's layouts) per token and layer:
# elements kept of each kind. Tensor parallelism materialises more [tokens, D] tensors (the
# all-reduced outputs, their float32 norms): full-width, or split over the sequence with
# sequence parallelism (d_tp of them either way: the layer scan's carry at data 4 x tensor 2
# keeps 6 [tokens / t, D] leaves a layer with remat none and 2 with dots_saveable, the layer
# vjp's D-sized leaves as STASHED counts them, where KEPT's t = 1 counts are 1 and 0).
# "scores": float32 [heads, keys] per query token with float32 compute; "scores16" with 16-bit
# compute where that differs. softmax's custom jvp (attention/xla.py turns it on) keeps the
# probabilities alone: one [heads, keys] less than exp(x - max) beside them did with float32
# (2.3 -> 1.3 measured; STASHED 2.125 -> 1.125), none less with bf16 (the float32 exp there
# became the float32 probabilities beside the bf16 ones: 2026-12-06, jax 0.12.0.1 and 0.12.1).
KEPT = {
    "none": {"d": 1.0, "d_tp": 8.0, "heads": 3.0, "mlp": 6.0, "scores": 1.3, "scores16": 2.3},
    "dots_saveable": {"d": 0.0, "d_tp": 2.0, "heads": 1.0, "mlp": 2.0, "scores": 1.0},
    "full": {"d": 1.0, "d_tp": 1.0, "heads": 0.0, "mlp": 0.0, "scores": 0.0},
}
KEPT["dots_with_no_batch_dims_saveable"] = KEPT["dots_saveable"]
# A pipeline stage's stash (pipeline.recompute false) is its vjp's residual leaves, what the
# runner's ring buffer holds whatever XLA could have fused: counted from those leaves' shapes
# (tests' model, p = 2): none keeps 6 D-sized values, q and the attention output (H hd) and k, v
# (2 K hd: 2 "heads" of (H + K) hd), 6 F-sized ones and the float32 logits and probabilities
# [H, S] with the causal mask's bools (K S bytes, 1/8 of a float32 [H, S] there); dots_saveable
# the dots' outputs: 2 D (the attention and MLP output projections), q, k, v and the attention
# output, 2 F (gate, up) and the scores; full the layer's input.
STASHED = {
    "none": {"d": 6.0, "heads": 2.0, "mlp": 6.0, "scores": 1.125, "scores16": 2.125},
    "dots_saveable": {"d": 2.0, "heads": 2.0, "mlp": 2.0, "scores": 1.0},
    "full": {"d": 1.0, "heads": 0.0, "mlp": 0.0, "scores": 0.0},
}
# Tensor parallelism splits the heads- and MLP-shaped leaves; the D-sized ones stay full-width
# and as many: the stash is the same leaves (read off the runner's ring buffers at tensor 2,
# 2026-12-03: 6 [tokens, D] a layer with remat none, as at tensor 1), not KEPT's extra copies.
for _v in STASHED.values():
    _v["d_tp"] = _v["d"]
del _v
# dots_with_no_batch_dims_saveable saves the projections' outputs alone: 2 D (the attention and
# MLP output projections), q ("q": H hd), k and v ("kv": K hd each), 2 F (gate, up); neither the
# attention output nor the scores (batched dots). Read off the stage vjp's leaves, tests' model,
# data 4 x pipeline 2, 2026-12-07 (KEPT's dots_saveable counted until then: its float32 scores
# made the planner 1.09-1.19 of the compiler's total).
STASHED["dots_with_no_batch_dims_saveable"] = {"d": 2.0, "d_tp": 2.0, "heads": 0.0, "q": 1.0, "kv": 2.0,
                                                "mlp": 2.0, "scores": 0.0}


def per_token_layer_bytes(ms: ModelShape, remat: str, c: int, t: int, seq: int, xla_attention: bool,
                          sequence_parallel: bool, table: dict = KEPT) -> float:
    """Bytes the backward keeps per token per layer under `remat` (see the module doc); `table`
    STASHED: what a pipeline stage's vjp stashes."""
    k = table[remat]
    d = ms.dim / t if sequence_parallel else ms.dim
    d_copies = k["d"] if t == 1 else k["d_tp"]
    heads = (ms.heads + ms.kv_heads) * ms.head_dim / t
    qkv = (k.get("q", 0.0) * ms.heads + k.get("kv", 0.0) * ms.kv_heads) * ms.head_dim / t
    scores = ms.heads * seq / t if xla_attention else 0.0  # float32 [heads, keys] per query token
    kept_scores = k["scores"] if c == 4 else k.get("scores16", k["scores"])
    return c * (d_copies * d + k["heads"] * heads + qkv + k["mlp"] * ms.ffn / t) + 4 * kept_scores * scores


# A split backward (zb_h1, 1f1b_split) under a train.remat policy: what W reads of the forward
# that the policy did not save, so Bx recomputed and keeps for W besides the cotangents, per
# token and layer (measured on XLA:CPU, float32 and bf16 compute, 2026-12-07, after the cut's
# two passes, split.py: W makes again what cheap equations give it, the norms' outputs among
# them; Bx computes the W equations whose outputs are fewer bytes than their inputs, the
# attention output from the probabilities): "heads" the attention output (w_o's input, H hd),
# "mlp" F-sized values (the gate and up matmuls' outputs, from which W makes w_down's input),
# each in the compute dtype.
W_RECOMPUTED = {
    "none": {},
    "full": {"heads": 1.0, "mlp": 2.0},
    "dots_saveable": {},
    "dots_with_no_batch_dims_saveable": {"heads": 1.0},
}


def w_kept_bytes(cfg: Config, layout: Layout) -> float:
    """Bytes a split backward's Bx (zb_h1, 1f1b_split) keeps for W per token and layer
    (parallel/pipeline/split.py: what W's equations read of Bx's values). The weight matmuls'
    output cotangents (q, k, v, the attention output's, the MLP's: its gate and up cotangents W
    makes again from the SwiGLU's output cotangent) and the two norms' output cotangents for the
    scale sums, in the compute dtype: 3 D + (H + 2K) hd + F elements (1024 a token on the
    tests' model). Under a train.remat policy also what Bx recomputed and W cannot make again
    from cheap equations (W_RECOMPUTED: with full H hd + 2 F)."""
    ms = ModelShape.of(cfg.model)
    t = layout.size("tensor")
    c = itemsize(cfg.train.compute_dtype)
    d = ms.dim / t if cfg.sharding.sequence_parallel else ms.dim
    k = W_RECOMPUTED[layout.remat]
    extra = k.get("heads", 0.0) * ms.heads * ms.head_dim + k.get("mlp", 0.0) * ms.ffn
    return c * (3 * d + ((ms.heads + 2 * ms.kv_heads) * ms.head_dim + ms.ffn + extra) / t)


def param_gather_itemsize(itemsize: int, platform: str) -> int:
    """Bytes per element of ZeRO-1/2's all-gather of the updated params (the step's out_shardings
    gather them): XLA:CPU gathers 16-bit params as float32 (the HLO gathers a convert of them;
    bf16 params over float32 masters, 2026-12-07); XLA:GPU in their dtype (a deviceless compile
    of the same step gathers bf16). ZeRO-3's gathers, the shard_map's own, stay 16-bit on both."""
    return max(itemsize, 4) if platform == "cpu" else itemsize


def estimate(cfg: Config, layout: Layout, model, state: dict | None = None,
             platform: str = "cpu") -> dict[str, float]:
    """Per-device bytes by term (module doc); `model` a jaxpar.train.model.ModelDef of cfg.model;
    `state`: state_terms of this layout when already known (the search caches them); `platform`
    the cluster's (XLA's buffer assignment differs: module doc). 'total' is what the compiled
    step needs: its arguments plus its temporaries."""
    out = dict(state if state is not None else state_terms(cfg, layout, model))
    out.update(activation_terms(cfg, layout, platform))
    if layout.zero_stage in (1, 2) and layout.size("fsdp") > 1:  # the gathered params' buffer
        p = itemsize(cfg.train.param_dtype)
        out["gathered"] *= param_gather_itemsize(p, platform) / p
    if platform == "gpu":
        out.update(gpu_terms(cfg, layout, out))
    if platform == "gpu" and layout.size("pipeline") == 1:
        backward = out["grads"] + out["working"]
        out["total"] = sum(v for k, v in out.items() if k not in ("logits", "grads", "working"))
        out["total"] += max(out["logits"], backward)  # the loss's peak or the backward's
        return out
    out["total"] = sum(out.values())
    return out


def gpu_token_layer_bytes(ms: ModelShape, remat: str, c: int, t: int, sequence_parallel: bool) -> float:
    """Bytes XLA:GPU keeps per token and layer for the backward under `remat` (GPU_KEPT): the
    layer scan's stacked residuals, and a pipeline stage's stashed vjp leaves alike (read off
    the runner's ring buffers: 2 D, 4 float32 D, 3 H hd, 2 K hd and 6 F a layer without remat,
    the 1B preset at data 4 x pipeline 2, 2026-12-07)."""
    k = GPU_KEPT[remat]
    d = ms.dim / t if sequence_parallel else ms.dim
    return (c * (k["d"] * d + (k["q"] * ms.heads + k["kv"] * ms.kv_heads) * ms.head_dim / t
                 + k["mlp"] * ms.ffn / t) + 4 * k["d32"] * d)


def gpu_terms(cfg: Config, layout: Layout, terms: dict[str, float]) -> dict[str, float]:
    """XLA:GPU's terms where they differ from XLA:CPU's (module doc), from this layout's `terms`."""
    t = cfg.train
    c = itemsize(t.compute_dtype)
    ms = ModelShape.of(cfg.model)
    tp = layout.size("tensor")
    acts_tokens = _tokens(cfg, layout)
    seqs = acts_tokens / t.seq_len * layout.size("context")
    tokens = min(acts_tokens, t.loss_chunk * seqs) if t.loss_chunk else acts_tokens  # the loss's
    out = {"logits": tokens * ms.vocab / tp * (4 + c), "update": 0.0,
           # the forward's compute-dtype params, live until the backward's last use
           "cast": terms["params"] / itemsize(t.param_dtype) * c
           if layout.zero_stage < 3 and c != itemsize(t.param_dtype) else 0.0}
    if layout.size("pipeline") == 1:  # a pipeline's are activation_terms' on platform gpu
        per_layer = gpu_token_layer_bytes(ms, layout.remat, c, tp, cfg.sharding.sequence_parallel)
        out["activations"] = acts_tokens * ms.layers * per_layer
    if layout.zero_stage < 3:
        out["gathered"] = 0.0
    if layout.zero_stage == 1 and layout.size("fsdp") > 1 and layout.micro == 1:
        # each layer's gradient is reduce-scattered inside the backward, as with ZeRO-2: the step
        # holds the optimizer's shard of it (update counts that shard's elements in float32)
        out["grads"] = terms["update"] / (4 * ADAM_TRANSIENT) * state_itemsizes(cfg)["grads"]
    return out


def _tokens(cfg: Config, layout: Layout) -> float:
    """This device's tokens of one microbatch (its part of each sequence with context)."""
    t = cfg.train
    batch_div = math.prod(layout.size(a) for a in cfg.sharding.resolved_rules().get("batch", ()))
    return t.global_batch / batch_div / layout.micro * t.seq_len / layout.size("context")


def state_terms(cfg: Config, layout: Layout, model) -> dict[str, float]:
    """params, opt_state, grads, update, gathered: what depends on the mesh, ZeRO stage and
    whether microbatches are accumulated, not on remat or the schedule."""
    plan = abstract_plan(cfg, layout)
    sizes = state_itemsizes(cfg, layout.micro)
    c = itemsize(cfg.train.compute_dtype)
    out = {k: 0.0 for k in ("params", "opt_state", "grads", "update", "gathered", "sync_state",
                            "sync_working")}
    param_elems = 0.0
    stacked_full = 0.0  # one layer's params, gathered (ZeRO-3), per device
    top_full = 0.0      # the embedding / head / final norm, gathered
    grad_full = 0.0     # one microbatch's gradient before any fsdp scatter
    grad_top = 0.0      # its part outside the layer stack, and one layer's of the stack
    grad_layer = 0.0
    for axes, sds in _leaves(model):
        shape = sds.shape
        elems = shard_elems(plan, axes, shape, "param")
        param_elems += elems
        out["params"] += elems * sizes["params"]
        opt = shard_elems(plan, axes, shape, "opt")
        out["opt_state"] += opt * sizes["opt_state"]
        out["grads"] += shard_elems(plan, axes, shape, "grad") * sizes["grads"]
        out["update"] += opt * 4 * ADAM_TRANSIENT
        no_fsdp = shard_elems(plan, axes, shape, "act", skip=("fsdp",))
        grad_full += no_fsdp * 4
        if axes[:1] == ("layers",):  # one layer of this device's stage
            one_layer = no_fsdp / (shape[0] / layout.size("pipeline"))
            stacked_full += one_layer * c
            grad_layer += one_layer * 4
        else:
            top_full += no_fsdp * c
            grad_top += no_fsdp * 4
    if layout.micro > 1 and layout.zero_stage == 2 and layout.size("pipeline") == 1:
        out["grads"] += grad_top + grad_layer  # the stack's scattered in the backward, layer by layer
    elif layout.micro > 1 and layout.zero_stage == 3 and layout.size("pipeline") == 1:
        # the gathers' transpose reduce-scatters each layer's gradient in the backward: the
        # accumulated sum and one microbatch's shard, never an unsharded gradient
        out["grads"] *= 2
    elif layout.micro > 1 and layout.zero_stage >= 2:
        out["grads"] += grad_full
    sync = planned_sync(cfg, layout, model, plan)
    out["sync_state"] = sync_state_bytes(cfg, sync, out["params"], param_elems)
    out["sync_working"] = sync_state_bytes(cfg, sync, out["params"], param_elems, part=LAYERS)
    if layout.zero_stage >= 3 and layout.size("fsdp") > 1:
        out["gathered"] = top_full + 2 * stacked_full
    elif layout.zero_stage in (1, 2) and layout.size("fsdp") > 1:  # the updated params, all-gathered
        out["gathered"] = out["params"]
    return out


def activation_terms(cfg: Config, layout: Layout, platform: str = "cpu") -> dict[str, float]:
    """activations, working, w_kept, boundary, logits, batch (module doc); on a GPU a pipeline
    stage's stash is XLA:GPU's (gpu_token_layer_bytes) and a tick holds GPU_STASH_TICK more."""
    t = cfg.train
    c = itemsize(t.compute_dtype)
    out = {"w_kept": 0.0, "boundary": 0.0}
    ms = ModelShape.of(cfg.model)
    batch_div = math.prod(layout.size(a) for a in cfg.sharding.resolved_rules().get("batch", ()))
    microbatches = layout.micro
    seqs = t.global_batch / batch_div / microbatches
    cp = layout.size("context")
    tokens = seqs * t.seq_len / cp  # this device's part of each sequence (parallel/context.py)
    tp = layout.size("tensor")
    # ring attention runs its own blockwise loop over the chunks: no [heads, keys] scores; the
    # all_to_all strategy attends over the whole sequence with heads / context
    xla = attention_impl(cfg) == "xla" and not (cp > 1 and cfg.context.strategy != "all_to_all")
    sp = cfg.sharding.sequence_parallel
    layers = ms.layers / layout.size("pipeline")
    full = per_token_layer_bytes(ms, "none", c, tp, t.seq_len, xla, sp)
    kept = per_token_layer_bytes(ms, layout.remat, c, tp, t.seq_len, xla, sp)
    if layout.size("pipeline") > 1:
        v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
        tt = timetable(layout.schedule, layout.size("pipeline"), microbatches, v, layout.recompute)
        # one microbatch's stage residuals, the stage vjp's leaves (STASHED by the remat policy;
        # on a GPU XLA:GPU's, GPU_KEPT's)
        if platform == "gpu":
            stashed, tick = gpu_token_layer_bytes(ms, layout.remat, c, tp, sp), GPU_STASH_TICK[tp > 1]
            full = gpu_token_layer_bytes(ms, "none", c, tp, sp)
        else:
            stashed = per_token_layer_bytes(ms, layout.remat, c, tp, t.seq_len, xla, sp, STASHED)
            tick = STASH_TICK
        stage = tokens * layers / v * stashed
        if layout.recompute:
            # A stage keeps each in-flight microbatch's input (the x ring's slots); a backward
            # tick runs the stage's vjp again: its residuals, live at once.
            out["activations"] = tt.n_x_slots * tokens * ms.dim * c
            out["working"] = stage
            boundary = tt.n_g_slots + BOUNDARY_TICK
        else:
            # A forward tick stashes the residuals for its backward in the runner's ring buffer
            # (the timetable's residual slots; filed under a cond, no spare slot since
            # 2026-12-07); a tick holds `tick` stages more (STASH_TICK, GPU_STASH_TICK).
            out["activations"] = tt.n_r_slots * stage
            out["working"] = tick * stage
            boundary = tt.n_x_slots + tt.n_g_slots + BOUNDARY_TICK
        if layout.remat != "none":
            # the backward (Bx with zb_h1) recomputes one layer at a time what the policy did not
            # save: a remat-free layer's residuals less the stashed ones, all live at its peak
            out["working"] += tokens * max(full - stashed, 0.0)
        elif layers / v > 1:
            # a layer's backward reads its residuals sliced out of the stage's stacked ones (a
            # copy; the loop of a one-layer stage is folded away and reads them in place)
            out["working"] += tokens * stashed
        # the stage-boundary ring buffers (inputs, cotangents) and a tick's other [tokens, D]s
        out["boundary"] = boundary * tokens * ms.dim * c
        if tt.n_w_slots:  # the runner's ring buffer (the timetable's w slots) and a tick's
            # W_TICK more (Bx's new one)
            out["w_kept"] = (tt.n_w_slots + W_TICK) * tokens * layers * w_kept_bytes(cfg, layout)
    else:
        out["activations"] = tokens * layers * kept
        out["working"] = WORKING * tokens * full if layout.remat != "none" else 0.0
    loss_tokens = min(tokens, t.loss_chunk * seqs) if t.loss_chunk else tokens
    out["logits"] = loss_tokens * ms.vocab / tp * 4 * LOGIT_COPIES
    out["batch"] = t.global_batch / batch_div * (t.seq_len + 1) * 4
    return out


def step_traffic(cfg: Config, layout: Layout, state: dict[str, float], ticks: int = 0) -> float:
    """Bytes a device moves to and from memory per step that no cache holds (`state`: this
    layout's state_terms; `ticks`: the pipeline runner's):
      stash     what a microbatch's forward keeps for its backward (KEPT by remat; a pipeline
                stage's vjp residuals, or with pipeline.recompute its input and the stage
                recomputed in the backward tick) and the float32 logits: written, read back;
                a remat's recomputed layer is one layer's worth, live only inside the layer
      weights   read by the forward and the backward of each microbatch (ZeRO-3: each layer's
                gathered whole, written by the gather and read)
      grads     written per microbatch (accumulated in place)
      optimizer the optimizer shard's params, gradient and Adam state read, params and state
                written, per step (ZeRO-1/2: and the all-gathered params)
      ticks     every tick of the pipeline runner's switch returns a stage's residuals (a
                forward's, or the zeros of the other branches; only a forward's are filed into
                the ring, since 2026-12-07: per microbatch, in stash), the stage's float32
                gradient accumulators and its activation / cotangent buffers, idle or not
      split     (zb_h1, 1f1b_split) what Bx keeps for W (w_kept_bytes), written and read back per
                microbatch, and the switch's output of it each tick like the residuals'
    Why: a small model's step on a CPU is bound by this traffic as much as by its FLOPs
    (remat `full` runs faster than none there), and it is the roofline's other axis on a GPU."""
    t = cfg.train
    c = itemsize(t.compute_dtype)
    ms = ModelShape.of(cfg.model)
    batch_div = math.prod(layout.size(a) for a in cfg.sharding.resolved_rules().get("batch", ()))
    seqs = t.global_batch / batch_div / layout.micro
    tokens = seqs * t.seq_len / layout.size("context")
    tp, p = layout.size("tensor"), layout.size("pipeline")
    cp = layout.size("context")
    xla = attention_impl(cfg) == "xla" and not (cp > 1 and cfg.context.strategy != "all_to_all")
    sp = cfg.sharding.sequence_parallel
    layers = ms.layers / p
    kept = per_token_layer_bytes(ms, layout.remat, c, tp, t.seq_len, xla, sp)
    if p > 1 and layout.recompute:
        full = per_token_layer_bytes(ms, "none", c, tp, t.seq_len, xla, sp)
        stash = tokens * (ms.dim * c + layers * (full if layout.remat == "none" else kept))
        residuals = 0.0
    else:
        stash = tokens * layers * kept
        residuals = stash
    if p > 1 and layout.schedule in SPLIT:
        w = tokens * layers * w_kept_bytes(cfg, layout)
        stash, residuals = stash + w, residuals + w
    loss_tokens = min(tokens, t.loss_chunk * seqs) if t.loss_chunk else tokens
    stash += loss_tokens * ms.vocab / tp * 4
    if layout.zero_stage >= 3:  # each layer's weights gathered whole (written) for each pass
        weights = 2 * state["params"] * layout.size("fsdp")
    else:
        weights = state["params"]
    per_micro = 2 * stash + 2 * weights + state["grads"]
    per_tick = residuals + state["grads"] + 2 * tokens * ms.dim * c if p > 1 else 0.0
    return layout.micro * per_micro + optimizer_traffic(cfg, layout, state) + ticks * per_tick


def optimizer_traffic(cfg: Config, layout: Layout, state: dict[str, float]) -> float:
    """Bytes the optimizer's update moves per step: its shard's params, float32 gradient and Adam
    state read, params and state written (ZeRO-1/2 then write the all-gathered params). Its own
    term because it runs after the last gradient has arrived: no matmul of the step hides it."""
    shard = state["update"] / (4 * ADAM_TRANSIENT)
    optimizer = 2 * state["opt_state"] + shard * (2 * itemsize(cfg.train.param_dtype) + 4) + state["update"]
    if layout.zero_stage in (1, 2):
        optimizer += state["gathered"]
    return optimizer
