"""Throughput, MFU, communication and memory metrics, and where they are written."""

from jaxpar.metrics.flops import (
    DEVICE_PEAK_FLOPS,
    generic_flops_per_token,
    llama_flops_per_token,
    mfu,
    peak_flops,
)
from jaxpar.metrics.hlo import (COLLECTIVE_KINDS, CollectiveOp, collective_bytes, collective_ops,
                                loop_collectives)
from jaxpar.metrics.memory import compiled_memory, device_memory_bytes, device_memory_stats
from jaxpar.metrics.progress import Progress, format_banner
from jaxpar.metrics.writers import CompositeWriter, JsonlWriter, MetricWriter, TensorBoardWriter

__all__ = [
    "COLLECTIVE_KINDS",
    "DEVICE_PEAK_FLOPS",
    "CollectiveOp",
    "CompositeWriter",
    "JsonlWriter",
    "MetricWriter",
    "Progress",
    "TensorBoardWriter",
    "collective_bytes",
    "collective_ops",
    "compiled_memory",
    "device_memory_bytes",
    "device_memory_stats",
    "format_banner",
    "generic_flops_per_token",
    "llama_flops_per_token",
    "loop_collectives",
    "mfu",
    "peak_flops",
]
