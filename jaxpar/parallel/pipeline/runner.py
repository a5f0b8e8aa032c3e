"""The pipelined forward and backward of one train step, run from a Timetable.

Runs inside the step's shard_map, manual over `pipeline` (and the batch axes); `tensor` and
co. stay with the compiler. Each device holds its stage's slice of the stacked layers (the plan
shards `layers` over `pipeline`) and the whole (data-parallel-local) batch; the top params
(embedding, final norm, head) are replicated over `pipeline`.

One `lax.scan` over the ticks; each tick
  1. looks up its row of the timetable with axis_index('pipeline'),
  2. runs one branch of `lax.switch` (an HLO conditional: each device runs only its own):
     forward of the first stage (embedding + layers) or of a middle stage (layers), or the
     backward of the first / a middle / the last stage. A backward recomputes its stage's
     forward from the stashed stage input under jax.vjp (remat at the stage boundary; the
     stage's own train.remat policy still applies inside). The last stage's forward is folded
     into its backward, which also yields the loss;
  3. sends the forward output to the next stage and the input cotangent to the previous one
     (two ppermutes, every tick), and files what arrives into ring buffers at the slots the
     timetable allocated (so a stage keeps only as many inputs as the schedule has in flight).
Gradients accumulate per device: layer grads stay local to their stage, top-param grads are
summed over `pipeline` by the step's final reduction (only the first and last stage add to them).
What passes between stages is the model's scan carry, any pytree (the MoE model carries its
router-loss sums beside the activations); what the model sows in its epilogue (jaxpar.nn.sow)
is collected by the last stage, added to its loss and returned per microbatch-sum.

The model is cut with the `jaxpar.nn.scan_layers` hook: what runs before the model's (single)
scan_layers call is the first stage's prologue, the scan is split by stage, what follows is the
last stage's epilogue. No mesh axis name appears in the model.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import nn
from jaxpar.sharding import vary, varying_axes
from jaxpar.train.model import nest
from jaxpar.parallel.pipeline.schedule import (B_FIRST, B_LAST, B_MID, F_FIRST, F_MID, IDLE,
                                               Timetable)

AXIS = "pipeline"


class _Stop(Exception):
    def __init__(self, value):
        super().__init__("pipeline stage boundary")
        self.value = value


def flatten(tree: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def interleave_pairs(p: int, v: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Device d holds chunks d*v + j (j < v) of the layer stack in the plan's contiguous layout;
    interleaved_1f1b wants chunks k*p + d. For each (j, k): the (source, destination) devices."""
    pairs: dict = {}
    for d in range(p):
        for j in range(v):
            c = d * v + j
            pairs.setdefault((j, c // p), []).append((d, c % p))
    return pairs


def to_interleaved(x: jax.Array, p: int, v: int) -> jax.Array:
    """[v, Lc, ...] contiguous chunks -> [v, Lc, ...] round-robin chunks (ppermutes only; each
    chunk moves once)."""
    out = [None] * v
    for (j, k), pairs in interleave_pairs(p, v).items():
        moved = jax.lax.ppermute(x[j], AXIS, pairs)
        out[k] = moved if out[k] is None else out[k] + moved
    return jnp.stack(out)


def from_interleaved(x: jax.Array, p: int, v: int) -> jax.Array:
    """The inverse of to_interleaved (for the gradients)."""
    out = [None] * v
    for (j, k), pairs in interleave_pairs(p, v).items():
        moved = jax.lax.ppermute(x[k], AXIS, [(b, a) for a, b in pairs])
        out[j] = moved if out[j] is None else out[j] + moved
    return jnp.stack(out)


def make_pipeline_grads(model, timetable: Timetable, ctx: nn.Context, prepare_top: Callable,
                        scatter: Callable, grad_specs: Any, stacked: set[tuple],
                        manual: tuple[str, ...] = ()) -> Callable:
    """run(params, mbs, loss) -> (losses [1], local grads, sown [1]): the pipelined equivalent
    of summing jax.value_and_grad(loss) over the microbatches `mbs` [m, b, seq+1], with `loss`
    the step's train.loss.MicrobatchLoss (the same normalisation and sown weighting).

    `prepare_top(state)` casts/gathers the non-layer params, `scatter(grads, specs)` is the
    per-microbatch gradient hook (the sync's: ZeRO-2), `stacked` the param paths with a `layers` dim,
    `manual` the shard_map's manual axes of size > 1: every tick's carry (accumulators, ring
    buffers) and every branch's zeros vary over them (check_vma), as what fills them does.
    """
    tt = timetable
    p, v = tt.p, tt.v
    tables = np.stack([tt.code, tt.mb, tt.chunk, tt.x_slot, tt.g_slot, tt.recv_x, tt.recv_g], -1)
    n_x, n_g = max(tt.n_x_slots, 1), max(tt.n_g_slots, 1)
    if v == 1:
        fwd_perm = [(d, d + 1) for d in range(p - 1)]
        bwd_perm = [(d + 1, d) for d in range(p - 1)]
    else:  # chunk k on device p-1 feeds chunk k+1 on device 0
        fwd_perm = [(d, (d + 1) % p) for d in range(p)]
        bwd_perm = [((d + 1) % p, d) for d in range(p)]
    flat_specs = flatten(grad_specs)

    def run(params, mbs, loss_fn):
        flat = flatten(params)
        top = {k: a for k, a in flat.items() if k not in stacked}
        lay = {k: a.reshape(v, a.shape[0] // v, *a.shape[1:]) for k, a in flat.items() if k in stacked}
        if v > 1:
            lay = {k: to_interleaved(a, p, v) for k, a in lay.items()}

        def call(top, lay_k, tokens, hook, prep):
            state = model.state(nest({**top, **lay_k}))
            if prep:
                state = prepare_top(state)
            try:
                with nn.use_context(dataclasses.replace(ctx, layers_hook=hook)):
                    return model.merge(state)(tokens[:, :-1])
            except _Stop as stop:
                return stop.value

        def stop_at_layers(stack, carry, fn):
            raise _Stop(carry)

        def pre(top, lay_k, tok):
            return call(top, lay_k, tok, stop_at_layers, True)

        def body(top, lay_k, x, tok):
            def hook(stack, carry, fn):
                raise _Stop(nn.scan_stack(stack, x, fn))
            return call(top, lay_k, tok, hook, False)

        def post(top, lay_k, y, tok):
            with nn.collect_aux() as sown:
                logits = call(top, lay_k, tok, lambda stack, carry, fn: y, True)
            return loss_fn(logits, tok[:, 1:], sown)

        def chunk(k):
            return {n: (a[0] if v == 1 else jax.lax.dynamic_index_in_dim(a, k, keepdims=False))
                    for n, a in lay.items()}

        def add_chunk(acc, g, k):
            g = scatter(g, {n: flat_specs[n] for n in g})
            if v == 1:
                return {n: acc[n].at[0].add(g[n].astype(acc[n].dtype)) for n in acc}
            return {n: jax.lax.dynamic_update_index_in_dim(
                acc[n], jax.lax.dynamic_index_in_dim(acc[n], k, keepdims=False) + g[n].astype(acc[n].dtype),
                k, 0) for n in acc}

        def add_top(acc, g):
            g = scatter(g, {n: flat_specs[n] for n in g})
            return {n: acc[n] + g[n].astype(acc[n].dtype) for n in acc}

        x_sds = jax.eval_shape(lambda: pre(top, chunk(0), mbs[0]))
        zeros_x = jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype), manual), x_sds)
        sown_sds = jax.eval_shape(
            lambda: post(top, chunk(0), body(top, chunk(0), zeros_x, mbs[0]), mbs[0]))[1][1]
        tree_at = lambda buf, i: jax.tree.map(
            lambda b: jax.lax.dynamic_index_in_dim(b, i, keepdims=False), buf)

        # ---- the branches: (acc_top, acc_lay, loss, x_in, g_in, tok, k) -> (..., y, dx)
        def idle(at, al, loss, x, g, tok, k):
            return at, al, loss, zeros_x, zeros_x

        def f_first(at, al, loss, x, g, tok, k):
            lk = chunk(k)
            return at, al, loss, body(top, lk, pre(top, lk, tok), tok), zeros_x

        def f_mid(at, al, loss, x, g, tok, k):
            return at, al, loss, body(top, chunk(k), x, tok), zeros_x

        def b_first(at, al, loss, x, g, tok, k):
            _, vjp = jax.vjp(lambda t, lk: body(t, lk, pre(t, lk, tok), tok), top, chunk(k))
            dt, dl = vjp(g)
            return add_top(at, dt), add_chunk(al, dl, k), loss, zeros_x, zeros_x

        def b_mid(at, al, loss, x, g, tok, k):
            _, vjp = jax.vjp(lambda lk, xi: body(top, lk, xi, tok), chunk(k), x)
            dl, dx = vjp(g)
            return at, add_chunk(al, dl, k), loss, zeros_x, dx

        def b_last(at, al, loss, x, g, tok, k):
            val, vjp, (lm, sown) = jax.vjp(lambda t, lk, xi: post(t, lk, body(t, lk, xi, tok), tok),
                                           top, chunk(k), x, has_aux=True)
            dt, dl, dx = vjp(vary(jnp.ones(val.shape, val.dtype), varying_axes(val)))
            loss = jax.tree.map(lambda a, b: a + b.astype(a.dtype), loss, (lm, sown))
            return add_top(at, dt), add_chunk(al, dl, k), loss, zeros_x, dx

        branches = {IDLE: idle, F_FIRST: f_first, F_MID: f_mid, B_FIRST: b_first, B_MID: b_mid,
                    B_LAST: b_last}
        used = sorted(set(np.unique(tt.code).tolist()))
        remap = np.zeros(max(branches) + 1, np.int32)
        remap[used] = np.arange(len(used))
        table = jnp.asarray(np.concatenate([remap[tables[..., :1]], tables[..., 1:]], -1))
        fns = [branches[c] for c in used]
        d = jax.lax.axis_index(AXIS)

        def tick(carry, row):
            at, al, loss, xbuf, gbuf = carry
            r = row[d]
            code, i, k, xs, gs, rx, rg = (r[j] for j in range(7))
            tok = jax.lax.dynamic_index_in_dim(mbs, i, keepdims=False)
            x_in, g_in = tree_at(xbuf, xs), tree_at(gbuf, gs)
            at, al, loss, y, dx = jax.lax.switch(code, fns, at, al, loss, x_in, g_in, tok, k)
            x_recv = jax.tree.map(lambda a: jax.lax.ppermute(a, AXIS, fwd_perm), y)
            g_recv = jax.tree.map(lambda a: jax.lax.ppermute(a, AXIS, bwd_perm), dx)
            # Slot n (one past the last) takes what arrives for nobody.
            put = lambda buf, new, i: jax.tree.map(
                lambda b, a: jax.lax.dynamic_update_index_in_dim(b, a, i, 0), buf, new)
            xbuf = put(xbuf, x_recv, jnp.where(rx < 0, n_x, rx))
            gbuf = put(gbuf, g_recv, jnp.where(rg < 0, n_g, rg))
            return (at, al, loss, xbuf, gbuf), None

        acc_top = jax.eval_shape(lambda: scatter(top, {n: flat_specs[n] for n in top}))
        # microbatch gradients accumulate in float32 whatever the params' dtype (bf16 would
        # round each addition)
        acc_top = {n: jnp.zeros(a.shape, jnp.float32) for n, a in acc_top.items()}
        acc_lay = jax.eval_shape(lambda: scatter({n: a[0] for n, a in lay.items()},
                                                 {n: flat_specs[n] for n in lay}))
        acc_lay = {n: jnp.zeros((v, *a.shape), jnp.float32) for n, a in acc_lay.items()}
        buf = lambda n: jax.tree.map(lambda s: jnp.zeros((n + 1, *s.shape), s.dtype), x_sds)
        loss0 = (jnp.zeros((), jnp.float32), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sown_sds))
        carry = jax.tree.map(lambda a: vary(a, manual), (acc_top, acc_lay, loss0, buf(n_x), buf(n_g)))
        (acc_top, acc_lay, (loss, sown), _, _), _ = jax.lax.scan(tick, carry, table)
        if v > 1:
            acc_lay = {n: from_interleaved(a, p, v) for n, a in acc_lay.items()}
        acc_lay = {n: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]) for n, a in acc_lay.items()}
        return loss[None], nest({**acc_top, **acc_lay}), jax.tree.map(lambda a: a[None], sown)

    return run
