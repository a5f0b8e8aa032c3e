"""cuDNN flash attention through jax.nn.dot_product_attention(implementation="cudnn"): GPU only,
bfloat16 or float16. `check_cudnn` says why it cannot run, as a config error, before tracing."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.attention.xla import segment_mask
from jaxpar.config import ConfigError

DTYPES = ("bfloat16", "float16")


def cudnn_problem(platform: str, dtype) -> str | None:
    """Why cuDNN attention cannot run on `platform` with inputs of `dtype` (None: it can)."""
    if platform != "gpu":
        return f"cuDNN flash attention needs a GPU, and this run's devices are {platform}"
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        return (f"cuDNN flash attention runs in {' or '.join(DTYPES)}, and attention computes in "
                f"{name} (train.compute_dtype)")
    return None


def check_cudnn(platform: str, dtype) -> None:
    problem = cudnn_problem(platform, dtype)
    if problem:
        fix = "train.compute_dtype=bfloat16, or " if platform == "gpu" else ""
        raise ConfigError(f"model.attention='cudnn': {problem}; use {fix}model.attention=auto (cudnn where "
                          f"it runs), blockwise or xla")


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                    causal: bool = True) -> jax.Array:
    """Like xla_attention; with segment ids cuDNN gets the boolean mask (which it reads as a bias)."""
    check_cudnn(jax.default_backend(), q.dtype)
    mask = None if segment_ids is None else segment_mask(segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")
