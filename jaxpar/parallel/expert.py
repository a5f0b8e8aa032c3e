"""Expert parallelism: route tokens to experts, run them, combine; locally or over `expert`.

A routing group is one sequence: capacity and the dropping order are decided per sequence, so a
layout that splits the batch over devices drops exactly the tokens a single device drops.

capacity  C = min(seq, ceil(capacity_factor * seq * k / E)) slots per expert per sequence. Each
          (token, choice) assignment takes the next free slot of its expert in priority order:
          all first choices in token order, then all second choices, ...; an assignment finding
          its expert full is dropped (it adds nothing; a token whose choices all drop passes
          through the residual only). Tokens are scattered into a [groups, E, C, embed] buffer.
dropless  every assignment is computed: rows sorted by expert, `jax.lax.ragged_dot` per group.
With `token_weights` [groups, seq] (packed documents), a weight-0 token (padding, a document's
closing EOS) is no token to route: it takes no capacity slot (the valid tokens keep their priority
order among themselves, so padding at a row's end cannot push real second choices out), is neither
kept nor counted as dropped, and its output is zero in both modes (dropless computes it and drops
it at the combine). It passes through the residual only: exact for the loss, since with document
masking only its own, uncounted, prediction reads it. The mask is applied before any all_to_all,
so expert parallelism routes exactly what one device routes.

Inside the train step's shard_map, manual over the batch axes (so over `expert`), each device
holds E/ep experts (the `expert` dim of their weights) and its own slice of the batch:
  capacity  the dispatch buffer is all_to_all'd over `expert`, split by expert block: each device
            receives the slots of its own experts from every device of its expert group, runs
            them, and the results travel back by the same all_to_all.
  dropless  each device sends every device of its group a fixed buffer of M = groups*seq*k rows
            (its rows for that device's experts first, zero padding after) with their expert ids;
            the receiver sorts all it got by expert and runs ragged_dot. The buffer has the worst
            case size (every row to one device): XLA:CPU has no ragged-all-to-all, so dropless
            moves ep x the bytes of a balanced exchange (see `jaxpar bench moe`).
Under context parallelism (each device holds runs of every sequence) capacity still decides per
whole sequence: an all-gather of per-run counts places each assignment in its expert's queue as
one device would, and the devices split every expert's slots over `context` to run them
(`_context_slots`, `_capacity_moe`); dropless routes each device's own tokens.
The expert MLP itself is the model's (`ffn`, `ragged_ffn`); the compiler may split it over
`tensor`, which is left automatic.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar import nn
from jaxpar.config import ConfigError

EXPERT_AXIS = "expert"


def capacity(seq_len: int, top_k: int, num_experts: int, factor: float) -> int:
    """Slots per expert per sequence (at least 1, at most seq_len: an expert sees a token once)."""
    return max(1, min(seq_len, math.ceil(factor * seq_len * top_k / num_experts)))


def capacity_slots(expert_idx: jax.Array, num_experts: int, cap: int,
                   valid: jax.Array | None = None, sequence=None) -> tuple[jax.Array, jax.Array, int]:
    """expert_idx [G, S, k] -> (slot [G, S, k] in [0, E*C], E*C meaning dropped; keep [G, S, k];
    C, the buffer's slots per expert). `valid` [G, S] bool: only these tokens take slots (the
    others get E*C and keep False). `sequence` (parallel/context.ContextParallel, size > 1):
    the tokens are this device's runs of each sequence; see `_context_slots`."""
    if sequence is not None:
        return _context_slots(expert_idx, num_experts, cap, valid, sequence)
    G, S, k = expert_idx.shape
    order = jnp.swapaxes(expert_idx, 1, 2).reshape(G, k * S)          # priority: choice-major
    onehot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)      # [G, kS, E]
    if valid is not None:  # an invalid token occupies nothing, so it shifts no later position
        onehot = onehot * jnp.tile(valid, (1, k)).astype(jnp.int32)[..., None]
    pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=1) - 1, order[..., None], axis=2)[..., 0]
    pos = jnp.swapaxes(pos.reshape(G, k, S), 1, 2)                    # [G, S, k]
    keep = pos < cap
    if valid is not None:
        keep = keep & valid[..., None]
    return jnp.where(keep, expert_idx * cap + pos, num_experts * cap), keep, cap


def _context_slots(expert_idx, num_experts: int, cap: int, valid, sequence):
    """Capacity under context parallelism: which assignments stay is decided in the whole
    sequence's priority order (choice-major, then position), as on one device. Each device counts
    its runs' assignments per choice and expert; one all_gather over `context` gives the counts
    of every earlier run (ContextParallel.runs_before) and of every earlier choice, so each
    assignment's position in its expert's queue is exact: its slot there, kept if below `cap`.
    The slots per expert are padded to a multiple of the context size (C: what `_capacity_moe`
    splits over the devices; the padding is never filled)."""
    G, S, k = expert_idx.shape
    E, R = num_experts, sequence.runs
    onehot = jax.nn.one_hot(jnp.swapaxes(expert_idx, 1, 2), E, dtype=jnp.int32)    # [G, k, S, E]
    if valid is not None:
        onehot = onehot * valid[:, None, :, None].astype(jnp.int32)
    runs = onehot.reshape(G, k, R, S // R, E)
    counts = runs.sum(3)                                                            # [G, k, R, E]
    before, total = sequence.runs_before(jnp.moveaxis(counts, 2, 0))              # [R, G, k, E], [G, k, E]
    earlier_choices = jnp.cumsum(total, axis=1) - total                             # [G, k, E]
    queue = (jnp.cumsum(runs, axis=3) - 1 + jnp.moveaxis(before, 0, 2)[:, :, :, None]
             + earlier_choices[:, :, None, None])                                   # [G, k, R, n, E]
    order = jnp.swapaxes(expert_idx, 1, 2)                                          # [G, k, S]
    pos = jnp.take_along_axis(queue.reshape(G, k, S, E), order[..., None], axis=3)[..., 0]
    pos = jnp.swapaxes(pos, 1, 2)                                                   # [G, S, k]
    keep = pos < cap
    if valid is not None:
        keep = keep & valid[..., None]
    slots = -(-cap // sequence.size) * sequence.size
    return jnp.where(keep, expert_idx * slots + pos, E * slots), keep, slots


def dropped_fraction(keep: jax.Array, valid: jax.Array | None, sequence_sum=lambda x: x) -> jax.Array:
    """Dropped share of the valid (token, choice) assignments: per sequence, averaged over
    sequences (a sequence with no valid token counts 0), so that every split of the batch
    averages to the one-device value; without `valid`, of all assignments. `sequence_sum`: a
    per-sequence count over this device's tokens -> over the whole sequence (context)."""
    k = keep.shape[-1]
    if valid is None:
        valid = jnp.ones(keep.shape[:2], bool)
    n = sequence_sum(valid.sum(axis=1, dtype=jnp.float32) * k)        # [G] valid assignments
    kept = sequence_sum(keep.sum(axis=(1, 2), dtype=jnp.float32))
    return jnp.where(n > 0, 1.0 - kept / jnp.maximum(n, 1.0), 0.0).mean()


def _dispatch(x: jax.Array, slot: jax.Array, n_slots: int) -> jax.Array:
    """x [G, S, D], slot [G, S, k] -> buffer [G, n_slots, D] (dropped slots fall off the end)."""
    k = slot.shape[-1]

    def one(xs, sl):
        rows = jnp.repeat(xs, k, axis=0)
        return jnp.zeros((n_slots, xs.shape[-1]), xs.dtype).at[sl.reshape(-1)].add(rows, mode="drop")

    return jax.vmap(one)(x, slot)


def _combine(buf: jax.Array, slot: jax.Array, gates: jax.Array) -> jax.Array:
    """buffer [G, n_slots, D], slot/gates [G, S, k] -> [G, S, D] (dropped slots read zeros)."""
    picked = jax.vmap(lambda b, sl: jnp.take(b, sl, axis=0, mode="fill", fill_value=0))(buf, slot)
    return jnp.einsum("gskd,gsk->gsd", picked, gates.astype(buf.dtype))


def _capacity_moe(x, expert_idx, gates, ffn, E, cap, axis, ep, valid=None, sequence=None):
    """Under context parallelism (`sequence`) the slots are the whole sequence's: each device
    fills those of its own kept assignments, and the devices split every expert's slots C ways
    (ContextParallel.own_part: an all_to_all, each slot filled on one device only) to run the
    experts on 1/C of them, then put the outputs back together (all_parts) for the combine."""
    G, S, D = x.shape
    slot, keep, cap = capacity_slots(expert_idx, E, cap, valid, sequence)
    buf = _dispatch(x, slot, E * cap).reshape(G, E, cap, D)
    if sequence is not None:
        buf = sequence.own_part(buf, axis=2)                                        # [G, E, cap / C, D]
    y = _run_experts(buf, ffn, axis, ep)
    if sequence is not None:
        y = sequence.all_parts(y, axis=2)
    out = _combine(y.reshape(G, E * cap, D), slot, gates)
    return out, dropped_fraction(keep, valid, *(() if sequence is None else (sequence.sequence_sum(),)))


def _run_experts(buf: jax.Array, ffn: Callable, axis: str | None, ep: int) -> jax.Array:
    """buf [G, E, c, D] of slots -> the experts' outputs, alike. Over `axis` (expert
    parallelism) each device runs its E/ep experts on every device's slots for them."""
    G, E, cap, D = buf.shape
    if axis is not None:  # [G, E, c, D] -> [G, ep (source), E/ep, c, D] holding my experts' slots
        buf = jax.lax.all_to_all(buf, axis, 1, 1, tiled=True)
    src = ep if axis is not None else 1
    h = buf.reshape(G, src, E // src, cap, D).transpose(2, 0, 1, 3, 4).reshape(E // src, G * src * cap, D)
    y = ffn(h).reshape(E // src, G, src, cap, D).transpose(1, 2, 0, 3, 4).reshape(G, E, cap, D)
    if axis is not None:
        y = jax.lax.all_to_all(y, axis, 1, 1, tiled=True)
    return y


def _sort_rows(ids: jax.Array, rows: jax.Array, n_groups: int):
    """Rows sorted by id (ids >= n_groups go last), group sizes, and the inverse permutation."""
    order = jnp.argsort(ids, stable=True)
    sizes = jax.nn.one_hot(ids, n_groups, dtype=jnp.int32).sum(0)
    return rows[order], sizes, jnp.argsort(order)


def _dropless_moe(x, expert_idx, gates, ragged_ffn, E, axis, ep):
    G, S, D = x.shape
    k = expert_idx.shape[-1]
    M = G * S * k
    ids = expert_idx.reshape(M)
    rows = jnp.repeat(x.reshape(G * S, D), k, axis=0)
    if axis is None:
        srt, sizes, inv = _sort_rows(ids, rows, E)
        y = ragged_ffn(srt, sizes)[inv]
    else:
        e_loc = E // ep
        srt, _, inv = _sort_rows(ids, rows, E)
        ids_srt = jnp.sort(ids, stable=True)
        count = jax.nn.one_hot(ids_srt // e_loc, ep, dtype=jnp.int32).sum(0)       # rows per device
        start = jnp.cumsum(count) - count
        r = jnp.arange(M)
        valid = r[None, :] < count[:, None]                                          # [ep, M]
        src = jnp.clip(start[:, None] + r[None, :], 0, M - 1)
        send = jnp.where(valid[..., None], srt[src], 0)                              # [ep, M, D]
        send_ids = jnp.where(valid, ids_srt[src] - jnp.arange(ep)[:, None] * e_loc, e_loc)
        recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True).reshape(ep * M, D)
        recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0, tiled=True).reshape(ep * M)
        srt2, sizes2, inv2 = _sort_rows(recv_ids, recv, e_loc)
        back = ragged_ffn(srt2, sizes2)[inv2].reshape(ep, M, D)
        back = jax.lax.all_to_all(back, axis, 0, 0, tiled=True)                      # my rows, by device
        dst = jnp.where(valid, start[:, None] + r[None, :], M)                        # M: padding
        y = jnp.zeros((M, D), back.dtype).at[dst.reshape(-1)].add(back.reshape(ep * M, D), mode="drop")
        y = y[inv]
    y = y.reshape(G, S, k, D)
    return jnp.einsum("gskd,gsk->gsd", y, gates.astype(y.dtype)), jnp.zeros((), jnp.float32)


def moe_apply(x: jax.Array, expert_idx: jax.Array, gates: jax.Array, ffn: Callable, ragged_ffn: Callable,
              *, num_experts: int, dispatch: str = "capacity", capacity_factor: float = 1.25,
              token_weights: jax.Array | None = None, axis: str | None = None,
              axis_size: int = 1, sequence=None) -> tuple[jax.Array, jax.Array]:
    """The MoE MLP of x [G, S, D] (see the module doc): returns (y [G, S, D], dropped fraction).

    `token_weights` [G, S]: tokens of weight 0 are not routed (no slot, output 0, not in the
    dropped fraction); None: every token is. With `axis` (a manual mesh axis of `axis_size`
    devices), this device holds experts [i * E/ep, (i+1) * E/ep) for its index i on `axis`, and
    tokens travel by all_to_all. `sequence` (parallel/context.ContextParallel of size > 1): x
    holds this device's part of each sequence; capacity counts the whole sequence."""
    if axis is not None and axis_size == 1:
        axis = None
    if num_experts % axis_size:
        raise ConfigError(f"num_experts={num_experts} is not divisible by the {axis} axis ({axis_size})")
    valid = None if token_weights is None else token_weights > 0
    if dispatch == "capacity":
        seq = x.shape[1] * (sequence.size if sequence is not None else 1)
        cap = capacity(seq, expert_idx.shape[-1], num_experts, capacity_factor)
        return _capacity_moe(x, expert_idx, gates, ffn, num_experts, cap, axis, axis_size, valid, sequence)
    if dispatch == "dropless":
        if valid is not None:  # computed (fixed shapes) but not combined
            gates = jnp.where(valid[..., None], gates, jnp.zeros_like(gates))
        return _dropless_moe(x, expert_idx, gates, ragged_ffn, num_experts, axis, axis_size)
    raise ValueError(f"unknown dispatch {dispatch!r}; valid: capacity, dropless")


nn.set_default_experts(moe_apply)  # what nn.experts runs outside a step: all experts local


def expert_hook(plan, manual: frozenset[str], sequence=None) -> Callable:
    """The nn.Context `experts` hook for code inside a shard_map manual over `manual`: all_to_all
    over `expert` when that axis is manual and larger than 1; all experts local otherwise.
    `sequence`: the step's context split (parallel/context.ContextParallel) when its size is > 1."""
    n = plan.mesh.shape.get(EXPERT_AXIS, 1)
    split = {} if sequence is None or sequence.size == 1 else {"sequence": sequence}
    if EXPERT_AXIS not in manual or n == 1:
        return functools.partial(moe_apply, **split) if split else moe_apply
    return functools.partial(moe_apply, axis=EXPERT_AXIS, axis_size=n, **split)


def check_layout(model_cfg, mesh_shape: dict[str, int]) -> None:
    """A MoE model's experts must split evenly over the `expert` axis."""
    moe = getattr(model_cfg, "moe", None)
    n = mesh_shape.get(EXPERT_AXIS, 1)
    if moe is not None and moe.num_experts and moe.num_experts % n:
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} is not divisible by mesh.expert={n}; each "
            f"expert device holds num_experts / mesh.expert experts, so use an expert size that "
            f"divides {moe.num_experts}"
        )
