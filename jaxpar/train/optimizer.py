"""AdamW with warmup + cosine, global-norm clipping and a weight-decay mask (no decay on norms,
biases or any 1-D parameter); mu in optimizer.mu_dtype. Master weights: jaxpar/train/precision.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar.collectives.onebit_adam import onebit_adam
from jaxpar.config import OptimizerConfig
from jaxpar.train.decay import decay_mask, schedule


def schedule_count(opt_state) -> jax.Array:
    """The step count the learning-rate schedule is read at: optax's ScaleByScheduleState (AdamW),
    else the first state with a `count` (1-bit Adam's). Skipped non-finite steps leave it behind
    the train step. Replica-stacked states (local SGD) step together: their first row."""
    has_count = lambda x: "count" in getattr(x, "_fields", ())  # a NamedTuple state with a count
    counted = [x for x in jax.tree.leaves(opt_state, is_leaf=has_count) if has_count(x)]
    sched = [x for x in counted if isinstance(x, optax.ScaleByScheduleState)]
    if not counted:
        raise ValueError("the optimizer state has no step count to read the learning-rate schedule at")
    return (sched or counted)[0].count.reshape(-1)[0]


def build_optimizer(cfg: OptimizerConfig, total_steps: int, axes_tree: dict) -> optax.GradientTransformation:
    if getattr(cfg, "name", "adamw") == "onebit_adam":
        return onebit_adam(cfg, total_steps, axes_tree)
    parts = []
    if cfg.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             mu_dtype=jnp.dtype(cfg.mu_dtype), weight_decay=cfg.weight_decay,
                             mask=decay_mask(axes_tree)))
    return optax.chain(*parts)
