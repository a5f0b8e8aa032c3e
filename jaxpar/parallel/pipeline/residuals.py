"""A stage's vjp as arrays a pipeline tick can stash and a later tick can call again.

`jax.vjp` returns a pytree whose leaves are the residuals. Leaves that are the very arrays the
backward tick has anyway (the stage's layer params, the replicated top params) are not stashed
but referenced by name, so a stage in flight holds its activations, not another copy of its
weights. Tracing is deterministic, so the plan made in one trace holds in every trace of the
same stage function (checked: `split` raises if a trace's references disagree)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax


@dataclass
class StashPlan:
    """How one stage's vjp splits: its treedef, and per leaf either None (stashed) or a
    (group, name) reference into the arrays passed to `join`."""

    treedef: Any = None
    refs: tuple = ()

    def split(self, vjp_fn, known: dict[str, dict]) -> list:
        leaves, treedef = jax.tree.flatten(vjp_fn)
        where = {id(a): (group, name) for group, arrays in known.items() for name, a in arrays.items()}
        refs = tuple(where.get(id(a)) for a in leaves)
        # Each trace has its own (equal but not identical) linear jaxpr in the treedef: any one
        # of them can take the residuals of another trace.
        if self.treedef is None:
            self.treedef, self.refs = treedef, refs
        elif refs != self.refs or treedef.num_leaves != self.treedef.num_leaves:
            raise RuntimeError("a pipeline stage's vjp changed structure between traces (a model input "
                               "such as per-row positions gives it residuals JAX counts differently in "
                               "different traces); run it with pipeline.recompute=true")
        return [a for a, r in zip(leaves, refs) if r is None]

    def join(self, kept: list, known: dict[str, dict]):
        it = iter(kept)
        leaves = [next(it) if r is None else known[r[0]][r[1]] for r in self.refs]
        return jax.tree.unflatten(self.treedef, leaves)
