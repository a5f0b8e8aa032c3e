"""method: none -- float32, the default reduction (a psum per gradient, unchanged)."""
from __future__ import annotations

from jaxpar.collectives.base import Compressor, Group


class NoCompression(Compressor):
    name = "none"

    def compress(self, x):
        return {"x": x}

    def decompress(self, payload):
        return payload["x"]

    scatters = False

    def reduce(self, x, state, group: Group, gather=None):
        return group.psum(x), {}
