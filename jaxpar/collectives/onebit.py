"""method: onebit -- the sign of each value plus one scale per block, with error feedback.

A block of `block_size` values is sent as its signs, packed 8 per byte (uint8), and its mean
absolute value s (float32): x ~ s * sign(x) (zero counts as +). 1/8 + 4 / block_size bytes per
value. Two-stage reduction as in base.two_stage_reduce, so packed signs cross the wire both
ways; error feedback on both stages is what makes 1-bit converge.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxpar.collectives.base import Compressor, blocks, ef_state_shapes
from jaxpar.config import ConfigError

SHIFTS = np.arange(8, dtype=np.uint8)  # numpy: a jnp array here would start a JAX backend at import


def pack_bits(bits):
    """[..., 8k] bool -> [..., k] uint8 (bit i of byte j is element 8j + i)."""
    b = bits.astype(jnp.uint8).reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)
    return jnp.sum(b << SHIFTS, axis=-1, dtype=jnp.uint8)


def unpack_bits(packed):
    """[..., k] uint8 -> [..., 8k] bool."""
    bits = (packed[..., None] >> SHIFTS) & 1
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8).astype(bool)


class OneBit(Compressor):
    name = "onebit"
    error_feedback = True

    def __init__(self, cfg=None, block_size: int | None = None):
        super().__init__(cfg)
        self.block = block_size or (cfg.block_size if cfg is not None else 256)
        if self.block % 8:
            raise ConfigError(
                f"gradient_compression.block_size={self.block} does not divide into bytes: onebit packs "
                f"8 signs per byte, so the block size must be a multiple of 8 (e.g. 256)")
        self.multiple = self.block

    def compress(self, x):
        b = blocks(x, self.block)
        scale = jnp.mean(jnp.abs(b), axis=-1)
        return {"signs": pack_bits(x >= 0), "scale": scale}

    def decompress(self, payload):
        signs, scale = payload["signs"], payload["scale"]
        s = jnp.where(unpack_bits(signs), 1.0, -1.0).astype(jnp.float32)
        return (blocks(s, self.block) * scale[..., None]).reshape(s.shape)

    def state_shapes(self, length, n):
        return ef_state_shapes(length, n) if self.error_feedback else {}
