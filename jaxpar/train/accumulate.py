"""Gradient accumulation over microbatches: one interface, two implementations.

    accumulate(params, mbs, loss) -> (losses [k], grads, sown [k, ...])

inside the step's shard_map: `mbs` is this device's batch as a train.batch.Batch whose fields
carry a leading microbatch dim (tokens [microbatches, batch, seq + 1]), `loss` a
train.loss.MicrobatchLoss; `grads` are the local gradients summed over the microbatches (in
float32 when there are several), each microbatch's passed through the sync's per-microbatch hook
(ZeRO-2's reduce-scatter). `ScanMicrobatches` runs a lax.scan; with mesh.pipeline > 1 the
pipeline's timetable runner (jaxpar/parallel/pipeline) does the same job across stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.parallel.pipeline import make_step_pipeline
from jaxpar.parallel.sync import GradientSync
from jaxpar.sharding import Plan, vary
from jaxpar.train.forward import Forward


def grad_dtype(grad_accum: int, wire_dtype):
    """The dtype the step holds gradients in: float32 to accumulate microbatches, else the wire's
    (train.grad_reduce_dtype)."""
    return jnp.float32 if grad_accum > 1 else wire_dtype


@dataclass(frozen=True)
class ScanMicrobatches:
    """value_and_grad of each microbatch in a lax.scan, added to one accumulator."""

    forward: Forward
    sync: GradientSync
    microbatches: int
    accum_dtype: Any
    varying: tuple[str, ...]  # the manual axes of size > 1 the accumulator varies over (check_vma)

    def __call__(self, params, mbs, loss):
        def mb_loss(params, mb):
            rows = self.forward.context.split(mb)  # this device's part of each sequence
            logits, sown = self.forward(params, rows)
            return loss(logits, rows, sown)

        specs = self.sync.grad_out

        def body(acc, mb):
            (_, (value, aux)), g = jax.value_and_grad(mb_loss, has_aux=True)(params, mb)
            g = self.sync.microbatch(g, specs)
            return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g), (value, aux)

        zeros = jax.eval_shape(lambda: self.sync.microbatch(
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), specs))
        acc0 = jax.tree.map(lambda z: vary(jnp.zeros(z.shape, self.accum_dtype), self.varying), zeros)
        grads, (losses, aux) = jax.lax.scan(body, acc0, mbs)
        return losses, grads, aux


def make_accumulation(model, plan: Plan, forward: Forward, sync: GradientSync, *, grad_accum: int,
                      pipeline_cfg: Any):
    """The pipeline's runner when mesh.pipeline > 1, else the microbatch scan."""
    if plan.mesh.shape.get("pipeline", 1) > 1:
        return make_step_pipeline(model, plan, pipeline_cfg, grad_accum, forward.ctx, forward.prepare_top,
                                  sync.microbatch, sync.grad_out)
    varying = tuple(sorted(a for a in sync.manual if plan.mesh.shape[a] > 1))
    return ScanMicrobatches(forward, sync, grad_accum, grad_dtype(grad_accum, sync.wire_dtype), varying)
