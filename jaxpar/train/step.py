"""The train step: one jit that composes the parallel strategies.

   shard_map (manual over the batch axes [+ pipeline]; tensor & co. left to the compiler)
     accumulate over microbatches (train/accumulate.py: a scan, or the pipeline's timetable):
       forward + backward of the local slice (train/forward.py; ZeRO-3 gathers per layer),
       the layer stacks' gradients reduced inside the backward layer scan, layer by layer, where
         the sync can (sync.in_scan: AllReduce without a pipeline, the compressed reductions
         but PowerSGD; train/layer_grads.py; the sync's per-layer state in `comm`),
       each microbatch's other gradients through the sync's hook (ZeRO-2 reduce-scatters them)
     the sync's final reduction of the rest (parallel/sync.py: psum / ZeRO-1 reduce-scatter,
       compressed, 1-bit Adam, local SGD)
   the sync applies the optimizer update; params come out in their plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.parallel.context import ContextParallel, loader_split
from jaxpar.parallel.sync import GradientSync, is_spec, key_path
from jaxpar.sharding import Plan, vary
from jaxpar.train.accumulate import make_accumulation
from jaxpar.train.batch import Batch, Documents
from jaxpar.train.forward import make_forward
from jaxpar.train.gradient_sync import make_sync
from jaxpar.train.loss import MicrobatchLoss, cross_entropy_sum
from jaxpar.train.loss_scale import LossScale
from jaxpar.train.model import ModelDef
from jaxpar.train.optimizer import schedule_count
from jaxpar.train.precision import DTYPES
from jaxpar.train.sown import flat_metrics


@dataclass(frozen=True)
class StepSpec:
    """Everything the step needs to know about layout, as data; `sync` is the gradient sync."""

    param_specs: Any
    grad_specs: Any
    state_shardings: Any
    batch_sharding: NamedSharding
    sync: GradientSync
    batch_layout: ContextParallel = ContextParallel()  # the loader's row layout (columns over context)
    loss_scale: LossScale = LossScale()  # train.loss_scale (its state, when dynamic, in the train state)


def make_step_spec(model: ModelDef, plan: Plan, tx: optax.GradientTransformation, compression: Any = None,
                   optimizer: Any = None, local_sgd: Any = None,
                   grad_reduce_dtype: str = "float32", grad_accum: int = 1, context: Any = None,
                   loss_scale: LossScale = LossScale()) -> StepSpec:
    """The step's shardings. `context` (config.ContextConfig): under mesh.context the loader
    lays each row out in its devices' columns (parallel/context.loader_split)."""
    specs = {use: plan.tree_specs(model.axes, model.shapes, use) for use in ("param", "grad", "opt")}
    to_sh = lambda spec: plan.sharding(spec)
    opt_shardings = optax.tree_map_params(  # every params-shaped tree of the optimizer state
        tx, lambda _, spec: to_sh(spec), jax.eval_shape(tx.init, model.shapes), specs["opt"],
        transform_non_params=lambda _: to_sh(P()), is_leaf=is_spec,
    )
    sync = make_sync(model, plan, specs, compression=compression, optimizer=optimizer, local_sgd=local_sgd,
                     wire_dtype=DTYPES[grad_reduce_dtype], accumulating=grad_accum > 1)
    shardings = sync.state_shardings({"step": to_sh(P()), "opt_state": opt_shardings,
                                      "params": jax.tree.map(to_sh, specs["param"], is_leaf=is_spec),
                                      **jax.tree.map(to_sh, loss_scale.state_specs(), is_leaf=is_spec)})
    layout, batch_sharding = loader_split(plan, context)
    return StepSpec(specs["param"], specs["grad"], shardings, batch_sharding, sync, layout, loss_scale)


def make_init(model: ModelDef, plan: Plan, tx, spec: StepSpec, param_dtype) -> Callable[[int], dict]:
    """init(seed) -> train state, placed by the plan (each device builds only its shards), its
    layer stacks in the plan's stored order (the one-device params, reordered: Plan.layer_order)."""
    def init(seed, params=None):  # params: given float32 weights (train.init_from) instead of random
        params = model.init(seed) if params is None else params
        params = plan.reorder_layers(params, model.axes, "stored")
        opt_state = tx.init(params)  # from the float32 init: master weights are exact
        params = jax.tree.map(lambda x: x.astype(param_dtype), params)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state,
                 **spec.loss_scale.init_state()}
        return spec.sync.init_state(state, tx)
    return jax.jit(init, static_argnums=0, out_shardings=spec.state_shardings)


def reorder_state(state: dict, model: ModelDef, plan: Plan, tx, sync: GradientSync, to: str) -> dict:
    """`state` with the layer stacks of its params, of every params-shaped tree of its optimizer
    state (moments, master weights) and of the sync's own params-shaped state (local SGD's
    replicas) in `to` order, "stored" or "canonical" (Plan.reorder_layers): checkpoints hold the
    canonical order, the step the stored one."""
    move = lambda x, axes, lead: plan.reorder_layers(x, axes, to, lead)
    return sync.reorder_layers(state, tx, model.axes, move)


def make_train_step(model: ModelDef, plan: Plan, tx, spec: StepSpec, *, grad_accum: int, pipeline: Any = None,
                    compute_dtype: str, remat: str, lr_schedule: optax.Schedule | None = None,
                    loss_sum_fn: Callable = cross_entropy_sum, loss_chunk: int | None = None,
                    skip_nonfinite: bool = False, return_grads: bool = False,
                    documents: Documents | None = None, context: Any = None):
    """Returns a jitted step(state, tokens) -> (state, metrics). `tokens` is the global
    [batch, seq+1] int array sharded over the batch axes (under mesh.context, each row's columns
    in the loader's layout, spec.batch_layout). With `skip_nonfinite`, a step whose loss
    or gradient norm is not finite leaves the state unchanged but for the step counter and reports
    metrics["nonfinite"] = 1. metrics["lr"] is the schedule at the optimizer's own count (the
    learning rate applied this step). With `return_grads` (a debug aid: tests/grad_util.py)
    metrics["grads"] is what the optimizer receives, after the sync's reduction: the mean gradient
    (replica-stacked under local SGD; 1-bit Adam after its warm-up hands over its reduced
    momentum instead). Microbatch gradients are accumulated in float32. `loss_chunk`
    (train.loss_chunk): the loss forms the logits that many tokens at a time. `documents`
    (data.packing): the rows hold packed documents; their segment ids, positions and target
    weights are derived from the global batch before the shard_map (train/batch.py) and the loss
    is the mean over the targets that count (a global count). `context`
    (config.ContextConfig): how sequences split over mesh.context (parallel/context.py).
    spec.loss_scale (train.loss_scale, float16): the backward runs on the loss times the scale and
    the gradients are divided by it before the sync reads them (the layer stacks reduced in the
    scan in their taps, the rest after accumulation); a dynamic scale skips the update of a step
    whose gradients overflow (train/loss_scale.py)."""
    sync = spec.sync
    manual, sizes = sync.manual, plan.mesh.shape
    forward = make_forward(model, plan, manual, DTYPES[compute_dtype], remat, sync.wire_dtype, loss_chunk,
                           context)
    accumulate = make_accumulation(model, plan, forward, sync, grad_accum=grad_accum, pipeline_cfg=pipeline)
    # sorted: `manual` is a frozenset, whose order changes with PYTHONHASHSEED, and the order of
    # the psum's axes changes the rounding of the loss between processes
    busy = tuple(sorted(a for a in manual if sizes[a] > 1))
    group = plan.batch_size_divisor // sync.replicas  # the devices one gradient is the mean over

    def local_grads(params, batch, comm, extra, scale):
        # The params typed as varying over every manual axis (check_vma). Replicated ones would
        # meet the per-device activations through an implicit pvary, whose transpose is a psum:
        # JAX would sum their gradients inside the backward (then the reduction below would add
        # them up again, N times the gradient; in a pipeline, inside a per-stage branch). Varying,
        # each device gets its local gradient, and the sync's reduction is the one that is checked.
        params = jax.tree.map(lambda p: vary(p, busy), params)
        count = None
        if batch.weights is not None:  # the targets that count, over the devices of one gradient
            within = tuple(a for a in batch_busy if a not in sync.replica_axes)
            count = jax.lax.psum(batch.token_count(), within) if within else batch.token_count()
        loss = MicrobatchLoss.for_batch(loss_sum_fn, batch.tokens.shape, group, accumulate.microbatches,
                                        count, forward.context.size, scale)
        mbs = jax.tree.map(lambda a: a.reshape(accumulate.microbatches, -1, *a.shape[1:]), batch)
        losses, grads, aux, comm = accumulate(params, mbs, loss, comm)
        if scale is not None:  # the scaled loss's gradients, back to the loss's own before the sync
            # reads them (the layer stacks it reduces in the scan were divided there: layer_grads.tap)
            grads = jax.tree_util.tree_map_with_path(
                lambda p, g: g if key_path(p) in sync.in_scan else g / scale.astype(g.dtype), grads)
        grads, comm = sync.reduce(grads, comm, extra)
        mean = lambda x: (jax.lax.psum(x, busy) if busy else x) / sync.replicas
        return (mean(losses.sum()), jax.tree.map(lambda a: mean(a.sum(0)), aux)), grads, comm

    # The batch (and the sync's per-device state) arrive split over the batch axes of size > 1
    # only: a size-1 axis in a spec would type every value as varying over it, and the
    # reductions skip those axes, so nothing could be checked as replicated over them.
    batch_busy = tuple(a for a in plan.batch_axes if sizes[a] > 1)
    busy_part = lambda s: plan.manual_part(s, batch_busy)
    # the sync's state: one row per device of every manual axis it sums over (pipeline, context)
    comm_specs = jax.tree.map(lambda s: plan.manual_part(s, busy), sync.comm_specs(), is_leaf=is_spec)
    param_in = jax.tree.map(lambda s: plan.manual_part(s, tuple(manual)), spec.param_specs, is_leaf=is_spec)
    as_batch = documents or Batch
    rows = busy_part(plan.batch_spec())  # every field of the Batch is split by rows like the tokens
    batch_specs = jax.tree.map(lambda _: rows, jax.eval_shape(as_batch, jnp.zeros((2, 2), jnp.int32)))
    sharded_grads = jax.shard_map(
        sync.wrap(local_grads), mesh=plan.mesh,
        in_specs=(sync.param_in_specs(param_in), batch_specs, comm_specs, sync.extra_specs(), P()),
        out_specs=((P(), P()), sync.grads_out_specs(sync.final_out), comm_specs),
        axis_names=set(manual), check_vma=True,
    )
    grad_shardings = sync.grad_shardings()
    scaler = spec.loss_scale

    def step(state, tokens):
        tokens = spec.batch_layout.whole_rows(tokens)
        scale = scaler.current(state)
        (loss, aux), grads, comm = sharded_grads(sync.params_in(state), as_batch(tokens),
                                                 state.get("comm", {}), sync.extra_inputs(state), scale)
        grads = jax.lax.with_sharding_constraint(sync.global_order(grads), grad_shardings)
        metrics = {"loss": loss, "grad_norm": sync.grad_norm(grads), **flat_metrics(aux)}
        update = lambda: sync.apply(tx, grads, comm, state)
        finite, loss_ok = jnp.isfinite(metrics["grad_norm"]), jnp.isfinite(loss)
        ok = finite & loss_ok
        skip = skip_nonfinite or scaler.dynamic  # a dynamic loss scale skips an overflow (loss_scale.py)
        new_state = unless_nonfinite(ok, update, state) if skip else update()
        bad = ~ok
        if scaler.dynamic:
            new_state[scaler.STATE_KEY] = scaler.next_state(state, finite)
            metrics["loss_scale"] = scale  # this step's
            metrics["overflow_steps"] = new_state[scaler.STATE_KEY]["overflows"]  # so far, this one too
            bad = ~loss_ok | (~finite & (scale <= scaler.minimum))  # an overflow the floor still has
        if skip_nonfinite:
            metrics["nonfinite"] = bad.astype(jnp.int32)
        if lr_schedule is not None:  # a skipped step does not advance the optimizer's count
            metrics["lr"] = lr_schedule(schedule_count(state["opt_state"]))
        if return_grads:
            metrics["grads"] = grads
        return {"step": state["step"] + 1, **new_state}, metrics

    return jax.jit(step, in_shardings=(spec.state_shardings, spec.batch_sharding),
                   out_shardings=(spec.state_shardings, None), donate_argnums=0)


def unless_nonfinite(ok: jax.Array, update: Callable[[], dict], state: dict) -> dict:
    """update() where `ok`, else the state as it was (the step counter aside): params, optimizer
    and the sync's state all kept. One cond, not a select per leaf: a select reads each donated
    buffer twice and XLA copies them all."""
    kept = {k: v for k, v in state.items() if k != "step"}
    return jax.lax.cond(ok, lambda: _like(update(), kept), lambda: kept)


def _like(tree, ref):
    """`tree` in the dtypes of `ref` (both branches of a cond must agree exactly)."""
    return jax.tree.map(lambda x, r: x.astype(r.dtype), tree, ref)
