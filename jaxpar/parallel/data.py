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
from jaxpar.platform import current as target_platform
from jaxpar.parallel.sync import GradientSync, flat_paths, key_path
from jaxpar.sharding import ZERO_AXIS, Plan, entry_axes, select_axes

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
    return target_platform() != "cpu"


def _on_wire(collective, x: jax.Array) -> jax.Array:
    """collective(x); a bf16 x on a backend without bf16 collectives goes in float32 (the same
    numbers as XLA:CPU's widening: bf16 inputs summed in float32, the sum rounded to bf16)."""
    if x.dtype != jnp.bfloat16 or native_bf16_collectives():
        return collective(x)
    return collective(x.astype(jnp.float32)).astype(x.dtype)


def reduce_scatter(x: jax.Array, names: tuple[str, ...], dim: int, auto: P = P()) -> jax.Array:
    """The tiled psum_scatter of a gradient in its own dtype (see _on_wire).

    `auto`: how the compiler's axes (those the enclosing shard_map leaves to it: tensor) split x,
    when they do. Then the scatter runs on each device's own block, in a shard_map manual over
    those axes too: XLA's partitioner replicates the operand of a reduce-scatter over a manual
    axis along the compiler's axes first (an all-gather over `tensor` of every gradient, and a
    scatter of twice the bytes: docs/benchmarks.md, issue 11). Each device then holds a part of
    its own block: on a dim that `auto` splits too, the fsdp shard is the minor factor,
    (*auto, fsdp) in the global order, which the shard_map's out_specs (manual axes first)
    cannot say: AllReduce.global_order puts the blocks back, without moving a byte."""
    scatter = lambda y: jax.lax.psum_scatter(y, names, scatter_dimension=dim, tiled=True)
    return _on_wire(on_own_block(scatter, auto), x)


def on_own_block(f, auto: P):
    """f run on each device's own block of the compiler's axes (`auto`: how they split its
    operand and result), in a shard_map manual over them; f itself when they split nothing.
    XLA's partitioner replicates the operand of a collective over a manual axis along the
    compiler's axes first (reduce_scatter, gather_in)."""
    if not any(entry_axes(e) for e in auto):
        return f
    mesh = jax.sharding.get_abstract_mesh()
    # manual over every axis left, not only `auto`'s: with `expert` manual outside, a partly
    # manual nesting fails XLA's sharding check (jax 0.12.0.1, "Manual axes must be sorted by
    # mesh axis index"); a fully manual one compiles
    rest = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    return lambda y: jax.shard_map(f, mesh=mesh, in_specs=auto, out_specs=auto, axis_names=rest)(y)


def compiler_part(spec: P, manual, sizes: dict[str, int]) -> P:
    """The part of `spec` the step's shard_map leaves to the compiler (non-manual axes of size > 1)."""
    return select_axes(spec, lambda a: a not in manual and sizes[a] > 1)


def all_reduce(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """The psum of a gradient in its own dtype (see _on_wire)."""
    return _on_wire(lambda y: jax.lax.psum(y, names), x)


def gather_in(x: jax.Array, dims: list[tuple[int, tuple[str, ...]]], dtype, grad_dtype=None,
              auto: P = P()) -> jax.Array:
    """All-gather a shard in the compute dtype (bf16 on the wire); the backward reduce-scatters
    the gradient in `grad_dtype` (train.grad_reduce_dtype; default the shard's own dtype) and
    hands it back in the shard's dtype. `jaxpar.nn`'s remat policy never saves its output.

    `auto`: how the compiler's axes (tensor) split the param, when they do. Then each device
    gathers, and in the backward scatters, its own block of them (on_own_block): XLA's
    partitioner all-gathered the shard over `tensor` before a gather over the manual fsdp, and
    the gradient before its reduce-scatter (ZeRO-3 at data=2 x fsdp=2 x tensor=2: 4x the
    planner's all-gather bytes, 2x its reduce-scatter; docs/benchmarks.md, issue 11). Not on a
    dim that `auto` and the gather share: the shard_map's local block order differs there."""
    shared = {d for d, _ in dims} & {d for d, e in enumerate(auto) if entry_axes(e)}
    auto = P() if shared else auto

    @jax.custom_vjp
    def gather(y):
        return on_own_block(lambda z: _gather(z, dims), auto)(y.astype(dtype))

    def fwd(y):
        return gather(y), None

    def bwd(_, g):
        g = g.astype(grad_dtype or x.dtype)
        for dim, names in reversed(dims):
            g = reduce_scatter(g, names, dim, auto)
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
    sizes = plan.mesh.shape

    def prepare_leaf(var: nnx.Variable, stacked: bool, cast_only: bool):
        x = var[...]
        dtype = compute_dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        axes = axes_of(var)
        dims, spec = [], P()
        if gather_axes and axes is not None:
            axes = tuple(axes[1:]) if stacked else tuple(axes)
            spec = plan.spec(axes, None, "param")
            dims = sharded_dims(spec, gather_axes)
        if dims:  # the gather casts its shard itself (bf16 on the wire; grads back in grad_dtype)
            auto = compiler_part(spec, manual, sizes)  # each device gathers its own tensor block
            return (var if cast_only
                    else var.replace(checkpoint_name(gather_in(x, dims, dtype, grad_dtype, auto), GATHERED)))
        return var.replace(x.astype(dtype)) if x.dtype != dtype else var

    def prepare(state, stacked: bool, cast_only: bool = False):
        return jax.tree.map(lambda v: prepare_leaf(v, stacked, cast_only), state,
                            is_leaf=lambda v: isinstance(v, nnx.Variable))

    return prepare


def scatter_microbatch_grads(grads, grad_specs, plan: Plan, manual: frozenset[str], dtype=None):
    """ZeRO-2: reduce-scatter each microbatch's gradients over `fsdp` as soon as they exist (in
    `dtype`, train.grad_reduce_dtype, when given). Given whole specs (with the compiler's axes)
    each device scatters its own block (reduce_scatter's `auto`); given their manual part, the
    shard_map's global order."""
    if plan.zero_stage != 2 or ZERO_AXIS not in manual:
        return grads
    sizes = plan.mesh.shape

    def scatter(g, spec):
        g = g if dtype is None else g.astype(dtype)
        for dim, names in sharded_dims(spec, {ZERO_AXIS}):
            g = reduce_scatter(g, names, dim, compiler_part(spec, manual, sizes))
        return g

    return jax.tree.map(scatter, grads, grad_specs)


def reduce_final_grads(grads, grad_specs, manual: frozenset[str], sizes: dict[str, int],
                       out_specs=None, dtype=None):
    """Reduce the accumulated gradients (laid out as `grad_specs`) to `out_specs` (default: the
    same): reduce-scatter the dims `out_specs` shards that are still whole (ZeRO-1 hands the
    optimizer only its shard, so it needs no more bytes than DP), then all-reduce over the batch
    axes left (axes of size 1 move nothing and are skipped). `dtype`: the wire dtype (the
    gradients are cast to it first; default: as they come). Whole specs (with the compiler's
    axes) or their manual part: as scatter_microbatch_grads."""
    def reduce(g, spec, out):
        g = g if dtype is None else g.astype(dtype)
        have = {a for _, names in sharded_dims(spec, manual) for a in names}
        for dim, names in sharded_dims(out, manual):
            todo = tuple(a for a in names if a not in have and sizes[a] > 1)
            if todo:
                g = reduce_scatter(g, todo, dim, compiler_part(out, manual, sizes))
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
    devices only.

    Every reduce-scatter runs on the device's own block of the compiler's axes (reduce_scatter's
    `auto`: the sync passes its whole specs), so a leaf whose fsdp shard shares a dim with
    `tensor` (ZeRO-1/2's w_down: P(('tensor', 'fsdp'))) leaves the shard_map with its blocks in
    the manual-first order, which `global_order` puts back."""

    name = "psum"

    def __init__(self, plan: Plan, grad_specs, opt_specs, wire_dtype=None,
                 layered: frozenset[tuple] = frozenset()):
        super().__init__(plan, grad_specs, opt_specs if plan.zero_stage == 1 else grad_specs, wire_dtype)
        # whole specs, the compiler's axes too: each reduce-scatter runs on the device's block
        self._grad, self._final = flat_paths(self.grad_specs), flat_paths(self.final_specs)
        if plan.mesh.shape.get("pipeline", 1) == 1:
            self.in_scan = self.whole_layers(layered)

    def _whole(self, path, spec: P) -> P:
        """The whole grad spec of the leaf at `path` (a key path, or one key holding it: the
        pipeline's flat dicts), whose manual part `spec` is."""
        path = key_path(path)
        path = path[0] if len(path) == 1 and isinstance(path[0], tuple) else path
        whole = self._grad[path]
        assert self.plan.manual_part(whole, tuple(self.manual)) == spec, (path, whole, spec)
        return whole

    def microbatch(self, grads, specs):
        whole = jax.tree_util.tree_map_with_path(self._whole, specs, is_leaf=lambda x: isinstance(x, P))
        return scatter_microbatch_grads(grads, whole, self.plan, self.manual, self.wire_dtype)

    def scatter_layer(self, g, path):
        return scatter_microbatch_grads(g, layer_spec(self._grad[path]), self.plan, self.manual,
                                        self.wire_dtype)

    def finish_layer(self, g, path, state):
        return reduce_final_grads(g, layer_spec(self._grad[path]), self.manual, self.plan.mesh.shape,
                                  layer_spec(self._final[path]), self.wire_dtype), state

    def reduce(self, grads, comm, extra):
        sizes = self.plan.mesh.shape

        def one(path, g):
            path = key_path(path)
            if path in self.in_scan:  # reduced in the layer scan already
                return g
            return reduce_final_grads(g, self._grad[path], self.manual, sizes, self._final[path],
                                      self.wire_dtype)

        return jax.tree_util.tree_map_with_path(one, grads), comm

    def global_order(self, grads):
        """The reduced gradients as `final_specs` lays them out. On a dim that the compiler's axes
        (A: tensor) and fsdp split together, each device scattered its own block of A: it holds
        block (M, A, fsdp) of the dim (M: the other manual axes there), while the shard_map's
        out_specs read its blocks in the order (M, fsdp, A), manual axes first. Splitting the dim
        into those factors and swapping them back is a relabelling XLA does in place (each
        device keeps its bytes). ZeRO-3's scatters are its gathers' transposes, in the out_specs'
        order already."""
        if self.plan.zero_stage >= 3:
            return grads
        sizes = self.plan.mesh.shape
        manual = lambda a: a in self.manual
        entry = lambda names: None if not names else names[0] if len(names) == 1 else tuple(names)

        def one(path, x):
            label = [tuple(a for a in entry_axes(e) if sizes[a] > 1) for e in self._final[key_path(path)]]
            label = [(*filter(manual, e), *(a for a in e if not manual(a))) for e in label]
            for d, e in enumerate(label):
                if ZERO_AXIS not in e or all(map(manual, e)):
                    continue
                held = (*(a for a in e if manual(a) and a != ZERO_AXIS), *(a for a in e if not manual(a)),
                        ZERO_AXIS)
                shape = x.shape
                split = lambda order: self.plan.sharding(
                    P(*map(entry, label[:d]), *order, None, *map(entry, label[d + 1:])))
                x = x.reshape(*shape[:d], *(sizes[a] for a in e), -1, *shape[d + 1:])
                x = jax.lax.with_sharding_constraint(x, split(e))
                x = jnp.moveaxis(x, [d + e.index(a) for a in held], list(range(d, d + len(e))))
                x = jax.lax.with_sharding_constraint(x, split(held))
                x = x.reshape(shape)
                label[d] = held
            return x

        return jax.tree_util.tree_map_with_path(one, grads)
