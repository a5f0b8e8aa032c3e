"""Context parallelism over the mesh axis `context`: each device holds 1/C of every sequence.

The step's shard_map is manual over `context` (parallel/sync.step_manual_axes). The loader lays
each row out device by device (`loader_columns`) with the columns sharded over `context`, so a
host builds and sends each device only its own tokens; the step rebuilds the rows (an int32
all-gather) for the document fields, which are cumulative over the whole row, and inside the
shard_map `ContextParallel.split` takes this device's tokens,
targets and their global positions (RoPE and the causal mask need them), and the model's
attention runs through the strategy's hook (nn.Context.attention):

  ring        the device keeps its queries; key/value chunks travel around the ring by
              ppermute, each arriving chunk folded into an online softmax with blockwise.py's
              tile step, [block, block] tiles that the causal mask or the segment ids (packed
              documents) leave empty skipped (blockwise.schedule, at run time: the positions are
              only known per device, the segments per batch). The custom VJP sends dK/dV around
              the ring with the chunks and recomputes the probabilities (no scores are saved).
              model.attention sets the tile (ring_tile): xla a whole run, blockwise
              model.attention_block; cudnn is refused (it cannot join an online softmax).
  all_gather  the ring's computation with every device's K and V chunks gathered at once (an
              all_to_all of copies) and read in the ring's order, the dK/dV of every chunk sent
              home by one all_to_all at the end: no collective-permute, so it runs inside a
              pipeline stage's branch (the ring cannot); a layer's whole-sequence K and V live
              at once.
  all_to_all  (Ulysses) an all_to_all from sequence-split to head-split, the model's own
              attention implementation over the whole sequence (reordered to global order), and
              back.

Layouts: `zigzag` (device i: chunks i and 2C-1-i of 2C, so every device has the same causal
work) and `contiguous` (chunk i of C). Params are replicated over `context`; each device's
gradient is a partial sum over its tokens, summed with the batch axes' by the gradient sync
(context is one more manual axis it reduces over); the loss divides by the global token count.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import attention as attention_ops
from jaxpar.attention.blockwise import (F32, State, block_backward, block_forward, finish, init_state, loop,
                                       schedule, segment_ranges, share_segment)
from jaxpar.config import ConfigError, ContextConfig
from jaxpar.sharding import Plan, vary_together

AXIS = "context"


# ---------------------------------------------------------------- which tokens a device holds


def chunk_starts(layout: str, size: int, seq: int, device) -> list:
    """Start positions (global) of the runs of tokens `device` (an int or a traced index) holds,
    each run `run_length(layout, size, seq)` long."""
    if layout == "zigzag":
        return [device * (seq // (2 * size)), (2 * size - 1 - device) * (seq // (2 * size))]
    return [device * (seq // size)]


def run_length(layout: str, size: int, seq: int) -> int:
    return seq // (2 * size) if layout == "zigzag" else seq // size


def device_positions(layout: str, size: int, seq: int, device) -> jax.Array:
    """[seq / size] int32 global positions of `device`'s tokens, in its local order."""
    n = run_length(layout, size, seq)
    starts = chunk_starts(layout, size, seq, device)
    return jnp.concatenate([s + jnp.arange(n, dtype=jnp.int32) for s in starts])


def gathered_order(layout: str, size: int, seq: int) -> np.ndarray:
    """The global positions of the devices' tokens concatenated in device order (what an
    all_to_all or all_gather over `context` assembles): a permutation of 0..seq-1."""
    n = run_length(layout, size, seq)
    return np.concatenate([s + np.arange(n) for d in range(size) for s in chunk_starts(layout, size, seq, d)])


def loader_columns(layout: str, size: int, seq: int) -> np.ndarray:
    """The positions (of a row's seq + 1 tokens) the loader lays out on the batch's dim 1: device
    by device, each of its runs with the token after it (the run's last target). Dim 1 then splits
    evenly over `context` and each device's shard, so each host's, is only its own tokens."""
    n = run_length(layout, size, seq)
    return np.concatenate([np.arange(s, s + n + 1) for d in range(size)
                           for s in chunk_starts(layout, size, seq, d)])


def rows_of_columns(tokens: jax.Array, layout: str, size: int) -> jax.Array:
    """[b, seq + 1] rows from the loader's columns (loader_columns). Under jit with dim 1 sharded
    over `context`, an all-gather of int32 token ids: 4 bytes a token, once a step, beside the
    K/V chunks every layer sends around the ring (document ids and positions are cumulative
    over the whole row, so the rows are rebuilt before the step splits them again)."""
    runs = size * (2 if layout == "zigzag" else 1)
    seq = (tokens.shape[1] // runs - 1) * runs
    cols = loader_columns(layout, size, seq)
    first = np.empty(seq + 1, np.int64)
    first[cols[::-1]] = np.arange(len(cols))[::-1]  # a position's first column (run ends repeat)
    return jnp.take(tokens, jnp.asarray(first, jnp.int32), axis=1)


# ---------------------------------------------------------------- the strategy object


@dataclass(frozen=True)
class ContextParallel:
    """What the step and forward ask of context parallelism; size 1 is the identity."""

    size: int = 1
    strategy: str = "ring"
    layout: str = "zigzag"

    def split(self, batch):
        """This device's train.batch.Rows of a train.batch.Batch: every per-token field cut to the
        layout's chunks, positions the tokens' global ones (or, packed with reset positions, the
        batch's own, cut alike)."""
        rows = batch.rows()
        if self.size == 1:
            return rows
        seq = rows.inputs.shape[-1]
        n = run_length(self.layout, self.size, seq)
        starts = chunk_starts(self.layout, self.size, seq, jax.lax.axis_index(AXIS))
        take = lambda x: None if x is None else jnp.concatenate(
            [jax.lax.dynamic_slice_in_dim(x, s, n, axis=-1) for s in starts], -1)
        pos = take(rows.positions)
        if pos is None:
            pos = device_positions(self.layout, self.size, seq, jax.lax.axis_index(AXIS))
            pos = jnp.broadcast_to(pos, rows.inputs.shape[:-1] + pos.shape)
        return type(rows)(take(rows.inputs), take(rows.targets), take(rows.segment_ids), pos,
                          take(rows.weights))

    def columns(self, seq: int) -> np.ndarray | None:
        """The loader's layout of each row under this split (loader_columns); None: whole rows."""
        return None if self.size == 1 else loader_columns(self.layout, self.size, seq)

    def whole_rows(self, tokens: jax.Array) -> jax.Array:
        """The [b, seq + 1] rows of a batch the loader laid out in `columns` (the identity at size 1)."""
        return tokens if self.size == 1 else rows_of_columns(tokens, self.layout, self.size)

    def sequence_sum(self) -> Callable | None:
        """The nn.Context.sequence_sum hook: a per-sequence sum over this device's tokens, summed
        over the devices that share the sequences (None: the whole sequences are here)."""
        if self.size == 1:
            return None
        return lambda x: jax.lax.psum(x, AXIS)

    @property
    def runs(self) -> int:
        """Runs of consecutive tokens each device holds of a sequence (zigzag: 2)."""
        return 2 if self.layout == "zigzag" else 1

    def runs_before(self, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
        """counts [runs, ...]: a count per run of tokens this device holds (its layout's runs, in
        its local order) -> (the sum of the counts of every run earlier in the sequence, over all
        devices, per local run [runs, ...]; the sum over the whole sequence [...]). Inside the
        step's shard_map: one all_gather over `context` (MoE's capacity order, expert.py)."""
        gathered = jax.lax.all_gather(counts, AXIS, axis=0, tiled=True)  # [size * runs, ...], device-major
        # a sequence of one token per run: chunk_starts gives each run's index in the sequence
        n = 2 * self.size if self.layout == "zigzag" else self.size
        order = np.asarray([s for d in range(self.size) for s in chunk_starts(self.layout, self.size, n, d)])
        by_seq = jnp.zeros_like(gathered).at[order].set(gathered)
        before = jnp.cumsum(by_seq, axis=0) - by_seq
        mine = jnp.stack(chunk_starts(self.layout, self.size, n, jax.lax.axis_index(AXIS)))
        return jnp.take(before, mine, axis=0), by_seq.sum(0)

    def own_part(self, x: jax.Array, axis: int) -> jax.Array:
        """x summed over the devices, of which each keeps its 1/size part of `axis` (`_home`:
        a reduce-scatter made of an all_to_all and a local sum)."""
        return _home(jnp.stack(jnp.split(x, self.size, axis=axis)))

    def all_parts(self, x: jax.Array, axis: int) -> jax.Array:
        """Every device's `x` concatenated along `axis` in device order (`_every_device`)."""
        return jnp.concatenate(list(_every_device(x, self.size)), axis=axis)

    def attention(self) -> Callable | None:
        """The nn.Context.attention hook (None: attention on this device)."""
        if self.size == 1:
            return None
        return functools.partial(ulysses_attention if self.strategy == "all_to_all" else ring_attention, self)


def loader_split(plan: Plan, cfg: Any) -> tuple[ContextParallel, jax.sharding.NamedSharding]:
    """How the loader lays out and shards the batch: (the split of mesh.context, or the identity;
    the batch's sharding: rows over the batch axes and, under context parallelism, each row's
    columns over `context`)."""
    cp = make_context(plan, cfg, frozenset({AXIS}))
    if cp.size == 1:
        return cp, plan.sharding(plan.batch_spec())
    return cp, plan.sharding(P(plan.batch_axes or None, AXIS))


def make_context(plan: Plan, cfg: Any, manual: frozenset[str]) -> ContextParallel:
    """The strategy of `cfg` (config.ContextConfig; None: its defaults) when the shard_map is
    manual over a `context` axis of size > 1, else the identity."""
    size = plan.mesh.shape.get(AXIS, 1)
    if size == 1 or AXIS not in manual:
        return ContextParallel()
    cfg = cfg or ContextConfig()
    return ContextParallel(size, cfg.strategy, cfg.layout)


def check_layout(cfg, mesh_shape: dict[str, int], check_model: bool = True) -> None:
    """Config mistakes of a context-parallel run, one clear ConfigError each (before compiling)."""
    c = mesh_shape.get(AXIS, 1)
    if c == 1:
        return
    ctx, t, m = cfg.context, cfg.train, cfg.model
    need = 2 * c if ctx.layout == "zigzag" else c
    if t.seq_len % need:
        raise ConfigError(
            f"train.seq_len={t.seq_len} must be divisible by {need} ({'2 x ' if need != c else ''}"
            f"mesh.context={c}, context.layout={ctx.layout}): each device holds "
            f"{'two chunks of seq_len / (2 x context)' if need != c else 'seq_len / context'} tokens; "
            f"use a multiple of {need} (e.g. {(t.seq_len // need + 1) * need})")
    if t.loss_chunk is not None and (t.seq_len // c) % t.loss_chunk:
        raise ConfigError(
            f"train.loss_chunk={t.loss_chunk} must divide the {t.seq_len // c} tokens each context "
            f"device holds (train.seq_len={t.seq_len} / mesh.context={c}); use a divisor of it")
    if mesh_shape.get("pipeline", 1) > 1 and ctx.strategy == "ring":
        raise ConfigError(
            f"context.strategy=ring does not compose with mesh.pipeline={mesh_shape['pipeline']}: the "
            f"ring's collective-permutes would run inside each stage's branch of the timetable, and "
            f"XLA:CPU's collective-permute waits for every device of the step, which the other "
            f"stages (in other branches) never join; use context.strategy=all_gather (the ring's "
            f"attention on K and V gathered at once) or all_to_all: their all-to-alls run within "
            f"each stage's context group; or mesh.pipeline=1")
    if ctx.strategy in ("ring", "all_gather") and m.attention == "cudnn":
        raise ConfigError(
            f"model.attention=cudnn does not run inside context.strategy={ctx.strategy} "
            f"(mesh.context={c}): the ring folds each arriving key/value chunk into its own online "
            f"softmax, which needs the per-query log-sum-exp that jax's cuDNN attention does not "
            f"return; use model.attention=auto or blockwise (the ring's tiles), or "
            f"context.strategy=all_to_all (cuDNN over whole sequences, a head group per device)")
    if ctx.strategy == "all_to_all" and check_model:
        tensor = mesh_shape.get("tensor", 1)
        for fld in ("n_heads", "n_kv_heads"):
            n = getattr(m, fld)
            if n % (c * tensor):
                raise ConfigError(
                    f"context.strategy=all_to_all splits the heads over mesh.context={c}"
                    f"{f' x mesh.tensor={tensor}' if tensor > 1 else ''}, but model.{fld}={n} is not "
                    f"divisible by {c * tensor}; use context.strategy=ring or a mesh.context that "
                    f"divides {n}")


# ---------------------------------------------------------------- all_to_all (Ulysses)


def zigzag_to_global(x: jax.Array, size: int) -> jax.Array:
    """[b, seq, ...] in gathered zigzag order (device d: chunks d, 2C-1-d) -> global order; a
    reshape, a flip and a concatenation (no gather, whose transpose is a scatter)."""
    b, seq = x.shape[:2]
    y = x.reshape(b, size, 2, seq // (2 * size), *x.shape[2:])
    return jnp.concatenate([y[:, :, 0], jnp.flip(y[:, :, 1], 1)], axis=1).reshape(x.shape)


def global_to_zigzag(x: jax.Array, size: int) -> jax.Array:
    """The inverse of zigzag_to_global."""
    b, seq = x.shape[:2]
    y = x.reshape(b, 2 * size, seq // (2 * size), *x.shape[2:])
    return jnp.stack([y[:, :size], jnp.flip(y[:, size:], 1)], axis=2).reshape(x.shape)


def ulysses_attention(cp: ContextParallel, q, k, v, segment_ids, *, implementation, block, threshold,
                      layout=None):
    """Sequence-split [b, s/C, h, d] -> head-split [b, s, h/C, d], attention, and back."""
    to_heads = lambda x: jax.lax.all_to_all(x, AXIS, split_axis=2, concat_axis=1, tiled=True)
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    if segment_ids is not None:
        segment_ids = jax.lax.all_gather(segment_ids, AXIS, axis=1, tiled=True)
    zigzag = cp.layout == "zigzag"
    if zigzag:  # global order, so the implementation's causal mask holds
        q, k, v = (zigzag_to_global(x, cp.size) for x in (q, k, v))
        segment_ids = None if segment_ids is None else zigzag_to_global(segment_ids, cp.size)
    o = attention_ops.attention(q, k, v, segment_ids, implementation=implementation, block=block,
                                threshold=threshold, layout=layout)
    if zigzag:
        o = global_to_zigzag(o, cp.size)
    return jax.lax.all_to_all(o, AXIS, split_axis=1, concat_axis=2, tiled=True)


# ---------------------------------------------------------------- ring


class Ring(NamedTuple):
    """Static shape of a ring call: ring size, layout, tiles (bq queries, bk keys), scale, the
    tokens of each of a device's runs (`run`, each padded to a whole number of tiles:
    `padded`); `gather`: every device's K and V gathered at once (context.strategy all_gather)
    instead of passed around the ring, the same chunk order, and dK, dV sent home at the end by
    one all-to-all: collectives within the context group, which a pipeline stage's branch can
    hold (a ring's collective-permute cannot)."""
    size: int
    layout: str
    bq: int
    bk: int
    scale: float
    run: int
    gather: bool = False

    @property
    def padded(self) -> int:
        return -(-self.run // self.bq) * self.bq

    def perm(self):
        return [(i, (i + 1) % self.size) for i in range(self.size)]

    def _positions(self, device, fill: int):
        """[tiles, bq] global positions of `device`'s tokens, each run's padding at `fill`."""
        runs = 2 if self.layout == "zigzag" else 1
        pos = device_positions(self.layout, self.size, runs * self.run * self.size, device)
        pad = ((0, 0), (0, self.padded - self.run))
        pos = jnp.pad(pos.reshape(runs, self.run), pad, constant_values=fill)
        return pos.reshape(-1, self.bq)

    def query_positions(self):
        """[nq, bq] global positions of this device's queries; padding at -1 (it sees no key)."""
        return self._positions(jax.lax.axis_index(AXIS), -1)

    def key_positions(self, step):
        """[nk, bk] global positions of the chunk a device holds after `step` ring steps (its
        owner is `step` devices before it); padding after every query (no query sees it)."""
        owner = (jax.lax.axis_index(AXIS) - step) % self.size
        return self._positions(owner, jnp.iinfo(jnp.int32).max)


def _tile(n: int, block: int) -> int:
    """The tile of a run of n tokens: as few tiles <= block as cover it, of equal size (a run
    that no tile near `block` divides is padded by fewer tokens than it has tiles, where the
    largest divisor <= block could be 1: a prime run of 1031 tokens in 1031^2 tiles of 1)."""
    return -(-n // -(-n // block))


def _pad_runs(x, runs: int, run: int, padded: int, fill=0):
    """[b, runs * run, ...] -> [b, runs * padded, ...], each run padded at its end with `fill`."""
    if x is None or padded == run:
        return x
    y = x.reshape(x.shape[0], runs, run, *x.shape[2:])
    y = jnp.pad(y, [(0, 0), (0, 0), (0, padded - run)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return y.reshape(x.shape[0], runs * padded, *x.shape[2:])


def _unpad_runs(x, runs: int, run: int, padded: int):
    """The inverse of _pad_runs."""
    if padded == run:
        return x
    y = x.reshape(x.shape[0], runs, padded, *x.shape[2:])[:, :, :run]
    return y.reshape(x.shape[0], runs * run, *x.shape[2:])


def _blocked(x, size: int):
    """[b, s, ...] -> [s / size, b, size, ...]."""
    return None if x is None else jnp.moveaxis(x.reshape(x.shape[0], -1, size, *x.shape[2:]), 1, 0)


def _unblocked(x):
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _at(x, i):
    return None if x is None else jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _pairs(nq: int, nk: int) -> np.ndarray:
    i, j = np.meshgrid(np.arange(nq), np.arange(nk), indexing="ij")
    return np.stack([i.ravel(), j.ravel()], 1).astype(np.int32)


def _chunk_schedule(qp, kp, qs, ks):
    """(table, count) of the (query tile, key tile) pairs of one chunk that hold a visible pair:
    the tile's first key at or before its last query, and (segment ids qs, ks [n, b, block])
    some query sharing a segment with some key (blockwise.share_segment)."""
    pairs = _pairs(qp.shape[0], kp.shape[0])
    i, j = pairs[:, 0], pairs[:, 1]
    keep = kp.min(-1)[j] <= qp.max(-1)[i]
    if qs is not None:
        keep = keep & share_segment(segment_ranges(qs), segment_ranges(ks), i, j)
    return schedule(pairs, keep)


def _chunk_forward(r: Ring, state: State, qb, kb, vb, qp, kp, qs, ks) -> State:
    """The online-softmax state after one key/value chunk, tile by tile (empty tiles skipped)."""
    def body(carry, ij):
        i, j = ij[0], ij[1]
        st = State(*(_at(c, i) for c in carry))
        st = block_forward(st, _at(qb, i), _at(kb, j), _at(vb, j), qp[i], kp[j], _at(qs, i), _at(ks, j),
                           causal=True, scale=r.scale)
        return State(*(jax.lax.dynamic_update_index_in_dim(c, x, i, 0) for c, x in zip(carry, st)))

    table, n = _chunk_schedule(qp, kp, qs, ks)
    return loop(table, body, state, n)


def _chunk_backward(r: Ring, grads, qb, kb, vb, do, lse, delta, qp, kp, qs, ks):
    """(dq, dk, dv) plus one chunk's float32 contributions, tile by tile (empty tiles skipped)."""
    def body(carry, ij):
        i, j = ij[0], ij[1]
        dq, dk, dv = carry
        gq, gk, gv = block_backward(_at(qb, i), _at(kb, j), _at(vb, j), _at(do, i), _at(lse, i),
                                    _at(delta, i), qp[i], kp[j], _at(qs, i), _at(ks, j), causal=True,
                                    scale=r.scale)
        add = lambda acc, x, n: jax.lax.dynamic_update_index_in_dim(acc, _at(acc, n) + x, n, 0)
        return add(dq, gq, i), add(dk, gk, j), add(dv, gv, j)

    table, n = _chunk_schedule(qp, kp, qs, ks)
    return loop(table, body, grads, n)


def _every_device(x, size: int):
    """[size (device), ...] of every device's x over `context` (an all-gather made of an
    all_to_all of copies: its transpose is an all_to_all too, where an all_gather's would be a
    reduce-scatter, which XLA:CPU aborts on in 16 bits)."""
    if x is None:
        return None
    copies = jnp.broadcast_to(x[None], (size, *x.shape))
    return jax.lax.all_to_all(copies, AXIS, 0, 0, tiled=True)


def _home(x):
    """x [size (owner), ...] of this device's contributions to every owner's chunk -> the sum of
    every device's contribution to this device's chunk (an all_to_all and a local sum)."""
    return jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True).sum(0)


def _gathered_forward(r: Ring, qb, kb, vb, qs, ks):
    me = jax.lax.axis_index(AXIS)
    qp = r.query_positions()
    state = vary_together(init_state(qb), qb, kb, vb, qs, ks, qp)
    kv = tuple(_every_device(x, r.size) for x in (kb, vb, ks))

    def step(state, t):  # the ring's order: the chunk of the device t before this one
        owner = (me - t) % r.size
        return _chunk_forward(r, state, qb, _at(kv[0], owner), _at(kv[1], owner), qp,
                              r.key_positions(t), qs, _at(kv[2], owner)), None

    state, _ = jax.lax.scan(step, state, np.arange(r.size, dtype=np.int32))
    return finish(state, qb.dtype)


def _gathered_bwd(r: Ring, res, do):
    qb, kb, vb, qs, ks, o, lse = res
    me = jax.lax.axis_index(AXIS)
    qp = r.query_positions()
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)
    kv = tuple(_every_device(x, r.size) for x in (kb, vb, ks))
    dq = jnp.zeros(qb.shape, F32)
    dkv = (jnp.zeros((r.size, *kb.shape), F32), jnp.zeros((r.size, *vb.shape), F32))
    dq, dkv = vary_together((dq, dkv), qb, kb, vb, qs, ks, do, lse, qp)

    def step(carry, t):
        dq, (dk, dv) = carry
        owner = (me - t) % r.size
        dq, gk, gv = _chunk_backward(r, (dq, _at(dk, owner), _at(dv, owner)), qb, _at(kv[0], owner),
                                     _at(kv[1], owner), do, lse, delta, qp, r.key_positions(t),
                                     qs, _at(kv[2], owner))
        put = lambda acc, g: jax.lax.dynamic_update_index_in_dim(acc, g, owner, 0)
        return (dq, (put(dk, gk), put(dv, gv))), None

    (dq, (dk, dv)), _ = jax.lax.scan(step, (dq, dkv), np.arange(r.size, dtype=np.int32))
    return (dq.astype(qb.dtype), _home(dk).astype(kb.dtype), _home(dv).astype(vb.dtype), None, None)


def _ring_forward(r: Ring, qb, kb, vb, qs, ks):
    if r.gather:
        return _gathered_forward(r, qb, kb, vb, qs, ks)
    qp = r.query_positions()
    state = vary_together(init_state(qb), qb, kb, vb, qs, ks, qp)
    send = lambda x: jax.tree.map(lambda a: jax.lax.ppermute(a, AXIS, r.perm()), x)

    def step(carry, t):
        state, kv = carry
        state = _chunk_forward(r, state, qb, kv[0], kv[1], qp, r.key_positions(t), qs, kv[2])
        return state, send(kv)

    kv = vary_together((kb, vb, ks), state)
    state, kv = loop(np.arange(r.size - 1, dtype=np.int32), step, (state, kv))
    state = _chunk_forward(r, state, qb, kv[0], kv[1], qp, r.key_positions(r.size - 1), qs, kv[2])
    return finish(state, qb.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(r: Ring, qb, kb, vb, qs, ks):
    return _ring_forward(r, qb, kb, vb, qs, ks)[0]


def _ring_fwd(r, qb, kb, vb, qs, ks):
    o, lse = _ring_forward(r, qb, kb, vb, qs, ks)
    return o, (qb, kb, vb, qs, ks, o, lse)


def _ring_bwd(r, res, do):
    if r.gather:
        return _gathered_bwd(r, res, do)
    qb, kb, vb, qs, ks, o, lse = res
    qp = r.query_positions()
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)
    dq = jnp.zeros(qb.shape, F32)
    dkv = (jnp.zeros(kb.shape, F32), jnp.zeros(vb.shape, F32))
    dq, dkv, kv = vary_together((dq, dkv, (kb, vb, ks)), qb, kb, vb, qs, ks, do, lse, qp)
    send = lambda x: jax.tree.map(lambda a: jax.lax.ppermute(a, AXIS, r.perm()), x)

    def grads_of(t, dq, dkv, kv):
        dq, dk, dv = _chunk_backward(r, (dq, *dkv), qb, kv[0], kv[1], do, lse, delta, qp,
                                     r.key_positions(t), qs, kv[2])
        return dq, (dk, dv)

    def step(carry, t):  # the chunk and its gradient so far move on together
        dq, dkv, kv = carry
        dq, dkv = grads_of(t, dq, dkv, kv)
        return dq, send(dkv), send(kv)

    dq, dkv, kv = loop(np.arange(r.size - 1, dtype=np.int32), step, (dq, dkv, kv))
    dq, dkv = grads_of(r.size - 1, dq, dkv, kv)
    dk, dv = send(dkv)  # one more hop: home to the chunk's owner
    return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_implementation(implementation: str, seq: int, threshold: int) -> str:
    """What the ring's tiles are for model.attention: `auto` as the implementation auto picks
    for the whole sequence (cuDNN cannot fold into the ring's online softmax: blockwise)."""
    if implementation == "auto":
        return "blockwise" if seq >= threshold else "xla"
    return implementation


def ring_tile(implementation: str, run: int, block: int, seq: int, threshold: int) -> int:
    """The ring's [tile, tile] score blocks for model.attention (ring_implementation): `xla` one
    per pair of runs (the whole scores of a chunk against a chunk, as xla holds them),
    `blockwise` at most model.attention_block (`_tile`: the run padded to whole tiles). A tile
    never straddles two runs."""
    return run if ring_implementation(implementation, seq, threshold) == "xla" else _tile(run, block)


def ring_attention(cp: ContextParallel, q, k, v, segment_ids, *, implementation: str = "blockwise",
                   block: int = 512, threshold: int = 2048, layout=None):
    """Causal ring attention of this device's q [b, s/C, h, d] against every device's k, v
    [b, s/C, kv_heads, d] (segment ids [b, s/C]: this device's). The model's `implementation`,
    `block` (model.attention_block) and `threshold` set the tile (ring_tile); the tiles are our
    own (blockwise's), so `layout` (for cudnn) does not apply."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    runs = cp.runs
    run = s // runs
    bq = ring_tile(implementation, run, block, s * cp.size, threshold)
    r = Ring(cp.size, cp.layout, bq, bq, d ** -0.5, run, cp.strategy == "all_gather")
    pad = lambda x, fill=0: _pad_runs(x, runs, run, r.padded, fill)
    seg = None if segment_ids is None else _blocked(pad(segment_ids.astype(jnp.int32), -1), bq)
    qb = _blocked(pad(q.reshape(b, s, kvh, h // kvh, d)), bq)
    o = _ring(r, qb, _blocked(pad(k), bq), _blocked(pad(v), bq), seg, seg)
    return _unpad_runs(_unblocked(o), runs, run, r.padded).reshape(b, s, h, d)


def ring_bytes(cfg, seq: int, batch: int, itemsize: int) -> dict[str, float]:
    """Analytic bytes each device receives per step of ring attention, all layers: forward, K and
    V of the C-1 other chunks per layer; backward, K and V again (C-1 hops) and their float32
    gradients dK, dV (C hops, the last one home). Segment ids are not counted."""
    m, c = cfg.model, cfg.mesh.context
    chunk = batch * (seq // c) * m.n_kv_heads * m.resolved_head_dim
    fwd = 2 * (c - 1) * chunk * itemsize
    bwd = 2 * (c - 1) * chunk * itemsize + 2 * c * chunk * 4
    return {"forward": fwd * m.n_layers, "backward": bwd * m.n_layers}
