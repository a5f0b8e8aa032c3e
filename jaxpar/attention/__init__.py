"""Attention implementations, one module each; `attention` picks one by name (model.attention).

  xla        jax.nn.dot_product_attention (XLA): the reference; [b, heads, seq, seq] scores
  blockwise  our online-softmax attention over query/key tiles with a recomputing custom VJP
             (blockwise.py): O(seq x block) memory, every backend, the tiles the causal mask or
             the segment ids leave empty skipped
  cudnn      cuDNN flash attention (GPU, bfloat16/float16)
  auto       cudnn where it runs, else blockwise from `threshold` tokens on, else xla

Every implementation takes q [b, seq, heads, d], k and v [b, seq, kv_heads, d] (GQA without
repeating K/V), is causal, and honours optional segment ids [b, seq] (no attention across a
segment boundary). To add one: a module here with `<name>_attention(q, k, v, segment_ids, *,
causal)`, its line in IMPLEMENTATIONS, and its name in jaxpar.config.ATTENTION_IMPLEMENTATIONS.
Models reach this through jaxpar.nn.attention, where a strategy (context parallelism) can
replace it via nn.Context.attention.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax

from jaxpar.attention.blockwise import blockwise_attention
from jaxpar.attention.cudnn import check_cudnn, cudnn_attention, cudnn_problem
from jaxpar.attention.xla import segment_mask, xla_attention
from jaxpar.platform import current as target_platform

CUDNN_MAX_HEAD_DIM = 128  # what `auto` trusts cuDNN's flash kernel with (multiples of 8)


def implementations(block: int, layout=None) -> dict[str, Callable]:
    """name -> fn(q, k, v, segment_ids, *, causal), each with its own options bound (blockwise's
    tile; cudnn's operand layout inside the step's shard_map)."""
    return {"xla": xla_attention, "cudnn": functools.partial(cudnn_attention, layout=layout),
            "blockwise": functools.partial(blockwise_attention, block=block)}


def resolve(implementation: str, *, platform: str, dtype, seq_len: int, head_dim: int, threshold: int) -> str:
    """The implementation `auto` stands for here (any other name is returned as it is)."""
    if implementation != "auto":
        return implementation
    if (cudnn_problem(platform, dtype) is None and head_dim <= CUDNN_MAX_HEAD_DIM and head_dim % 8 == 0):
        return "cudnn"
    return "blockwise" if seq_len >= threshold else "xla"


def check(implementation: str, platform: str, compute_dtype) -> None:
    """ConfigError when `implementation` cannot run on `platform` in `compute_dtype` (call it
    before anything is allocated; tracing checks again)."""
    if implementation == "cudnn":
        check_cudnn(platform, compute_dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
              implementation: str = "auto", block: int = 512, threshold: int = 2048,
              causal: bool = True, layout=None) -> jax.Array:
    """Causal attention by the named implementation (see the module docstring). `layout`: how
    the compiler's mesh axes split (q, k) inside the step's shard_map (nn.Context.spec), for
    cudnn, which runs there with every axis manual."""
    name = resolve(implementation, platform=target_platform(), dtype=q.dtype, seq_len=q.shape[1],
                   head_dim=q.shape[-1], threshold=threshold)
    fns = implementations(block, layout)
    if name not in fns:
        raise ValueError(f"unknown attention implementation {name!r}; valid: auto, {', '.join(fns)}")
    return fns[name](q, k, v, segment_ids, causal=causal)


__all__ = ["attention", "blockwise_attention", "check", "cudnn_attention", "resolve", "segment_mask",
           "xla_attention"]
