"""A flax NNX model seen as data: graph, parameter shapes, logical axes; params as a plain dict.

Params travel as nested dicts of arrays (what optax and orbax like best); `apply` rebuilds the
module inside the traced step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
from flax import nnx

from jaxpar.config import ConfigError
from jaxpar.nn import axes_of


def pure_dict(state) -> dict:
    """nnx.State -> nested dict of arrays (across flax versions)."""
    return nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()


def nest(flat: dict[tuple, Any]) -> dict:
    """{(a, b): v} -> {a: {b: v}}."""
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


@dataclass(frozen=True)
class ModelDef:
    graphdef: Any
    abstract: Any          # nnx.State of Variables holding ShapeDtypeStructs (+ metadata)
    axes: dict             # pure dict: path -> tuple of logical names (None entries allowed)
    shapes: dict           # pure dict: path -> jax.ShapeDtypeStruct
    factory: Callable[[nnx.Rngs], nnx.Module]

    @classmethod
    def from_factory(cls, factory: Callable[[nnx.Rngs], nnx.Module]) -> "ModelDef":
        abstract_module = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
        if not isinstance(abstract_module, nnx.Module):
            raise ConfigError(f"the model factory returned {type(abstract_module).__name__}, not an "
                              f"nnx.Module")
        _, _, rest = nnx.split(abstract_module, nnx.Param, ...)
        others = dict(nnx.to_flat_state(rest))
        if others:
            listing = ", ".join(f"{'/'.join(map(str, k))} ({type(v).__name__})"
                                for k, v in list(others.items())[:5])
            raise ConfigError(
                f"the model holds state other than nnx.Param: {listing}"
                + (f" and {len(others) - 5} more" if len(others) > 5 else "")
                + "; jaxpar trains and checkpoints a model's nnx.Param only: keep no RNG streams "
                  "(dropout), batch statistics or counters in it, and create weights with "
                  "jaxpar.nn.param")
        graphdef, abstract = nnx.split(abstract_module, nnx.Param)
        flat = dict(nnx.to_flat_state(abstract))
        axes, shapes = {}, {}
        for path, var in flat.items():
            ax = axes_of(var)
            val = var.get_value() if hasattr(var, "get_value") else var.value
            if ax is None:
                ax = (None,) * len(val.shape)
            if len(ax) != len(val.shape):
                raise ValueError(f"param {'/'.join(map(str, path))}: axes {ax} vs shape {val.shape}")
            axes[path] = tuple(ax)
            shapes[path] = jax.ShapeDtypeStruct(val.shape, val.dtype)
        return cls(graphdef, abstract, nest(axes), nest(shapes), factory)

    @property
    def n_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.shapes))

    def init(self, seed: int) -> dict:
        """Fresh params as a pure dict (call under jit with out_shardings to place them)."""
        module = self.factory(nnx.Rngs(seed))
        return pure_dict(nnx.split(module, nnx.Param)[1])

    def state(self, params: dict):
        """An nnx.State of Variables (with metadata) holding `params`."""
        state = jax.tree.map(lambda v: v, self.abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
        nnx.replace_by_pure_dict(state, params)
        return state

    def merge(self, state) -> nnx.Module:
        return nnx.merge(self.graphdef, state)

    def leaves_with_paths(self, tree: dict):
        return {"/".join(str(k.key) for k in path): leaf
                for path, leaf in jax.tree_util.tree_flatten_with_path(
                    tree, is_leaf=lambda x: isinstance(x, tuple))[0]}
