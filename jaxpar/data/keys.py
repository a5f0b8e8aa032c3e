"""Per-row random keys: a counter-based hash (splitmix64) of (seed, step, row), vectorised in numpy.

Computing any subset of rows gives exactly the keys those rows have in the full batch, so every
source (jaxpar/data/loader.py, synthetic.py) draws its randomness from here.
"""
from __future__ import annotations

import numpy as np

_M64 = 0xFFFF_FFFF_FFFF_FFFF


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a bijective, well-mixed hash of uint64 values (wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_keys(seed: int, step: int, row_indices: np.ndarray, salt: int = 0) -> np.ndarray:
    """One uint64 random key per row, depending only on (seed, step, row, salt)."""
    k = mix64(np.uint64((seed ^ (salt << 32)) & _M64))
    k = mix64(k ^ np.uint64(step & _M64))
    return mix64(k ^ np.asarray(row_indices, dtype=np.uint64))
