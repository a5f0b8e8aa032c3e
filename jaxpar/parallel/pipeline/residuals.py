"""A stage's vjp as arrays a pipeline tick can stash and a later tick can call again.

`jax.vjp` returns a pytree whose leaves are the residuals. Leaves that are the very arrays the
backward tick has anyway (the stage's layer params, the replicated top params) are not stashed
but referenced by name, so a stage in flight holds its activations, not another copy of its
weights. Tracing is deterministic, so the plan made in one trace holds in every trace of the
same stage function (checked: `split` raises if a trace's references disagree)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend.core import Literal

from jaxpar.sharding import vary, varying_axes


def bind_lenient(eqn, args: list) -> list:
    """`eqn` applied to `args` (its outputs, as a list). A stashed residual can come back more
    varying than the forward typed it (out of a ring buffer whose slot depends on the stage):
    - the vjp's pvary on it is then a no-op, which jax >= 0.12.1 refuses to bind, so it is cast
      only over the axes still missing (jaxpar.sharding.vary);
    - an operation that took it beside a value the forward typed alike (both invariant) now sees
      two types: the others are cast to the union, as tracing would have cast them had the
      residual been that varying then (zb_h1's W half beside the all_gather context strategy
      under a remat policy). Collectives (an axis name in their params) are bound as they are."""
    with eqn.ctx.manager:
        if eqn.primitive.name == "pvary":
            return [vary(args[0], eqn.params["axes"])]
        ans = eqn.primitive.bind(*_alike(eqn, args), **eqn.primitive.get_bind_params(eqn.params))
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _alike(eqn, args: list) -> list:
    """`args` (traced values and the jaxpr's literals) all varying over the union of their axes
    (bind_lenient)."""
    if len(args) < 2 or "axis_name" in eqn.params or "axes" in eqn.params:
        return args
    axes = [varying_axes(a) for a in args]
    union = frozenset().union(*axes)
    if all(a == union for a in axes):
        return args
    return [a if x == union else vary(a, tuple(sorted(union))) for a, x in zip(args, axes)]


def replay(closed, args: list) -> list:
    """The outputs of `closed` (a ClosedJaxpr) on `args`, each equation bound leniently."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, bind_lenient(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]


@dataclass
class StashPlan:
    """How one stage's vjp splits: its treedef, and per leaf either None (stashed) or a
    (group, name) reference into the arrays passed to `join`."""

    treedef: Any = None
    refs: tuple = ()
    avals: tuple = ()  # every leaf's type as the forward made it
    _programs: dict = field(default_factory=dict)  # `program`'s traces, by cotangent type

    def split(self, vjp_fn, known: dict[str, dict]) -> list:
        leaves, treedef = jax.tree.flatten(vjp_fn)
        where = {id(a): (group, name) for group, arrays in known.items() for name, a in arrays.items()}
        refs = tuple(where.get(id(a)) for a in leaves)
        # Each trace has its own (equal but not identical) linear jaxpr in the treedef: any one
        # of them can take the residuals of another trace.
        if self.treedef is None:
            self.treedef, self.refs = treedef, refs
            self.avals = tuple(jax.typeof(a) for a in leaves)
        elif refs != self.refs or treedef.num_leaves != self.treedef.num_leaves:
            raise RuntimeError("a pipeline stage's vjp changed structure between traces (an input typed "
                               "differently in different traces gives it residuals JAX counts "
                               "differently: runner.mb_at types every microbatch alike); run it with "
                               "pipeline.recompute=true")
        return [a for a, r in zip(leaves, refs) if r is None]

    def program(self, g):
        """(ClosedJaxpr, output treedef) of the stage's vjp applied to a cotangent like `g`,
        traced on the leaves as the forward typed them (the stashed ones may come back more
        varying); traced once per cotangent type."""
        key = tuple(jax.typeof(a) for a in jax.tree.leaves(g))
        if key not in self._programs:
            fn = lambda leaves, g: jax.tree.unflatten(self.treedef, leaves)(g)
            closed, out = jax.make_jaxpr(fn, return_shape=True)(list(self.avals), g)
            self._programs[key] = closed, jax.tree.structure(out)
        return self._programs[key]

    def join(self, kept: list, known: dict[str, dict]):
        """The stage's vjp again, from the stashed leaves `kept` and the `known` arrays: its
        `program`, replayed on them (`replay`)."""
        it = iter(kept)
        leaves = [next(it) if r is None else known[r[0]][r[1]] for r in self.refs]

        def vjp(g):
            closed, out_tree = self.program(g)
            return jax.tree.unflatten(out_tree, replay(closed, leaves + jax.tree.leaves(g)))
        return vjp
