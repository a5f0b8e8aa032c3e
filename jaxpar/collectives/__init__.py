"""Compressed gradient collectives: the data-parallel reduction in fewer bytes.

`gradient_compression.method` picks one compressor (one per file, a common interface in
`base.py`); `GradientReducer` applies it to the gradient reduction over the data-parallel axes
inside the train step's shard_map: per layer inside the backward layer scan (error-feedback
residuals per layer slice), but PowerSGD and a float32 warm-up after it (see `reducer.py`).

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
from jaxpar.collectives.methods import METHODS, make_compressor
from jaxpar.collectives.none import NoCompression
from jaxpar.collectives.onebit import OneBit
from jaxpar.collectives.powersgd import PowerSGD
from jaxpar.collectives.reducer import GradientReducer
from jaxpar.collectives.topk import TopK

__all__ = ["METHODS", "Compressor", "Group", "GradientReducer", "make_compressor", "two_stage_reduce",
           "BF16", "FP16", "Int8", "NoCompression", "OneBit", "PowerSGD", "TopK"]
