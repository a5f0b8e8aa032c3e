"""method: int8 -- block-wise absmax int8 with error feedback.

Each block of `block_size` values is sent as int8 q = round(x / s), s = absmax / 127 (one float32
scale per block): 1 + 4 / block_size bytes per value. The reduction is the two-stage one of
base.two_stage_reduce, so int8 crosses the wire both ways (all-to-all, then all-gather).
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxpar.collectives.base import Compressor, blocks, ef_state_shapes


class Int8(Compressor):
    name = "int8"
    error_feedback = True

    def __init__(self, cfg=None, block_size: int | None = None):
        super().__init__(cfg)
        self.block = block_size or (cfg.block_size if cfg is not None else 256)
        self.multiple = self.block

    def compress(self, x):
        b = blocks(x, self.block)
        scale = jnp.max(jnp.abs(b), axis=-1) / 127.0
        safe = jnp.where(scale > 0, scale, 1.0)
        q = jnp.clip(jnp.round(b / safe[..., None]), -127, 127).astype(jnp.int8)
        return {"q": q.reshape(x.shape), "scale": scale}

    def decompress(self, payload):
        q, scale = payload["q"], payload["scale"]
        b = blocks(q, self.block).astype(jnp.float32) * scale[..., None]
        return b.reshape(q.shape)

    def state_shapes(self, length, n):
        return ef_state_shapes(length, n) if self.error_feedback else {}
