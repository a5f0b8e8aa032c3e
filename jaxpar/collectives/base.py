"""The common interface of the gradient compressors, and the collectives they run over a Group.

A compressor turns a float32 bucket (rows x columns; a row is what one device sends to one peer)
into a *payload* (a dict of arrays: what crosses the wire) and back:

    payload = comp.compress(x)          # x: [rows, C] float32, C a multiple of comp.multiple
    y       = comp.decompress(payload)  # [rows, C] float32, y ~ x

and sums a bucket over the devices of a Group inside `shard_map`:

    total, state = comp.reduce(x, state, group)   # x: [L] (this device's), total: [L] (the sum)

Quantising compressors (int8, onebit) run the reduction as reduce-scatter + all-gather built from
an all-to-all of the compressed chunks, a local dequantise-and-sum of the chunk this device owns,
a requantise and an all-gather of the compressed chunks: what crosses the wire is compressed both
ways. With error feedback, what a quantiser drops is kept (per device) and added back the next
step: `worker` for what this device sent, `server` for the chunk it requantised. Over any number
of steps, sum(outputs) + sum over devices(worker + server) == sum(true inputs) (up to float
rounding): nothing is lost, only delayed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.sharding import vary, varying_axes

Payload = dict[str, jax.Array]


@dataclass(frozen=True)
class Group:
    """The devices a collective runs over: named mesh axes, optionally restricted to index groups
    of one axis (e.g. the across-host part of `data`: devices with the same in-host index)."""

    axes: tuple[str, ...]
    size: int
    index_groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def name(self):
        return self.axes[0] if len(self.axes) == 1 else self.axes

    @property
    def _groups(self):
        return None if self.index_groups is None else [list(g) for g in self.index_groups]

    def describe(self) -> str:
        s = "+".join(self.axes)
        return f"{s}[{self.size} of {len(self.index_groups[0]) * len(self.index_groups)}]" \
            if self.index_groups else s

    def psum(self, x):
        return jax.lax.psum(x, self.name, axis_index_groups=self._groups)

    def psum_scatter(self, x):
        return jax.lax.psum_scatter(x, self.name, scatter_dimension=0, axis_index_groups=self._groups,
                                    tiled=True)

    def all_to_all(self, x):
        """x: [size * k, ...]; block j goes to member j; row block i of the result came from member i."""
        return jax.lax.all_to_all(x, self.name, 0, 0, axis_index_groups=self._groups, tiled=True)

    @property
    def checkable(self) -> bool:
        """Whether shard_map's replication check (check_vma) can follow this group's collectives:
        not over axis_index_groups (see `unchecked`)."""
        return self.index_groups is None

    def all_gather(self, x):
        if not self.axes:  # a group of one: nothing to gather
            return x
        if self.checkable:  # every member receives the same array: typed as replicated over it
            return jax.lax.all_gather(x, self.name, axis=0, tiled=True, to="invarying")
        return jax.lax.all_gather(x, self.name, axis=0, axis_index_groups=self._groups, tiled=True)


def unchecked(fn, *args, replicated: tuple[str, ...]):
    """fn(*args) -> (total, state) for a reduction whose collectives run over axis_index_groups
    (gradient_compression.scope: dcn, which splits `data` into in-host and across-host groups),
    where JAX cannot check replication: it types a grouped all_gather's output as still varying
    over the whole axis, and has no grouped psum under the check at all (NotImplementedError).
    The exemption is this call alone: `fn` runs in a nested shard_map with check_vma=False (which
    moves no data and types every output as replicated), and its outputs are typed again by hand:
    `total` as replicated over `replicated` -- the caller's reduction sums over those axes'
    groups and then gathers over the rest of each axis, so every device holds the same total --
    and varying over the others; `state` (error-feedback residuals: per device) as varying over
    all of them. The nested shard_map also goes manual over one mesh axis of size 1 that is not
    manual yet: jax 0.12.1 refuses a shard_map with no new axis to go manual over, and a size-1
    axis splits nothing."""
    axes = frozenset().union(*map(varying_axes, jax.tree.leaves(args)))
    if not axes:
        return fn(*args)
    mesh = jax.sharding.get_abstract_mesh()
    spare = [a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] == 1]
    if not spare:
        raise ValueError(
            "gradient_compression.scope=dcn needs one mesh axis of size 1 outside the step's manual "
            f"axes (mesh {dict(mesh.shape)}, manual {sorted(mesh.manual_axes)}): set mesh.tensor, "
            "mesh.pipeline or mesh.context to 1, or gradient_compression.scope=all")
    total, state = jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(),
                                 axis_names=set(axes) | {spare[0]}, check_vma=False)(*args)
    keep = tuple(sorted(axes - set(replicated)))
    return jax.tree.map(lambda x: vary(x, keep), total), jax.tree.map(lambda x: vary(x, sorted(axes)), state)


class Compressor:
    """Base class: subclasses set `name` and implement compress/decompress (and maybe reduce)."""

    name = "base"
    #: keeps error-feedback residuals in the train state (state["comm"])
    error_feedback = False
    #: the bucket's column count (per row) must be a multiple of this
    multiple = 1
    #: reduce() honours `gather` (a reduce-scatter: each member keeps its own chunks of the sum)
    scatters = True

    #: a slice of a gradient (one layer's) can be reduced alone, with residuals of its own shape:
    #: GradientReducer reduces it inside the backward layer scan (not PowerSGD: its Q)
    per_slice = True

    def __init__(self, cfg: Any = None):
        self.cfg = cfg

    # ------------------------------------------------------------------ per-bucket interface
    def compress(self, x: jax.Array) -> Payload:
        raise NotImplementedError

    def decompress(self, payload: Payload) -> jax.Array:
        raise NotImplementedError

    def state_shapes(self, length: int, n: int) -> dict[str, tuple[int, ...]]:
        """Per-device residual shapes for a bucket of `length` elements reduced over n devices."""
        return {}

    def reduce(self, x: jax.Array, state: dict, group: Group,
               gather: Group | None = None) -> tuple[jax.Array, dict]:
        """Sum of x over group (x: [L] with L a multiple of group.size * multiple). With `gather`
        (a part of group's axes; `scatters` compressors only), the chunks of the sum that the
        members of this device's `gather` group own, in their order (ZeRO-1)."""
        return two_stage_reduce(self, x, state, group, gather)

    def payload_bytes(self, rows: int, cols: int) -> float:
        """Bytes of compress() of a [rows, cols] bucket (cols a multiple of `multiple`): every
        method's payload is per row and affine in the columns (values, per-block scales or
        picks, a per-row scale), so two traced sizes give every other (the planner asks for
        many)."""
        if getattr(self, "_unit", None) is None:
            m = max(self.multiple, 8)
            size = lambda k: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(
                jax.eval_shape(self.compress, jax.ShapeDtypeStruct((1, k * m), jnp.float32))))
            one = size(1)
            self._unit = (m, one, size(2) - one)
        m, one, per_unit = self._unit
        return rows * (one + (cols / m - 1) * per_unit)

    def wire_bytes_per_element(self) -> float:
        """Bytes of payload per gradient element (one compression), for docs and checks."""
        x = jnp.zeros((1, max(self.multiple, 8) * 32), jnp.float32)
        p = jax.eval_shape(self.compress, x)
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(p)) / x.size


def two_stage_reduce(comp: Compressor, x: jax.Array, state: dict, group: Group, gather: Group | None = None):
    """Compressed all-to-all (the reduce-scatter), local sum of this device's chunk, recompressed
    all-gather (over `gather` when given). With comp.error_feedback, residuals `worker` ([L]) and
    `server` ([L / n])."""
    n = group.size
    ef = comp.error_feedback
    v = x + state["worker"] if ef else x
    rows = v.reshape(n, -1)
    payload = comp.compress(rows)
    new = {}
    if ef:
        new["worker"] = v - comp.decompress(payload).reshape(-1)
    received = jax.tree.map(group.all_to_all, payload)       # row i: my chunk, from member i
    chunk = comp.decompress(received).sum(0, keepdims=True)   # [1, C] float32
    if ef:
        chunk = chunk + state["server"][None]
    payload2 = comp.compress(chunk)
    if ef:
        new["server"] = (chunk - comp.decompress(payload2))[0]
    gathered = jax.tree.map((gather or group).all_gather, payload2)  # [n, ...]: every member's chunk
    return comp.decompress(gathered).reshape(-1), new


def ef_state_shapes(length: int, n: int) -> dict[str, tuple[int, ...]]:
    return {"worker": (length,), "server": (length // n,)}


def blocks(x: jax.Array, block: int) -> jax.Array:
    """[rows, C] -> [rows, C / block, block]."""
    return x.reshape(x.shape[0], x.shape[1] // block, block)
