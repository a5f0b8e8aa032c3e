"""method: none -- float32, the default reduction (a psum per gradient, unchanged)."""
from __future__ import annotations

import jax

from jaxpar.collectives.base import Compressor, Group


class NoCompression(Compressor):
    name = "none"

    def compress(self, x):
        return {"x": x}

    def decompress(self, payload):
        return payload["x"]

    def reduce(self, x, state, group: Group):
        return group.psum(x), {}
