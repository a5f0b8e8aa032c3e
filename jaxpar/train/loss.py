"""The loss of one microbatch, as its share of the global-batch mean: one definition for the
plain step's microbatch scan and the pipeline's last stage; and the chunked loss of
train.loss_chunk, which never forms the whole float32 [batch, seq, vocab] logits."""
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
class DeferredLogits:
    """What the model's head (jaxpar.nn.head) hands the loss under train.loss_chunk: its input x
    [batch, seq, embed] and weight w [embed, vocab]. `token_sum` forms the logits `chunk` tokens
    at a time, each chunk under jax.checkpoint so that the backward forms them again instead of
    keeping them: one chunk's float32 logits exist at a time, forward and backward."""

    x: jax.Array
    w: jax.Array
    chunk: int  # static (pytree metadata)

    def token_sum(self, sum_fn: Callable, targets: jax.Array) -> jax.Array:
        b, s, d = self.x.shape
        n = s // self.chunk
        xs = self.x.reshape(b, n, self.chunk, d).swapaxes(0, 1)
        ts = targets.reshape(b, n, self.chunk).swapaxes(0, 1)
        one = jax.checkpoint(lambda x, t, w: sum_fn(jnp.einsum("bsd,dv->bsv", x, w), t))
        return jax.lax.map(lambda xt: one(xt[0], xt[1], self.w), (xs, ts)).sum()


jax.tree_util.register_dataclass(DeferredLogits, data_fields=["x", "w"], meta_fields=["chunk"])


def token_loss_sum(sum_fn: Callable, logits, targets: jax.Array) -> jax.Array:
    """sum_fn(logits, targets) for logits or DeferredLogits (chunk by chunk)."""
    if isinstance(logits, DeferredLogits):
        return logits.token_sum(sum_fn, targets)
    return sum_fn(logits, targets)


@dataclass(frozen=True)
class MicrobatchLoss:
    """loss(logits, targets, sown) -> (value to differentiate, (token loss, sown metrics)) for one
    microbatch on one device. The token NLL is divided by `n_tokens`, the tokens of the whole batch
    one gradient is the mean over (this device's batch times `devices`), and the sown values by
    the microbatch's share of it: summed over microbatches and devices, both are global means.
    With `sequence_shards` (context parallelism) a device holds that fraction of each sequence:
    its partial token sum still divides by the global count, its sown means count 1/shards."""

    sum_fn: Callable[[jax.Array, jax.Array], jax.Array]
    n_tokens: int
    share: float

    @classmethod
    def for_batch(cls, sum_fn, local_tokens_shape: tuple[int, int], devices: int, microbatches: int,
                  sequence_shards: int = 1):
        """`local_tokens_shape`: this device's [batch, seq + 1] (all its microbatches, whole
        sequences)."""
        batch, seq1 = local_tokens_shape
        return cls(sum_fn, batch * (seq1 - 1) * devices, 1.0 / (devices * microbatches * sequence_shards))

    def __call__(self, logits: jax.Array, targets: jax.Array, sown: dict):
        return add_sown(token_loss_sum(self.sum_fn, logits, targets) / self.n_tokens, sown, self.share)
