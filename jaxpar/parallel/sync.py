"""The gradient-sync interface: how the per-device gradients of the step's shard_map become what
the optimizer receives, and how the optimizer's step is applied to the train state.

One protocol, four implementations (each readable alone):
  AllReduce          parallel/data.py          psum; ZeRO-1 reduce-scatters to the optimizer
                                               shard, ZeRO-2 each microbatch over fsdp
  GradientReducer    collectives/reducer.py    compressed reductions (every registered method),
                                               error-feedback residuals in state["comm"]
  OneBitAdamReducer  collectives/onebit_adam.py  1-bit Adam's momentum exchange
  LocalSGD           collectives/local_sgd.py  replicas that step alone, state["local"]

The step (train/step.py) asks the sync for its state, the shard_map's specs, the per-microbatch
hook and the final reduction, and never asks which one it got. The defaults here are what a
stateless sync over one set of params needs; a sync overrides what it changes.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import optax
from jax.sharding import PartitionSpec as P

from jaxpar.sharding import Plan, entry_axes

is_spec = lambda x: isinstance(x, P)


def key_path(path) -> tuple:
    """A jax tree path as a tuple of dict keys: ("layers", "wq")."""
    return tuple(getattr(k, "key", k) for k in path)


def flat_paths(tree, is_leaf=is_spec) -> dict[tuple, Any]:
    """{key path: leaf} of a nested dict (of arrays or PartitionSpecs)."""
    return {key_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def step_manual_axes(plan: Plan) -> frozenset[str]:
    """The axes the step's shard_map is manual over: the batch axes, `pipeline` when staged and
    `context` when sequences are split (jaxpar/parallel/context.py): each device's gradient is
    then a partial sum that the reductions add up over `context` like over a batch axis."""
    extra = {a for a in ("pipeline", "context") if plan.mesh.shape.get(a, 1) > 1}
    return frozenset(plan.batch_axes) | extra


class GradientSync:
    """Base class of the gradient syncs (see the module doc). `wire_dtype`: what the default
    reductions send (train.grad_reduce_dtype); `replicas`: how many optimizer replicas step alone
    (local SGD; one gradient is the mean over batch devices / replicas), over `replica_axes`."""

    name = "sync"
    replicas = 1
    replica_axes: tuple[str, ...] = ()
    #: key paths of the stacked layer params whose gradient this sync reduces inside the backward
    #: layer scan, layer by layer (scatter_layer / finish_layer); `reduce` leaves them alone
    in_scan: frozenset[tuple] = frozenset()

    def __init__(self, plan: Plan, grad_specs: Any, final_specs: Any = None, wire_dtype: Any = None):
        self.plan = plan
        self.manual = step_manual_axes(plan)
        self.grad_specs = grad_specs
        self.final_specs = grad_specs if final_specs is None else final_specs
        self.wire_dtype = wire_dtype
        self.grad_out = self._local(grad_specs)  # inside the shard_map
        self.set_final_specs(self.final_specs)

    def _local(self, specs):
        return jax.tree.map(lambda s: self.plan.manual_part(s, tuple(self.manual)), specs, is_leaf=is_spec)

    def set_final_specs(self, specs) -> None:
        """What the optimizer receives, as global specs (`final_specs`) and inside the shard_map
        (`final_out`): e.g. the ZeRO-1 shard of each gradient."""
        self.final_specs, self.final_out = specs, self._local(specs)

    # ------------------------------------------------------------------ state (outside the step)
    def comm_specs(self) -> dict:
        """PartitionSpecs of state["comm"] (per-device reduction state), {} when there is none."""
        return {}

    def init_comm(self) -> dict:
        return {}

    def state_shardings(self, shardings: dict) -> dict:
        """The train state's shardings, given those of step, params and opt_state."""
        comm = self.comm_specs()
        if comm:
            shardings = {**shardings, "comm": jax.tree.map(self.plan.sharding, comm, is_leaf=is_spec)}
        return shardings

    def init_state(self, state: dict, tx: optax.GradientTransformation) -> dict:
        """The fresh train state, given step, params and opt_state."""
        return {**state, "comm": self.init_comm()} if self.comm_specs() else state

    #: dims before a param's own in the optimizer state's params-shaped trees (a replica dim)
    opt_lead = 0

    def reorder_layers(self, state: dict, tx: optax.GradientTransformation, axes, move: Callable) -> dict:
        """`state` with every params-shaped tree's layer stacks moved by move(tree, axes, lead)
        (lead: dims before a param's own): the params and the optimizer state's (`comm` is bound
        to its layout, stored order, and not moved). A sync with params-shaped state of its own
        moves that too."""
        opt = lambda x, ax: move(x, ax, self.opt_lead)
        return {**state, "params": move(state["params"], axes, 0),
                "opt_state": optax.tree_map_params(tx, opt, state["opt_state"], axes)}

    # ------------------------------------------------------------------ the shard_map's layout
    def params_in(self, state: dict):
        return state["params"]

    def param_in_specs(self, specs):
        return specs

    def grads_out_specs(self, specs):
        """The shard_map's out_specs of the reduced gradients (given `final_out`)."""
        return specs

    def grad_shardings(self):
        return jax.tree.map(self.plan.sharding, self.final_specs, is_leaf=is_spec)

    def global_order(self, grads):
        """The reduced gradients out of the shard_map, as the global arrays `final_specs` lay
        out (a sync whose devices reduce blocks the out_specs cannot name puts them back here)."""
        return grads

    def extra_inputs(self, state: dict) -> dict:
        """More of the train state the reduction reads (e.g. the step, the optimizer's momentum)."""
        return {}

    def extra_specs(self) -> dict:
        return {}

    def wrap(self, local_grads: Callable) -> Callable:
        """The shard_map body, adapted to what params_in hands it."""
        return local_grads

    def whole_layers(self, paths) -> frozenset:
        """The stacked leaves among `paths` whose layers dim (dim 0) `grad_out` and `final_out`
        both keep whole on each device: only their gradients can be reduced a layer's slice at a
        time inside the layer scan (`in_scan`)."""
        grad, final = flat_paths(self.grad_out), flat_paths(self.final_out)
        whole = lambda spec: not (len(spec) and any(a in self.manual for a in entry_axes(spec[0])))
        return frozenset(p for p in paths if whole(grad[p]) and whole(final[p]))

    # ------------------------------------------------------------------ inside the shard_map
    def microbatch(self, grads, specs):
        """Each microbatch's gradients as they are added to the accumulator; `specs`: their
        layout inside the shard_map (`grad_out`, or the part of it the pipeline has at hand)."""
        return grads

    def scatter_layer(self, g, path: tuple):
        """One layer's gradient of the `in_scan` leaf `path` (its layers dim dropped), as each
        microbatch's backward produces it: what `microbatch` does to the whole stack."""
        raise NotImplementedError

    def finish_layer(self, g, path: tuple, state: dict) -> tuple[Any, dict]:
        """(One layer's scattered gradient (summed over the microbatches) of the `in_scan` leaf
        `path`, reduced to its `final_out` layout: what `reduce` does to the whole stack; the
        layer's new `layer_state`). `state`: this layer's slice of the leaf's `layer_state`."""
        raise NotImplementedError

    def layer_state(self, comm: dict) -> dict:
        """{in_scan path: {name: array [layers, ...]}}: this device's part of the comm state that
        the layer scan reads and writes one layer at a time (error-feedback residuals of each
        layer's slice); {} when none. The scan hands its new value to `with_layer_state`."""
        return {}

    def with_layer_state(self, comm: dict, state: dict) -> dict:
        """`comm` with its `layer_state` part replaced by `state`."""
        return comm

    def reduce(self, grads, comm: dict, extra: dict):
        """(what the optimizer receives, laid out as `final_out`; the new comm state)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ after the shard_map
    def grad_norm(self, grads) -> jax.Array:
        return optax.tree.norm(grads) if hasattr(optax, "tree") else optax.global_norm(grads)

    def apply(self, tx: optax.GradientTransformation, grads, comm: dict, state: dict) -> dict:
        """The state after the optimizer update, the step counter aside."""
        new = {k: v for k, v in state.items() if k != "step"}
        updates, new["opt_state"] = tx.update(grads, state["opt_state"], state["params"])
        new["params"] = optax.apply_updates(state["params"], updates)
        if comm:
            new["comm"] = comm
        return new

    def describe(self) -> str:
        return self.name
