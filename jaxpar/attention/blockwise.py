"""Blockwise (flash-style) attention in pure JAX: O(seq x block) memory on every backend.

Scores exist one [block, block] tile at a time. The forward keeps a running max, sum and output
per query row (online softmax); the custom VJP recomputes each tile's probabilities from the
saved log-sum-exp instead of storing them. One while loop visits only the (query block, key
block) pairs some query may see: under the causal mask the tiles above the diagonal are not in
its list, so they are never computed; with segment ids (packed documents) the pairs whose
query tile and key tile share no segment are moved behind the others at run time and the loop
stops before them (`schedule`), forward and backward alike.

`block_forward` / `block_backward` are one tile's step with explicit global positions and
segment ids: ring attention calls them for each key/value chunk that arrives.
Layout: q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim]. GQA views
the query heads as [kv_heads, groups], so K and V are never repeated.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.sharding import vary_together

NEG = -1e30  # finite: a row that has seen no key yet keeps exp(NEG - NEG) = 1, not NaN
F32 = jnp.float32


class State(NamedTuple):
    """Online-softmax state of a query block: running max m and sum l [b, q, kv, g], output acc
    [b, q, kv, g, d] (float32, not yet divided by l)."""
    m: jax.Array
    l: jax.Array
    acc: jax.Array


def init_state(q: jax.Array) -> State:
    """The state before any key, for q [b, q, kv, g, d]."""
    rows = q.shape[:-1]
    return State(jnp.full(rows, NEG, F32), jnp.zeros(rows, F32), jnp.zeros(q.shape, F32))


def tile_mask(q_pos, k_pos, q_seg, k_seg, causal: bool) -> jax.Array | None:
    """Which (query, key) pairs may attend, [b or 1, q, 1, 1, k]; None: all of them.
    Positions [q], [k] are global token positions; segment ids [b, q], [b, k]."""
    mask = None
    if causal:
        mask = (q_pos[:, None] >= k_pos[None, :])[None, :, None, None, :]
    if q_seg is not None:
        same = (q_seg[:, :, None] == k_seg[:, None, :])[:, :, None, None, :]
        mask = same if mask is None else mask & same
    return mask


def _scores(q, k, scale):
    return jnp.einsum("bqkgd,bskd->bqkgs", q, k, preferred_element_type=F32) * scale


def block_forward(state: State, q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, causal: bool,
                  scale: float) -> State:
    """The state after one key/value tile: q [b, q, kv, g, d], k and v [b, k, kv, d]."""
    s = _scores(q, k, scale)
    mask = tile_mask(q_pos, k_pos, q_seg, k_seg, causal)
    if mask is not None:
        s = jnp.where(mask, s, NEG)
    m = jnp.maximum(state.m, s.max(-1))
    p = jnp.exp(s - m[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)  # a row with no key seen yet has m = NEG, so exp(0) = 1 here
    corr = jnp.exp(state.m - m)
    pv = jnp.einsum("bqkgs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=F32)
    return State(m, state.l * corr + p.sum(-1), state.acc * corr[..., None] + pv)


def finish(state: State, dtype) -> tuple[jax.Array, jax.Array]:
    """(output in `dtype`, log-sum-exp) of a state; a row that saw no key gives 0 (lse NEG)."""
    seen = state.l > 0
    o = state.acc / jnp.where(seen, state.l, 1.0)[..., None]
    lse = jnp.where(seen, state.m + jnp.log(jnp.where(seen, state.l, 1.0)), NEG)
    return o.astype(dtype), lse


def block_backward(q, k, v, do, lse, delta, q_pos, k_pos, q_seg=None, k_seg=None, *, causal: bool,
                   scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One tile's float32 (dq, dk, dv) contributions, from the softmax's saved `lse` and
    delta = rowsum(do * o) [b, q, kv, g]; the probabilities are recomputed, never stored."""
    p = jnp.exp(_scores(q, k, scale) - lse[..., None])
    mask = tile_mask(q_pos, k_pos, q_seg, k_seg, causal)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = jnp.einsum("bqkgs,bqkgd->bskd", p.astype(do.dtype), do, preferred_element_type=F32)
    dp = jnp.einsum("bqkgd,bskd->bqkgs", do, v, preferred_element_type=F32)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bqkgs,bskd->bqkgd", ds.astype(k.dtype), k, preferred_element_type=F32) * scale
    dk = jnp.einsum("bqkgs,bqkgd->bskd", ds.astype(q.dtype), q, preferred_element_type=F32) * scale
    return dq, dk, dv


def visible_pairs(nq: int, nk: int, bq: int, bk: int, q_offset: int, kv_offset: int,
                  causal: bool) -> np.ndarray:
    """[n, 2] (query block, key block) pairs that hold at least one visible pair of tokens."""
    i, j = np.meshgrid(np.arange(nq), np.arange(nk), indexing="ij")
    keep = np.ones_like(i, bool)
    if causal:  # the block's first key is at or before its last query
        keep = kv_offset + j * bk <= q_offset + i * bq + bq - 1
    return np.stack([i[keep], j[keep]], axis=1).astype(np.int32)


class Tiling(NamedTuple):
    """Static shape of one call: block sizes, block counts, positions' offsets, scale."""
    bq: int
    bk: int
    nq: int
    nk: int
    q_offset: int
    kv_offset: int
    causal: bool
    scale: float

    def positions(self):
        q_pos = self.q_offset + jnp.arange(self.nq * self.bq, dtype=jnp.int32).reshape(self.nq, self.bq)
        k_pos = self.kv_offset + jnp.arange(self.nk * self.bk, dtype=jnp.int32).reshape(self.nk, self.bk)
        return q_pos, k_pos

    def pairs(self) -> np.ndarray:
        return visible_pairs(self.nq, self.nk, self.bq, self.bk, self.q_offset, self.kv_offset, self.causal)


def loop(xs, body, carry, n=None):
    """carry = body(carry, x) for each of the first `n` rows x of the table `xs` (default: all
    of them), as a while loop. A scan here would be split by JAX's partial evaluation inside a
    differentiated layer scan: the parts that depend only on constants (every tile's causal mask,
    in ring attention the probabilities too) hoisted out and stacked over all iterations,
    [tiles, block, block] bytes (528 MiB at 8K tokens). A while loop is never split, and its
    trip count `n` may be a traced value (`schedule`)."""
    xs = jnp.asarray(xs)
    n = xs.shape[0] if n is None else n
    i0 = jnp.int32(0) if isinstance(n, int) else vary_together(jnp.zeros((), jnp.int32), n)

    def step(c):
        i, inner = c
        return i + 1, body(inner, jax.lax.dynamic_index_in_dim(xs, i, keepdims=False))

    return jax.lax.while_loop(lambda c: c[0] < n, step, (i0, carry))[1]


def segment_ranges(seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The (lowest, highest) segment id of each tile and row, [n, b] each, of blocked ids
    [n, b, block]. The negative ids of the positions that pad a ragged last tile match nothing,
    so they are left out: a tile of those only would get (int32 max, -1), overlapping none."""
    real = seg >= 0
    return jnp.where(real, seg, jnp.iinfo(jnp.int32).max).min(-1), jnp.where(real, seg, -1).max(-1)


def share_segment(q_ranges, k_ranges, i, j) -> jax.Array:
    """[n] bool: whether query tile i[n] and key tile j[n] may hold a query and a key of the same
    segment, i.e. their id ranges overlap in some row. Disjoint ranges hold no equal pair of ids
    whatever the ids' order, so skipping on False is exact for any segment ids; packed rows
    (train/batch.py: ids count the EOS before a token, non-decreasing in steps of 1) make the
    test tight: every id of a range is in its tile, so an overlap is a shared document."""
    (qlo, qhi), (klo, khi) = q_ranges, k_ranges
    return ((qlo[i] <= khi[j]) & (klo[j] <= qhi[i])).any(-1)


def schedule(pairs, keep: jax.Array | None):
    """(table, count) for `loop`: the rows of `pairs` where `keep` first (in their order, so the
    arithmetic is that of visiting all: a skipped tile would leave the state as it was), then
    the others; `count` the kept ones. keep None: all pairs, a static count."""
    if keep is None:
        return pairs, len(pairs)
    order = jnp.argsort(jnp.logical_not(keep), stable=True)
    return jnp.asarray(pairs)[order], keep.sum(dtype=jnp.int32)


def _tile_schedule(t: Tiling, qs, ks):
    """The (query block, key block) pairs the kernel visits, as `schedule` gives them: the causal
    list of `t`, less the pairs whose tiles share no segment (qs / ks: blocked ids or None)."""
    pairs = t.pairs()
    if qs is None:
        return schedule(pairs, None)
    return schedule(pairs, share_segment(segment_ranges(qs), segment_ranges(ks), pairs[:, 0], pairs[:, 1]))


def _at(x, i):
    return None if x is None else jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _add_at(acc, x, i):
    return jax.lax.dynamic_update_index_in_dim(acc, _at(acc, i) + x, i, 0)


def _forward_blocks(t: Tiling, qb, kb, vb, qs, ks):
    """Blocked inputs (leading block dim: qb [nq, b, bq, kv, g, d], kb/vb [nk, b, bk, kv, d],
    segments [n, b, block] or None) -> (output like qb, lse [nq, b, bq, kv, g])."""
    q_pos, k_pos = t.positions()
    table, n = _tile_schedule(t, qs, ks)
    state = vary_together(init_state(qb), qb, kb, vb)

    def body(carry, ij):
        i, j = ij[0], ij[1]
        st = State(*(_at(c, i) for c in carry))
        st = block_forward(st, _at(qb, i), _at(kb, j), _at(vb, j), q_pos[i], k_pos[j], _at(qs, i), _at(ks, j),
                           causal=t.causal, scale=t.scale)
        return State(*(jax.lax.dynamic_update_index_in_dim(c, x, i, 0) for c, x in zip(carry, st)))

    return finish(loop(table, body, state, n), qb.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(t: Tiling, qb, kb, vb, qs, ks):
    return _forward_blocks(t, qb, kb, vb, qs, ks)[0]


def _attend_fwd(t, qb, kb, vb, qs, ks):
    o, lse = _forward_blocks(t, qb, kb, vb, qs, ks)
    return o, (qb, kb, vb, qs, ks, o, lse)


def _attend_bwd(t, res, do):
    qb, kb, vb, qs, ks, o, lse = res
    q_pos, k_pos = t.positions()
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)
    grads = vary_together((jnp.zeros(qb.shape, F32), jnp.zeros(kb.shape, F32), jnp.zeros(vb.shape, F32)),
                          qb, kb, vb, do)

    def body(carry, ij):
        i, j = ij[0], ij[1]
        dq, dk, dv = carry
        gq, gk, gv = block_backward(_at(qb, i), _at(kb, j), _at(vb, j), _at(do, i), _at(lse, i),
                                    _at(delta, i), q_pos[i], k_pos[j], _at(qs, i), _at(ks, j),
                                    causal=t.causal, scale=t.scale)
        return _add_at(dq, gq, i), _add_at(dk, gk, j), _add_at(dv, gv, j)

    table, n = _tile_schedule(t, qs, ks)
    dq, dk, dv = loop(table, body, grads, n)
    return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _blocks(x: jax.Array, n: int, size: int, fill=0) -> jax.Array:
    """[b, seq, ...] -> [n, b, size, ...], the sequence padded with `fill` to n * size."""
    pad = n * size - x.shape[1]
    if pad:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[0], n, size, *x.shape[2:]), 1, 0)


def _tiling(b: int, sq: int, sk: int, d: int, segment_ids, *, causal: bool, block: int, scale, q_offset: int,
            kv_offset: int) -> tuple[Tiling, jax.Array | None, jax.Array | None]:
    """The call's Tiling and blocked segment ids (queries', keys'; None when neither segment ids
    nor padding need a mask)."""
    if segment_ids is not None and sq != sk:
        raise ValueError(f"blockwise attention: segment_ids need self-attention, got {sq} queries, {sk} keys")
    if block < 1:
        raise ValueError(f"blockwise attention: block must be >= 1, got {block}")
    bq, bk = min(block, sq), min(block, sk)
    nq, nk = -(-sq // bq), -(-sk // bk)
    t = Tiling(bq, bk, nq, nk, q_offset, kv_offset, causal, d ** -0.5 if scale is None else float(scale))
    qs = ks = None
    if segment_ids is not None or nk * bk != sk:
        seg = jnp.zeros((b, sk), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        qs = _blocks(seg[:, :sq] if segment_ids is None else seg, nq, bq, fill=-2)
        ks = _blocks(seg, nk, bk, fill=-1)  # padded keys match no query
    return t, qs, ks


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                        *, causal: bool = True, block: int = 512, scale: float | None = None,
                        q_offset: int = 0, kv_offset: int = 0) -> jax.Array:
    """softmax(q k^T * scale + mask) v with the memory of one [block, block] tile per head.

    q [b, sq, heads, d]; k, v [b, sk, kv_heads, d] (heads a multiple of kv_heads); segment_ids
    [b, seq] int >= 0 (a token sees only keys of its own segment; self-attention, sq == sk).
    Tokens sit at global positions q_offset + i and kv_offset + j for the causal mask. A
    sequence that `block` does not divide is padded; the padded keys are masked out."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if h % kvh:
        raise ValueError(f"blockwise attention: {h} query heads are not a multiple of {kvh} kv heads")
    t, qs, ks = _tiling(b, sq, sk, d, segment_ids, causal=causal, block=block, scale=scale, q_offset=q_offset,
                        kv_offset=kv_offset)
    qb = _blocks(q.reshape(b, sq, kvh, h // kvh, d), t.nq, t.bq)
    o = _attend(t, qb, _blocks(k, t.nk, t.bk), _blocks(v, t.nk, t.bk), qs, ks)
    return jnp.moveaxis(o, 0, 1).reshape(b, t.nq * t.bq, h, d)[:, :sq]


def visited_tiles(segment_ids: jax.Array | None, seq: int, *, block: int = 512,
                  causal: bool = True) -> tuple[jax.Array | int, int]:
    """(tiles blockwise_attention computes, tiles under the causal mask alone) for a
    self-attention of `seq` tokens with `segment_ids` [b, seq]: the kernel's own schedule, each
    pair computed once in the forward and once in the backward (a test and bench aid)."""
    b = 1 if segment_ids is None else segment_ids.shape[0]
    t, qs, ks = _tiling(b, seq, seq, 1, segment_ids, causal=causal, block=block, scale=None, q_offset=0,
                        kv_offset=0)
    return _tile_schedule(t, qs, ks)[1], len(t.pairs())
