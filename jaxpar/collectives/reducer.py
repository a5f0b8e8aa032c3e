"""The compressed data-parallel gradient reduction of the train step.

Inside the step's shard_map (manual over the batch axes, and pipeline and context where they
split the step) each device holds its local gradients, already reduce-scattered over `fsdp` where
the ZeRO stage shards them. Every gradient still has to be summed over the rest of those axes
("rest": data, fsdp/expert where not sharded, context, and pipeline for the params every stage
holds: embeddings, final norm, head). By default only the batch axes of rest are compressed:
context and pipeline sums run in float32 beside them, like an in-host axis (the data-parallel
traffic is what crosses the slow links; name them in gradient_compression.axes to compress them).
The reducer groups the gradients by their rest axes into flat float32 buckets and, per bucket:

    compressed group X = rest restricted to gradient_compression.axes (default: the batch axes
                         of rest), or, with scope: dcn, the across-host part of `data` only
    outer groups U     = the rest of rest (in-host, fast links): float32

    bucket --psum_scatter over U--> 1/|U| of it --compressed sum over X--> --all_gather over U-->

so the slow link carries compressed bytes and the fast link float32. At ZeRO-1 the optimizer
needs only its fsdp shard of each gradient: such leaves go to "scattered" buckets laid out so that
each device's fsdp shard is what the reduction leaves on it when the last all-gather skips fsdp
(reduce-scatter bytes, as without compression; see `_scattered_layout`). Error-feedback residuals
live in the train state as state["comm"][bucket][name], one row per device (leading axis over
the batch axes, pipeline and context, sharded that way), so they are checkpointed and resumed
with the rest.
PowerSGD works per matrix instead of per bucket; non-matrix gradients are psum'd in float32.
A method that works on any slice (Compressor.per_slice: all but PowerSGD) reduces each layer's
slice of each stacked leaf as a bucket of its own, inside the backward layer scan, its residuals
in state["comm"]["layers"] (see GradientReducer); under a pipeline, whose stages run their layers
in per-tick branches, every bucket is reduced after the timetable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.collectives.base import Compressor, Group, unchecked
from jaxpar.collectives.methods import make_compressor
from jaxpar.collectives.powersgd import PowerSGD, init_q, matrix_split
from jaxpar.config import ConfigError
from jaxpar.parallel.data import layer_spec, reduce_scatter, scatter_microbatch_grads
from jaxpar.parallel.sync import GradientSync, flat_paths, is_spec, key_path
from jaxpar.sharding import ZERO_AXIS, entry_axes, vary, varying_axes


@dataclass
class Bucket:
    key: str
    rest: tuple[str, ...]                 # every axis the gradients are summed over
    leaves: list[int]                     # indices into the flattened gradient tree
    compressed: Group | None              # None: plain float32 psum (the default path)
    outer: list[Group] = field(default_factory=list)
    length: int = 0                       # local elements of all leaves
    padded: int = 0
    matrices: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # powersgd: leaf -> (b, m, n)
    scattered: bool = False               # ZeRO-1: each device keeps its fsdp shard of the sum
    levels: tuple[int, ...] = ()          # scattered: the sizes the reduction splits the bucket into
    fsdp_level: int = 0                   # scattered: which of `levels` is fsdp
    layer: bool = False                   # one layer's slice of one stacked leaf (layers dim dropped)

    @property
    def checkable(self) -> bool:
        """Whether check_vma can follow the bucket's collectives (no axis_index_groups)."""
        return all(g.checkable for g in [self.compressed, *self.outer] if g is not None)


def data_host_groups(mesh, dcn: int) -> tuple[list[list[int]], list[list[int]]]:
    """(in-host groups, across-host groups) of `data` axis indices for `dcn` hosts along data.
    With several processes the hosts are read from the devices; on one process (simulated) the
    across-host part is the major part of the axis, as jax's hybrid meshes lay it out."""
    size = mesh.shape["data"]
    check_dcn_size(size, dcn)
    procs = _data_processes(mesh)
    if len(set(procs)) == dcn and dcn > 1:
        hosts = sorted(set(procs), key=procs.index)
        in_host = [[j for j in range(size) if procs[j] == h] for h in hosts]
    else:
        ici = size // dcn
        in_host = [list(range(h * ici, (h + 1) * ici)) for h in range(dcn)]
    if len({len(g) for g in in_host}) != 1:
        raise ConfigError("gradient_compression scope 'dcn': hosts hold different numbers of data indices")
    across = [list(col) for col in zip(*in_host)]
    return in_host, across


def _data_processes(mesh) -> list[int]:
    """The process of each `data` index (all 0 on a device-less mesh: the planner's)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return [0] * mesh.shape["data"]
    names = list(mesh.axis_names)
    return [np.take(mesh.devices, j, axis=names.index("data")).flat[0].process_index
            for j in range(mesh.shape["data"])]


def check_dcn_size(data: int, dcn: int) -> None:
    if data % dcn:
        raise ConfigError(f"gradient_compression.dcn_size={dcn} does not divide mesh.data={data}: the hosts "
                          f"split `data`; use a dcn_size that divides it (or leave it unset: the number of "
                          f"processes along data)")


def dcn_size_of(mesh, cfg) -> int:
    if cfg.dcn_size is not None:
        return cfg.dcn_size
    return len(set(_data_processes(mesh)))


LAYERS = "layers"  # state["comm"][LAYERS]: the residuals of the in-scan leaves, [devices, layers, ...]


class GradientReducer(GradientSync):
    """The compressed gradient sync (jaxpar/parallel/sync.py), built once per step from the
    config, the plan and the model's gradient specs.

    A method whose reduction of a slice needs that slice alone (`Compressor.per_slice`: bf16,
    fp16, and the block-wise int8, onebit, topk, whose blocks then never span layers) reduces
    the stacked layer params (`layered`, as make_sync picks them for AllReduce) inside the
    backward layer scan, like AllReduce: each layer's slice of each leaf is its own bucket
    (`layer_buckets`), compressed, reduced (its ZeRO-1 shard kept) and decompressed as soon as
    the layer's backward produces it (scatter_layer / finish_layer; jaxpar/train/layer_grads.py);
    the rest (embeddings, norm, head) in buckets after the scan. Error-feedback residuals of an
    in-scan leaf are kept per layer slice (state["comm"]["layers"][leaf], [devices, layers,
    ...]), scanned beside the params and written back through the layer scan's state sinks
    (`layer_state`; the new residuals are a second buffer beside the old ones, +3.7 MB temp for
    int8 on the quickstart model: docs/benchmarks.md). After the scan stay: PowerSGD (Q is
    warm-started from the last step's and orthogonalised across the stacked matrices of a leaf,
    and its factorisation holds the whole stack; per layer it would run one small QR per layer
    and leaf), and any method with
    gradient_compression.warmup_steps (the float32-or-compressed choice reads the step, which the
    backward does not see)."""

    def __init__(self, cfg, plan, model, grad_specs, compressor: Compressor | None = None, wire_dtype=None,
                 layered: frozenset[tuple] = frozenset()):
        sizes = plan.mesh.shape
        if cfg.scope == "dcn" and cfg.dcn_size is not None:  # also where `data` has nothing to compress
            check_dcn_size(sizes.get("data", 1), cfg.dcn_size)
        super().__init__(plan, grad_specs, wire_dtype=wire_dtype)
        self.cfg = cfg
        self.comp = compressor or make_compressor(cfg)
        self.name = self.comp.name
        self.batch_axes = tuple(plan.batch_axes)
        # every axis a gradient may be summed over: the batch axes, and pipeline (the stages' parts of
        # the embeddings, norm and head) and context (partial sums of sequence chunks) where the step
        # is manual over them; the per-device state has one row per device of all of them
        self.sum_axes = (*self.batch_axes, *(a for a in ("pipeline", "context") if a in self.manual))
        self.n_devices = math.prod(sizes[a] for a in self.sum_axes)
        # an axis that splits work but sums no gradient (tensor) has nothing to compress: naming it
        # alone left every reduction in float32 under the method's name
        idle = [a for a in cfg.axes or () if sizes.get(a, 1) > 1 and a not in self.sum_axes]
        if idle:
            raise ConfigError(
                f"gradient_compression.axes={list(cfg.axes)}: no gradient is summed over "
                f"{', '.join(f'{a} (size {sizes[a]})' for a in idle)}, so there is nothing to compress "
                f"there; gradients are summed over: {', '.join(self.sum_axes) or 'no axis'}")
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(grad_specs, is_leaf=is_spec)
        self.paths = [".".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat]
        specs = [s for _, s in flat]
        shapes = jax.tree.leaves(model.shapes)
        self.global_shapes = [sds.shape for sds in shapes]
        axes = jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, tuple))
        self.local_shapes, self.layered, rests = [], [], []
        opt_specs = [plan.spec(ax, sds.shape, "opt") for sds, ax in zip(shapes, axes)]
        self.zero1: list[int | None] = []  # ZeRO-1: the local dim each leaf is scattered on over fsdp
        for spec, sds, ax, opt in zip(specs, shapes, axes, opt_specs):
            entries = (*spec, *(None,) * (len(sds.shape) - len(spec)))
            local = tuple(d // math.prod(sizes[a] for a in entry_axes(e) if a in self.sum_axes)
                          for d, e in zip(sds.shape, entries))
            self.local_shapes.append(local)
            self.layered.append(bool(ax) and ax[0] == "layers")
            done = {a for e in entries for a in entry_axes(e) if a in self.sum_axes}
            rests.append(tuple(sorted(a for a in self.sum_axes if a not in done and sizes[a] > 1)))
            self.zero1.append(self._zero1_dim(entries, opt, local))
        final = [o if d is not None else s for s, o, d in zip(specs, opt_specs, self.zero1)]
        self.set_final_specs(jax.tree.unflatten(self.treedef, final))
        self._grad_out = flat_paths(self.grad_out)
        keys = [key_path(path) for path, _ in flat]
        if self.comp.per_slice and not cfg.warmup_steps and sizes.get("pipeline", 1) == 1:
            self.in_scan = self.whole_layers(k for k, r in zip(keys, rests) if k in layered and r)
        self.layer_buckets = {k: self._bucket(rests[i], [i], self.zero1[i] is not None, layer=True)
                              for i, k in enumerate(keys) if k in self.in_scan}
        after = [i for i, k in enumerate(keys) if k not in self.in_scan]
        self.buckets: list[Bucket] = []
        for rest, scattered in sorted({(rests[i], self.zero1[i] is not None) for i in after}):
            if not rest:
                continue
            leaves = [i for i in after if rests[i] == rest and (self.zero1[i] is not None) == scattered]
            self.buckets.append(self._bucket(rest, leaves, scattered))
        if isinstance(self.comp, PowerSGD):
            self._check_rank()

    def _check_rank(self) -> None:
        """A PowerSGD rank at which no gradient matrix wins falls back to float32 for every one:
        the run would be uncompressed while describe() says powersgd (one error instead)."""
        mats = []
        for b in self.buckets:
            if b.compressed is None:
                continue
            if b.matrices:
                return
            for i in b.leaves:
                shape = self.local_shapes[i][1:] if self.layered[i] else self.local_shapes[i]
                k = matrix_split(shape)
                if k is not None:
                    mats.append((math.prod(shape[:k]), math.prod(shape[k:])))
        if not mats:  # nothing compressed, or no matrices: norm scales only
            return
        best = max(min(min(m, n), -(-m * n // (m + n))) - 1 for m, n in mats)
        hint = f"use a rank <= {best}" if best >= 1 else "no rank compresses these matrices"
        raise ConfigError(
            f"gradient_compression.rank={self.comp.rank} compresses no gradient matrix: PowerSGD sends "
            f"a m x n gradient as (m + n) * rank floats, which wins only for rank < min(m, n) and "
            f"(m + n) * rank < m * n, so every gradient would be all-reduced in float32; {hint}")

    def _zero1_dim(self, entries, opt: P, local: tuple[int, ...]) -> int | None:
        """The dim a leaf's gradient is reduce-scattered on over fsdp at ZeRO-1 (where its
        optimizer state is sharded on it and nothing else differs), else None."""
        plan, sizes = self.plan, self.plan.mesh.shape
        if plan.zero_stage != 1 or sizes.get(ZERO_AXIS, 1) <= 1 or ZERO_AXIS not in self.batch_axes:
            return None
        opt_entries = (*opt, *(None,) * (len(entries) - len(opt)))
        manual = lambda e: tuple(a for a in entry_axes(e) if a in self.batch_axes)
        dims = [d for d, (g, o) in enumerate(zip(entries, opt_entries)) if manual(g) != manual(o)]
        if len(dims) != 1:
            return None
        d = dims[0]
        ok = manual(opt_entries[d]) == (*manual(entries[d]), ZERO_AXIS) and not manual(entries[d])
        return d if ok and local[d] % sizes[ZERO_AXIS] == 0 else None

    # ------------------------------------------------------------------ layout

    def _groups(self, rest: tuple[str, ...]) -> tuple[Group | None, list[Group]]:
        cfg, sizes = self.cfg, self.plan.mesh.shape
        if cfg.axes is not None:
            bad = [a for a in cfg.axes if a not in sizes]
            if bad:
                raise ConfigError(f"gradient_compression.axes: unknown mesh axes {bad}; valid: {list(sizes)}")
        if cfg.scope == "dcn":
            if "data" not in rest:
                return None, []
            dcn = dcn_size_of(self.plan.mesh, cfg)
            if dcn <= 1:
                return None, []
            in_host, across = data_host_groups(self.plan.mesh, dcn)
            ici = len(in_host[0])
            comp = Group(("data",), dcn, None if ici == 1 else tuple(map(tuple, across)))
            outer = [Group((a,), sizes[a]) for a in rest if a != "data"]
            if ici > 1:
                outer.append(Group(("data",), ici, tuple(map(tuple, in_host))))
            return comp, outer
        want = tuple(a for a in rest if a in (self.batch_axes if cfg.axes is None else cfg.axes))
        if not want:
            return None, []
        other = tuple(a for a in rest if a not in want)
        outer = [Group(other, math.prod(sizes[a] for a in other))] if other else []
        return Group(want, math.prod(sizes[a] for a in want)), outer

    def _shape(self, b: Bucket, i: int) -> tuple[int, ...]:
        """Leaf i's local shape in bucket b (a layer bucket: one layer's)."""
        return self.local_shapes[i][1:] if b.layer else self.local_shapes[i]

    def _dim(self, b: Bucket, i: int) -> int | None:
        """The dim leaf i is scattered on at ZeRO-1 in bucket b (a layer bucket: one layer's)."""
        d = self.zero1[i]
        return None if d is None else d - b.layer

    def _bucket(self, rest, leaves, scattered: bool = False, layer: bool = False) -> Bucket:
        comp, outer = self._groups(rest)
        b = Bucket("+".join(rest) + ("_scattered" if scattered else ""), rest, leaves, comp, outer,
                   scattered=scattered, layer=layer)
        if comp is None:
            return b
        if isinstance(self.comp, PowerSGD):
            for i in leaves:
                shape = self.local_shapes[i]
                batch, mat = (shape[:1], shape[1:]) if self.layered[i] else ((), shape)
                k = matrix_split(mat)
                if k is None:
                    continue
                m, n = math.prod(mat[:k]), math.prod(mat[k:])
                if self.comp.worth_it(m, n):
                    b.matrices[i] = (math.prod(batch), m, n)
            return b
        b.length = sum(math.prod(self._shape(b, i)) for i in leaves)
        if scattered:
            return self._scattered_layout(b)
        mult = math.prod(g.size for g in outer) * comp.size * self.comp.multiple
        b.padded = -(-b.length // mult) * mult
        return b

    def _scattered_layout(self, b: Bucket) -> Bucket:
        """The reduction splits a bucket into blocks, one level per axis it scatters over (the
        outer groups', then the compressed group's), and gathers them back in reverse; a device
        that skips the fsdp gather keeps the blocks with its own fsdp index. So the bucket is laid
        out as [levels..., C] with every leaf's fsdp shard f at index f of the fsdp level:
        what the device with fsdp index f keeps is exactly shard f of every leaf."""
        sizes = self.plan.mesh.shape
        levels: list[tuple[str | None, int]] = []
        for g in [*b.outer, b.compressed]:
            levels += [(None, g.size)] if g.index_groups else [(a, sizes[a]) for a in g.axes]
        b.levels = tuple(s for _, s in levels)
        b.fsdp_level = [a for a, _ in levels].index(ZERO_AXIS)
        others = math.prod(b.levels) // sizes[ZERO_AXIS]
        unit = others * self.comp.multiple
        shard = b.length // sizes[ZERO_AXIS]
        b.padded = -(-shard // unit) * unit * sizes[ZERO_AXIS]
        return b

    # ------------------------------------------------------------------ state

    def _state_shapes(self) -> dict:
        out = {}
        for b in self.buckets:
            if b.compressed is None:
                continue
            if isinstance(self.comp, PowerSGD):
                out[b.key] = {self.paths[i]: {"q": (bb, n, self.comp.rank),
                                              **({"residual": (bb, m, n)}
                                                 if self.comp.error_feedback else {})}
                              for i, (bb, m, n) in b.matrices.items()}
            elif self.comp.error_feedback:
                out[b.key] = self._bucket_state_shapes(b)
        layers = {self.paths[b.leaves[0]]: {k: (self.local_shapes[b.leaves[0]][0], *s)
                                            for k, s in self._bucket_state_shapes(b).items()}
                  for b in self.layer_buckets.values()
                  if b.compressed is not None and self.comp.error_feedback}
        out[LAYERS] = {k: v for k, v in layers.items() if v}
        return {k: v for k, v in out.items() if v}

    def _bucket_state_shapes(self, b: Bucket) -> dict:
        length = b.padded // math.prod(g.size for g in b.outer)
        return self.comp.state_shapes(length, b.compressed.size)

    def comm_shapes(self) -> dict:
        """Per-device shapes of state["comm"] (its leaves without the leading device axis):
        {bucket: {name: shape}}, the in-scan layers' under LAYERS."""
        return self._state_shapes()

    @property
    def stateful(self) -> bool:
        return bool(self._state_shapes())

    def comm_specs(self):
        """PartitionSpecs of state["comm"]: a leading axis over the devices (`sum_axes`)."""
        axes = self.sum_axes
        spec = P(axes if len(axes) > 1 else axes[0])
        return jax.tree.map(lambda _: spec, self._state_shapes(), is_leaf=lambda x: isinstance(x, tuple))

    def init_comm(self) -> dict:
        """Zero residuals (and PowerSGD's first Q), one row per device."""
        def make(path, shape):
            if path and getattr(path[-1], "key", None) == "q":
                return self._first_q(self.paths.index(path[-2].key), shape)
            return jnp.zeros((self.n_devices, *shape), jnp.float32)
        return jax.tree_util.tree_map_with_path(make, self._state_shapes(),
                                                is_leaf=lambda x: isinstance(x, tuple))

    def _first_q(self, i: int, shape: tuple[int, ...]) -> jax.Array:
        """PowerSGD's first Q of leaf i, [devices, *shape], the same for every layout: a stack
        split over pipeline stages gives each stage its own layers' slice of the whole stack's Q
        (in the plan's stored order), as one device holding the stack would start."""
        layers = self.global_shapes[i][0] if self.layered[i] else None
        if layers is None or shape[0] == layers:
            return jnp.broadcast_to(init_q(shape[:-2], shape[-2], shape[-1]), (self.n_devices, *shape))
        q = init_q((layers,), shape[-2], shape[-1])[self.plan.layer_order(layers)]
        sizes = self.plan.mesh.shape
        stages = sizes["pipeline"]
        before = math.prod(sizes[a] for a in self.sum_axes[:self.sum_axes.index("pipeline")])
        after = self.n_devices // (before * stages)
        q = jnp.broadcast_to(q.reshape(1, stages, 1, *shape), (before, stages, after, *shape))
        return q.reshape(self.n_devices, *shape)

    # ------------------------------------------------------------------ the reduction

    def extra_inputs(self, state) -> dict:
        """More of the train state the reduction reads (the step, for a float32 warm-up)."""
        return {"step": state["step"]} if self.cfg.warmup_steps else {}

    def extra_specs(self) -> dict:
        return {"step": P()} if self.cfg.warmup_steps else {}

    def microbatch(self, grads, specs):
        """ZeRO-2 reduce-scatters each microbatch's gradients over fsdp, as without compression."""
        return scatter_microbatch_grads(grads, specs, self.plan, self.manual, self.wire_dtype)

    def reduce(self, grads, comm: dict | None, extra: dict | None = None):
        """Inside shard_map: (summed grads, new comm state). comm leaves carry a leading 1.
        During gradient_compression.warmup_steps the reduction is the float32 psum (residuals
        untouched), then the compressed one."""
        if self.cfg.warmup_steps and extra and "step" in extra:
            return jax.lax.cond(extra["step"] >= self.cfg.warmup_steps, _per_device_state(self._compressed),
                                _per_device_state(self._plain), grads, comm)
        return self._compressed(grads, comm)

    def _plain(self, grads, comm):
        leaves = self.treedef.flatten_up_to(grads)
        for b in self.buckets:
            for i in b.leaves:
                leaves[i] = self._psum(leaves[i], self.zero1[i], b.rest)
        return jax.tree.unflatten(self.treedef, leaves), comm

    def _psum(self, g, d: int | None, rest: tuple[str, ...]):
        """g summed over `rest` in float32; reduce-scattered to its shard on dim d (ZeRO-1). A
        layer's gradient tapped in the backward scan comes in the compute dtype: cast first (the
        compressed buckets' packing does the same), or XLA:CPU aborts compiling a bf16 scatter."""
        g = g.astype(jnp.float32)
        if d is None:
            return jax.lax.psum(g, rest)
        g = reduce_scatter(g, (ZERO_AXIS,), d)
        others = tuple(a for a in rest if a != ZERO_AXIS)
        return jax.lax.psum(g, others) if others else g

    def _my_shard(self, g, i: int):
        """This device's fsdp shard of a whole (summed) ZeRO-1 leaf."""
        d = self.zero1[i]
        if d is None:
            return g
        n = g.shape[d] // self.plan.mesh.shape[ZERO_AXIS]
        return jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(ZERO_AXIS) * n, n, axis=d)

    def _compressed(self, grads, comm: dict | None):
        comm = jax.tree.map(lambda x: x[0], comm or {})
        leaves = self.treedef.flatten_up_to(grads)
        out = list(leaves)
        new_comm = {}
        for b in self.buckets:
            if isinstance(self.comp, PowerSGD) and b.compressed is not None:
                st = self._reduce_powersgd(b, leaves, out, comm.get(b.key, {}))
                if st:  # a bucket of norm scales only has no state
                    new_comm[b.key] = st
                continue
            pieces, st = self._reduce_bucket(b, leaves, comm.get(b.key, {}))
            if st:
                new_comm[b.key] = st
            for i, piece in zip(b.leaves, pieces):
                out[i] = piece
        if LAYERS in comm:  # updated in the layer scan already
            new_comm[LAYERS] = comm[LAYERS]
        new_comm = jax.tree.map(lambda x: x[None], new_comm)
        return jax.tree.unflatten(self.treedef, out), new_comm

    def _reduce_bucket(self, b: Bucket, leaves, st: dict) -> tuple[list, dict]:
        """(bucket b's leaves summed, in b.leaves' order; the new state). `leaves`: indexable by
        leaf index (the flattened gradients, or one layer's slice of one leaf)."""
        if b.compressed is None:
            return [self._psum(leaves[i], self._dim(b, i), b.rest) for i in b.leaves], {}
        flat = self._pack_scattered(b, leaves) if b.scattered else self._pack(b, leaves)
        reduce = lambda flat, st: self._reduce_flat(b, flat, st)
        kept = tuple(a for a in b.rest if not (b.scattered and a == ZERO_AXIS))  # summed, replicated
        flat, st = reduce(flat, st) if b.checkable else unchecked(reduce, flat, st, replicated=kept)
        pieces = self._unpack(b, flat, leaves)
        return [piece.astype(leaves[i].dtype) for i, piece in zip(b.leaves, pieces)], st

    def scatter_layer(self, g, path):
        """ZeRO-2's reduce-scatter of one layer's gradient over fsdp, as `microbatch` does."""
        return scatter_microbatch_grads(g, layer_spec(self._grad_out[path]), self.plan, self.manual,
                                        self.wire_dtype)

    def finish_layer(self, g, path, state):
        """One layer's gradient of a stacked leaf, reduced alone as its own bucket, with its own
        slice of the leaf's residuals."""
        b = self.layer_buckets[path]
        (out,), state = self._reduce_bucket(b, {b.leaves[0]: g}, state)
        return out, state

    def layer_state(self, comm):
        by_name = {self.paths[b.leaves[0]]: p for p, b in self.layer_buckets.items()}
        return {by_name[k]: jax.tree.map(lambda x: x[0], st) for k, st in comm.get(LAYERS, {}).items()}

    def with_layer_state(self, comm, state):
        if LAYERS not in self._state_shapes():
            return comm
        layers = {self.paths[self.layer_buckets[p].leaves[0]]: jax.tree.map(lambda x: x[None], st)
                  for p, st in state.items() if st}
        return {**comm, LAYERS: layers}

    def _pack(self, b: Bucket, leaves):
        flat = jnp.concatenate([leaves[i].reshape(-1).astype(jnp.float32) for i in b.leaves])
        return jnp.pad(flat, (0, b.padded - b.length))

    def _pack_scattered(self, b: Bucket, leaves):
        """The bucket of a ZeRO-1 bucket's leaves in the layout of `_scattered_layout`."""
        f = self.plan.mesh.shape[ZERO_AXIS]
        rows = [jnp.moveaxis(leaves[i], self._dim(b, i), 0).reshape(f, -1).astype(jnp.float32)
                for i in b.leaves]
        shards = jnp.concatenate(rows, axis=1)  # row j: shard j of every leaf
        shards = jnp.pad(shards, ((0, 0), (0, b.padded // f - shards.shape[1])))
        others = [s for j, s in enumerate(b.levels) if j != b.fsdp_level]
        blocks = shards.reshape(f, *others, -1)
        return jnp.moveaxis(blocks, 0, b.fsdp_level).reshape(-1)

    def _unpack(self, b: Bucket, flat, leaves) -> list:
        """The reduced bucket cut back into its leaves (their ZeRO-1 shards for a scattered one)."""
        f = self.plan.mesh.shape[ZERO_AXIS] if b.scattered else 1
        out, off = [], 0
        for i in b.leaves:
            n = math.prod(self._shape(b, i)) // f
            piece = flat[off:off + n]
            off += n
            if not b.scattered:
                out.append(piece.reshape(leaves[i].shape))
                continue
            d = self._dim(b, i)
            moved = jnp.moveaxis(leaves[i], d, 0).shape
            out.append(jnp.moveaxis(piece.reshape(moved[0] // f, *moved[1:]), 0, d))
        return out

    def _reduce_flat(self, b: Bucket, flat, st):
        """A flat bucket summed over b.rest: float32 over the outer groups, compressed over X. A
        scattered bucket skips the fsdp part of the gathers: each device keeps its shard."""
        for g in b.outer:
            flat = g.psum_scatter(flat)
        comp = b.compressed
        if not b.scattered or ZERO_AXIS not in comp.axes:
            flat, st = self.comp.reduce(flat, st, comp)
        elif self.comp.scatters:
            flat, st = self.comp.reduce(flat, st, comp, gather=_without(comp, ZERO_AXIS, self.plan))
        else:  # the whole sum, then this device's blocks of it
            flat, st = self.comp.reduce(flat, st, comp)
            sizes = self.plan.mesh.shape
            blocks = flat.reshape(*(sizes[a] for a in comp.axes), -1)
            flat = jax.lax.dynamic_index_in_dim(blocks, jax.lax.axis_index(ZERO_AXIS),
                                                comp.axes.index(ZERO_AXIS), keepdims=False).reshape(-1)
        for g in reversed(b.outer):
            skip = b.scattered and ZERO_AXIS in g.axes
            flat = (_without(g, ZERO_AXIS, self.plan) if skip else g).all_gather(flat)
        return flat, st

    def _reduce_powersgd(self, b: Bucket, leaves, out, st) -> dict:
        new = {}
        for i in b.leaves:
            g = leaves[i]
            if i not in b.matrices:
                out[i] = self._psum(g, self.zero1[i], b.rest)
                continue
            bb, m, n = b.matrices[i]
            name = self.paths[i]

            def reduce(g, st):
                g = g.reshape(bb, m, n).astype(jnp.float32)
                if b.outer:  # float32 over the outer groups, then the factors over X
                    # The state (one row per device) is the same on every member of an outer
                    # group, but typed as varying over it (check_vma): the residual goes into the
                    # sum in equal parts, and Q is averaged (a tiny [n, rank] all-reduce), or P,
                    # Q and the result would count as varying over the group
                    share = math.prod(grp.size for grp in b.outer)
                    if "residual" in st:
                        g = g + st["residual"] / share
                        st = {**st, "residual": jnp.zeros(g.shape, g.dtype)}
                    for grp in b.outer:
                        g = grp.psum(g)
                        st = {**st, "q": grp.psum(st["q"]) / grp.size}
                return self.comp.reduce_matrix(g, st, b.compressed)
            approx, new[name] = reduce(g, st[name]) if b.checkable else \
                unchecked(reduce, g, st[name], replicated=b.rest)
            out[i] = self._my_shard(approx.reshape(g.shape).astype(g.dtype), i)
        return new

    # ------------------------------------------------------------------ what crosses the wire

    def wire_ops(self) -> list[tuple[str, float, tuple[str, ...], int, float]]:
        """(kind, result bytes on one device, group axes, group size, times per step) of every
        collective the compressed reduction issues (`_reduce_flat`, `_reduce_powersgd`, `_psum`),
        the layer buckets once per layer: what the planner counts (planner/comm.py), checked
        against the compiled HLO (tests/test_planner.py). Without the ZeRO-2/3 scatters and
        gathers over fsdp, which are the plain sync's. Computed once per sync (a planner's search
        asks for each layout's)."""
        if getattr(self, "_wire_ops", None) is None:
            self._wire_ops = self._count_wire_ops()
        return self._wire_ops

    def _count_wire_ops(self) -> list:
        ops: list = []
        payload = self.comp.payload_bytes

        def op(kind, nbytes, group, times=1.0):
            if group is not None and group.size > 1:
                ops.append((kind, float(nbytes), group.axes, group.size, times))

        def psum(i, b, times):
            elems, d = math.prod(self._shape(b, i)), self._dim(b, i)
            if d is not None:
                fsdp = Group((ZERO_AXIS,), self.plan.mesh.shape[ZERO_AXIS])
                op("reduce-scatter", 4 * elems / fsdp.size, fsdp, times)
                elems //= fsdp.size
            op("all-reduce", 4 * elems, self._rest_group(b.rest, () if d is None else (ZERO_AXIS,)), times)

        layer_buckets = [(b, self.local_shapes[b.leaves[0]][0]) for b in self.layer_buckets.values()]
        for b, times in [*((b, 1.0) for b in self.buckets), *layer_buckets]:
            if b.compressed is None:
                for i in b.leaves:
                    psum(i, b, times)
                continue
            if isinstance(self.comp, PowerSGD):
                r = self.comp.rank
                for i in b.leaves:
                    if i not in b.matrices:
                        psum(i, b, times)
                        continue
                    bb, m, n = b.matrices[i]
                    for g in b.outer:
                        op("all-reduce", 4 * bb * m * n, g, times)
                        op("all-reduce", 4 * bb * n * r, g, times)
                    op("all-reduce", 4 * bb * m * r, b.compressed, times)
                    op("all-reduce", 4 * bb * n * r, b.compressed, times)
                continue
            length = b.padded
            for g in b.outer:
                length //= g.size
                op("reduce-scatter", 4 * length, g, times)
            x = b.compressed
            gather = _without(x, ZERO_AXIS, self.plan) if b.scattered and ZERO_AXIS in x.axes else x
            if self.comp.scatters:
                op("all-to-all", payload(x.size, length // x.size), x, times)
                op("all-gather", gather.size * payload(1, length // x.size), gather, times)
                length = gather.size * length // x.size
            else:
                op("all-gather", x.size * payload(1, length), x, times)
                length = length if gather is x else length // (x.size // gather.size)
            for g in reversed(b.outer):
                g = _without(g, ZERO_AXIS, self.plan) if b.scattered and ZERO_AXIS in g.axes else g
                length *= g.size
                op("all-gather", 4 * length, g, times)
        return ops

    def _rest_group(self, rest: tuple[str, ...], skip: tuple[str, ...] = ()) -> Group:
        axes = tuple(a for a in rest if a not in skip)
        return Group(axes, math.prod(self.plan.mesh.shape[a] for a in axes))

    def describe(self) -> str:
        parts = []
        layers = {(b.key, b.compressed, tuple(b.outer), b.scattered): b for b in self.layer_buckets.values()}
        for b in [*self.buckets, *layers.values()]:
            key = f"{b.key} per layer in the backward scan" if b.layer else b.key
            if b.compressed is None:
                parts.append(f"{key}: float32 {'reduce-scatter' if b.scattered else 'psum'}")
            else:
                outer = "".join(f" (float32 over {g.describe()})" for g in b.outer)
                parts.append(f"{key}: {self.comp.name} over {b.compressed.describe()}{outer}")
        return "; ".join(parts) or "no reduction"


def _per_device_state(branch):
    """`branch` whose new comm state is typed as varying like the state that came in (one row
    per device): the two branches of the warm-up cond must agree, and PowerSGD's Q, all-reduced
    in the compressed branch, is the same on every device while the warm-up passes it through."""
    def run(grads, comm):
        grads, new = branch(grads, comm)
        return grads, jax.tree.map(lambda n, old: vary(n, tuple(sorted(varying_axes(old)))), new, comm)
    return run


def _without(group: Group, axis: str, plan) -> Group:
    """`group` less one of its axes (maybe none, a gather that moves nothing): where a ZeRO-1
    gather skips fsdp."""
    axes = tuple(a for a in group.axes if a != axis)
    return Group(axes, math.prod(plan.mesh.shape[a] for a in axes))
