"""Compressed gradient collectives: the data-parallel reduction in fewer bytes.

`gradient_compression.method` picks one compressor (one per file, a common interface in
`base.py`); `GradientReducer` applies it to the final gradient reduction over the data-parallel
axes inside the train step's shard_map (see `reducer.py`).

  none      float32 psum, the default path unchanged
  bf16      16-bit chunks on the wire, float32 sums
  fp16      as bf16 with a per-chunk scale (cannot overflow)
  int8      block absmax int8, error feedback, int8 both ways
  onebit    sign + per-block scale, 8 signs per byte, error feedback
  topk      largest fraction of each block: values + uint8/uint16 indices, error feedback
  powersgd  rank-r P, Q per matrix, error feedback, warm-started Q
"""
from __future__ import annotations

from jaxpar.collectives.base import Compressor, Group, two_stage_reduce
from jaxpar.collectives.cast import BF16, FP16
from jaxpar.collectives.int8 import Int8
from jaxpar.collectives.none import NoCompression
from jaxpar.collectives.onebit import OneBit
from jaxpar.collectives.powersgd import PowerSGD
from jaxpar.collectives.topk import TopK

METHODS: dict[str, type[Compressor]] = {
    "none": NoCompression,
    "bf16": BF16,
    "fp16": FP16,
    "int8": Int8,
    "onebit": OneBit,
    "topk": TopK,
    "powersgd": PowerSGD,
}


def make_compressor(cfg) -> Compressor:
    """The compressor a GradientCompressionConfig names (ConfigError for an unknown method)."""
    from jaxpar.config import ConfigError
    if cfg.method not in METHODS:
        raise ConfigError(f"unknown gradient_compression.method {cfg.method!r}; "
                          f"valid: {', '.join(METHODS)}")
    comp = METHODS[cfg.method](cfg)
    comp.error_feedback = comp.error_feedback and cfg.error_feedback
    return comp


def __getattr__(name):
    if name == "GradientReducer":
        from jaxpar.collectives.reducer import GradientReducer
        return GradientReducer
    raise AttributeError(name)


__all__ = ["METHODS", "Compressor", "Group", "GradientReducer", "make_compressor", "two_stage_reduce",
           "BF16", "FP16", "Int8", "NoCompression", "OneBit", "PowerSGD", "TopK"]
