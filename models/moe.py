"""Mixture of experts: a softmax top-k router over SwiGLU experts, in a Llama-style decoder.

`MoE` is the layer; `MoELlama` is `models.llama.Llama` with every `moe.every_n`-th MLP replaced by
it (Mixtral: every layer, 8 experts, top-2). Dispatch, capacity and dropping live behind
`jaxpar.nn.experts` (jaxpar/parallel/expert.py); only logical axis names appear here (`expert`
for the experts' dim). The router losses and expert load are reported with `jaxpar.nn.sow`:
  moe/load_balance_loss  Switch: E * sum_e f_e * P_e per sequence, averaged over sequences, where
                         f_e = fraction of the sequence's top-k assignments that chose e and
                         P_e = mean router probability of e (1 when balanced); weight load_balance_coef
  moe/z_loss             mean over tokens of logsumexp(router logits)^2; weight z_loss_coef
  moe/dropped_fraction   fraction of (token, choice) assignments dropped by the capacity
  moe/load               [E] fraction of assignments that chose each expert
each averaged over the MoE layers. With `token_weights` [batch, seq] (packed documents: 0 for
padding and each document's closing EOS, the tokens the LM loss does not count) the router's
statistics count only weighted tokens: f_e, P_e, the z loss and the load are weighted means per
sequence, averaged over sequences (a sequence is a whole row on every layout, so the step's
average over devices stays the one-device value). The dispatch gets them too: a weight-0 token
takes no expert capacity (padding at a row's end would otherwise crowd out real tokens' later
choices), its MoE output is zero, and the dropped fraction is over the weighted tokens'
assignments only, per sequence.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import nn
from jaxpar.nn import constrain, param, scan_layers
from jaxpar.registry import PRESETS as PRESET_REGISTRY
from models.llama import RESIDUAL, Block, Llama, decode_layers, init_attention, kv_cache, model_rope, rms_norm

# Mixtral 8x7B (published): 46,702,792,704 parameters, 12,879,925,248 active per token
# (2 of 8 experts); `param_count` / `active_param_count` give them, the tests check both.
PRESETS: dict[str, dict] = {
    "moe_tiny": dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                     moe=dict(num_experts=8, top_k=2)),
    "moe_small": dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256,
                      moe=dict(num_experts=8, top_k=2, every_n=1)),
    "mixtral_8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         ffn_dim=14336, rope_theta=1e6, tie_embeddings=False,
                         moe=dict(num_experts=8, top_k=2, every_n=1)),
}
for _name, _fields in PRESETS.items():  # what `model.preset` may name (read by jaxpar/config.py)
    PRESET_REGISTRY.register(_name, _fields)

AUX_KEYS = ("lb", "z", "dropped", "load")


def swiglu_experts(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """h [experts, tokens, embed] through each expert's own SwiGLU."""
    g = nn.project("etd,edf->etf", h, w_gate)
    u = nn.project("etd,edf->etf", h, w_up)
    a = constrain(jax.nn.silu(g) * u, ("expert", None, "mlp"))
    return nn.project("etf,efd->etd", a, w_down)


def swiglu_ragged(rows: jax.Array, sizes: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """rows [m, embed] sorted by expert, `sizes` rows per expert, through their expert's SwiGLU."""
    g = jax.lax.ragged_dot(rows, w_gate, sizes)
    u = jax.lax.ragged_dot(rows, w_up, sizes)
    return jax.lax.ragged_dot(jax.nn.silu(g) * u, w_down, sizes)


def _sequence_mean(x: jax.Array, weights: jax.Array | None) -> jax.Array:
    """x [G, S, ...] -> [G, ...]: each sequence's mean over its tokens, weighted by `weights` [G, S]
    (a sequence with no weight gives 0). The sums go through nn.sequence_sum: where a device
    holds part of each sequence (context parallelism) the mean is still the whole sequence's."""
    if weights is None:
        return nn.sequence_sum(x.sum(axis=1)) / nn.sequence_sum(jnp.float32(x.shape[1]))
    w = weights.astype(jnp.float32).reshape(*weights.shape, *(1,) * (x.ndim - 2))
    return nn.sequence_sum((x * w).sum(axis=1)) / jnp.maximum(nn.sequence_sum(w.sum(axis=1)), 1e-30)


def expert_fraction(expert_idx: jax.Array, num_experts: int, weights: jax.Array | None = None) -> jax.Array:
    """f [G, E]: per sequence, the fraction of its (weighted) tokens' top-k assignments to each expert."""
    return _sequence_mean(jax.nn.one_hot(expert_idx, num_experts, dtype=jnp.float32).mean(axis=2), weights)


def load_balance_loss(probs: jax.Array, expert_idx: jax.Array, num_experts: int,
                      weights: jax.Array | None = None) -> jax.Array:
    """Switch load-balancing loss, per sequence then averaged: probs [G, S, E], expert_idx [G, S, k];
    `weights` [G, S]: only weighted tokens count in f and P."""
    f = expert_fraction(expert_idx, num_experts, weights)              # [G, E]
    p = _sequence_mean(probs.astype(jnp.float32), weights)             # [G, E]
    return (num_experts * (f * p).sum(-1)).mean()


def z_loss(logits: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean of logsumexp(logits)^2 over tokens; with `weights` [G, S] the weighted mean per sequence,
    averaged over sequences."""
    z2 = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2
    return _sequence_mean(z2, weights).mean()


class MoE(nnx.Module):
    """Router + `num_experts` SwiGLU experts (+ a shared expert), stacked over `num_layers`."""

    def __init__(self, cfg, num_layers: int, rngs: nnx.Rngs):
        m = cfg.moe
        L, D, E = num_layers, cfg.dim, m.num_experts
        F = m.expert_ffn_dim or cfg.ffn_dim
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.moe = m
        self.router = param(rngs, (L, D, E), ("layers", "embed", None), std=std)
        self.w_gate = param(rngs, (L, E, D, F), ("layers", "expert", "embed", "mlp"), std=std)
        self.w_up = param(rngs, (L, E, D, F), ("layers", "expert", "embed", "mlp"), std=std)
        self.w_down = param(rngs, (L, E, F, D), ("layers", "expert", "mlp", "embed"), std=out_std)
        if m.shared_expert:
            Fs = m.shared_ffn_dim or F
            self.shared_gate = param(rngs, (L, D, Fs), ("layers", "embed", "mlp"), std=std)
            self.shared_up = param(rngs, (L, D, Fs), ("layers", "embed", "mlp"), std=std)
            self.shared_down = param(rngs, (L, Fs, D), ("layers", "mlp", "embed"), std=out_std)

    def route(self, h: jax.Array):
        """(router logits [B, S, E] f32, probs, expert_idx [B, S, k], gates [B, S, k])."""
        m = self.moe
        logits = nn.project("bsd,de->bse", h.astype(jnp.float32), self.router[...].astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1)
        top_p, idx = jax.lax.top_k(probs, m.top_k)
        gates = top_p / top_p.sum(-1, keepdims=True) if m.gates_normalized else top_p
        return logits, probs, idx, gates

    def __call__(self, h: jax.Array, dispatch: str | None = None,
                 token_weights: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """h [batch, seq, embed] -> (y, aux) with aux as in AUX_KEYS (this layer's values).
        `dispatch` overrides moe.dispatch (decoding is dropless: a token's output never depends
        on which other tokens share its step); `token_weights` [batch, seq]: the tokens the
        router losses and the load count and the experts see (None: all; weight-0 tokens take
        no capacity and get y = 0 from the experts, a shared expert still runs on them)."""
        m = self.moe
        logits, probs, idx, gates = self.route(h)
        wg, wu, wd = self.w_gate[...], self.w_up[...], self.w_down[...]
        y, dropped = nn.experts(
            h, idx, gates.astype(h.dtype),
            lambda x: swiglu_experts(x, wg, wu, wd),
            lambda rows, sizes: swiglu_ragged(rows, sizes, wg, wu, wd),
            num_experts=m.num_experts, dispatch=dispatch or m.dispatch, capacity_factor=m.capacity_factor,
            token_weights=token_weights)
        if m.shared_expert:
            g = nn.project("bsd,df->bsf", h, self.shared_gate[...])
            u = nn.project("bsd,df->bsf", h, self.shared_up[...])
            a = constrain(jax.nn.silu(g) * u, ("batch", "seq", "mlp"))
            y = y + nn.project("bsf,fd->bsd", a, self.shared_down[...])
        w = token_weights
        load = expert_fraction(idx, m.num_experts, w).mean(0)
        aux = {"lb": load_balance_loss(probs, idx, m.num_experts, w), "z": z_loss(logits, w),
               "dropped": dropped, "load": load}
        return y, aux


class MoEBlock(nnx.Module):
    """A decoder layer whose MLP is the MoE (attention as in models.llama.Block)."""

    def __init__(self, cfg, num_layers: int, rngs: nnx.Rngs):
        init_attention(self, cfg, num_layers, rngs)
        self.moe = MoE(cfg, num_layers, rngs)

    qkv, attention, decode_attention = Block.qkv, Block.attention, Block.decode_attention

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array | None = None,
                 token_weights: jax.Array | None = None) -> tuple[jax.Array, dict]:
        x = x + self.attention(rms_norm(x, self.attn_norm[...], self.eps), cos, sin, segment_ids)
        x = constrain(x, RESIDUAL)
        y, aux = self.moe(rms_norm(x, self.mlp_norm[...], self.eps), token_weights=token_weights)
        return constrain(x + y, RESIDUAL), aux

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: dict, pos: jax.Array):
        """As models.llama.Block.decode, the MLP the experts' (dropless)."""
        x, cache = self.decode_attention(x, cos, sin, cache, pos)
        y, _ = self.moe(rms_norm(x, self.mlp_norm[...], self.eps), dispatch="dropless")
        return x + y, cache


class Group(nnx.Module):
    """`every_n - 1` dense layers then one MoE layer; the model scans `n_layers / every_n` groups."""

    def __init__(self, cfg, num_groups: int, rngs: nnx.Rngs):
        self.n_dense = cfg.moe.every_n - 1
        for i in range(self.n_dense):
            setattr(self, f"dense{i}", Block(cfg, num_groups, rngs))
        self.moe_layer = MoEBlock(cfg, num_groups, rngs)

    def __call__(self, carry, cos, sin, segment_ids=None, token_weights=None):
        x, acc = carry
        for i in range(self.n_dense):
            x = getattr(self, f"dense{i}")(x, cos, sin, segment_ids)
        x, aux = self.moe_layer(x, cos, sin, segment_ids, token_weights)
        return x, jax.tree.map(jnp.add, acc, aux)

    def decode(self, x, cos, sin, cache: dict, pos):
        """The group's layers in order, each with its own keys and values in `cache[name]`."""
        new = {}
        for name in group_layer_names(self.n_dense + 1):
            x, new[name] = getattr(self, name).decode(x, cos, sin, cache[name], pos)
        return x, new


def group_layer_names(every_n: int) -> list[str]:
    """The attribute names of a Group's layers, in order."""
    return [f"dense{i}" for i in range(every_n - 1)] + ["moe_layer"]


class MoELlama(nnx.Module):
    """tokens [batch, seq] int -> logits [batch, seq, vocab]; router losses and load via nn.sow."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.cfg = cfg
        V, D = cfg.vocab_size, cfg.dim
        self.embed = param(rngs, (V, D), ("vocab", "embed"), std=cfg.init_std)
        self.layers = Group(cfg, cfg.n_layers // cfg.moe.every_n, rngs)
        self.norm = param(rngs, (D,), ("norm",), ones=True)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (D, V), ("embed", "vocab"), std=cfg.init_std)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, token_weights: jax.Array | None = None) -> jax.Array:
        """As models.llama.Llama (segment_ids, positions [batch, seq] optional); token_weights
        [batch, seq]: the tokens the router losses count and the experts route (None: all)."""
        cfg, m = self.cfg, self.cfg.moe
        # the ids whole along the sequence: pinned to the residual's split, their slice off the
        # [b, seq + 1] rows would be a halo exchange (collective-permutes; in a pipeline
        # stage's branch, a rendezvous the other stages never join)
        tokens = constrain(tokens, ("batch", "seq"))
        x = constrain(jnp.take(self.embed[...], tokens, axis=0), RESIDUAL)
        cos, sin = model_rope(cfg, tokens.shape[1] if positions is None else positions)
        acc = {"lb": jnp.zeros(()), "z": jnp.zeros(()), "dropped": jnp.zeros(()),
               "load": jnp.zeros((m.num_experts,))}
        x, acc = scan_layers(self.layers, (x, acc),
                             lambda layer, c: layer(c, cos, sin, segment_ids, token_weights))
        n_moe = cfg.n_layers // m.every_n
        acc = {k: v / n_moe for k, v in acc.items()}
        nn.sow("moe/load_balance_loss", acc["lb"], loss_weight=m.load_balance_coef)
        nn.sow("moe/z_loss", acc["z"], loss_weight=m.z_loss_coef)
        nn.sow("moe/dropped_fraction", acc["dropped"])
        nn.sow("moe/load", acc["load"])
        return self.logits(x)

    logits = Llama.logits

    def decode(self, tokens: jax.Array, cache: dict, pos: jax.Array) -> tuple[jax.Array, dict]:
        """As models.llama.Llama.decode (the cache from moe.init_cache); router losses not sown."""
        return decode_layers(self, tokens, cache, pos)


def init_cache(cfg, batch: int, length: int, dtype=jnp.float32) -> dict:
    """An empty KV cache for MoELlama.decode: per layer of a group, k, v [groups, batch, length,
    kv_heads, head_dim]."""
    groups = cfg.n_layers // cfg.moe.every_n
    return {name: kv_cache(cfg, groups, batch, length, dtype) for name in group_layer_names(cfg.moe.every_n)}


def _counts(cfg) -> tuple[int, int, int]:
    """(params outside the experts, params of one expert over all MoE layers, MoE layers)."""
    m = cfg.moe
    D, H, K, F, V, L = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size, cfg.n_layers
    hd = cfg.head_dim or D // H
    Fe = m.expert_ffn_dim or F
    n_moe = L // m.every_n
    attn = D * hd * (2 * H + 2 * K) + 2 * D
    shared = 3 * D * (m.shared_ffn_dim or Fe) if m.shared_expert else 0
    base = (L * attn + (L - n_moe) * 3 * D * F + n_moe * (D * m.num_experts + shared)
            + V * D * (1 if cfg.tie_embeddings else 2) + D)
    return base, n_moe * 3 * D * Fe, n_moe


def param_count(cfg) -> int:
    """All parameters (checked against the built model in the tests)."""
    base, per_expert, _ = _counts(cfg)
    return base + cfg.moe.num_experts * per_expert


def active_param_count(cfg) -> int:
    """Parameters one token uses: everything but the experts it was not routed to."""
    base, per_expert, _ = _counts(cfg)
    return base + cfg.moe.top_k * per_expert
