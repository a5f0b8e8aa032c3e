"""method: powersgd -- rank-r low-rank gradients (Vogels et al., 2019), error feedback, warm start.

Each gradient matrix M (a parameter with >= 2 dims, seen as m x n; a leading `layers` dim is a
batch of matrices) plus its residual is reduced as

    P = psum(M Q)          m x r      (Q: n x r, last step's, warm start)
    P = orthonormal(P)
    Q = psum(M^T P)        n x r      (kept for the next step)
    sum over devices of M  ~  P Q^T

so (m + n) * r floats cross the wire instead of m * n. Each device keeps M - P P^T M (what its
own M lost) as its residual. Parameters that are not matrices (norm scales), or too small to win
((m + n) r >= m n), are all-reduced in float32.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.collectives.base import Compressor, Group


def matrix_split(shape: tuple[int, ...]) -> int | None:
    """The dim index k such that shape[:k] x shape[k:] is the squarest matrix (None if < 2 dims)."""
    if len(shape) < 2:
        return None
    return min(range(1, len(shape)), key=lambda k: math.prod(shape[:k]) + math.prod(shape[k:]))


def orthonormal(p: jax.Array) -> jax.Array:
    """Orthonormal columns spanning p ([..., m, r]); QR, identical on every device."""
    q, _ = jnp.linalg.qr(p)
    return q


class PowerSGD(Compressor):
    name = "powersgd"
    error_feedback = True
    per_slice = False  # Q per stacked matrix, warm-started from the last step (reducer.py)

    def __init__(self, cfg=None, rank: int | None = None):
        super().__init__(cfg)
        self.rank = rank or (cfg.rank if cfg is not None else 4)

    def worth_it(self, m: int, n: int) -> bool:
        return (m + n) * self.rank < m * n and min(m, n) > self.rank

    # compress/decompress on a batch of matrices [b, m, n], for tests and single-device use
    def compress(self, m_: jax.Array, q: jax.Array | None = None) -> dict:
        if q is None:
            q = init_q(m_.shape[:-2], m_.shape[-1], self.rank)
        p = orthonormal(m_ @ q)
        return {"p": p, "q": jnp.swapaxes(m_, -1, -2) @ p}

    def decompress(self, payload):
        return payload["p"] @ jnp.swapaxes(payload["q"], -1, -2)

    def reduce_matrix(self, m_: jax.Array, state: dict, group: Group) -> tuple[jax.Array, dict]:
        """m_: [b, m, n] this device's gradient; state: residual [b, m, n], q [b, n, r]."""
        v = m_ + state["residual"] if "residual" in state else m_
        p = orthonormal(group.psum(v @ state["q"]))
        q_local = jnp.swapaxes(v, -1, -2) @ p
        q = group.psum(q_local)
        approx = p @ jnp.swapaxes(q, -1, -2)
        if not self.error_feedback:
            return approx, {"q": q}
        # this device's own approximation sits behind a barrier: with oneDNN dots (XLA:CPU, bf16
        # compute) XLA fuses `v - dot` into the dot as a subtract taking the dot second, which
        # oneDNN cannot build ("partition compile failed", then the process dies of SIGILL)
        own = jax.lax.optimization_barrier(p @ jnp.swapaxes(q_local, -1, -2))
        return approx, {"residual": v - own, "q": q}


def init_q(batch: tuple[int, ...], n: int, rank: int, seed: int = 0) -> jax.Array:
    """The first Q: gaussian, the same on every device (a fixed key)."""
    return jax.random.normal(jax.random.key(seed), (*batch, n, rank), jnp.float32)
