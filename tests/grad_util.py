"""The gradient the optimizer receives, for numerics tests: a Trainer's step built with
`return_grads=True` (metrics["grads"]: after the data-parallel reduction, before clipping).

    grads, norm = first_step_grads(tiny_config(...), devices)            # numpy pytree, float
    grads, norm = first_step_grads(ref_cfg, devices[:1], batch=rows)     # a given [b, seq+1] batch

Compare a layout's grads with the one-device, unsharded run of the same batch (see
tests/test_numerics.py): an optimizer step hides a gradient off by a constant factor.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxpar.train.trainer import Trainer


def grad_trainer(cfg, devices=None) -> tuple[Trainer, callable]:
    """(trainer, step) where step(state, batch) -> (state, metrics) also returns metrics["grads"]."""
    trainer = Trainer(cfg, devices=devices, log=lambda s: None)
    return trainer, trainer.make_step(return_grads=True)


def place_batch(trainer: Trainer, batch) -> jax.Array:
    """A host [global_batch, seq+1] int array laid out as the trainer's step expects."""
    return trainer.put_batch(batch)


def to_numpy(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def first_step_grads(cfg, devices=None, batch=None) -> tuple[dict, float]:
    """(grads as a numpy pytree shaped like the params, global norm) of the first step of `cfg`
    from its fresh state, on the trainer's batch 0 or on `batch` (host tokens). Under local SGD
    the grads are replica-stacked ([replicas, ...]) and the norm is the logged grad_norm."""
    metrics = run_steps(cfg, 1, devices, batches=None if batch is None else [batch])[0]
    return metrics["grads"], float(metrics["grad_norm"])


def run_steps(cfg, steps: int, devices=None, batches=None, states: bool = False) -> list:
    """The numpy metrics (grads included) of `steps` steps of `cfg` from its fresh state, on the
    trainer's batches 0, 1, ... or on the host `batches`; with `states`, (metrics, the numpy
    train state after the step) per step."""
    trainer, step = grad_trainer(cfg, devices)
    state, out = trainer.init_state(), []
    for i in range(steps):
        tokens = trainer.loader.batch(i) if batches is None else place_batch(trainer, batches[i])
        state, metrics = step(state, tokens)
        metrics = canonical_grads(trainer, to_numpy(metrics))
        out.append((metrics, to_numpy(state)) if states else metrics)
    return out


def canonical_grads(trainer: Trainer, metrics: dict) -> dict:
    """`metrics` with its grads' layer stacks in the model's order (the step's follow the plan's
    stored order, interleaved under interleaved_1f1b: sharding.Plan.layer_order), on the host."""
    if "grads" not in metrics or not trainer.plan.interleaves_layers:
        return metrics
    def canonical(g, axes, shape):
        if axes[:1] != ("layers",):
            return g
        lead = g.ndim - len(shape.shape)  # local SGD: a replica dim first
        return np.take(g, np.argsort(trainer.plan.layer_order(g.shape[lead])), axis=lead)
    grads = jax.tree.map(canonical, metrics["grads"], trainer.model.axes, trainer.model.shapes,
                         is_leaf=lambda x: isinstance(x, tuple))
    return {**metrics, "grads": grads}


def plain_grad(model):
    """jit((params, rows) -> grads): jax.grad of the mean token cross entropy of `model` (a
    ModelDef; no aux losses) on host rows [b, seq + 1], on one device: no mesh, no step, no
    optimizer. The reference for what a dense model's step receives (metrics["grads"])."""
    import jax.numpy as jnp
    import optax

    def loss(params, rows):
        logits = model.merge(model.state(params))(rows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), rows[:, 1:]).mean()
    return jax.jit(jax.grad(loss))


def global_norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))
