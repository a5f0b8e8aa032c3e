"""Which Hugging Face tensor fills which jaxpar param, and how their layouts differ.

HF stores every projection as torch's Linear weight, [out_features, in_features]; jaxpar's
params are [in, out] with the head dims split out. Per layer (H query heads, K KV heads,
head dim d, model dim D, MLP dim F):

  q_proj [H*d, D] -> wq [D, H, d]      (transpose, split the out dim into heads)
  k_proj / v_proj [K*d, D] -> wk / wv [D, K, d]
  o_proj [D, H*d] -> wo [H, d, D]      (transpose, split the in dim into heads)
  gate/up_proj [F, D] -> w_gate/w_up [D, F];  down_proj [D, F] -> w_down [F, D]
  lm_head [V, D] -> head [D, V];  embed_tokens [V, D] -> embed [V, D] (as is)
  Mixtral: gate [E, D] -> router [D, E];  experts.e.w1 / w3 / w2 -> w_gate / w_up / w_down[e]

jaxpar stacks the layers (and a Mixtral layer's experts) on leading dims, so one param gathers
L (or L*E) HF tensors.

RoPE: both use the rotate-half convention: a head's dims split into halves (x1, x2) rotated as
(x1 cos - x2 sin, x2 cos + x1 sin) with frequency i on dims i and i + d/2 (models/llama.py
apply_rope; transformers' rotate_half). HF's q/k weights are already permuted into that
convention by its own conversion from Meta's interleaved (pairs 2i, 2i+1) layout, so the q/k
rows map over unchanged: no permutation here. (A checkpoint in Meta's original interleaved
layout would need rows i, i + d/2 interleaved; this module does not read those.)

Every mapping is a pure transpose/reshape, so import then export is bit-exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

# how one HF tensor becomes one (per-layer) jaxpar slab; see `to_ours`
COPY, T, T_SPLIT_OUT, T_SPLIT_IN = "copy", "T", "T_split_out", "T_split_in"


@dataclass(frozen=True)
class Entry:
    """One jaxpar param: its path, the HF tensor names filling its leading `stack` dims (row-major
    over those dims), the per-tensor transform, and the per-tensor jaxpar shape."""

    path: tuple[str, ...]
    names: tuple[str, ...]
    stack: tuple[int, ...]       # leading jaxpar dims that index HF tensors (layers, experts)
    kind: str
    shape: tuple[int, ...]       # jaxpar shape of one slab (without the stack dims)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.stack + self.shape

    @property
    def hf_shape(self) -> tuple[int, ...]:
        s = self.shape
        if self.kind == T_SPLIT_OUT:
            return (s[1] * s[2], s[0])
        if self.kind == T_SPLIT_IN:
            return (s[2], s[0] * s[1])
        return s[::-1] if self.kind == T else s


def entries(m) -> list[Entry]:
    """The param table of a jaxpar ModelConfig (dense Llama or Mixtral-shaped MoE)."""
    L, D, H, K, F, V = m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size
    d = m.resolved_head_dim
    moe = m.moe.num_experts > 0
    base = ("layers", "moe_layer") if moe else ("layers",)
    lay = lambda suffix: tuple(f"model.layers.{i}.{suffix}" for i in range(L))
    out = [Entry(("embed",), ("model.embed_tokens.weight",), (), COPY, (V, D)),
           Entry(("norm",), ("model.norm.weight",), (), COPY, (D,))]
    if not m.tie_embeddings:
        out.append(Entry(("head",), ("lm_head.weight",), (), T, (D, V)))
    out += [
        Entry(base + ("attn_norm",), lay("input_layernorm.weight"), (L,), COPY, (D,)),
        Entry(base + ("mlp_norm",), lay("post_attention_layernorm.weight"), (L,), COPY, (D,)),
        Entry(base + ("wq",), lay("self_attn.q_proj.weight"), (L,), T_SPLIT_OUT, (D, H, d)),
        Entry(base + ("wk",), lay("self_attn.k_proj.weight"), (L,), T_SPLIT_OUT, (D, K, d)),
        Entry(base + ("wv",), lay("self_attn.v_proj.weight"), (L,), T_SPLIT_OUT, (D, K, d)),
        Entry(base + ("wo",), lay("self_attn.o_proj.weight"), (L,), T_SPLIT_IN, (H, d, D)),
    ]
    if not moe:
        out += [Entry(("layers", "w_gate"), lay("mlp.gate_proj.weight"), (L,), T, (D, F)),
                Entry(("layers", "w_up"), lay("mlp.up_proj.weight"), (L,), T, (D, F)),
                Entry(("layers", "w_down"), lay("mlp.down_proj.weight"), (L,), T, (F, D))]
        return out
    E = m.moe.num_experts
    ex = lambda w: tuple(f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
                         for i in range(L) for e in range(E))
    mo = base + ("moe",)
    out += [Entry(mo + ("router",), lay("block_sparse_moe.gate.weight"), (L,), T, (D, E)),
            Entry(mo + ("w_gate",), ex("w1"), (L, E), T, (D, F)),
            Entry(mo + ("w_up",), ex("w3"), (L, E), T, (D, F)),
            Entry(mo + ("w_down",), ex("w2"), (L, E), T, (F, D))]
    return out


def to_ours(kind: str, shape: tuple[int, ...], read: Callable[[tuple], np.ndarray],
            index: tuple[slice, ...]) -> np.ndarray:
    """The part `index` (slices, one per dim of `shape`) of one jaxpar slab, reading from its HF
    tensor only the rows and columns that part needs: read(hf_index) -> the HF tensor's part."""
    idx = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    if kind == COPY:
        return read(idx)
    if kind == T:
        return read((idx[1], idx[0])).T
    if kind == T_SPLIT_OUT:  # ours [D, N, d] <- hf [N*d, D]
        (sD, sN, sd), d = idx, shape[2]
        x = read((slice(sN.start * d, sN.stop * d), sD)).T
        return x.reshape(x.shape[0], -1, d)[:, :, sd]
    if kind == T_SPLIT_IN:  # ours [N, d, D] <- hf [D, N*d]
        (sN, sd, sD), d = idx, shape[1]
        x = read((sD, slice(sN.start * d, sN.stop * d))).T
        return x.reshape(-1, d, x.shape[1])[:, sd, :]
    raise ValueError(kind)


def to_hf(kind: str, slab: np.ndarray) -> np.ndarray:
    """One jaxpar slab -> its HF tensor (C-contiguous, as safetensors writes it)."""
    if kind == COPY:
        return np.ascontiguousarray(slab)
    if kind == T:
        return np.ascontiguousarray(slab.T)
    if kind == T_SPLIT_OUT:
        return np.ascontiguousarray(slab.reshape(slab.shape[0], -1).T)
    if kind == T_SPLIT_IN:
        return np.ascontiguousarray(slab.reshape(-1, slab.shape[-1]).T)
    raise ValueError(kind)
