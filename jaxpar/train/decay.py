"""What AdamW (optimizer.py) and 1-bit Adam (jaxpar/collectives/onebit_adam.py) share: the
learning-rate schedule (warmup + cosine) and the weight-decay mask (no decay on norms, biases
or any 1-D parameter)."""
from __future__ import annotations

import jax
import optax

from jaxpar.config import OptimizerConfig


def schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The learning rate at an optimizer count (a scalar, or an array of counts)."""
    decay = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
    warmup_cosine = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=decay, end_value=cfg.lr * cfg.min_lr_ratio,
    )

    def lr(count):
        # computed once a step: left to fusion, XLA copies the cosine into every parameter's
        # update kernel (XLA:CPU compiled those copies: 5-8% of a small model's step compile)
        return jax.lax.optimization_barrier(warmup_cosine(count))
    return lr


def decays(axes: tuple) -> bool:
    """Whether a param with these logical axes takes weight decay: a matrix of each layer, not a
    norm, bias or vector. A stack's leading `layers` dim (jaxpar.nn.scan_layers) does not count:
    a layer's bias decays stacked or not."""
    per_layer = axes[1:] if axes[:1] == ("layers",) else axes
    return len(per_layer) >= 2 and "norm" not in axes and "bias" not in axes


def decay_mask(axes_tree: dict) -> dict:
    return jax.tree.map(decays, axes_tree, is_leaf=lambda x: isinstance(x, tuple))
