"""A Llama-style decoder in flax NNX: RMSNorm, RoPE, SwiGLU, grouped-query attention,
tied or untied embeddings, layers stacked on a leading `layers` dim and scanned.

Only logical axis names appear here; jaxpar's rules decide what they mean on a mesh.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import nn
from jaxpar.nn import constrain, param, scan_layers
from jaxpar.registry import PRESETS as PRESET_REGISTRY

# Published shapes. Parameter counts: 1b 1,235,814,400 (Llama 3.2 1B), 8b 8,030,261,248
# (Llama 3.1 8B), 70b 70,553,706,496 (Llama 3.1 70B).
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384),
    "small": dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768),
    "1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
               rope_theta=500000.0, tie_embeddings=True),
    "8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               rope_theta=500000.0, tie_embeddings=False),
    "70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                rope_theta=500000.0, tie_embeddings=False),
}
for _name, _fields in PRESETS.items():  # what `model.preset` may name (read by jaxpar/config.py)
    PRESET_REGISTRY.register(_name, _fields)

RESIDUAL = ("batch", "residual_seq", "embed")


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions, head_dim: int, theta: float, scaling=None) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim // 2] at `positions` (an int: 0..positions-1, giving [seq, hd/2];
    or an int array such as [batch, seq] of each token's position); `scaling`: a
    config.RopeScalingConfig (or None)."""
    inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is not None:
        inv = llama3_frequencies(inv, scaling)
    pos = jnp.arange(positions) if isinstance(positions, int) else positions
    ang = pos.astype(jnp.float32)[..., None] * inv
    return jnp.cos(ang), jnp.sin(ang)


def llama3_frequencies(inv: jax.Array, s) -> jax.Array:
    """Llama 3.1: low frequencies (long wavelengths) divided by `factor`, high ones kept, and a
    linear blend in wavelength-ratio between (so a model trained at the original context
    extends to a longer one)."""
    ratio = s.original_max_position_embeddings * inv / (2 * math.pi)  # context / wavelength
    blend = jnp.clip((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor), 0.0, 1.0)
    return (1.0 - blend) * inv / s.factor + blend * inv


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on [batch, seq, heads, head_dim]; cos, sin [seq, hd/2] (shared by the
    batch) or [batch, seq, hd/2] (each row's own positions)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def model_rope(cfg, positions) -> tuple[jax.Array, jax.Array]:
    """The (cos, sin) tables for this model config of positions 0..positions-1 (an int) or of the
    given positions (an int array, e.g. [batch, seq])."""
    return rope_tables(positions, cfg.head_dim or cfg.dim // cfg.n_heads, cfg.rope_theta, cfg.rope_scaling)


def init_attention(layer: nnx.Module, cfg, num_layers: int, rngs: nnx.Rngs) -> tuple[float, float]:
    """The attention params and both norms of a stacked decoder layer (shared by the dense and
    the MoE layer); returns the (input, output-projection) init scales."""
    L, D, H, K = num_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads
    hd = cfg.head_dim or D // H
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    layer.eps = cfg.norm_eps
    # model.attention and its tile / threshold (jaxpar/attention), read by Block.attention
    layer.attn_impl, layer.attn_block = cfg.attention, cfg.attention_block
    layer.attn_threshold = cfg.attention_threshold
    layer.attn_norm = param(rngs, (L, D), ("layers", "norm"), ones=True)
    layer.wq = param(rngs, (L, D, H, hd), ("layers", "embed", "heads", "head_dim"), std=std)
    layer.wk = param(rngs, (L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"), std=std)
    layer.wv = param(rngs, (L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"), std=std)
    layer.wo = param(rngs, (L, H, hd, D), ("layers", "heads", "head_dim", "embed"), std=out_std)
    layer.mlp_norm = param(rngs, (L, D), ("layers", "norm"), ones=True)
    return std, out_std


class Block(nnx.Module):
    """Decoder layers: attention + SwiGLU MLP. Params stacked over `num_layers`."""

    def __init__(self, cfg, num_layers: int, rngs: nnx.Rngs):
        L, D, F = num_layers, cfg.dim, cfg.ffn_dim
        std, out_std = init_attention(self, cfg, num_layers, rngs)
        self.w_gate = param(rngs, (L, D, F), ("layers", "embed", "mlp"), std=std)
        self.w_up = param(rngs, (L, D, F), ("layers", "embed", "mlp"), std=std)
        self.w_down = param(rngs, (L, F, D), ("layers", "mlp", "embed"), std=out_std)

    def qkv(self, h: jax.Array, cos: jax.Array, sin: jax.Array):
        """The rotated queries and keys, and the values, of normed inputs h [batch, seq, dim]."""
        # laid out at the projections, before RoPE: constrained only after it, the compiler kept
        # a sequence-split residual stream's split through the q and k projections (gathering
        # wq and wk whole) and resharded q and k by all-to-alls after RoPE
        q_axes, kv_axes = ("batch", "seq", "heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")
        q = constrain(nn.project("bsd,dhk->bshk", h, self.wq[...]), q_axes)
        k = constrain(nn.project("bsd,dhk->bshk", h, self.wk[...]), kv_axes)
        v = constrain(nn.project("bsd,dhk->bshk", h, self.wv[...]), kv_axes)
        return constrain(apply_rope(q, cos, sin), q_axes), constrain(apply_rope(k, cos, sin), kv_axes), v

    def attention(self, h: jax.Array, cos: jax.Array, sin: jax.Array,
                  segment_ids: jax.Array | None = None) -> jax.Array:
        q, k, v = self.qkv(h, cos, sin)
        o = nn.attention(q, k, v, segment_ids, implementation=self.attn_impl, block=self.attn_block,
                         threshold=self.attn_threshold)
        o = constrain(o, ("batch", "seq", "heads", "head_dim"))
        return nn.project("bshk,hkd->bsd", o, self.wo[...])

    def mlp(self, h: jax.Array) -> jax.Array:
        g = nn.project("bsd,df->bsf", h, self.w_gate[...])
        u = nn.project("bsd,df->bsf", h, self.w_up[...])
        a = constrain(jax.nn.silu(g) * u, ("batch", "seq", "mlp"))
        return nn.project("bsf,fd->bsd", a, self.w_down[...])

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        x = x + self.attention(rms_norm(x, self.attn_norm[...], self.eps), cos, sin, segment_ids)
        x = constrain(x, RESIDUAL)
        x = x + self.mlp(rms_norm(x, self.mlp_norm[...], self.eps))
        return constrain(x, RESIDUAL)

    def decode_attention(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: dict, pos: jax.Array):
        """The attention half of a layer on tokens at positions pos.. (cos/sin: theirs), attending
        to the cache: (x after the attention's residual, the cache with their keys and values
        written at pos..)."""
        q, k, v = self.qkv(rms_norm(x, self.attn_norm[...], self.eps), cos, sin)
        ck = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), pos, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), pos, axis=1)
        # query i (at pos + i) sees the cached keys 0..pos + i: causal, and blind to unwritten slots
        seen = jnp.arange(ck.shape[1])[None, :] <= pos + jnp.arange(x.shape[1])[:, None]
        o = jax.nn.dot_product_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), mask=seen[None, None])
        return x + nn.project("bshk,hkd->bsd", o, self.wo[...]), {"k": ck, "v": cv}

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: dict, pos: jax.Array):
        """One layer on tokens at positions pos.., attending to the cache: (x, the new cache)."""
        x, cache = self.decode_attention(x, cos, sin, cache, pos)
        return x + self.mlp(rms_norm(x, self.mlp_norm[...], self.eps)), cache


def decode_layers(model, tokens: jax.Array, cache: dict, pos: jax.Array) -> tuple[jax.Array, dict]:
    """Incremental decoding through a model's stacked `layers` (each with a `decode(x, cos, sin,
    cache, pos)`) and its `logits`: the decode path of Llama and MoELlama alike."""
    cfg = model.cfg
    x = jnp.take(model.embed[...], tokens, axis=0)
    length = jax.tree.leaves(cache)[0].shape[2]  # every cache leaf: [layers, batch, length, ...]
    cos, sin = model_rope(cfg, length)
    cos, sin = (jax.lax.dynamic_slice_in_dim(t, pos, tokens.shape[1], axis=0) for t in (cos, sin))
    graphdef, state = nnx.split(model.layers)

    def body(h, layer_and_cache):
        layer_state, layer_cache = layer_and_cache
        return nnx.merge(graphdef, layer_state).decode(h, cos, sin, layer_cache, pos)

    x, cache = jax.lax.scan(body, x, (state, cache))
    return model.logits(x), cache


def kv_cache(cfg, layers: int, batch: int, length: int, dtype) -> dict:
    """One stack of keys and values: k, v [layers, batch, length, kv_heads, head_dim]."""
    shape = (layers, batch, length, cfg.n_kv_heads, cfg.head_dim or cfg.dim // cfg.n_heads)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


class Llama(nnx.Module):
    """tokens [batch, seq] int -> logits [batch, seq, vocab]; optional segment_ids [batch, seq]
    (packed documents: attention stays inside a segment) and positions [batch, seq] (each token's
    RoPE position: restarted per document, or a context-parallel shard's global positions;
    default 0..seq-1)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.cfg = cfg
        V, D = cfg.vocab_size, cfg.dim
        self.embed = param(rngs, (V, D), ("vocab", "embed"), std=cfg.init_std)
        self.layers = Block(cfg, cfg.n_layers, rngs)
        self.norm = param(rngs, (D,), ("norm",), ones=True)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (D, V), ("embed", "vocab"), std=cfg.init_std)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, token_weights: jax.Array | None = None) -> jax.Array:
        """tokens [batch, seq] -> logits; segment_ids / positions [batch, seq] for packed
        documents; token_weights (which tokens count) unused: no per-token statistic is sown."""
        cfg = self.cfg
        # the ids whole along the sequence: pinned to the residual's split, their slice off the
        # [b, seq + 1] rows would be a halo exchange (collective-permutes; in a pipeline
        # stage's branch, a rendezvous the other stages never join)
        tokens = constrain(tokens, ("batch", "seq"))
        x = constrain(jnp.take(self.embed[...], tokens, axis=0), RESIDUAL)
        cos, sin = model_rope(cfg, tokens.shape[1] if positions is None else positions)
        x = scan_layers(self.layers, x, lambda layer, h: layer(h, cos, sin, segment_ids))
        return self.logits(x)

    def logits(self, x: jax.Array) -> jax.Array:
        """The final norm and the (tied or own) head."""
        x = rms_norm(x, self.norm[...], self.cfg.norm_eps)
        return nn.head(x, self.embed[...].T if self.cfg.tie_embeddings else self.head[...])

    def decode(self, tokens: jax.Array, cache: dict, pos: jax.Array) -> tuple[jax.Array, dict]:
        """Incremental decoding: tokens [batch, s] at positions pos..pos+s-1, given the keys and
        values of positions < pos in `cache` (init_cache) -> (logits [batch, s, vocab], the
        cache with these positions added). The same math as __call__, which training uses."""
        return decode_layers(self, tokens, cache, pos)


def init_cache(cfg, batch: int, length: int, dtype=jnp.float32) -> dict:
    """An empty KV cache for Llama.decode: k, v [layers, batch, length, kv_heads, head_dim]."""
    return kv_cache(cfg, cfg.n_layers, batch, length, dtype)


def param_count(cfg) -> int:
    """Analytic parameter count (checked against the built model in the tests)."""
    D, H, K, F, V, L = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size, cfg.n_layers
    hd = cfg.head_dim or D // H
    per_layer = D * hd * (2 * H + 2 * K) + 3 * D * F + 2 * D
    return L * per_layer + V * D * (1 if cfg.tie_embeddings else 2) + D
