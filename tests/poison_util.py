"""A model and a data source that make chosen steps non-finite (the non-finite guard's tests)."""
import jax.numpy as jnp

from models.llama import Llama


class PoisonSource:
    """Wraps a token source: rows of the `bad` data steps get a -1 token (the model turns it into NaN)."""

    def __init__(self, base, bad=()):
        self.base, self.bad = base, set(bad)

    def rows(self, step, row_indices, seq_len):
        rows = self.base.rows(step, row_indices, seq_len)
        if step in self.bad:
            rows = rows.copy()
            rows[:, 0] = -1
        return rows


class Poisoned(Llama):
    """The Llama whose logits are NaN for a batch holding a -1 token."""

    def __call__(self, tokens):
        bad = (tokens < 0).any()
        return super().__call__(jnp.maximum(tokens, 0)) * jnp.where(bad, jnp.nan, 1.0)


def poisoned_factory(cfg):
    return lambda rngs: Poisoned(cfg.model, rngs)
