"""cuDNN flash attention through jax.nn.dot_product_attention(implementation="cudnn"): GPU only,
bfloat16 or float16. `check_cudnn` says why it cannot run, as a config error, before tracing."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.attention.xla import segment_mask
from jaxpar.config import ConfigError
from jaxpar.manual import axes_left, fully_manual
from jaxpar.platform import current as target_platform
from jaxpar.sharding import entry_axes

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
                    causal: bool = True, layout=None) -> jax.Array:
    """Like xla_attention; with segment ids cuDNN gets the boolean mask (which it reads as a bias).

    Inside the step's shard_map it runs with every mesh axis manual (jaxpar/manual.py: JAX
    partitions cuDNN attention by custom_partitioning, which fails on a partly manual sharding).
    `layout`: (q's spec, k's) over the compiler's axes (heads over `tensor`: nn.Context.spec);
    a compiler axis of size > 1 that it leaves out splits the heads too."""
    check_cudnn(target_platform(), q.dtype)
    mask = None if segment_ids is None else segment_mask(segment_ids)
    q_spec, kv_spec = _split_heads(layout or (P(), P()), q.shape[2], k.shape[2])

    def run(q, k, v, *mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask[0] if mask else None, is_causal=causal,
                                            implementation="cudnn")
    args, specs = (q, k, v), (q_spec, kv_spec, kv_spec)
    if mask is not None:
        args, specs = (*args, mask), (*specs, P())
    return fully_manual(run, args, specs, q_spec, diff=3)


def _split_heads(layout, heads: int, kv_heads: int) -> tuple[P, P]:
    """(q's spec, k's) with every compiler axis of size > 1 that `layout` leaves out put on the
    heads dim (2): in a region with every axis manual each device must hold its own part."""
    mesh = jax.sharding.get_abstract_mesh()
    left = axes_left()
    named = {a for spec in layout for e in spec for a in entry_axes(e)}
    extra = tuple(a for a in left if a not in named and mesh.shape[a] > 1)
    if not extra:
        return layout
    n = math.prod(mesh.shape[a] for a in extra)
    if heads % n or kv_heads % n:
        raise ConfigError(f"model.attention='cudnn': the mesh axes {extra} (size {n}) split neither the "
                          f"batch nor the heads here, and heads={heads} / kv_heads={kv_heads} do not divide "
                          f"by {n}; use model.attention=blockwise or xla")

    def with_heads(spec: P) -> P:
        entries = list(spec) + [None] * (4 - len(spec))
        entries[2] = (*entry_axes(entries[2]), *extra)
        return P(*entries)
    return with_heads(layout[0]), with_heads(layout[1])
