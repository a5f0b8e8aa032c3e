"""The loss of one microbatch, as its share of the global-batch mean: one definition for the
plain step's microbatch scan and the pipeline's last stage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jaxpar.train.sown import add_sown


def cross_entropy_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Summed token NLL in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).sum()


@dataclass(frozen=True)
class MicrobatchLoss:
    """loss(logits, tokens, sown) -> (value to differentiate, (token loss, sown metrics)) for one
    microbatch on one device. The token NLL is divided by `n_tokens`, the tokens of the whole batch
    one gradient is the mean over (this device's batch times `devices`), and the sown values by
    the microbatch's share of it: summed over microbatches and devices, both are global means."""

    sum_fn: Callable[[jax.Array, jax.Array], jax.Array]
    n_tokens: int
    share: float

    @classmethod
    def for_batch(cls, sum_fn, local_tokens_shape: tuple[int, int], devices: int, microbatches: int):
        """`local_tokens_shape`: this device's [batch, seq + 1] (all its microbatches)."""
        batch, seq1 = local_tokens_shape
        return cls(sum_fn, batch * (seq1 - 1) * devices, 1.0 / (devices * microbatches))

    def __call__(self, logits: jax.Array, tokens: jax.Array, sown: dict):
        return add_sown(self.sum_fn(logits, tokens[:, 1:]) / self.n_tokens, sown, self.share)
