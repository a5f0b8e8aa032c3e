"""The compressors by `gradient_compression.method` name, registered for the config to check.
A new compressor is a module implementing collectives.base.Compressor plus one line here (or a
`COMPRESSORS.register(name, cls)` call of its own: tests/test_compression.py registers one)."""
from __future__ import annotations

from jaxpar.collectives.base import Compressor
from jaxpar.collectives.cast import BF16, FP16
from jaxpar.collectives.int8 import Int8
from jaxpar.collectives.none import NoCompression
from jaxpar.collectives.onebit import OneBit
from jaxpar.collectives.powersgd import PowerSGD
from jaxpar.collectives.topk import TopK
from jaxpar.config import ConfigError
from jaxpar.registry import COMPRESSORS

METHODS: dict[str, type[Compressor]] = {
    "none": NoCompression,
    "bf16": BF16,
    "fp16": FP16,
    "int8": Int8,
    "onebit": OneBit,
    "topk": TopK,
    "powersgd": PowerSGD,
}
for _name, _cls in METHODS.items():
    COMPRESSORS.register(_name, _cls)


def make_compressor(cfg) -> Compressor:
    """The compressor a GradientCompressionConfig names (ConfigError for an unknown method)."""
    if cfg.method not in COMPRESSORS:
        raise ConfigError(f"unknown gradient_compression.method {cfg.method!r}; "
                          f"valid: {', '.join(COMPRESSORS.names())}")
    comp = COMPRESSORS.get(cfg.method)(cfg)
    comp.error_feedback = comp.error_feedback and cfg.error_feedback
    return comp
