"""Data parallelism and ZeRO-1/2/3 over the batch axes, with explicit collectives.

The loss and gradients run inside a `shard_map` that is manual over the batch axes (data, fsdp,
...), so each device sees its own slice of the batch and produces *local* gradients; this module
decides how they are reduced:
  - ZeRO-0/1: accumulate local gradients over microbatches, then one all-reduce (psum; ZeRO-1:
              a reduce-scatter to the optimizer's shard);
  - ZeRO-2:   reduce-scatter each microbatch's gradients over `fsdp` (so the accumulator is
              sharded), then all-reduce the shards over the remaining batch axes;
  - ZeRO-3:   parameters arrive sharded over `fsdp`; each layer's weights are all-gathered just
              before use (again in the backward, under remat), and the transpose of that
              all-gather is the reduce-scatter of their gradients, all-reduced over the rest;
  (for the stacked layer params the reductions run inside the backward layer scan, layer by
  layer: see AllReduce and jaxpar/train/layer_grads.py)
Plain GSPMD would all-reduce and then slice; here the bytes on the wire match the ZeRO paper.
`AllReduce` is this module's gradient sync (jaxpar/parallel/sync.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax.ad_checkpoint import checkpoint_name

from jaxpar.nn import axes_of
from jaxpar.parallel.sync import GradientSync, flat_paths, key_path
from jaxpar.sharding import ZERO_AXIS, Plan, entry_axes

GATHERED = "jaxpar_zero3_gathered"


def sharded_dims(spec: P, axes: set[str] | frozenset[str]) -> list[tuple[int, tuple[str, ...]]]:
    """[(dim, mesh axes)] for the dims of `spec` that use any of `axes`."""
    out = []
    for i, entry in enumerate(spec):
        hit = tuple(a for a in entry_axes(entry) if a in axes)
        if hit:
            out.append((i, hit))
    return out


def _gather(x: jax.Array, dims: list[tuple[int, tuple[str, ...]]]) -> jax.Array:
    for dim, names in dims:
        x = jax.lax.all_gather(x, names, axis=dim, tiled=True)
    return x


def native_bf16_collectives() -> bool:
    """Whether the backend reduces bf16 natively. XLA:CPU does not: it widens bf16 collectives
    to float32, aborts on a bf16 reduce-scatter and (jax 0.12.0.1) crashes promoting some bf16
    all-reduces of the train step (AllReducePromotion: "Invalid binary instruction opcode copy")."""
    return jax.default_backend() != "cpu"


def _on_wire(collective, x: jax.Array) -> jax.Array:
    """collective(x); a bf16 x on a backend without bf16 collectives goes in float32 (the same
    numbers as XLA:CPU's widening: bf16 inputs summed in float32, the sum rounded to bf16)."""
    if x.dtype != jnp.bfloat16 or native_bf16_collectives():
        return collective(x)
    return collective(x.astype(jnp.float32)).astype(x.dtype)


def reduce_scatter(x: jax.Array, names: tuple[str, ...], dim: int) -> jax.Array:
    """The tiled psum_scatter of a gradient in its own dtype (see _on_wire)."""
    return _on_wire(lambda y: jax.lax.psum_scatter(y, names, scatter_dimension=dim, tiled=True), x)


def all_reduce(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """The psum of a gradient in its own dtype (see _on_wire)."""
    return _on_wire(lambda y: jax.lax.psum(y, names), x)


def gather_in(x: jax.Array, dims: list[tuple[int, tuple[str, ...]]], dtype, grad_dtype=None) -> jax.Array:
    """All-gather a shard in the compute dtype (bf16 on the wire); the backward reduce-scatters
    the gradient in `grad_dtype` (train.grad_reduce_dtype; default the shard's own dtype) and
    hands it back in the shard's dtype. `jaxpar.nn`'s remat policy never saves its output."""
    @jax.custom_vjp
    def gather(y):
        return _gather(y.astype(dtype), dims)

    def fwd(y):
        return gather(y), None

    def bwd(_, g):
        g = g.astype(grad_dtype or x.dtype)
        for dim, names in reversed(dims):
            g = reduce_scatter(g, names, dim)
        return (g.astype(x.dtype),)

    gather.defvjp(fwd, bwd)
    return gather(x)


def param_preparer(plan: Plan, manual: frozenset[str], compute_dtype, grad_dtype=None) -> callable:
    """Returns prepare(state, stacked, cast_only=False) -> state: cast each param to the compute
    dtype and, at ZeRO-3, all-gather its `fsdp` shards. The gathered weights are named GATHERED,
    which the layer scan's remat policy never saves: the backward gathers again instead of
    keeping whole weights alive (ZeRO-3's 2 gathers + 1 reduce-scatter per layer).

    `cast_only` (the stacked layer params, before the layer scan): cast what needs no gather and
    leave the rest for the scan. Casting the whole stack once, outside the scan, is what a plain
    jit does; per layer inside it, the backward converts and transposes each layer's gradient in
    float32 (twice the bytes) and the forward carries the float32 stack through the loop.
    `grad_dtype`: the dtype of ZeRO-3's gradient reduce-scatter (see gather_in).
    """
    gather_axes = {ZERO_AXIS} & manual if plan.zero_stage >= 3 else set()

    def prepare_leaf(var: nnx.Variable, stacked: bool, cast_only: bool):
        x = var[...]
        dtype = compute_dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        axes = axes_of(var)
        dims = []
        if gather_axes and axes is not None:
            axes = tuple(axes[1:]) if stacked else tuple(axes)
            dims = sharded_dims(plan.spec(axes, None, "param"), gather_axes)
        if dims:  # the gather casts its shard itself (bf16 on the wire; grads back in grad_dtype)
            return (var if cast_only
                    else var.replace(checkpoint_name(gather_in(x, dims, dtype, grad_dtype), GATHERED)))
        return var.replace(x.astype(dtype)) if x.dtype != dtype else var

    def prepare(state, stacked: bool, cast_only: bool = False):
        return jax.tree.map(lambda v: prepare_leaf(v, stacked, cast_only), state,
                            is_leaf=lambda v: isinstance(v, nnx.Variable))

    return prepare


def scatter_microbatch_grads(grads, grad_specs, plan: Plan, manual: frozenset[str], dtype=None):
    """ZeRO-2: reduce-scatter each microbatch's gradients over `fsdp` as soon as they exist (in
    `dtype`, train.grad_reduce_dtype, when given)."""
    if plan.zero_stage != 2 or ZERO_AXIS not in manual:
        return grads

    def scatter(g, spec):
        g = g if dtype is None else g.astype(dtype)
        for dim, names in sharded_dims(spec, {ZERO_AXIS}):
            g = reduce_scatter(g, names, dim)
        return g

    return jax.tree.map(scatter, grads, grad_specs)


def reduce_final_grads(grads, grad_specs, manual: frozenset[str], sizes: dict[str, int],
                       out_specs=None, dtype=None):
    """Reduce the accumulated gradients (laid out as `grad_specs`) to `out_specs` (default: the
    same): reduce-scatter the dims `out_specs` shards that are still whole (ZeRO-1 hands the
    optimizer only its shard, so it needs no more bytes than DP), then all-reduce over the batch
    axes left (axes of size 1 move nothing and are skipped). `dtype`: the wire dtype (the
    gradients are cast to it first; default: as they come)."""
    def reduce(g, spec, out):
        g = g if dtype is None else g.astype(dtype)
        have = {a for _, names in sharded_dims(spec, manual) for a in names}
        for dim, names in sharded_dims(out, manual):
            todo = tuple(a for a in names if a not in have and sizes[a] > 1)
            if todo:
                g = reduce_scatter(g, todo, dim)
        done = {a for _, names in sharded_dims(out, manual) for a in names}
        rest = tuple(sorted(a for a in manual if a not in done and sizes[a] > 1))
        return all_reduce(g, rest) if rest else g

    return jax.tree.map(reduce, grads, grad_specs, grad_specs if out_specs is None else out_specs,
                        is_leaf=lambda x: isinstance(x, P))


def layer_spec(spec: P) -> P:
    """The spec of one layer of a stacked param (its leading layers dim dropped)."""
    return P(*spec[1:])


class AllReduce(GradientSync):
    """Plain data parallelism and ZeRO: every microbatch's gradients reduce-scattered over fsdp
    at ZeRO-2; the accumulated gradients reduce-scattered to the optimizer's shard at ZeRO-1 (no
    more bytes than DP, half an all-reduce's), all-reduced over the batch axes left.

    Without a pipeline the stacked layer params (`layered`: their key paths) are reduced that
    way inside the backward layer scan, one layer at a time, as soon as the backward of the
    layer has produced its gradient (`in_scan`; jaxpar/train/layer_grads.py), so the collectives
    of layer i overlap the backward of layer i-1. At ZeRO-3 the transpose of a layer's gather
    (gather_in) has reduce-scattered its gradient over fsdp already: scatter_layer leaves it and
    finish_layer all-reduces it over the axes left (data). The embeddings, final norm and head
    are reduced after the scan. A pipeline (parallel/pipeline) reduces after its timetable: its
    stages run their layers in per-tick branches, where a per-layer collective would run on some
    devices only."""

    name = "psum"

    def __init__(self, plan: Plan, grad_specs, opt_specs, wire_dtype=None,
                 layered: frozenset[tuple] = frozenset()):
        super().__init__(plan, grad_specs, opt_specs if plan.zero_stage == 1 else grad_specs, wire_dtype)
        self._grad_out, self._final_out = flat_paths(self.grad_out), flat_paths(self.final_out)
        if plan.mesh.shape.get("pipeline", 1) == 1:
            self.in_scan = self.whole_layers(layered)

    def microbatch(self, grads, specs):
        return scatter_microbatch_grads(grads, specs, self.plan, self.manual, self.wire_dtype)

    def scatter_layer(self, g, path):
        return scatter_microbatch_grads(g, layer_spec(self._grad_out[path]), self.plan, self.manual,
                                        self.wire_dtype)

    def finish_layer(self, g, path, state):
        return reduce_final_grads(g, layer_spec(self._grad_out[path]), self.manual, self.plan.mesh.shape,
                                  layer_spec(self._final_out[path]), self.wire_dtype), state

    def reduce(self, grads, comm, extra):
        sizes = self.plan.mesh.shape

        def one(path, g):
            path = key_path(path)
            if path in self.in_scan:  # reduced in the layer scan already
                return g
            return reduce_final_grads(g, self._grad_out[path], self.manual, sizes, self._final_out[path],
                                      self.wire_dtype)

        return jax.tree_util.tree_map_with_path(one, grads), comm
