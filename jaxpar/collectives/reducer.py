"""The compressed data-parallel gradient reduction of the train step.

Inside the step's shard_map (manual over the batch axes) each device holds its local gradients,
already reduce-scattered over `fsdp` where the ZeRO stage shards them. Every gradient still has
to be summed over the rest of the batch axes ("rest": data, and fsdp/expert where not sharded).
The reducer groups the gradients by their rest axes into flat float32 buckets and, per bucket:

    compressed group X = rest restricted to gradient_compression.axes (default: all of rest),
                         or, with scope: dcn, the across-host part of `data` only
    outer groups U     = the rest of rest (in-host, fast links): float32

    bucket --psum_scatter over U--> 1/|U| of it --compressed sum over X--> --all_gather over U-->

so the slow link carries compressed bytes and the fast link float32. Error-feedback residuals
live in the train state as state["comm"][bucket][name], one row per batch device (leading axis
over the batch axes, sharded that way), so they are checkpointed and resumed with the rest.
PowerSGD works per matrix instead of per bucket; non-matrix gradients are psum'd in float32.
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
from jaxpar.sharding import entry_axes, vary, varying_axes


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

    @property
    def checkable(self) -> bool:
        """Whether check_vma can follow the bucket's collectives (no axis_index_groups)."""
        return all(g.checkable for g in [self.compressed, *self.outer] if g is not None)


def data_host_groups(mesh, dcn: int) -> tuple[list[list[int]], list[list[int]]]:
    """(in-host groups, across-host groups) of `data` axis indices for `dcn` hosts along data.
    With several processes the hosts are read from the devices; on one process (simulated) the
    across-host part is the major part of the axis, as jax's hybrid meshes lay it out."""
    size = mesh.shape["data"]
    if size % dcn:
        raise ConfigError(f"gradient_compression.dcn_size={dcn} does not divide mesh.data={size}")
    names = list(mesh.axis_names)
    procs = [np.take(mesh.devices, j, axis=names.index("data")).flat[0].process_index for j in range(size)]
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


def dcn_size_of(mesh, cfg) -> int:
    if cfg.dcn_size is not None:
        return cfg.dcn_size
    names = list(mesh.axis_names)
    return len({np.take(mesh.devices, j, axis=names.index("data")).flat[0].process_index
                for j in range(mesh.shape["data"])})


class GradientReducer:
    """Built once per step from the config, the plan and the model's gradient specs."""

    def __init__(self, cfg, plan, model, grad_specs, compressor: Compressor | None = None):
        self.cfg = cfg
        self.comp = compressor or make_compressor(cfg)
        self.plan = plan
        sizes = plan.mesh.shape
        if sizes.get("pipeline", 1) > 1:
            raise ConfigError("gradient compression (and 1-bit Adam) with mesh.pipeline > 1 is not supported "
                              "yet; use gradient_compression.method=none with pipeline parallelism")
        self.manual = tuple(plan.batch_axes)
        self.n_devices = math.prod(sizes[a] for a in self.manual)
        is_spec = lambda x: isinstance(x, P)
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(grad_specs, is_leaf=is_spec)
        self.paths = [".".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat]
        specs = [s for _, s in flat]
        shapes = jax.tree.leaves(model.shapes)
        axes = jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, tuple))
        self.local_shapes, self.layered, rests = [], [], []
        for spec, sds, ax in zip(specs, shapes, axes):
            entries = (*spec, *(None,) * (len(sds.shape) - len(spec)))
            local = tuple(d // math.prod(sizes[a] for a in entry_axes(e) if a in self.manual)
                          for d, e in zip(sds.shape, entries))
            self.local_shapes.append(local)
            self.layered.append(bool(ax) and ax[0] == "layers")
            done = {a for e in entries for a in entry_axes(e) if a in self.manual}
            rests.append(tuple(sorted(a for a in self.manual if a not in done and sizes[a] > 1)))
        self.buckets: list[Bucket] = []
        for rest in sorted(set(rests)):
            if not rest:
                continue
            leaves = [i for i, r in enumerate(rests) if r == rest]
            self.buckets.append(self._bucket(rest, leaves))

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
        want = rest if cfg.axes is None else tuple(a for a in rest if a in cfg.axes)
        if not want:
            return None, []
        other = tuple(a for a in rest if a not in want)
        outer = [Group(other, math.prod(sizes[a] for a in other))] if other else []
        return Group(want, math.prod(sizes[a] for a in want)), outer

    def _bucket(self, rest, leaves) -> Bucket:
        comp, outer = self._groups(rest)
        b = Bucket("+".join(rest), rest, leaves, comp, outer)
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
        b.length = sum(math.prod(self.local_shapes[i]) for i in leaves)
        mult = math.prod(g.size for g in outer) * comp.size * self.comp.multiple
        b.padded = -(-b.length // mult) * mult
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
                length = b.padded // math.prod(g.size for g in b.outer)
                out[b.key] = self.comp.state_shapes(length, b.compressed.size)
        return {k: v for k, v in out.items() if v}

    @property
    def stateful(self) -> bool:
        return bool(self._state_shapes())

    def state_specs(self):
        """PartitionSpecs of state["comm"]: a leading axis over the batch devices."""
        spec = P(self.manual if len(self.manual) > 1 else self.manual[0])
        return jax.tree.map(lambda _: spec, self._state_shapes(), is_leaf=lambda x: isinstance(x, tuple))

    def state_shardings(self):
        return jax.tree.map(self.plan.sharding, self.state_specs(), is_leaf=lambda x: isinstance(x, P))

    def init_state(self) -> dict:
        """Zero residuals (and PowerSGD's first Q), one row per batch device."""
        def make(path, shape):
            if path and getattr(path[-1], "key", None) == "q":
                q = init_q(shape[:-2], shape[-2], shape[-1])
                return jnp.broadcast_to(q, (self.n_devices, *shape))
            return jnp.zeros((self.n_devices, *shape), jnp.float32)
        return jax.tree_util.tree_map_with_path(make, self._state_shapes(),
                                                is_leaf=lambda x: isinstance(x, tuple))

    # ------------------------------------------------------------------ the reduction

    def extra_inputs(self, state) -> dict:
        """More of the train state the reduction reads (the step, for a float32 warm-up)."""
        return {"step": state["step"]} if self.cfg.warmup_steps else {}

    def extra_specs(self, grad_out) -> dict:
        return {"step": P()} if self.cfg.warmup_steps else {}

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
                leaves[i] = jax.lax.psum(leaves[i], b.rest)
        return jax.tree.unflatten(self.treedef, leaves), comm

    def _compressed(self, grads, comm: dict | None):
        comm = jax.tree.map(lambda x: x[0], comm or {})
        leaves = self.treedef.flatten_up_to(grads)
        out = list(leaves)
        new_comm = {}
        for b in self.buckets:
            if b.compressed is None:
                for i in b.leaves:
                    out[i] = jax.lax.psum(leaves[i], b.rest)
                continue
            if isinstance(self.comp, PowerSGD):
                st = self._reduce_powersgd(b, leaves, out, comm.get(b.key, {}))
                if st:  # a bucket of norm scales only has no state
                    new_comm[b.key] = st
                continue
            st = comm.get(b.key, {})
            flat = jnp.concatenate([leaves[i].reshape(-1).astype(jnp.float32) for i in b.leaves])
            flat = jnp.pad(flat, (0, b.padded - b.length))
            reduce = lambda flat, st, b=b: self._reduce_flat(b, flat, st)
            flat, st = reduce(flat, st) if b.checkable else unchecked(reduce, flat, st, replicated=b.rest)
            if st:
                new_comm[b.key] = st
            off = 0
            for i in b.leaves:
                n = math.prod(self.local_shapes[i])
                out[i] = flat[off:off + n].reshape(leaves[i].shape).astype(leaves[i].dtype)
                off += n
        new_comm = jax.tree.map(lambda x: x[None], new_comm)
        return jax.tree.unflatten(self.treedef, out), new_comm

    def _reduce_flat(self, b: Bucket, flat, st):
        """A flat bucket summed over b.rest: float32 over the outer groups, compressed over X."""
        for g in b.outer:
            flat = g.psum_scatter(flat)
        flat, st = self.comp.reduce(flat, st, b.compressed)
        for g in reversed(b.outer):
            flat = g.all_gather(flat)
        return flat, st

    def _reduce_powersgd(self, b: Bucket, leaves, out, st) -> dict:
        new = {}
        for i in b.leaves:
            g = leaves[i]
            if i not in b.matrices:
                out[i] = jax.lax.psum(g, b.rest)
                continue
            bb, m, n = b.matrices[i]
            name = self.paths[i]

            def reduce(g, st):
                for grp in b.outer:
                    g = grp.psum(g)
                return self.comp.reduce_matrix(g.reshape(bb, m, n).astype(jnp.float32), st, b.compressed)
            approx, new[name] = reduce(g, st[name]) if b.checkable else \
                unchecked(reduce, g, st[name], replicated=b.rest)
            out[i] = approx.reshape(g.shape).astype(g.dtype)
        return new

    def describe(self) -> str:
        parts = []
        for b in self.buckets:
            if b.compressed is None:
                parts.append(f"{b.key}: float32 psum")
            else:
                outer = "".join(f" (float32 over {g.describe()})" for g in b.outer)
                parts.append(f"{b.key}: {self.comp.name} over {b.compressed.describe()}{outer}")
        return "; ".join(parts) or "no reduction"


def _per_device_state(branch):
    """`branch` whose new comm state is typed as varying like the state that came in (one row
    per device): the two branches of the warm-up cond must agree, and PowerSGD's Q, all-reduced
    in the compressed branch, is the same on every device while the warm-up passes it through."""
    def run(grads, comm):
        grads, new = branch(grads, comm)
        return grads, jax.tree.map(lambda n, old: vary(n, tuple(sorted(varying_axes(old)))), new, comm)
    return run
