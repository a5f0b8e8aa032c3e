"""A learnable synthetic source: no files, any vocab size, and a loss that visibly falls.

Each row follows a fixed affine rule x[t+1] = (a * x[t] + b) % vocab, derived from the seed,
except that with probability `noise` a token is drawn uniformly instead. A model that learns
the rule reaches a loss near the noise entropy; one that learns nothing stays at log(vocab).
"""
from __future__ import annotations

import math

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data.keys import mix64, row_keys

_SALT_RULE, _SALT_TOKENS, _SALT_NOISE = 1, 2, 3


class SyntheticSource:
    def __init__(self, vocab_size: int, seed: int, noise: float = 0.1) -> None:
        if vocab_size < 2:
            raise ConfigError(
                f"model.vocab_size={vocab_size} is too small for data.source='synthetic' "
                "(need >= 2)"
            )
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise={noise} must be in [0, 1]")
        self.vocab_size = vocab_size
        self.seed = seed
        self.noise = noise
        rng = np.random.default_rng([seed & 0xFFFF_FFFF_FFFF_FFFF, _SALT_RULE])
        a = int(rng.integers(1, vocab_size)) if vocab_size > 2 else 1
        while math.gcd(a, vocab_size) != 1:  # coprime: the rule is a permutation of the vocab
            a = int(rng.integers(1, vocab_size))
        self.a, self.b = a, int(rng.integers(0, vocab_size))

    def _uniform(self, step: int, row_indices: np.ndarray, length: int, salt: int) -> np.ndarray:
        """uint64 [rows, length] hash bits, a pure function of (seed, step, row, position)."""
        keys = row_keys(self.seed, step, row_indices, salt)
        return mix64(keys[:, None] ^ np.arange(length, dtype=np.uint64)[None, :])

    def rows(self, step: int, row_indices: np.ndarray, seq_len: int) -> np.ndarray:
        rows = np.asarray(row_indices)
        length = seq_len + 1
        v = np.uint64(self.vocab_size)
        rand = (self._uniform(step, rows, length, _SALT_TOKENS) % v).astype(np.int64)
        coin = (self._uniform(step, rows, length, _SALT_NOISE) >> np.uint64(11)).astype(np.float64)
        flip = coin * (1.0 / (1 << 53)) < self.noise
        out = np.empty((len(rows), length), dtype=np.int64)
        out[:, 0] = rand[:, 0]
        for t in range(1, length):  # sequential in t, vectorised over rows
            ruled = (self.a * out[:, t - 1] + self.b) % self.vocab_size
            out[:, t] = np.where(flip[:, t], rand[:, t], ruled)
        return out.astype(np.int32)
