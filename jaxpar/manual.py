"""Run a function with every mesh axis manual, from inside the step's partly manual shard_map.

The train step's shard_map is manual over the batch axes and leaves the others (tensor, and any
axis of size 1) to the compiler. An op that JAX partitions by `custom_partitioning` (cuDNN
flash attention) fails to compile there: its partitioner cannot read a sharding that is partly
manual (jax 0.12: `assert not hlo_sharding.is_manual()`, or `GSPMDSharding has no attribute
'spec'`). With every axis manual XLA never asks it, so `fully_manual` runs `f` in a nested
shard_map over the axes left. Its gradient is a custom vjp whose residuals stay on the device
that made them: differentiating the nested shard_map directly fails verification (jax 0.12:
its residuals come out with a spec naming an axis the parent already holds manual). And `f`
sees its differentiated arguments typed as varying over the axes left, so that its residuals keep
their type through the round trip (stacked over the axes left, they come back varying over
them, and cuDNN's vjp would return cotangents that shard_map's check_vma rejects); the cast's
transpose sums the cotangents back to the inputs' types, and the result is summed over the
axes of size 1 that `out_spec` does not name (free: no copy to add).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.sharding import entry_axes, vary


def axes_left() -> tuple[str, ...]:
    """The mesh axes the enclosing shard_map leaves to the compiler, in mesh order; () outside any
    shard_map (nothing to do there: the compiler partitions the whole program)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return ()
    return tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)


def fully_manual(f: Callable, args: Sequence[jax.Array], in_specs: Sequence[P], out_spec: P,
                 diff: int | None = None):
    """f(*args) with every mesh axis manual. `in_specs` / `out_spec`: how the axes left split the
    arguments and the result (P(): not at all). `diff`: only the first `diff` arguments are
    differentiated (the rest, e.g. a boolean mask, get no cotangent); default all. Every axis
    left of size > 1 must split the result (`out_spec` names it): the caller picks the dim."""
    left = axes_left()
    if not left:
        return f(*args)
    mesh = jax.sharding.get_abstract_mesh()
    diff = len(args) if diff is None else diff
    own = P(left)  # a residual: each device's own, stacked on a new leading dim
    in_specs, kept = tuple(in_specs), {}
    named = {a for e in out_spec for a in entry_axes(e)}
    unnamed = [a for a in left if a not in named and mesh.shape[a] > 1]
    if unnamed:
        raise ValueError(f"fully_manual: out_spec {out_spec} leaves the mesh axes {unnamed} unsplit")
    ones = tuple(a for a in left if a not in named)

    def varying(*ys):
        out = f(*(vary(y, left) for y in ys[:diff]), *ys[diff:])
        return jax.lax.psum(out, ones) if ones else out

    def nested(fn, ins, outs):
        return jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs, axis_names=frozenset(left))

    @jax.custom_vjp
    def run(*xs):
        return nested(varying, in_specs, out_spec)(*xs)

    def run_fwd(*xs):
        def forward(*ys):
            out, pullback = jax.vjp(lambda *d: varying(*d, *ys[diff:]), *ys[:diff])
            leaves, kept["tree"] = jax.tree.flatten(pullback)
            return out, [leaf[None] for leaf in leaves]
        out, res = nested(forward, in_specs, (out_spec, own))(*xs)
        return out, res

    def run_bwd(res, ct):
        def backward(res_local, ct_local):
            pullback = jax.tree.unflatten(kept["tree"], [leaf[0] for leaf in res_local])
            return tuple(pullback(ct_local))
        grads = nested(backward, (own, out_spec), in_specs[:diff])(res, ct)
        return (*grads, *(None for _ in args[diff:]))

    run.defvjp(run_fwd, run_bwd)
    return run(*args)
