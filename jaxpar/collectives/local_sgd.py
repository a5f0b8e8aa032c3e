"""Local SGD (`local_sgd.sync_every: H > 1`): data-parallel replicas step alone for H steps, then
average their parameters -- one parameter all-reduce every H steps instead of a gradient
all-reduce every step, so the `data` reduction traffic is divided by H.

  state["local"]["params"]  each replica's own parameters, a leading axis over `data` (R rows,
                            sharded over `data`: every device holds its replica's copy)
  state["opt_state"]        the inner optimizer's state, per replica (same leading axis)
  state["params"]           the synchronised parameters (what is evaluated and exported),
                            updated at each sync:
      outer: average   params = mean over replicas
      outer: nesterov  (DiLoCo) delta = params - mean, m = mu m + delta,
                       params -= outer_lr * (delta + mu m); state["local"]["momentum"] holds m
  after a sync every replica restarts from state["params"].

Inside the step's shard_map, gradients are summed over the batch axes except `data` (fsdp and
expert still reduce within a replica): each replica's gradient is the mean over its own share of
the batch (what one device would compute on those rows); clipping is per replica and the logged
grad_norm is the root mean square of the replicas' norms. Needs mesh.data > 1, parameters
not sharded over `data`, no gradient compression, AdamW (a pipeline's stages and context's
sequence chunks are summed within each replica, like fsdp). Under bf16 params with
float32 masters (train/precision.py) the replicas' masters are what is averaged and restarted
from, and the nesterov outer step keeps float32 weights (state["local"]["outer_master"]).
`LocalSGD` is the gradient sync (jaxpar/parallel/sync.py) of such a run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.parallel.data import all_reduce, scatter_microbatch_grads, sharded_dims
from jaxpar.parallel.sync import GradientSync, is_spec
from jaxpar.sharding import entry_axes

AXIS = "data"


class LocalSGD(GradientSync):
    """Replicas that step alone (module doc). Within a replica it reduces after the backward
    scan (its inner sync, a compressed one or a psum, is not asked for in-scan leaves)."""

    name = "local SGD: gradients reduced within a replica only"

    def __init__(self, cfg, plan, param_specs, grad_specs, compression=None, optimizer=None, wire_dtype=None):
        shape = plan.mesh.shape
        self.cfg = cfg
        self.replicas, self.every = shape.get(AXIS, 1), cfg.sync_every
        self.replica_axes = (AXIS,)
        if self.replicas < 2:
            raise ConfigError(f"local_sgd.sync_every={cfg.sync_every} needs data-parallel replicas: "
                              "mesh.data > 1")
        if AXIS not in plan.batch_axes:
            raise ConfigError("local_sgd needs `data` among the batch axes (sharding.rules.batch)")
        if compression is not None and compression.method != "none":
            raise ConfigError(f"local_sgd syncs parameters, not gradients: drop gradient_compression.method="
                              f"{compression.method!r}")
        if optimizer is not None and getattr(optimizer, "name", "adamw") != "adamw":
            raise ConfigError("local_sgd runs AdamW inside each replica, "
                              f"not optimizer.name={optimizer.name!r}")
        if any(AXIS in entry_axes(e) for s in jax.tree.leaves(param_specs, is_leaf=is_spec) for e in s):
            raise ConfigError("local_sgd: parameters sharded over `data` (sharding.rules) "
                              "cannot form replicas")
        super().__init__(plan, grad_specs, wire_dtype=wire_dtype)
        self.nesterov = cfg.outer == "nesterov"

    # ------------------------------------------------------------------ layout
    def replica_spec(self, spec: P) -> P:
        return P(AXIS, *spec)

    def replica_specs(self, specs):
        return jax.tree.map(self.replica_spec, specs, is_leaf=is_spec)

    def replica_shardings(self, shardings):
        return jax.tree.map(lambda s: NamedSharding(s.mesh, self.replica_spec(s.spec)), shardings,
                            is_leaf=lambda x: isinstance(x, NamedSharding))

    def state_shardings(self, shardings: dict) -> dict:
        local = {"params": self.replica_shardings(shardings["params"])}
        if self.nesterov:
            local["momentum"] = shardings["params"]
            if _masters(shardings["opt_state"]) is not None:
                local["outer_master"] = shardings["params"]
        return {**shardings, "opt_state": self.replica_shardings(shardings["opt_state"]), "local": local}

    def init_state(self, state: dict, tx) -> dict:
        """Every replica starts from the params, with its own copy of the fresh optimizer state
        (which holds the float32 masters, as initialised, under bf16 params)."""
        params = state["params"]
        stack = lambda x: jnp.broadcast_to(x, (self.replicas, *jnp.shape(x)))
        local = {"params": jax.tree.map(stack, params)}
        if self.nesterov:
            local["momentum"] = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            masters = _masters(state["opt_state"])
            if masters is not None:  # the outer step's own float32 weights
                local["outer_master"] = masters
        return {**state, "opt_state": jax.tree.map(stack, state["opt_state"]), "local": local}

    opt_lead = 1  # one optimizer state per replica, the replica dim first

    def reorder_layers(self, state: dict, tx, axes, move) -> dict:
        """The base's, and the replicas' own params (replica dim first), the outer momentum and
        float32 outer weights (one each)."""
        state = super().reorder_layers(state, tx, axes, move)
        local = {k: move(v, axes, 1 if k == "params" else 0) for k, v in state["local"].items()}
        return {**state, "local": local}

    def params_in(self, state):
        return state["local"]["params"]

    param_in_specs = replica_specs
    grads_out_specs = replica_specs

    def grad_shardings(self):
        return self.replica_shardings(super().grad_shardings())

    def wrap(self, local_grads):
        """The shard_map body on replica-stacked params: squeeze this replica's row, add it back."""
        def body(params, *inputs):
            params = jax.tree.map(lambda p: p[0], params)
            loss, grads, comm = local_grads(params, *inputs)
            return loss, jax.tree.map(lambda g: g[None], grads), comm
        return body

    # ------------------------------------------------------------------ the step
    def microbatch(self, grads, specs):
        return scatter_microbatch_grads(grads, specs, self.plan, self.manual, self.wire_dtype)

    def reduce(self, grads, comm, extra):
        """Summed over every batch axis but `data`: each replica's own gradient."""
        within = self.manual - {AXIS}
        sizes = self.plan.mesh.shape

        def reduce(g, spec):
            done = {a for _, names in sharded_dims(spec, self.manual) for a in names}
            rest = tuple(sorted(a for a in within if a not in done and sizes[a] > 1))
            g = g if self.wire_dtype is None else g.astype(self.wire_dtype)  # train.grad_reduce_dtype
            return all_reduce(g, rest) if rest else g
        return jax.tree.map(reduce, grads, self.grad_specs, is_leaf=is_spec), comm

    def grad_norm(self, grads) -> jax.Array:
        """The root mean square of the replicas' gradient norms (each replica clips its own)."""
        sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim)))
                 for g in jax.tree.leaves(grads))
        return jnp.sqrt(jnp.mean(sq))

    def apply(self, tx, grads, comm, state):
        """Each replica's optimizer step; every `sync_every` steps the outer step and a restart.
        With float32 masters under bf16 params (train/precision.with_masters) the masters are
        what is averaged and what the replicas restart from (the params their bf16 cast), and
        the nesterov outer step keeps its own float32 weights (local["outer_master"])."""
        lp = state["local"]["params"]
        updates, opt_state = jax.vmap(tx.update)(grads, state["opt_state"], lp)
        lp = optax.apply_updates(lp, updates)
        outer = state["params"]
        local = {k: v for k, v in state["local"].items() if k != "params"}  # the outer step's state
        cfg = self.cfg
        f32 = lambda x: x.astype(jnp.float32)

        def sync(args):
            lp, outer, local, masters = args
            src = lp if masters is None else masters
            avg = jax.tree.map(lambda x: f32(x).mean(0), src)  # the all-reduce over data
            if self.nesterov:
                weights = jax.tree.map(f32, local.get("outer_master", outer))
                delta = jax.tree.map(lambda o, a: o - a, weights, avg)
                mom = jax.tree.map(lambda m, d: cfg.outer_momentum * m + d, local["momentum"], delta)
                new = jax.tree.map(lambda o, d, m: o - cfg.outer_lr * (d + cfg.outer_momentum * m),
                                   weights, delta, mom)
                local = {**local, "momentum": mom}
                if "outer_master" in local:
                    local["outer_master"] = new
            else:
                new = avg
            outer = jax.tree.map(lambda o, n: n.astype(o.dtype), outer, new)
            restart = lambda p, n: jnp.broadcast_to(n, p.shape).astype(p.dtype)
            lp = jax.tree.map(restart, lp, outer)
            if masters is not None:
                masters = jax.tree.map(restart, masters, new)
            return lp, outer, local, masters

        lp, outer, local, masters = jax.lax.cond((state["step"] + 1) % self.every == 0, sync, lambda a: a,
                                                 (lp, outer, local, _masters(opt_state)))
        if masters is not None:
            opt_state = opt_state._replace(master=masters)
        kept = {k: v for k, v in state.items() if k != "step"}
        return {**kept, "params": outer, "opt_state": opt_state, "local": {**local, "params": lp}}


def _masters(opt_state):
    """The float32 master weights of an optimizer state run under with_masters (None: none)."""
    return getattr(opt_state, "master", None)
