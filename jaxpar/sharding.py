"""Logical axis names -> mesh PartitionSpecs, and what each ZeRO stage shards over `fsdp`.

The model names its dims (`embed`, `heads`, `mlp`, ...); a rules table maps each name to mesh axes.
The same parameter gets a different spec depending on what it is used for:
  - params:     `fsdp` kept only at ZeRO-3,
  - opt state:  `fsdp` kept from ZeRO-1,
  - gradients:  `fsdp` kept from ZeRO-2 (reduce-scattered, not all-reduced);
below ZeRO-3 the gradient and optimizer shards take `fsdp` on the outermost dim of each device's
block that it divides, as the minor factor where another axis splits that dim too (contiguous
blocks: Plan._zero_outermost), ZeRO-3 on the dim the rules name.
The plan is data you can print (`Plan.table`). It also says in which order the `layers` dim is
stored (`layer_rounds`, see `Plan.layer_order`): the pipeline's interleaved schedule wants each
device's layers in the order it runs them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.config import ConfigError

Use = Literal["param", "opt", "grad", "act"]
ZERO_AXIS = "fsdp"


def path_name(path) -> str:
    """'layers/wq' for a pytree key path (how errors name a param)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


@dataclass(frozen=True)
class Plan:
    """The sharding plan: mesh + logical rules + ZeRO stage."""

    mesh: Mesh
    rules: dict[str, tuple[str, ...]]
    zero_stage: int = 1
    replicated_tolerance: float = 0.05
    manual: frozenset[str] = field(default_factory=frozenset)
    #: how the `layers` dim is stored over its mesh axis: 1, contiguous blocks (the model's
    #: order); v > 1, v chunks per device round-robin (pipeline.virtual_stages, see layer_order)
    layer_rounds: int = 1
    _spec_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # cached: a Plan is frozen, and the planner's search asks each of these hundreds of
    # thousands of times
    @functools.cached_property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.rules.get("batch", ()) if a in self.mesh.shape)

    @functools.cached_property
    def batch_size_divisor(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def means_to_shard(self, axes: tuple[str | None, ...]) -> bool:
        """Whether the plan means to shard a parameter with these logical axes (so leaving it
        whole is a mistake the replication check reports). ZeRO-3 over fsdp and tensor
        parallelism split every weight; a pipeline splits the layer stacks (logical axis
        `layers`: the embedding, head and final norm stay on every stage), expert parallelism the
        experts (`expert`: attention and the router are replicated over the expert axis, as in
        every expert-parallel design). By the logical names, not the rules: a rule emptied by
        mistake must not make its params look meant to be whole."""
        shape = self.mesh.shape
        if (self.zero_stage >= 3 and shape.get(ZERO_AXIS, 1) > 1) or shape.get("tensor", 1) > 1:
            return True
        return ((shape.get("pipeline", 1) > 1 and "layers" in axes)
                or (shape.get("expert", 1) > 1 and "expert" in axes))

    def _keeps(self, use: Use) -> bool:
        """Whether `fsdp` sharding of a parameter dim is kept for this use."""
        return {"param": 3, "grad": 2, "opt": 1, "act": 0}[use] <= self.zero_stage

    def spec(self, axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None,
             use: Use = "param", name: str = "") -> P:
        """The PartitionSpec of an array whose dims are named `axes` (memoized per plan: it is
        frozen, and the planner asks for the same specs again for every option on a mesh)."""
        key = (tuple(axes), None if shape is None else tuple(shape), use)
        if key not in self._spec_memo:
            self._spec_memo[key] = self._spec(axes, shape, use, name)
        return self._spec_memo[key]

    def _spec(self, axes, shape, use: Use, name: str) -> P:
        used: set[str] = set()
        out = []
        for i, logical in enumerate(axes):
            if logical is not None and logical not in self.rules:
                raise ConfigError(
                    f"{name or 'array'}: dim {i} is named {logical!r}, which no sharding rule knows "
                    f"(a typo would leave the dim replicated); known logical axes: "
                    f"{', '.join(sorted(self.rules))}; a new name needs a rule, e.g. "
                    f"sharding.rules.{logical}=[] (replicated) or =[tensor]")
            mesh_axes = []
            for a in self.rules.get(logical, ()) if logical else ():
                if use != "act" and a == ZERO_AXIS and not self._keeps(use):
                    continue
                if self.mesh.shape.get(a, 1) == 1 or a in used:
                    continue
                mesh_axes.append(a)
            if shape is not None and mesh_axes:
                n = math.prod(self.mesh.shape[a] for a in mesh_axes)
                if shape[i] % n:
                    raise ConfigError(
                        f"{name or 'array'}: dim {i} ({logical!r}) has size {shape[i]}, not divisible "
                        f"by mesh axes {'x'.join(mesh_axes)} = {n}; change the model size or the mesh"
                    )
            used.update(mesh_axes)
            out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
        if use in ("grad", "opt") and self.zero_stage < 3 and shape is not None:
            out = self._zero_outermost(axes, shape, out)
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    def _zero_outermost(self, axes, shape, out: list) -> list:
        """ZeRO-1/2's gradient and optimizer shards over `fsdp` on the outermost dim of each
        device's block that fsdp divides (not `layers`: the layer scan slices it). Below ZeRO-3
        the params are whole over fsdp, so any dim gives the same bytes; the outermost makes the
        reduce-scatter, the shard's update and the all-gather back contiguous blocks, where the
        rules' dim (`embed`, the last of w_down and wo) has XLA transpose each gradient around a
        strided collective: on XLA:CPU 3x the time of the same reduce-scatter over dim 0
        (docs/benchmarks.md, overhead). A dim another mesh axis splits (w_down's `mlp` over
        `tensor`) takes fsdp as the minor factor, P(('tensor', 'fsdp')): each device's fsdp
        shard is a contiguous part of its own tensor block (its `mlp / tensor` rows), which the
        gradient sync scatters locally (parallel/data.AllReduce). ZeRO-3 keeps the rules' dim:
        there the params are sharded for the compute, and their gradients follow them."""
        sizes = self.mesh.shape
        n = sizes.get(ZERO_AXIS, 1)
        at = [i for i, e in enumerate(out) if ZERO_AXIS in entry_axes(e)]
        if n == 1 or not at:
            return out
        entry = lambda names: None if not names else names[0] if len(names) == 1 else tuple(names)
        out = list(out)
        rest = tuple(a for a in entry_axes(out[at[0]]) if a != ZERO_AXIS)
        for i, (logical, size) in enumerate(zip(axes, shape)):
            others = rest if i == at[0] else entry_axes(out[i])
            if i == at[0] or (logical != "layers" and (size // math.prod(sizes[a] for a in others)) % n == 0):
                out[at[0]] = entry(rest)
                out[i] = entry((*others, ZERO_AXIS))
                break
        return out

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def tree_specs(self, axes_tree, shapes_tree, use: Use):
        """Specs for a pytree of params given matching trees of logical axes and shapes."""
        return jax.tree_util.tree_map_with_path(
            lambda path, ax, sh: self.spec(ax, sh.shape, use, name=path_name(path)),
            axes_tree, shapes_tree, is_leaf=lambda x: isinstance(x, tuple),
        )

    def batch_spec(self) -> P:
        return P(self.batch_axes or None)

    def manual_part(self, spec: P, manual: tuple[str, ...]) -> P:
        """Keep only the manual axes of a spec (shard_map in/out specs)."""
        return select_axes(spec, lambda a: a in manual)

    # ---- the stored order of the layer stacks

    def __post_init__(self) -> None:
        split = [a for a in self.rules.get("layers", ()) if self.mesh.shape.get(a, 1) > 1]
        if len(split) > 1 and self.layer_rounds > 1:
            raise ConfigError(
                f"sharding.rules.layers={list(self.rules['layers'])} splits the layer stack over "
                f"{len(split)} mesh axes; pipeline.virtual_stages={self.layer_rounds} stores it "
                f"round-robin over one: map `layers` to one mesh axis (pipeline)")

    @property
    def layer_axis(self) -> str | None:
        """The mesh axis (of size > 1) the `layers` dim is split over, or None."""
        return next((a for a in self.rules.get("layers", ()) if self.mesh.shape.get(a, 1) > 1), None)

    @property
    def interleaves_layers(self) -> bool:
        return self.layer_rounds > 1 and self.layer_axis is not None

    def layer_order(self, n_layers: int) -> np.ndarray:
        """Position i of a stored `layers` dim holds the model's layer order[i].

        Canonical (the model's) order is what one device, a checkpoint, an HF export hold. With
        `layer_rounds` v > 1 over p devices the stack is cut into p*v chunks and device d's block
        holds chunks d, p + d, ..., (v-1)p + d: the order interleaved_1f1b runs them (its virtual
        stage k*p + d is device d's k-th), so the train step moves no weights and no gradients
        between devices. Why the stored values are permuted: a NamedSharding cuts a dim into
        contiguous blocks, so no sharding of the canonical [layers, ...] array puts these chunks
        on one device, and reshaping it to [v, p, ...] would change the model's shapes and the
        checkpoint format. The permutation lives here, in the layout: the model names only
        logical axes, the step never asks for the schedule (the runner reads its v chunks off
        the local block). What sees the params outside the step goes through reorder_layers:
        init (the one-device params, reordered), checkpoint save and restore (canonical on disk,
        so any layout, `jaxpar generate` and the HF export read them; the cost is paid at
        checkpoint time only: train/trainer.Trainer.in_order) and the eval step."""
        p = self.mesh.shape[self.layer_axis] if self.interleaves_layers else 1
        v = self.layer_rounds if p > 1 else 1
        if n_layers % (p * v):
            raise ConfigError(f"{n_layers} layers do not split into mesh.{self.layer_axis}={p} x "
                              f"pipeline.virtual_stages={v} chunks")
        return np.arange(n_layers).reshape(v, p, n_layers // (p * v)).transpose(1, 0, 2).reshape(-1)

    def reorder_layers(self, tree: Any, axes: Any, to: Literal["stored", "canonical"], lead: int = 0) -> Any:
        """`tree` (params-shaped: params, gradients, an optimizer moment) with every leaf whose
        logical `axes` start with `layers` taken from canonical to stored order or back (see
        layer_order). Each device's chunks move once, by ppermute over the layer axis (a gather
        would all-gather the whole stack); the other dims keep their sharding. `lead`: dims
        before each leaf's own (local SGD's replica dim). Runs under jit or eagerly; an identity
        without interleaving."""
        if to not in ("stored", "canonical"):
            raise ValueError(f"reorder_layers: to={to!r}; valid: stored, canonical")
        if not self.interleaves_layers:
            return tree
        axis, p, v = self.layer_axis, self.mesh.shape[self.layer_axis], self.layer_rounds
        moves: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (from slot, to slot): device pairs
        for d in range(p):
            for j in range(v):  # chunk c: canonical on device d, slot j; stored on c % p, slot c // p
                c = d * v + j
                if to == "stored":
                    moves.setdefault((j, c // p), []).append((d, c % p))
                else:
                    moves.setdefault((c // p, j), []).append((c % p, d))

        def local(a):
            shape = a.shape
            a = a.reshape(*shape[:lead], v, shape[lead] // v, *shape[lead + 1:])
            out = [None] * v
            for (i, o), pairs in moves.items():
                moved = jax.lax.ppermute(jnp.take(a, i, axis=lead), axis, pairs)
                out[o] = moved if out[o] is None else out[o] + moved
            return jnp.stack(out, axis=lead).reshape(shape)

        spec = P(*(None,) * lead, axis)
        move = jax.shard_map(local, mesh=self.mesh, in_specs=spec, out_specs=spec, axis_names={axis})
        return jax.tree.map(lambda x, ax: move(x) if ax[:1] == ("layers",) else x, tree, axes)


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, one name, or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def select_axes(spec: P, keep: Callable[[str], bool]) -> P:
    """`spec` with only the mesh axes for which keep(axis) holds."""
    def entry(e):
        kept = tuple(a for a in entry_axes(e) if keep(a))
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*(entry(e) for e in spec))


def varying_axes(x) -> frozenset[str]:
    """The manual axes `x` varies over, as shard_map's check_vma types it (empty outside one)."""
    return frozenset(jax.typeof(x).mat.varying)


def vary(x: jax.Array, axes) -> jax.Array:
    """`x` typed as varying over the manual `axes` (shard_map's check_vma), for a value that is
    per-device by construction though JAX cannot infer it (a loop carry's zeros, which each
    device accumulates its own values into). Axes it already varies over are left as they are.
    jax.lax.pcast(to="varying") is in every JAX jaxpar supports (pvary is gone since 0.10)."""
    todo = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, todo, to="varying") if todo else x


def vary_together(tree, *refs):
    """`tree` with every leaf varying over all the axes that any leaf of `tree` or `refs` varies
    over: a loop carry typed as its loop body will return it (a carry's type must not change
    between iterations, and what a body computes from them varies over all of its inputs' axes)."""
    axes = frozenset().union(*map(varying_axes, jax.tree.leaves((tree, refs))))
    return jax.tree.map(lambda x: vary(x, tuple(sorted(axes))), tree)


def check_replication(plan: Plan, named_specs: dict[str, tuple[P, tuple[int, ...], int, tuple]],
                      unnamed: frozenset[str] = frozenset()) -> dict:
    """Fail when more than the tolerance of parameter bytes is replicated against the plan.

    `named_specs` maps a param path to (spec, shape, itemsize, logical axes). A param counts
    against the plan when the plan means to shard it (Plan.means_to_shard) and its spec shards
    none of its dims (no rule reaches it, or its dims do not divide). `unnamed`: the params with
    no logical axis names at all (no rule can reach them; the message says so). The report's
    `replicated_fraction` is every whole param's share (the banner's figure), intended or not.
    """
    total = sum(math.prod(sh) * isz for _, sh, isz, _ in named_specs.values())
    whole = {n: (math.prod(sh) * isz, axes) for n, (s, sh, isz, axes) in named_specs.items()
             if all(e is None for e in s)}
    repl = {n: b for n, (b, axes) in whole.items() if plan.means_to_shard(axes)}
    frac = sum(repl.values()) / max(total, 1)
    whole_bytes = sum(b for b, _ in whole.values())
    report = {"param_bytes": total, "replicated_bytes": whole_bytes,
              "replicated_fraction": whole_bytes / max(total, 1), "unintended_fraction": frac}
    if frac > plan.replicated_tolerance:
        worst = sorted(repl.items(), key=lambda kv: -kv[1])[:5]
        listing = ", ".join(f"{n} ({b / 2**20:.2f} MiB)" for n, b in worst)
        bare = [n for n, _ in worst if n in unnamed]
        how = (f"{', '.join(bare)} {'has' if len(bare) == 1 else 'have'} no logical axis names, so no "
               f"rule can shard {'it' if len(bare) == 1 else 'them'}: create weights with "
               f"jaxpar.nn.param(rngs, shape, axes) (or nnx.Param(..., axes=...)), or" if bare else
               "Shard them with sharding.rules (their logical axes to mesh axes), or")
        raise ConfigError(
            f"{frac:.1%} of parameter bytes are replicated where this layout means to shard them, above "
            f"sharding.replicated_tolerance={plan.replicated_tolerance}; largest: {listing}. {how} "
            f"accept it with sharding.replicated_tolerance={math.ceil(frac * 100) / 100:.2f} (a fraction "
            f"of the bytes, 0-1)"
        )
    return report


def per_device_bytes(arrays) -> int:
    """Bytes one device holds of a pytree of (possibly sharded) arrays or ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(arrays):
        sh = getattr(x, "sharding", None)
        shape = sh.shard_shape(x.shape) if sh is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total
