"""The reference: jax.nn.dot_product_attention with the XLA implementation. It materialises the
float32 [batch, heads, seq, seq] scores; segment ids become a boolean [batch, 1, seq, seq] mask."""
from __future__ import annotations

import jax


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[b, seq] ids -> [b, 1, seq, seq] bool: query i may see key j of the same segment."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                  causal: bool = True) -> jax.Array:
    """q [b, s, heads, d], k and v [b, s, kv_heads, d] -> [b, s, heads, d]."""
    mask = None if segment_ids is None else segment_mask(segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")
