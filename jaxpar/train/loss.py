"""The loss of one microbatch, as its share of the global-batch mean: one definition for the
plain step's microbatch scan and the pipeline's last stage; and the chunked loss of
train.loss_chunk, which never forms the whole float32 [batch, seq, vocab] logits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jaxpar.nn import project
from jaxpar.train.sown import add_sown


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Summed token NLL in float32; `weights` [b, seq] (packed documents: 0 for a target that does
    not count) multiply each token's NLL."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return (nll if weights is None else nll * weights).sum()


@dataclass(frozen=True)
class DeferredLogits:
    """What the model's head (jaxpar.nn.head) hands the loss under train.loss_chunk: its input x
    [batch, seq, embed] and weight w [embed, vocab]. `token_sum` forms the logits `chunk` tokens
    at a time, each chunk under jax.checkpoint so that the backward forms them again instead of
    keeping them: one chunk's float32 logits exist at a time, forward and backward."""

    x: jax.Array
    w: jax.Array
    chunk: int  # static (pytree metadata)

    def token_sum(self, sum_fn: Callable, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
        b, s, d = self.x.shape
        n = s // self.chunk
        split = lambda a: a.reshape(b, n, self.chunk, *a.shape[2:]).swapaxes(0, 1)
        logits = lambda x, w: project("bsd,dv->bsv", x, w)
        if weights is None:
            one = jax.checkpoint(lambda x, t, w: sum_fn(logits(x, w), t))
            return jax.lax.map(lambda xt: one(xt[0], xt[1], self.w), (split(self.x), split(targets))).sum()
        one = jax.checkpoint(lambda x, t, u, w: sum_fn(logits(x, w), t, u))
        xtu = (split(self.x), split(targets), split(weights))
        return jax.lax.map(lambda a: one(a[0], a[1], a[2], self.w), xtu).sum()


jax.tree_util.register_dataclass(DeferredLogits, data_fields=["x", "w"], meta_fields=["chunk"])


def token_loss_sum(sum_fn: Callable, logits, targets: jax.Array,
                   weights: jax.Array | None = None) -> jax.Array:
    """sum_fn(logits, targets[, weights]) for logits or DeferredLogits (chunk by chunk); the
    weights (packed documents) are passed only when there are some."""
    if isinstance(logits, DeferredLogits):
        return logits.token_sum(sum_fn, targets, weights)
    return sum_fn(logits, targets) if weights is None else sum_fn(logits, targets, weights)


@dataclass(frozen=True)
class MicrobatchLoss:
    """loss(logits, rows, sown) -> (value to differentiate, (token loss, sown metrics)) for one
    microbatch on one device (a train.batch.Rows: targets and their weights). The token NLL is
    divided by `n_tokens`, the targets that count in the whole batch one gradient is the mean
    over (static: this device's batch times `devices`; with packed documents a traced global
    count of the weighted targets), and the sown values by the microbatch's share of it: summed
    over microbatches and devices, both are global means. With `sequence_shards` (context
    parallelism) a device holds that fraction of each sequence: its partial token sum still
    divides by the global count, its sown means count 1/shards."""

    sum_fn: Callable[..., jax.Array]
    n_tokens: int | jax.Array
    share: float
    scale: jax.Array | None = None  # train.loss_scale: the value to differentiate is scaled by it

    @classmethod
    def for_batch(cls, sum_fn, local_tokens_shape: tuple[int, int], devices: int, microbatches: int,
                  n_tokens: jax.Array | None = None, sequence_shards: int = 1,
                  scale: jax.Array | None = None):
        """`local_tokens_shape`: this device's [batch, seq + 1] (all its microbatches, whole
        sequences); `n_tokens`: the counted targets when they are not all of them (packed
        documents)."""
        batch, seq1 = local_tokens_shape
        n = batch * (seq1 - 1) * devices if n_tokens is None else n_tokens
        return cls(sum_fn, n, 1.0 / (devices * microbatches * sequence_shards), scale)

    def __call__(self, logits: jax.Array, rows, sown: dict):
        total = token_loss_sum(self.sum_fn, logits, rows.targets, rows.weights)
        value, aux = add_sown(total / self.n_tokens, sown, self.share)
        return (value if self.scale is None else value * self.scale), aux
