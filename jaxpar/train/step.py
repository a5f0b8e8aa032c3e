"""The train step: one jit that composes the parallel strategies.

   shard_map (manual over the batch axes; tensor & co. left to the compiler)
     for each microbatch: forward + backward of the local slice (ZeRO-3 gathers per layer)
                          ZeRO-2 reduce-scatters the microbatch gradients
     all-reduce what is left over the batch axes
   optimizer update on (possibly fsdp-sharded) optimizer state; params come out in their plan.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import nn
from jaxpar.collectives.local_sgd import LocalReducer, LocalSGD
from jaxpar.collectives.onebit_adam import OneBitAdamReducer
from jaxpar.collectives.reducer import GradientReducer
from jaxpar.config import GradientCompressionConfig
from jaxpar.parallel.data import GATHERED, param_preparer, reduce_data_parallel, scatter_microbatch_grads
from jaxpar.parallel.expert import expert_hook
from jaxpar.parallel.pipeline import make_step_pipeline, stacked_paths
from jaxpar.parallel.tensor import activation_constrainer
from jaxpar.sharding import Plan, vary
from jaxpar.train.model import ModelDef
from jaxpar.train.optimizer import schedule_count
from jaxpar.train.sown import add_sown, flat_metrics

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def cross_entropy_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Summed token NLL in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).sum()


@dataclass(frozen=True)
class StepSpec:
    """Everything the step needs to know about layout, as data."""

    param_specs: Any
    grad_specs: Any
    opt_shardings: Any
    state_shardings: Any
    batch_sharding: NamedSharding
    reducer: Any = None  # jaxpar.collectives.GradientReducer when gradients are compressed
    local_sgd: Any = None  # jaxpar.collectives.local_sgd.LocalSGD when replicas step alone


def grad_dtype(grad_accum: int, grad_reduce_dtype: str):
    """The dtype the step holds gradients in: float32 to accumulate microbatches, else the wire's."""
    return jnp.float32 if grad_accum > 1 else DTYPES[grad_reduce_dtype]


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def make_step_spec(model: ModelDef, plan: Plan, tx: optax.GradientTransformation,
                   compression: Any = None, optimizer: Any = None, local_sgd: Any = None) -> StepSpec:
    param_specs = jax.tree.map(lambda ax, s: plan.spec(ax, s.shape, "param"), model.axes, model.shapes,
                               is_leaf=_is_axes)
    grad_specs = jax.tree.map(lambda ax, s: plan.spec(ax, s.shape, "grad"), model.axes, model.shapes,
                              is_leaf=_is_axes)
    opt_param_specs = jax.tree.map(lambda ax, s: plan.spec(ax, s.shape, "opt"), model.axes, model.shapes,
                                   is_leaf=_is_axes)
    abstract_opt = jax.eval_shape(tx.init, model.shapes)
    to_sh = lambda spec: plan.sharding(spec)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, spec: to_sh(spec), abstract_opt, opt_param_specs,
        transform_non_params=lambda _: to_sh(P()), is_leaf=lambda x: isinstance(x, P),
    )
    state_shardings = {
        "step": to_sh(P()),
        "params": jax.tree.map(to_sh, param_specs, is_leaf=lambda x: isinstance(x, P)),
        "opt_state": opt_shardings,
    }
    reducer = local = None
    if local_sgd is not None and local_sgd.sync_every > 1:
        local = LocalSGD(local_sgd, plan, param_specs, compression, optimizer)
        local.update_shardings(state_shardings)
        reducer = LocalReducer(plan, grad_specs)
    elif optimizer is not None and getattr(optimizer, "name", "adamw") == "onebit_adam":
        reducer = OneBitAdamReducer(optimizer, compression or GradientCompressionConfig(), plan, model,
                                    grad_specs)
        state_shardings["comm"] = reducer.state_shardings()
    elif compression is not None and compression.method != "none":
        reducer = GradientReducer(compression, plan, model, grad_specs)
        if reducer.stateful:  # error-feedback residuals: one row per batch device
            state_shardings["comm"] = reducer.state_shardings()
    return StepSpec(param_specs, grad_specs, opt_shardings, state_shardings,
                    plan.sharding(plan.batch_spec()), reducer, local)


def make_init(model: ModelDef, tx, spec: StepSpec, param_dtype) -> Callable[[int], dict]:
    """init(seed) -> train state, placed by the plan (each device builds only its shards)."""
    def init(seed, params=None):  # params: given float32 weights (train.init_from) instead of random
        params = model.init(seed) if params is None else params
        opt_state = tx.init(params)  # from the float32 init: master weights are exact
        params = jax.tree.map(lambda x: x.astype(param_dtype), params)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state}
        if "comm" in spec.state_shardings:
            state["comm"] = spec.reducer.init_state()
        if spec.local_sgd is not None:
            state["opt_state"], state["local"] = spec.local_sgd.init(params, tx)
        return state
    return jax.jit(init, static_argnums=0, out_shardings=spec.state_shardings)


def make_train_step(model: ModelDef, plan: Plan, tx, spec: StepSpec, *, grad_accum: int,
                    pipeline: Any = None,
                    compute_dtype: str, remat: str, lr_schedule: optax.Schedule | None = None,
                    grad_reduce_dtype: str = "float32",
                    loss_sum_fn: Callable = cross_entropy_sum, skip_nonfinite: bool = False,
                    return_grads: bool = False):
    """Returns a jitted step(state, tokens) -> (state, metrics). `tokens` is the global
    [batch, seq+1] int array sharded over the batch axes. With `skip_nonfinite`, a step whose loss
    or gradient norm is not finite leaves params and optimizer state unchanged (the step counter
    still advances) and reports metrics["nonfinite"] = 1. metrics["lr"] is the schedule at the
    optimizer's own count (the learning rate applied this step). With `return_grads` (a debug
    aid: tests/grad_util.py) metrics["grads"] is what the optimizer receives, after the data-
    parallel reduction: the mean gradient (replica-stacked under local SGD; 1-bit Adam after its
    warm-up hands over its reduced momentum instead). Microbatch gradients are accumulated in
    float32 and reduced over the batch axes in `grad_reduce_dtype` (train.grad_reduce_dtype)."""
    pipelined = plan.mesh.shape.get("pipeline", 1) > 1  # `pipeline`: a config.PipelineConfig
    manual = frozenset(plan.batch_axes) | ({"pipeline"} if pipelined else set())
    cdt = DTYPES[compute_dtype]
    rdt = DTYPES[grad_reduce_dtype]
    prepare = param_preparer(plan, manual, cdt, rdt)
    ctx = nn.Context(constrain=activation_constrainer(plan, manual), experts=expert_hook(plan, manual),
                     layer_params=lambda st: prepare(st, stacked=True), remat=remat,
                     never_save=(GATHERED,) if plan.zero_stage >= 3 else ())
    is_spec = lambda x: isinstance(x, P)
    param_in = jax.tree.map(lambda s: plan.manual_part(s, tuple(manual)), spec.param_specs, is_leaf=is_spec)
    grad_out = jax.tree.map(lambda s: plan.manual_part(s, tuple(manual)), spec.grad_specs, is_leaf=is_spec)
    # What the optimizer receives: ZeRO-1 reduce-scatters to its optimizer-state shard.
    final_specs = spec.grad_specs
    if spec.reducer is None and spec.local_sgd is None and plan.zero_stage == 1:
        final_specs = jax.tree.map(lambda ax, sh: plan.spec(ax, sh.shape, "opt"), model.axes,
                                   model.shapes, is_leaf=_is_axes)
    final_out = jax.tree.map(lambda s: plan.manual_part(s, tuple(manual)), final_specs, is_leaf=is_spec)
    run_pipeline = None
    if pipelined:  # stages over `pipeline`, microbatches run by a timetable (jaxpar/parallel/pipeline)
        stacked_str = {"/".join(map(str, k)) for k in stacked_paths(model)}
        run_pipeline, grad_accum = make_step_pipeline(
            model, plan, pipeline, grad_accum, ctx, lambda st: _prepare_top(st, prepare, stacked_str),
            loss_sum_fn, lambda g, s: scatter_microbatch_grads(g, s, plan, manual), grad_out)

    stacked = {k for k, ax in model.leaves_with_paths(model.axes).items() if ax[:1] == ("layers",)}

    def forward(params, inputs):
        state = _prepare_top(model.state(params), prepare, stacked)
        with nn.use_context(ctx), nn.collect_aux() as sown:
            logits = model.merge(state)(inputs)
        return logits, dict(sown)

    if ctx.never_save:  # ZeRO-3: embeddings and head are gathered again for the backward too
        forward = never_save_ends(model, ctx, lambda st: _prepare_top(st, prepare, stacked))

    # The devices one gradient is averaged over: every batch device, or under local SGD the
    # devices of one replica (each replica's gradient is the mean over its own share of the batch).
    replicas = spec.local_sgd
    n_replicas = replicas.replicas if replicas else 1
    group = plan.batch_size_divisor // n_replicas

    def local_loss(params, tokens, n_tokens):
        logits, sown = forward(params, tokens[:, :-1])
        loss = loss_sum_fn(logits, tokens[:, 1:]) / n_tokens
        return add_sown(loss, sown, 1.0 / (group * grad_accum))

    def local_grads(params, tokens, comm, extra):
        # sorted: `manual` is a frozenset, whose order changes with PYTHONHASHSEED, and the order
        # of the psum's axes changes the rounding of the loss between processes
        busy = tuple(sorted(a for a in manual if plan.mesh.shape[a] > 1))
        # The params typed as varying over every manual axis (check_vma). Replicated ones would
        # meet the per-device activations through an implicit pvary, whose transpose is a psum:
        # JAX would sum their gradients inside the backward (then the reduction below would add
        # them up again, N times the gradient; in a pipeline, inside a per-stage branch). Varying,
        # each device gets its local gradient, and the reduction below is the one that is checked.
        params = jax.tree.map(lambda p: vary(p, busy), params)
        n_tokens = tokens.shape[0] * (tokens.shape[1] - 1) * group
        mbs = tokens.reshape(grad_accum, tokens.shape[0] // grad_accum, tokens.shape[1])

        def body(acc, mb):
            (_, (loss, aux)), g = jax.value_and_grad(local_loss, has_aux=True)(params, mb, n_tokens)
            g = scatter_microbatch_grads(g, grad_out, plan, manual, rdt)
            return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g), (loss, aux)

        zeros = jax.eval_shape(lambda: scatter_microbatch_grads(
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), grad_out, plan, manual))
        # the accumulator varies over the batch axes, like every microbatch gradient added to it
        acc0 = jax.tree.map(lambda z: vary(jnp.zeros(z.shape, grad_dtype(grad_accum, grad_reduce_dtype)),
                                           batch_busy), zeros)
        if run_pipeline is None:
            grads, (losses, aux) = jax.lax.scan(body, acc0, mbs)
        else:
            losses, grads, aux = run_pipeline(params, mbs, n_tokens)
        grads, comm = reduce_data_parallel(grads, grad_out, manual, plan.mesh.shape, spec.reducer, comm,
                                           extra=extra, out_specs=final_out, dtype=rdt)
        total = lambda x: jax.lax.psum(x, busy) if busy else x
        if n_replicas > 1:  # the replicas' means, averaged
            total = lambda x, _sum=total: _sum(x) / n_replicas
        return (total(losses.sum()), jax.tree.map(lambda a: total(a.sum(0)), aux)), grads, comm

    # The batch (and the reducer's per-device residuals) arrive split over the batch axes of size
    # > 1 only, the same layout: a size-1 axis in a spec would type every value as varying over
    # it, and the reductions skip those axes, so nothing could be checked as replicated over them.
    batch_busy = tuple(a for a in plan.batch_axes if plan.mesh.shape[a] > 1)
    busy_part = lambda s: plan.manual_part(s, batch_busy)
    comm_specs = jax.tree.map(busy_part, spec.reducer.state_specs(), is_leaf=is_spec) \
        if "comm" in spec.state_shardings else {}
    extra_specs = spec.reducer.extra_specs(grad_out) if spec.reducer is not None else {}
    sharded_grads = jax.shard_map(
        replicas.wrap(local_grads) if replicas else local_grads, mesh=plan.mesh,
        in_specs=(replicas.replica_specs(param_in) if replicas else param_in,
                  busy_part(plan.batch_spec()), comm_specs, extra_specs),
        out_specs=((P(), P()), replicas.replica_specs(final_out) if replicas else final_out, comm_specs),
        axis_names=set(manual), check_vma=True,
    )
    grad_shardings = jax.tree.map(plan.sharding, final_specs, is_leaf=is_spec)
    if replicas:
        grad_shardings = replicas.replica_shardings(grad_shardings)

    def apply(state, grads, comm):
        """The state after the optimizer update (the step counter aside)."""
        new = {k: v for k, v in state.items() if k != "step"}
        if replicas:  # local SGD: each replica steps alone; every sync_every steps they meet
            new["params"], new["opt_state"], new["local"] = replicas.update(tx, grads, state)
        else:
            updates, new["opt_state"] = tx.update(grads, state["opt_state"], state["params"])
            new["params"] = optax.apply_updates(state["params"], updates)
        if comm:
            new["comm"] = comm
        return new

    def step(state, tokens):
        extra = spec.reducer.extra_inputs(state) if spec.reducer is not None else {}
        params = replicas.params_in(state) if replicas else state["params"]
        (loss, aux), grads, comm = sharded_grads(params, tokens, state.get("comm", {}), extra)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        grad_norm = replicas.grad_norm(grads) if replicas else (
            optax.tree.norm(grads) if hasattr(optax, "tree") else optax.global_norm(grads))
        metrics = {"loss": loss, "grad_norm": grad_norm, **flat_metrics(aux)}
        if skip_nonfinite:
            # A skipped step keeps params, optimizer, reducer and replica state. One cond, not a
            # select per leaf: a select reads each donated buffer twice and XLA copies them all.
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            kept = {k: v for k, v in state.items() if k != "step"}
            new_state = jax.lax.cond(ok, lambda: _like(apply(state, grads, comm), kept), lambda: kept)
            metrics["nonfinite"] = jnp.logical_not(ok).astype(jnp.int32)
        else:
            new_state = apply(state, grads, comm)
        if lr_schedule is not None:  # a skipped step does not advance the optimizer's count
            metrics["lr"] = lr_schedule(schedule_count(state["opt_state"]))
        if return_grads:
            metrics["grads"] = grads
        return {"step": state["step"] + 1, **new_state}, metrics

    return jax.jit(step, in_shardings=(spec.state_shardings, spec.batch_sharding),
                   out_shardings=(spec.state_shardings, None), donate_argnums=0)


def _like(tree, ref):
    """`tree` in the dtypes of `ref` (both branches of a cond must agree exactly)."""
    return jax.tree.map(lambda x, r: x.astype(r.dtype), tree, ref)


class _Stop(Exception):
    def __init__(self, value):
        super().__init__("stopped at the layer scan")
        self.value = value


def never_save_ends(model: ModelDef, ctx: nn.Context, prepare_top: Callable) -> Callable:
    """forward(params, tokens) -> (logits, sown) for ZeRO-3. What the model runs before its
    scan_layers call (the embedding) and after it (final norm, head) each run under a checkpoint
    that saves everything but the gathered weights (ctx.never_save), so the backward gathers them
    again; the layer scan runs between the two, outside any checkpoint, so that its per-layer
    policy (train.remat, which never saves the gathers either) is the one that acts. A checkpoint
    around the whole forward would not do: JAX partial-evaluates a checkpoint nested in another
    with the outer one's policy, which silently replaced every train.remat by "save all but the
    gathers". A model that never calls scan_layers runs whole under the checkpoint."""
    policy = nn.remat_policy("none", ctx.never_save)
    weights: dict = {}  # sown name -> loss weight (static, so kept out of the checkpoints)
    fired: list = []

    def call(params, tokens, hook, prep: bool):
        state = model.state(params)
        if prep:
            state = prepare_top(state)
        try:
            with nn.use_context(dataclasses.replace(ctx, layers_hook=hook)), nn.collect_aux() as sown:
                out = model.merge(state)(tokens)
        except _Stop as stop:
            out = stop.value
        weights.update((k, w) for k, (_, w) in sown.items())
        return out, {k: v for k, (v, _) in sown.items()}

    def stop(stack, carry, fn):
        fired.append(True)
        raise _Stop(carry)

    def pre(params, tokens):
        return call(params, tokens, stop, True)

    def layers(params, x, tokens):
        def scan(stack, carry, fn):
            raise _Stop(nn.scan_stack(stack, x, fn))
        return call(params, tokens, scan, False)[0]

    def post(params, y, tokens):
        return call(params, tokens, lambda stack, carry, fn: y, True)

    def forward(params, tokens):
        fired.clear()
        x, sown_pre = jax.checkpoint(pre, policy=policy)(params, tokens)
        if not fired:  # no layer scan: `pre` ran the whole model
            return x, {k: (v, weights[k]) for k, v in sown_pre.items()}
        y = layers(params, x, tokens)
        logits, sown_post = jax.checkpoint(post, policy=policy)(params, y, tokens)
        # `post` runs the prologue again (dead code but for the gathers the head shares): what
        # the prologue sowed is taken from `pre`
        return logits, {k: (v, weights[k]) for k, v in {**sown_post, **sown_pre}.items()}

    return forward


def _prepare_top(state, prepare, stacked_paths: set[str]):
    """Cast/gather the params used outside the layer scan (embeddings, final norm, head) and cast
    the layer stacks that need no per-layer gather (see jaxpar.parallel.data.param_preparer)."""
    flat = nnx.to_flat_state(state)
    items = []
    for path, var in flat:
        stacked = "/".join(map(str, path)) in stacked_paths
        items.append((path, prepare({"v": var}, stacked=stacked, cast_only=stacked)["v"]))
    return nnx.from_flat_state(items)
