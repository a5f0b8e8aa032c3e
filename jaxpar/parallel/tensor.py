"""Megatron-style tensor parallelism, expressed as logical-axis rules.

Column-parallel weights shard their output dim (`heads`, `kv_heads`, `mlp`, `vocab` -> `tensor`),
row-parallel weights their input dim (`wo`'s heads, `w_down`'s mlp), so each attention/MLP block
needs one reduction of its output. With `sharding.sequence_parallel`, the residual stream between
blocks is sharded over `tensor` along the sequence (`residual_seq`), turning that all-reduce into a
reduce-scatter + all-gather and splitting the norms' work. The compiler inserts the collectives;
this module only pins activations to the plan.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.sharding import Plan, select_axes


def drop_axes(spec: P, axes: frozenset[str] | set[str]) -> P:
    """`spec` without the mesh axes `axes` (the manual ones, inside a shard_map)."""
    return select_axes(spec, lambda a: a not in axes)


def activation_constrainer(plan: Plan, manual: frozenset[str]) -> Callable:
    """constrain(x, logical_axes) for code running inside a shard_map manual over `manual`.

    Only the compiler-managed axes (tensor, ...) are constrained; the manual ones are already
    local to each device.
    """
    auto = [a for a, n in plan.mesh.shape.items() if a not in manual and n > 1]

    def constrain(x: jax.Array, axes) -> jax.Array:
        if len(axes) != x.ndim:
            raise ValueError(f"constrain: axes {axes} do not match an array of rank {x.ndim}")
        spec = drop_axes(plan.spec(tuple(axes), None, use="act", name=f"constrain {tuple(axes)}"), manual)
        if not auto:  # nothing to pin; the names are still checked (a typo fails on every mesh)
            return x
        # the shard_map's own (abstract) mesh, whose manual axes are typed Manual: a value that
        # varies over them (check_vma) cannot be constrained on the all-Auto concrete mesh
        return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), spec))

    return constrain


def activation_spec(plan: Plan, manual: frozenset[str]) -> Callable:
    """spec(logical_axes) -> how the compiler-managed axes split such an activation, inside a
    shard_map manual over `manual` (nn.Context.spec: what an op run with every axis manual lays
    its operands out by)."""
    return lambda axes: drop_axes(plan.spec(tuple(axes), None, use="act"), manual)
