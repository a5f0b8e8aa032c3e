"""The pipelined forward and backward of one train step, run from a Timetable.

Runs inside the step's shard_map, manual over `pipeline` (and the batch axes); `tensor` and
co. stay with the compiler. Each device holds its stages' slice of the stacked layers (the plan
shards `layers` over `pipeline`; with interleaved_1f1b it stores device d's chunks k*p + d in its
block, in the order they run: sharding.Plan.layer_order) and the whole (data-parallel-local)
batch; the top params (embedding, final norm, head) are replicated over `pipeline`.

One `lax.scan` over the ticks; each tick
  1. looks up its row of the timetable with axis_index('pipeline'),
  2. runs one branch of `lax.switch` (an HLO conditional: each device runs only its own):
     forward of the first stage (embedding + layers) or of a middle stage (layers), or the
     backward of the first / a middle / the last stage. With pipeline.recompute=false a forward
     runs under jax.vjp and stashes the residuals (residuals.py; the stage's train.remat policy
     decides what they are) and its backward applies them; with recompute=true a backward
     recomputes its stage's forward from the stashed stage input (remat at the stage boundary).
     zb_h1 and 1f1b_split run a vjp per layer and cut each layer's backward into Bx and W (split.py).
     Without recompute the last stage's forward runs on its own tick and keeps its output and
     residuals; its backward starts at the head and the loss (which it yields). With recompute
     the last stage's forward is folded into its backward;
  3. sends the forward output to the next stage and the input cotangent to the previous one,
     each a ppermute over only the (source, destination) pairs that have something to send on
     this tick (one static pattern a direction per tick, both picked by one lax.switch all
     devices agree on; a tick nobody sends on runs no ppermute), and files what arrives, and
     what the tick keeps, into ring buffers at the slots the timetable allocated (one switch;
     so a stage keeps only as many inputs as the schedule has in flight). XLA:GPU syncs the
     host on every conditional: a tick runs three (op, send, file).
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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import nn
from jaxpar.sharding import vary, varying_axes
from jaxpar.train.model import nest, pure_dict
from jaxpar.parallel.pipeline.residuals import StashPlan
from jaxpar.parallel.pipeline.split import LayerSplit
from jaxpar.parallel.pipeline.schedule import (B_FIRST, B_LAST, B_MID, BX_FIRST, BX_LAST, BX_MID,
                                               F_FIRST, F_LAST, F_MID, IDLE, SPLIT, W, Timetable)

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


def send_patterns(recv: np.ndarray, perm: list[tuple[int, int]]):
    """(patterns, index per tick): the distinct sets of `perm`'s pairs whose destination receives
    something on a tick (recv [tick, device] >= 0), numbered from 1; 0 is a tick without sends."""
    patterns: list[tuple] = []
    index = np.zeros(recv.shape[0], np.int32)
    for t, row in enumerate(recv):
        pairs = tuple((a, b) for a, b in perm if row[b] >= 0)
        if pairs:
            if pairs not in patterns:
                patterns.append(pairs)
            index[t] = patterns.index(pairs) + 1
    return patterns, index


def stage_perms(p: int, v: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(forward, backward) (source, destination) stage pairs of the sends: with v > 1 chunk k on
    device p-1 feeds chunk k+1 on device 0, a ring."""
    if v == 1:
        return [(d, d + 1) for d in range(p - 1)], [(d + 1, d) for d in range(p - 1)]
    return [(d, (d + 1) % p) for d in range(p)], [((d + 1) % p, d) for d in range(p)]


def tick_plan(tt: Timetable):
    """What the compiled tick runs: (branch codes, (moves, index per tick)). The tick's op
    switch has one branch per code the timetable uses, in code order; its send switch branch 0
    (nothing) and one per move: a (forward pattern, backward pattern) pair of send_patterns'
    (either may be empty), numbered by first use. Read by the runner and by whoever weights the
    compiled step's branches (bench.comm)."""
    fwd_perm, bwd_perm = stage_perms(tt.p, tt.v)
    (fwd, fwd_idx), (bwd, bwd_idx) = send_patterns(tt.recv_x, fwd_perm), send_patterns(tt.recv_g, bwd_perm)
    moves: list[tuple[tuple, tuple]] = []
    index = np.zeros(tt.ticks, np.int32)
    for t, (f, b) in enumerate(zip(fwd_idx, bwd_idx)):
        if f or b:
            move = (fwd[f - 1] if f else (), bwd[b - 1] if b else ())
            if move not in moves:
                moves.append(move)
            index[t] = moves.index(move) + 1
    return sorted(set(np.unique(tt.code).tolist())), (moves, index)


def file_patterns(tt: Timetable) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """(filings, index [tick, device]): the distinct sets of rings a device files into on a tick
    ("x": a received stage input, "g": a received cotangent, "r": its forward's residuals, "y":
    the last stage's output, "w": what Bx keeps for W), the rings the schedule has only."""
    puts = {"x": tt.recv_x, "g": tt.recv_g}
    if not tt.recompute:
        puts.update(r=tt.r_put, y=tt.y_put)
    if tt.schedule in SPLIT:
        puts["w"] = tt.w_put
    names = list(puts)
    masks = np.stack([puts[n] >= 0 for n in names], -1)  # [tick, device, ring]
    filings = sorted({tuple(n for n, on in zip(names, row) if on) for row in masks.reshape(-1, len(names))})
    index = np.zeros(masks.shape[:2], np.int32)
    for j, f in enumerate(filings):
        index[(masks == np.array([n in f for n in names])).all(-1)] = j
    return filings, index


class Slot(NamedTuple):
    """A slot of one of the runner's rings (a list of [slots, ...] buffers: the stage residuals,
    or zb_h1's what-Bx-keeps-for-W), handed whole and read-only into the tick's switch with the
    slot to read, so that only the branches that read it slice it (`read`; W's layer scan slices
    each layer's share of `ring` at `at` itself). Sliced before the switch, the slot was live
    through every branch and copied again as the switch's operand: a slot more at the tick's
    peak. (Passed through the switch and written there in place, zb_h1's ring was copied in every
    branch: XLA's conditional outputs are copies unless no branch reads the operand.)"""

    ring: list
    at: Any

    def read(self) -> list:
        return [jax.lax.dynamic_index_in_dim(b, self.at, keepdims=False) for b in self.ring]


def make_pipeline_grads(model, timetable: Timetable, ctx: nn.Context, prepare_top: Callable,
                        cast_layers: Callable, scatter: Callable, grad_specs: Any, stacked: set[tuple],
                        manual: tuple[str, ...] = (), rows: Callable | None = None) -> Callable:
    """run(params, mbs, loss) -> (losses [1], local grads, sown [1]): the pipelined equivalent
    of summing jax.value_and_grad(loss) over the microbatches `mbs` (the step's batch: every
    field [m, b, ...], tokens [m, b, seq+1]; `mb.rows().apply(model)` runs the model on one), with
    `loss` the step's train.loss.MicrobatchLoss (the same normalisation and sown weighting).

    `prepare_top(state)` casts/gathers the non-layer params, `cast_layers(state)` casts the layer
    stacks that need no per-layer gather to the compute dtype, `scatter(grads, specs)` is the
    per-microbatch gradient hook (the sync's: ZeRO-2), `stacked` the param paths with a `layers` dim,
    `manual` the shard_map's manual axes of size > 1: every tick's carry (accumulators, ring
    buffers) and every branch's zeros vary over them (check_vma), as what fills them does.
    `rows(mb)`: a microbatch's Rows on this device (default mb.rows(): whole sequences).
    """
    rows = rows or (lambda mb: mb.rows())
    tt = timetable
    p, v = tt.p, tt.v
    tables = np.stack([tt.code, tt.mb, tt.chunk, tt.x_slot, tt.g_slot, tt.recv_x, tt.recv_g,
                       tt.r_slot, tt.r_put, tt.y_put, tt.w_slot, tt.w_put], -1)
    n_x, n_g, n_r, n_w = max(tt.n_x_slots, 1), max(tt.n_g_slots, 1), tt.n_r_slots, tt.n_w_slots
    stash = not tt.recompute
    split = tt.schedule in SPLIT  # zb_h1: Bx and W
    flat_specs = flatten(grad_specs)
    # Per tick, the pairs that send: a move index (0: nobody), the same column on every device so
    # that the switch around the ppermutes is uniform.
    used, (moves, move_idx) = tick_plan(tt)
    tables = np.concatenate([tables, np.broadcast_to(move_idx[:, None, None], (tt.ticks, p, 1))], -1)
    # Per tick and device, which rings it files into: one switch over the combinations the
    # timetable uses (file_patterns), not a cond per ring
    filings, file_idx = file_patterns(tt)
    tables = np.concatenate([tables, file_idx[..., None]], -1)

    def run(params, mbs, loss_fn):
        flat = flatten(params)
        top = {k: a for k, a in flat.items() if k not in stacked}
        # The layer stacks in the compute dtype, cast once for the step, outside every tick and
        # vjp: a stage's vjp references them as it does float32 weights (a cast inside it is a
        # residual, a copy of the stage's weights stashed per microbatch in flight), and no
        # tick casts again. Their gradients come back in that dtype (add_chunk casts them to
        # the params').
        cast = flatten(pure_dict(cast_layers(model.state(params))))
        dtypes = {k: flat[k].dtype for k in stacked}
        # the plan stores chunk k*p + d as device d's k-th (Plan.layer_order): the order it runs them
        lay = {k: a.reshape(v, a.shape[0] // v, *a.shape[1:]) for k, a in cast.items() if k in stacked}

        def call(top, lay_k, mb, hook, prep):
            state = model.state(nest({**top, **lay_k}))
            if prep:
                state = prepare_top(state)
            try:
                with nn.use_context(dataclasses.replace(ctx, layers_hook=hook)):
                    return rows(mb).apply(model.merge(state))
            except _Stop as stop:
                return stop.value

        def stop_at_layers(stack, carry, fn):
            raise _Stop(carry)

        def pre(top, lay_k, tok):
            # typed like a received carry (what the model starts its carry with, e.g. the MoE
            # router sums' zeros, varies over nothing), so that the stage's vjp is one function
            return jax.tree.map(lambda a: vary(a, manual), call(top, lay_k, tok, stop_at_layers, True))

        def body(top, lay_k, x, tok):
            def hook(stack, carry, fn):
                raise _Stop(nn.scan_stack(stack, x, fn))
            return call(top, lay_k, tok, hook, False)

        def post(top, lay_k, y, tok):
            with nn.collect_aux() as sown:
                logits = call(top, lay_k, tok, lambda stack, carry, fn: y, True)
            return loss_fn(logits, rows(tok), sown)

        def chunk(k):
            return {n: (a[0] if v == 1 else jax.lax.dynamic_index_in_dim(a, k, keepdims=False))
                    for n, a in lay.items()}

        def add_chunk(acc, g, k):
            # the cast's transpose: what the gradient of a weight cast inside the vjp would be
            g = {n: g[n].astype(dtypes[n]) for n in g}
            g = scatter(g, {n: flat_specs[n] for n in g})
            if v == 1:
                return {n: acc[n].at[0].add(g[n].astype(acc[n].dtype)) for n in acc}
            return {n: jax.lax.dynamic_update_index_in_dim(
                acc[n], jax.lax.dynamic_index_in_dim(acc[n], k, keepdims=False) + g[n].astype(acc[n].dtype),
                k, 0) for n in acc}

        def add_top(acc, g):
            g = scatter(g, {n: flat_specs[n] for n in g})
            return {n: acc[n] + g[n].astype(acc[n].dtype) for n in acc}

        # typed varying over every manual axis whatever `i` is: a tick's index varies over
        # `pipeline`, the shape traces' 0 does not, and the stage's vjp must have one structure
        # (per-row positions computed from it would otherwise be cast per use in one trace and
        # shared in another: a different residual count, residuals.StashPlan.split)
        mb_at = lambda i: jax.tree.map(
            lambda a: vary(jax.lax.dynamic_index_in_dim(a, i, keepdims=False), manual), mbs)
        x_sds = jax.eval_shape(lambda: pre(top, chunk(0), mb_at(0)))
        zeros_x = jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype), manual), x_sds)
        sown_sds = jax.eval_shape(
            lambda: post(top, chunk(0), body(top, chunk(0), zeros_x, mb_at(0)), mb_at(0)))[1][1]
        tree_at = lambda buf, i: jax.tree.map(
            lambda b: jax.lax.dynamic_index_in_dim(b, i, keepdims=False), buf)

        # recompute=false: a stage's vjp, its residuals stashed but for the params it references
        plan = StashPlan()
        layers = LayerSplit()  # split (zb_h1): one vjp per layer, the backward cut in two

        def stage_vjp(lk, x, tok):
            if split:
                def hook(stack, carry, fn):
                    raise _Stop(layers.forward(stack, x, fn, lk, top))
                y, kept = call(top, lk, tok, hook, False)
            else:
                y, fn = jax.vjp(lambda lk, xi: body(top, lk, xi, tok), lk, x)
                kept = plan.split(fn, {"lay": lk, "top": top})
            return y, [vary(a, manual) for a in kept]

        def input_half(r, lk, g):
            """Bx: the stage's input cotangent, and what its W reads."""
            dx, kept = layers.input_half(r, lk, top, g)
            return dx, [vary(a, manual) for a in kept]

        r_sds = jax.eval_shape(lambda: stage_vjp(chunk(0), zeros_x, mb_at(0))[1]) if stash else []
        zeros_r = [vary(jnp.zeros(s.shape, s.dtype), manual) for s in r_sds]
        w_sds = jax.eval_shape(lambda: input_half(zeros_r, chunk(0), zeros_x)[1]) if split else []
        zeros_w = [vary(jnp.zeros(s.shape, s.dtype), manual) for s in w_sds]

        def stage_grads(r, lk, x, g, tok):
            """(layer grads, input cotangent) of a stage's backward."""
            if stash:
                return plan.join(r, {"lay": lk, "top": top})(g)
            _, vjp = jax.vjp(lambda lk, xi: body(top, lk, xi, tok), lk, x)
            return vjp(g)

        # ---- the branches: (acc_top, acc_lay, loss, x_in, g_in, r: Slot, w: Slot, tok, k)
        #      -> (acc_top, acc_lay, loss, y, dx, r_out, w_out)
        def idle(at, al, loss, x, g, r, w, tok, k):
            return at, al, loss, zeros_x, zeros_x, zeros_r, zeros_w

        def forward(lk, x, tok):
            if stash:
                return stage_vjp(lk, x, tok)
            return body(top, lk, x, tok), zeros_r

        def f_first(at, al, loss, x, g, r, w, tok, k):
            lk = chunk(k)
            y, res = forward(lk, pre(top, lk, tok), tok)
            return at, al, loss, y, zeros_x, res, zeros_w

        def f_mid(at, al, loss, x, g, r, w, tok, k):
            y, res = forward(chunk(k), x, tok)
            return at, al, loss, y, zeros_x, res, zeros_w

        def b_first(at, al, loss, x, g, r, w, tok, k):
            lk = chunk(k)
            x0, pre_vjp = jax.vjp(lambda t: pre(t, lk, tok), top)
            dl, dx = stage_grads(r, lk, x0, g, tok)
            (dt,) = pre_vjp(dx)
            return add_top(at, dt), add_chunk(al, dl, k), loss, zeros_x, zeros_x, zeros_r, zeros_w

        def b_mid(at, al, loss, x, g, r, w, tok, k):
            dl, dx = stage_grads(r, chunk(k), x, g, tok)
            return at, add_chunk(al, dl, k), loss, zeros_x, dx, zeros_r, zeros_w

        def seed(val):  # the loss's cotangent, typed as varying as the loss is (check_vma)
            return vary(jnp.ones(val.shape, val.dtype), varying_axes(val))

        def add_loss(loss, aux):  # this microbatch's (loss, sown) into the running sums
            return jax.tree.map(lambda a, b: a + b.astype(a.dtype), loss, aux)

        def head_grads(loss, lk, y, tok):
            """The head and loss's backward from the last stage's kept output: (loss plus this
            microbatch's, top grads, output cotangent)."""
            val, vjp, aux = jax.vjp(lambda t, yi: post(t, lk, yi, tok), top, y, has_aux=True)
            dt, dy = vjp(seed(val))
            return add_loss(loss, aux), dt, jax.tree.map(lambda a: vary(a, manual), dy)

        def b_last_kept(at, al, loss, y, g, r, w, tok, k):
            """The last stage's backward from its kept output and residuals (F last ran)."""
            lk = chunk(k)
            loss, dt, dy = head_grads(loss, lk, y, tok)
            dl, dx = stage_grads(r, lk, None, dy, tok)
            return add_top(at, dt), add_chunk(al, dl, k), loss, zeros_x, dx, zeros_r, zeros_w

        def b_last(at, al, loss, x, g, r, w, tok, k):
            val, vjp, aux = jax.vjp(lambda t, lk, xi: post(t, lk, body(t, lk, xi, tok), tok),
                                    top, chunk(k), x, has_aux=True)
            dt, dl, dx = vjp(seed(val))
            return add_top(at, dt), add_chunk(al, dl, k), add_loss(loss, aux), zeros_x, dx, zeros_r, zeros_w

        # ---- split backward (zb_h1): Bx runs the layers' input-gradient half (split.py), sends
        # the input cotangent and keeps what W reads; W adds the weight gradients from that alone
        def bx_first(at, al, loss, x, g, r, w, tok, k):
            lk = chunk(k)
            _, pre_vjp = jax.vjp(lambda t: pre(t, lk, tok), top)
            dx, w_out = input_half(r, lk, g)
            (dt,) = pre_vjp(dx)
            return add_top(at, dt), al, loss, zeros_x, zeros_x, zeros_r, w_out

        def bx_mid(at, al, loss, x, g, r, w, tok, k):
            dx, w_out = input_half(r, chunk(k), g)
            return at, al, loss, zeros_x, dx, zeros_r, w_out

        def bx_last(at, al, loss, y, g, r, w, tok, k):
            lk = chunk(k)
            loss, dt, dy = head_grads(loss, lk, y, tok)
            dx, w_out = input_half(r, lk, dy)
            return add_top(at, dt), al, loss, zeros_x, dx, zeros_r, w_out

        def w_grads(at, al, loss, x, g, r, w, tok, k):
            lk = chunk(k)
            dl = layers.weight_half(r, w.ring, w.at, lk, top)
            return at, add_chunk(al, dl, k), loss, zeros_x, zeros_x, zeros_r, zeros_w

        def reading(branch):  # a backward slices the residual slot it reads (Slot)
            return lambda at, al, loss, x, g, r, w, tok, k: branch(at, al, loss, x, g, r.read(), w, tok, k)

        branches = {IDLE: idle, F_FIRST: f_first, F_MID: f_mid, B_FIRST: reading(b_first),
                    B_MID: reading(b_mid), B_LAST: reading(b_last_kept) if stash else b_last,
                    F_LAST: f_mid, BX_FIRST: reading(bx_first), BX_MID: reading(bx_mid),
                    BX_LAST: reading(bx_last), W: reading(w_grads)}
        remap = np.zeros(max(branches) + 1, np.int32)
        remap[used] = np.arange(len(used))
        table = jnp.asarray(np.concatenate([remap[tables[..., :1]], tables[..., 1:]], -1))
        fns = [branches[c] for c in used]
        d = jax.lax.axis_index(AXIS)

        def send(y, dx, idx):
            """The tick's forward and backward sends: one switch (one conditional, which XLA:GPU
            syncs the host on), each branch a move of tick_plan's."""
            permute = lambda tree, pairs: (jax.tree.map(lambda a: jax.lax.ppermute(a, AXIS, pairs), tree)
                                           if pairs else zeros_x)
            branches = [lambda y, dx, fw=fw, bw=bw: (permute(y, fw), permute(dx, bw)) for fw, bw in moves]
            return jax.lax.switch(idx, [lambda y, dx: (zeros_x, zeros_x), *branches], y, dx)

        def tick(carry, row):
            at, al, loss, xbuf, gbuf, rbuf, wbuf = carry
            r = row[d]
            code, i, k, xs, gs, rx, rg, rs, rp, yp, ws, wp, mi, fl = (r[j] for j in range(14))
            tok = mb_at(i)
            x_in, g_in = tree_at(xbuf, xs), tree_at(gbuf, gs)
            at, al, loss, y, dx, r_out, w_out = jax.lax.switch(code, fns, at, al, loss, x_in, g_in,
                                                               Slot(rbuf, rs), Slot(wbuf, ws), tok, k)
            x_recv, g_recv = send(y, dx, mi)
            # Each ring is written only where the timetable names a slot, so that no ring needs a
            # spare slot for the ticks that file nothing (until 2026-12-07 the x and g rings had one,
            # the residual ring until earlier that day: a stage stash more on every device). One
            # switch files all of a tick's: XLA:GPU syncs the host on every conditional (it reads
            # the branch index back), and a cond per ring was up to five a tick.
            put = lambda buf, new, i: jax.tree.map(
                lambda b, a: jax.lax.dynamic_update_index_in_dim(b, a, i, 0), buf, new)
            writes = {"x": (0, x_recv, rx), "g": (1, g_recv, rg), "r": (2, r_out, rp), "y": (0, y, yp),
                      "w": (3, w_out, wp)}

            def filing(rings):
                def branch(bufs):
                    bufs = list(bufs)
                    for ring in rings:  # x before y: both file into the x ring
                        at, new, i = writes[ring]
                        bufs[at] = put(bufs[at], new, i)
                    return tuple(bufs)
                return branch
            rings = (xbuf, gbuf, rbuf, wbuf)
            xbuf, gbuf, rbuf, wbuf = jax.lax.switch(fl, [filing(f) for f in filings], rings)
            return (at, al, loss, xbuf, gbuf, rbuf, wbuf), None

        acc_top = jax.eval_shape(lambda: scatter(top, {n: flat_specs[n] for n in top}))
        # microbatch gradients accumulate in float32 whatever the params' dtype (bf16 would
        # round each addition)
        acc_top = {n: jnp.zeros(a.shape, jnp.float32) for n, a in acc_top.items()}
        acc_lay = jax.eval_shape(lambda: scatter({n: a[0] for n, a in lay.items()},
                                                 {n: flat_specs[n] for n in lay}))
        acc_lay = {n: jnp.zeros((v, *a.shape), jnp.float32) for n, a in acc_lay.items()}
        buf = lambda n: jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), x_sds)
        loss0 = (jnp.zeros((), jnp.float32), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sown_sds))
        rbuf = [jnp.zeros((n_r, *s.shape), s.dtype) for s in r_sds]
        wbuf = [jnp.zeros((n_w, *s.shape), s.dtype) for s in w_sds]
        carry = jax.tree.map(lambda a: vary(a, manual),
                             (acc_top, acc_lay, loss0, buf(n_x), buf(n_g), rbuf, wbuf))
        (acc_top, acc_lay, (loss, sown), *_), _ = jax.lax.scan(tick, carry, table)
        acc_lay = {n: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]) for n, a in acc_lay.items()}
        return loss[None], nest({**acc_top, **acc_lay}), jax.tree.map(lambda a: a[None], sown)

    return run
