"""Gradient accumulation over microbatches: one interface, two implementations.

    accumulate(params, mbs, loss, comm) -> (losses [k], grads, sown [k, ...], comm)

inside the step's shard_map: `mbs` is this device's batch as a train.batch.Batch whose fields
carry a leading microbatch dim (tokens [microbatches, batch, seq + 1]), `loss` a
train.loss.MicrobatchLoss; `grads` are the local gradients summed over the microbatches (in
float32 when there are several), each microbatch's passed through the sync's per-microbatch hook
(ZeRO-2's reduce-scatter), but for the layer stacks the sync reduces inside the backward layer
scan (sync.in_scan, train/layer_grads.py), which come out reduced already (and the sync's
per-layer state in `comm` updated: GradientSync.layer_state). `ScanMicrobatches`
runs a lax.scan; with mesh.pipeline > 1 the pipeline's timetable runner
(jaxpar/parallel/pipeline) does the same job across stages (reducing after its timetable).
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
from jaxpar.train.layer_grads import LayerGrads


def grad_dtype(grad_accum: int, wire_dtype):
    """The dtype the step holds gradients in: float32 to accumulate microbatches, else the wire's
    (train.grad_reduce_dtype)."""
    return jnp.float32 if grad_accum > 1 else wire_dtype


@dataclass(frozen=True)
class ScanMicrobatches:
    """value_and_grad of each microbatch in a lax.scan, added to one accumulator. The layer
    stacks the sync reduces in the backward (train/layer_grads.py) are not differentiated: their
    sinks are; every microbatch runs in the scan, the last one's backward finishing each layer's
    reduction with the accumulated gradient of the others."""

    forward: Forward
    sync: GradientSync
    microbatches: int
    accum_dtype: Any
    varying: tuple[str, ...]  # the manual axes of size > 1 the accumulator varies over (check_vma)
    layers: LayerGrads

    def __call__(self, params, mbs, loss, comm):
        lg, sync, m = self.layers, self.sync, self.microbatches
        top, stacks = lg.split(params)
        state = sync.layer_state(comm)

        def grads_of(mb, acc, is_last):
            def mb_loss(diff, mb):
                top, sinks = diff
                rows = self.forward.context.split(mb)  # this device's part of each sequence
                taps = lg.taps(sinks, acc, is_last, state, loss.scale)
                logits, sown = self.forward(lg.join(top, stacks), rows, taps)
                return loss(logits, rows, sown)

            (_, (value, aux)), (g, g_sinks) = jax.value_and_grad(mb_loss, has_aux=True)(
                (top, lg.sinks(accumulating=m > 1)), mb)
            return sync.microbatch(g, lg.top_specs), g_sinks, (value, aux)

        if lg.active and m == 1:
            g, g_sinks, (value, aux) = grads_of(jax.tree.map(lambda a: a[0], mbs), None, True)
            finished = {p: last for p, (_, last, _) in g_sinks.items()}
            new = {p: st for p, (_, _, st) in g_sinks.items()}
            return (value[None], lg.join(g, finished), jax.tree.map(lambda a: a[None], aux),
                    sync.with_layer_state(comm, new))

        add = lambda a, x: a + x.astype(a.dtype)

        def body(carry, xs):
            acc_top, acc_mid, done = carry
            i, mb = xs
            g, g_sinks, out = grads_of(mb, acc_mid, i == m - 1)
            mid = {p: ct for p, (ct, _, _) in g_sinks.items()}
            last = {p: (ct, st) for p, (_, ct, st) in g_sinks.items()}  # zeros but on the last
            return (jax.tree.map(add, acc_top, g), jax.tree.map(add, acc_mid, mid),
                    jax.tree.map(add, done, last)), out

        zeros = jax.eval_shape(lambda: sync.microbatch(
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), top), lg.top_specs))
        acc_top = jax.tree.map(lambda z: vary(jnp.zeros(z.shape, self.accum_dtype), self.varying), zeros)
        carry = (acc_top, lg.zeros_acc() if lg.active else {}, lg.zeros_done() if lg.active else {})
        (grads, _, done), (losses, aux) = jax.lax.scan(body, carry, (jnp.arange(m), mbs))
        finished, new = {p: d[0] for p, d in done.items()}, {p: d[1] for p, d in done.items()}
        return losses, lg.join(grads, finished), aux, sync.with_layer_state(comm, new)


def make_accumulation(model, plan: Plan, forward: Forward, sync: GradientSync, *, grad_accum: int,
                      pipeline_cfg: Any):
    """The pipeline's runner when mesh.pipeline > 1, else the microbatch scan."""
    if plan.mesh.shape.get("pipeline", 1) > 1:
        return make_step_pipeline(model, plan, pipeline_cfg, grad_accum, forward.ctx, forward.prepare_top,
                                  forward.cast_layers,
                                  sync.microbatch, sync.grad_out, forward.context.split)
    varying = tuple(sorted(a for a in sync.manual if plan.mesh.shape[a] > 1))
    accum = grad_dtype(grad_accum, sync.wire_dtype)
    return ScanMicrobatches(forward, sync, grad_accum, accum, varying,
                            LayerGrads(sync, model.shapes, varying, accum))
