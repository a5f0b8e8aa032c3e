"""Held-out evaluation: the forward only (no gradients), on the training mesh and layout.

The same shard_map as the train step (manual over the batch axes, and over `context` when
sequences are split: each device evaluates its part of each sequence, like the train step; the
rest left to the compiler), the same forward (train/forward.py: casts, ZeRO-3 gathers, activation constraints,
expert dispatch) and the same token NLL; only the backward and the update are missing. The eval
batches are batches 0..eval.batches-1 of the held-out source (data.eval_fraction /
data.eval_paths), the same ones at every evaluation.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.context import AXIS as CONTEXT_AXIS
from jaxpar.parallel.sync import is_spec
from jaxpar.sharding import Plan
from jaxpar.train.batch import Batch, Documents
from jaxpar.train.forward import make_forward
from jaxpar.train.loss import cross_entropy_sum, token_loss_sum
from jaxpar.train.model import ModelDef
from jaxpar.train.precision import DTYPES


def make_eval_step(model: ModelDef, plan: Plan, param_specs, batch_sharding, *, compute_dtype: str,
                   batch_layout: Any = None,
                   loss_sum_fn: Callable = cross_entropy_sum, loss_chunk: int | None = None,
                   documents: Documents | None = None, context: Any = None) -> Callable:
    """A jitted eval(params, tokens) -> (summed token NLL, counted targets) of the global
    [batch, seq + 1] batch (with `documents`, data.packing: the targets the train loss counts).
    `params` are the train state's params, in their plan (`param_specs`). The pipeline axis (if
    any) is left to the compiler: the forward runs unstaged, the layer stack gathered by XLA.
    `context` (config.ContextConfig): how sequences split over mesh.context; `batch_layout`
    (StepSpec.batch_layout): how the loader laid the rows out (None: whole rows)."""
    sizes = plan.mesh.shape
    manual = frozenset(plan.batch_axes) | ({CONTEXT_AXIS} if sizes.get(CONTEXT_AXIS, 1) > 1 else set())
    busy = tuple(sorted(a for a in manual if sizes[a] > 1))  # sorted: the psum's rounding is fixed
    forward = make_forward(model, plan, manual, DTYPES[compute_dtype], "none", loss_chunk=loss_chunk,
                           context=context)

    as_batch = documents or Batch

    def local_loss(params, batch):
        rows = forward.context.split(batch)  # this device's part of each sequence (or all of it)
        logits, _ = forward(params, rows)
        total = token_loss_sum(loss_sum_fn, logits, rows.targets, rows.weights)
        count = rows.targets.size if rows.weights is None else rows.weights.sum()
        out = (total, jnp.asarray(count, jnp.float32))
        return jax.lax.psum(out, busy) if busy else out

    param_in = jax.tree.map(lambda s: plan.manual_part(s, tuple(manual)), param_specs, is_leaf=is_spec)
    batch_busy = tuple(a for a in plan.batch_axes if sizes[a] > 1)
    rows = plan.manual_part(plan.batch_spec(), batch_busy)
    batch_specs = jax.tree.map(lambda _: rows, jax.eval_shape(as_batch, jnp.zeros((2, 2), jnp.int32)))
    sharded = jax.shard_map(local_loss, mesh=plan.mesh, in_specs=(param_in, batch_specs),
                            out_specs=(P(), P()), axis_names=set(manual), check_vma=True)

    def evaluate(params, tokens):
        # the forward runs the layers in the model's order (interleaved storage: Plan.layer_order)
        if batch_layout is not None:
            tokens = batch_layout.whole_rows(tokens)
        return sharded(plan.reorder_layers(params, model.axes, "canonical"), as_batch(tokens))

    param_shardings = jax.tree.map(plan.sharding, param_specs, is_leaf=is_spec)
    return jax.jit(evaluate, in_shardings=(param_shardings, batch_sharding))


class Evaluator:
    """evaluator(params) -> {"eval_loss", "eval_ppl"} over `batches` batches of `loader`."""

    def __init__(self, eval_step: Callable, loader, batches: int):
        self.eval_step, self.loader, self.batches = eval_step, loader, batches

    def __call__(self, params) -> dict[str, float]:
        sums = jax.device_get([self.eval_step(params, self.loader.batch(i)) for i in range(self.batches)])
        loss = sum(float(t) for t, _ in sums) / max(sum(float(n) for _, n in sums), 1.0)  # per counted target
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0))}
