"""The reference: jax.nn.dot_product_attention with the XLA implementation. It materialises the
float32 [batch, heads, seq, seq] scores; segment ids become a boolean [batch, 1, seq, seq] mask."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

# softmax's custom jvp (jax's default from 0.12.1, a flag before): the backward keeps the
# probabilities alone, not also exp(x - max) and its sum, one float32 [heads, keys] per query
# token and layer less. Turned on here for every jax jaxpar supports, so that the residuals (and
# the planner's memory model, planner/memory.py) are the same on each; `nullcontext` once jax
# drops the flag.
_softmax_custom_jvp = getattr(jax, "softmax_custom_jvp", lambda on: contextlib.nullcontext())


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[b, seq] ids -> [b, 1, seq, seq] bool: query i may see key j of the same segment."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                  causal: bool = True) -> jax.Array:
    """q [b, s, heads, d], k and v [b, s, kv_heads, d] -> [b, s, heads, d].

    float16 runs in float32 and comes back in float16: jax's XLA attention asks for float16 dots
    with float32 accumulation by name (DotAlgorithmPreset.F16_F16_F32), which XLA:CPU (and TPU)
    refuse when the step lowers (jax 0.12.0.1: "not supported by dot_general on CPU"). float16
    values are exact in float32, so the scores are those of that preset."""
    if q.dtype == jnp.float16:
        up = lambda x: x.astype(jnp.float32)
        return xla_attention(up(q), up(k), up(v), segment_ids, causal=causal).astype(q.dtype)
    mask = None if segment_ids is None else segment_mask(segment_ids)
    with _softmax_custom_jvp(True):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")
