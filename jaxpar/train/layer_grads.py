"""Layer gradients reduced inside the backward layer scan, as each layer's backward produces them.

The stacked layer params whose reduction the sync runs in the scan (`GradientSync.in_scan`) are
not differentiated themselves. Each layer's slice passes through `tap`, an identity whose
custom vjp hands the layer's gradient, reduced by the sync, to a *sink*: a zeros array of the
reduced gradient's (stacked) shape, scanned beside the params (nn.Context.layer_taps). The
gradient of the step's loss "with respect to the sinks" is then the reduced layer gradient,
built one layer at a time inside the backward loop, where XLA can overlap each layer's
collective with the next layer's backward; the full local gradient of the stack never exists
unless accumulation keeps it. The tap sits on the slice as the scan hands it over, before any
per-layer gather (nn.Context.layer_params): at ZeRO-3 its cotangent is the gather's transpose,
the layer's gradient reduce-scattered over fsdp, which the sync then all-reduces over `data`.

With several microbatches every microbatch runs inside the microbatch loop, with two sinks per
stack: the *mid* sink takes the sync's per-microbatch part (`scatter_layer`: ZeRO-2's
reduce-scatter over fsdp; ZeRO-0/1: nothing), summed over the microbatches in the loop's carry;
on the last microbatch (a traced flag: a `lax.cond` in the tap's backward) the *last* sink takes
instead the layer's scattered gradient plus that sum, reduced the rest of the way
(`finish_layer`): one all-reduce (ZeRO-0/1) per layer per step, inside the last backward, and
ZeRO-2 holds only gradient shards. (Running the last microbatch after the loop instead gave its
activations buffers of their own on XLA:CPU: accumulation lost its memory saving.)

A sync that keeps state per layer (`GradientSync.layer_state`: the compressed reductions'
error-feedback residuals of each layer's slice) has it scanned beside the params like `acc`, and
the new state goes out the same way as the reduced gradient: as the cotangent of a third sink of
the state's shape (zeros before the last microbatch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.sync import GradientSync, flat_paths
from jaxpar.sharding import entry_axes, vary, varying_axes
from jaxpar.train.model import nest


def _zeros_like(aval: tuple) -> jax.Array:
    shape, dtype, axes = aval
    return vary(jnp.zeros(shape, dtype), axes)


def _aval(x: jax.Array) -> tuple:
    return x.shape, x.dtype, tuple(sorted(varying_axes(x)))


def tap(x: jax.Array, acc, state: dict, sinks: tuple, is_last, reducers: tuple, scale=None) -> jax.Array:
    """x, whose cotangent g goes to the sinks (mid, last, state): on the last microbatch
    (`is_last`) (last, state) <- finish(g, acc, state) and mid gets zeros, before it
    mid <- scatter(g) and last and state get zeros. With one microbatch `mid` is None and
    `is_last` True. `acc` (or None) and `state` (the sync's layer state, maybe {}) ride along for
    the backward; x, acc and state get no gradient (they are not differentiated). `scale`
    (train.loss_scale, or None): g is the gradient of the scaled loss, divided by it in float32
    before the sync reads it (its state, e.g. error feedback, then never holds scaled values)."""
    mid, last, st_sinks = sinks
    scatter, finish = reducers
    mid_aval, last_aval = (None if mid is None else _aval(mid)), _aval(last)
    st_avals = jax.tree.map(_aval, st_sinks)
    as_state = lambda x, aval: vary(x.astype(aval[1]), aval[2])  # per device: typed as its sink

    @jax.custom_vjp
    def ident(x, acc, state, sinks, is_last, scale):
        return x

    def fwd(x, acc, state, sinks, is_last, scale):
        return x, (acc, state, is_last, scale)

    def bwd(res, g):
        acc, state, is_last, scale = res
        if scale is not None:
            g = g.astype(jnp.float32) / scale

        def to_last(g, acc, state):
            g, state = finish(g, acc, state)
            return g.astype(last_aval[1]), jax.tree.map(as_state, state, st_avals)

        if mid_aval is None:
            g, state = to_last(g, acc, state)
            return None, None, None, (None, g, state), None, None
        zeros_st = lambda: jax.tree.map(_zeros_like, st_avals, is_leaf=lambda a: isinstance(a, tuple))
        cts = jax.lax.cond(is_last,
                           lambda g, acc, state: (_zeros_like(mid_aval), *to_last(g, acc, state)),
                           lambda g, acc, state: (scatter(g).astype(mid_aval[1]), _zeros_like(last_aval),
                                                  zeros_st()),
                           g, acc, state)
        return None, None, None, cts, None, None

    ident.defvjp(fwd, bwd)
    return ident(x, acc, state, sinks, is_last, scale)


@dataclass(frozen=True)
class Taps:
    """nn.Context.layer_taps: per stack-relative path, (acc or None, the sync's layer state
    ({} if none), (mid sink or None, last sink, state sinks)) stacked over layers; `is_last`:
    whether this is the step's last microbatch."""

    xs: dict
    reducers: dict  # stack-relative path -> (scatter(g), finish(g, acc, state) -> (g, state))
    is_last: Any = True
    scale: Any = None  # train.loss_scale's factor (see tap)

    def apply(self, layer_state, xs):
        items = []
        for path, var in nnx.to_flat_state(layer_state):
            if path in self.reducers:
                acc, state, sinks = xs[path]
                var = var.replace(tap(var[...], acc, state, sinks, self.is_last, self.reducers[path],
                                      self.scale))
            items.append((path, var))
        return nnx.from_flat_state(items)


def _local(shape: tuple[int, ...], spec: P, manual, sizes) -> tuple[int, ...]:
    entries = (*spec, *(None,) * (len(shape) - len(spec)))
    return tuple(d // math.prod(sizes[a] for a in entry_axes(e) if a in manual)
                 for d, e in zip(shape, entries))


def _axes(spec: P, manual, sizes) -> tuple[str, ...]:
    return tuple(sorted({a for e in spec for a in entry_axes(e) if a in manual and sizes[a] > 1}))


class LayerGrads:
    """The split of the params into the differentiated rest ("top": embeddings, norm, head) and
    the in-scan layer stacks, and the sinks and taps of one microbatch's backward."""

    def __init__(self, sync: GradientSync, shapes: dict, varying: tuple[str, ...], accum_dtype):
        self.sync, self.varying, self.accum_dtype = sync, varying, accum_dtype
        self.paths = sorted(sync.in_scan)
        self.active = bool(self.paths)
        stacks = {p[0] for p in self.paths}
        if len(stacks) > 1:  # nn.scan_layers runs one stack: its params share one attribute
            raise ValueError(f"in-scan layer gradients need one layer stack, got {sorted(stacks)}")
        sizes, manual = sync.plan.mesh.shape, sync.manual
        flat_shapes = flat_paths(shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
        grad_out, final_out = flat_paths(sync.grad_out), flat_paths(sync.final_out)
        wire = sync.wire_dtype or jnp.float32
        # (shape, dtype, varying axes) of each sink: before the last microbatch the scattered
        # gradient (varying over every manual axis: a per-device partial sum), at the last the
        # reduced one (varying over the axes its final layout shards it on)
        self.mid = {p: (_local(flat_shapes[p].shape, grad_out[p], manual, sizes), accum_dtype, varying)
                    for p in self.paths}
        self.last = {p: (_local(flat_shapes[p].shape, final_out[p], manual, sizes), wire,
                         _axes(final_out[p], manual, sizes)) for p in self.paths}
        top_specs = {k: v for k, v in flat_paths(sync.grad_out).items() if k not in sync.in_scan}
        self.top_specs = nest(top_specs)
        # the sync's per-layer state (its avals: per device, varying over every manual axis)
        state = jax.eval_shape(sync.layer_state, jax.eval_shape(sync.init_comm))
        self.state = {p: {k: (v.shape, v.dtype, varying) for k, v in state.get(p, {}).items()}
                      for p in self.paths}

    def split(self, params: dict) -> tuple[dict, dict]:
        flat = flat_paths(params, is_leaf=None)
        top = {k: v for k, v in flat.items() if k not in self.sync.in_scan}
        return nest(top), {k: flat[k] for k in self.paths}

    def join(self, top: dict, layers: dict) -> dict:
        return nest({**flat_paths(top, is_leaf=None), **layers})

    def sinks(self, accumulating: bool) -> dict:
        """Per path (mid sink, last sink, state sinks): zeros to differentiate; no mid sink for
        one microbatch."""
        return {p: (_zeros_like(self.mid[p]) if accumulating else None, _zeros_like(self.last[p]),
                    self._zeros_state(p)) for p in self.paths}

    def _zeros_state(self, p) -> dict:
        return {k: _zeros_like(aval) for k, aval in self.state[p].items()}

    def taps(self, sinks: dict, acc: dict | None, is_last, state: dict, scale=None) -> Taps | None:
        """`state`: the sync's layer_state of this step (read on the last microbatch); `scale`:
        the loss scale the layer gradients are divided by in the taps (see tap)."""
        if not self.active:
            return None
        sync = self.sync

        def reducers(path):
            def finish(g, acc, state):
                g = sync.scatter_layer(g, path)
                return sync.finish_layer(g if acc is None else g.astype(acc.dtype) + acc, path, state)
            return (lambda g: sync.scatter_layer(g, path)), finish

        acc = acc or {}  # keyed like the stack's own state: the path below the stack's attribute
        xs = {p[1:]: (acc.get(p), state.get(p, {}), sinks[p]) for p in self.paths}
        return Taps(xs, {p[1:]: reducers(p) for p in self.paths}, is_last, scale)

    def zeros_acc(self) -> dict:
        """The loop carry's sum of the mid sinks (the scattered gradients before the last)."""
        return {p: _zeros_like(aval) for p, aval in self.mid.items()}

    def zeros_done(self) -> dict:
        """The loop carry that receives the last sinks' reduced gradients and the new layer
        state (zeros until then)."""
        return {p: (_zeros_like(aval), self._zeros_state(p)) for p, aval in self.last.items()}
