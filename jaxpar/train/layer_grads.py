"""Layer gradients reduced inside the backward layer scan, as each layer's backward produces them.

The stacked layer params whose reduction the sync runs in the scan (`GradientSync.in_scan`) are
not differentiated themselves. Each layer's slice passes through `tap`, an identity whose
custom vjp hands the layer's gradient, reduced by the sync, to a *sink*: a zeros array of the
reduced gradient's (stacked) shape, scanned beside the params (nn.Context.layer_taps). The
gradient of the step's loss "with respect to the sinks" is then the reduced layer gradient,
built one layer at a time inside the backward loop, where XLA can overlap each layer's
collective with the next layer's backward; the full local gradient of the stack never exists
unless accumulation keeps it.

With several microbatches the microbatches but the last are `scatter`ed (the sync's
per-microbatch part, ZeRO-2's reduce-scatter over fsdp; ZeRO-0/1: nothing) and summed; the last
microbatch's tap adds that sum, layer by layer (scanned beside the sink), to its own scattered
gradient before the rest of the reduction (`finish`): one all-reduce (ZeRO-0/1) per layer per
step, and ZeRO-2 holds only gradient shards. The step uses this with one microbatch only
(train/gradient_sync.make_sync: XLA:CPU gives the last microbatch's activations, outside the
loop, buffers of their own, so accumulation would lose its memory saving).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.sync import GradientSync, flat_paths
from jaxpar.sharding import entry_axes, vary
from jaxpar.train.model import nest


def tap(x: jax.Array, acc, sink: jax.Array, reduce: Callable) -> jax.Array:
    """x, whose cotangent g goes to `sink` as reduce(g, acc) (in the sink's dtype); `acc` (or
    None) rides along for the backward. x and acc get no gradient (they are not differentiated)."""
    @jax.custom_vjp
    def ident(x, acc, sink):
        return x

    def fwd(x, acc, sink):
        return x, acc

    def bwd(acc, g):
        return None, None, reduce(g, acc).astype(sink.dtype)

    ident.defvjp(fwd, bwd)
    return ident(x, acc, sink)


@dataclass(frozen=True)
class Taps:
    """nn.Context.layer_taps: per stack-relative path, (acc or None, sink) stacked over layers."""

    xs: dict
    reducers: dict  # stack-relative path -> reduce(g, acc)

    def apply(self, layer_state, xs):
        items = []
        for path, var in nnx.to_flat_state(layer_state):
            if path in self.reducers:
                acc, sink = xs[path]
                var = var.replace(tap(var[...], acc, sink, self.reducers[path]))
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

    def split(self, params: dict) -> tuple[dict, dict]:
        flat = flat_paths(params, is_leaf=None)
        top = {k: v for k, v in flat.items() if k not in self.sync.in_scan}
        return nest(top), {k: flat[k] for k in self.paths}

    def join(self, top: dict, layers: dict) -> dict:
        return nest({**flat_paths(top, is_leaf=None), **layers})

    def sinks(self, last: bool) -> dict:
        kinds = self.last if last else self.mid
        return {p: vary(jnp.zeros(shape, dtype), axes) for p, (shape, dtype, axes) in kinds.items()}

    def taps(self, sinks: dict, acc: dict | None, last: bool) -> Taps | None:
        if not self.active:
            return None
        sync = self.sync

        def reducer(path):
            if not last:
                return lambda g, _: sync.scatter_layer(g, path)

            def finish(g, acc):
                g = sync.scatter_layer(g, path)
                return sync.finish_layer(g if acc is None else g.astype(acc.dtype) + acc, path)
            return finish

        acc = acc or {}  # keyed like the stack's own state: the path below the stack's attribute
        xs = {p[1:]: (acc.get(p), sinks[p]) for p in self.paths}
        return Taps(xs, {p[1:]: reducer(p) for p in self.paths})

    def zeros_acc(self) -> dict:
        return {p: vary(jnp.zeros(shape, self.accum_dtype), self.varying)
                for p, (shape, _, _) in self.mid.items()}
