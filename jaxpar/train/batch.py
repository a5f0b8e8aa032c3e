"""The batch as the step carries it, and the documents of packed rows derived from its tokens.

`Batch` is one pytree that the step's shard_map, the microbatch scan and the pipeline move as
they moved the bare tokens: every field has the rows on dim 0 and the sequence on dim 1, so a
split of the batch (or, later, of the sequence) cuts them all alike. `Documents` (data.packing)
derives the document fields from the tokens alone, once, on the global batch before the
shard_map: an end-of-text token (EOS) ends its document, so the token after it starts the next
one. Padding is EOS too (jaxpar/data/packing.py): each pad is a document of its own whose target
counts for nothing.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Batch(NamedTuple):
    """Rows of tokens [b, seq + 1] (inputs and, shifted by one, targets); with packed documents
    also, per input, segment_ids [b, seq] (its document), positions [b, seq] (its place in the
    document: data.reset_positions) and weights [b, seq] (1.0 where its target counts, 0.0 for
    the target after an EOS: the next document's first token, or padding)."""

    tokens: jax.Array
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    weights: jax.Array | None = None

    @property
    def inputs(self) -> jax.Array:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> jax.Array:
        return self.tokens[:, 1:]

    def rows(self) -> "Rows":
        """The model's and the loss's view: inputs and targets [b, seq] (the whole sequences)."""
        return Rows(self.inputs, self.targets, self.segment_ids, self.positions, self.weights)

    def token_count(self) -> jax.Array | int:
        """The targets that count in these rows: a static int unless the batch has weights."""
        if self.weights is None:
            return self.inputs.shape[0] * self.inputs.shape[1]
        return self.weights.sum()


class Rows(NamedTuple):
    """What one device runs of a microbatch: inputs and targets [b, s] and the optional
    per-input fields (Batch's). With context parallelism s is this device's part of each
    sequence and `positions` are its tokens' global (or per-document) positions."""

    inputs: jax.Array
    targets: jax.Array
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    weights: jax.Array | None = None

    def apply(self, model):
        """model(inputs), with segment_ids / positions / token_weights (the target weights: which
        tokens count, for the model's own per-token statistics such as MoE router losses) when
        given (a model that takes none of them still runs unpacked, unsplit rows). token_weights
        are optional information: a model whose call does not name them runs packed rows too."""
        kw = {k: getattr(self, k) for k in ("segment_ids", "positions") if getattr(self, k) is not None}
        if self.weights is not None and _takes(model, "token_weights"):
            kw["token_weights"] = self.weights
        return model(self.inputs, **kw)


def _takes(model, name: str) -> bool:
    """Whether model(...) accepts the keyword `name` (named, or through **kwargs)."""
    try:
        params = inspect.signature(model).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@dataclass(frozen=True)
class Documents:
    """data.packing: how the step reads documents out of packed rows (`eos_id`: the token that
    ends a document; `reset_positions`: RoPE positions restart at 0 in each document)."""

    eos_id: int
    reset_positions: bool = False

    def __call__(self, tokens: jax.Array) -> Batch:
        return document_batch(tokens, self.eos_id, self.reset_positions)


def document_batch(tokens: jax.Array, eos_id: int, reset_positions: bool = False) -> Batch:
    """The Batch of rows `tokens` [b, seq + 1] whose documents each end with `eos_id`.

    An input's segment id is the number of EOS before it in its row (an EOS belongs to the
    document it ends), its position the distance to its document's first token, and its target
    counts unless the input is an EOS."""
    x = tokens[:, :-1]
    eos = x == eos_id
    segment_ids = (jnp.cumsum(eos, axis=1, dtype=jnp.int32) - eos).astype(jnp.int32)
    positions = None
    if reset_positions:
        idx = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)
        first = jnp.concatenate([jnp.ones_like(eos[:, :1]), eos[:, :-1]], axis=1)  # starts a document
        positions = idx - jax.lax.cummax(jnp.where(first, idx, 0), axis=1)
    return Batch(tokens, segment_ids, positions, jnp.logical_not(eos).astype(jnp.float32))
