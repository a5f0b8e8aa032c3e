"""`jaxpar plan calibrate [-o FILE]`: measure this machine into a cluster description: matmul
throughput per dtype on one device, all-reduce bandwidth and latency over the local devices,
memory per device (the accelerator's, or the host's RAM shared by forced CPU devices)."""
from __future__ import annotations

import os
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.planner.cluster import GIB, Cluster, Efficiency, Link


def _best(fn, repeats: int = 5) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_tflops(dtype, n: int) -> float:
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    return 2 * n**3 / _best(lambda: f(a)) / 1e12


def allreduce(size_bytes: int) -> tuple[float, float]:
    """(bandwidth GB/s per device by the ring formula, seconds for a tiny all-reduce)."""
    devs = jax.local_devices()
    n = len(devs)
    mesh = jax.sharding.Mesh(np.array(devs), ("d",))
    shard = NamedSharding(mesh, P("d"))
    f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    big = jax.device_put(jnp.ones((n * size_bytes // 4,), jnp.float32), shard)
    small = jax.device_put(jnp.ones((n,), jnp.float32), shard)
    t = _best(lambda: f(big))
    lat = _best(lambda: f(small))
    wire = 2 * (n - 1) / n * size_bytes
    return wire / max(t - lat, 1e-9) / 1e9, lat


def memory_per_device() -> float:
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return stats["bytes_limit"] / GIB
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 * GIB
    return 0.8 * total / len(jax.local_devices()) / GIB


def calibrate() -> Cluster:
    platform = jax.devices()[0].platform
    n = 4096 if platform != "cpu" else 512
    peaks = {name: round(matmul_tflops(dt, n), 4) for name, dt in
             (("float32", jnp.float32), ("bfloat16", jnp.bfloat16))}
    bw, lat = allreduce(64 * 2**20 if platform != "cpu" else 4 * 2**20) if jax.local_device_count() > 1 \
        else (1.0, 1e-5)
    steps = 2 * max(1, jax.local_device_count() - 1)  # ring steps of one all-reduce
    link = Link(bandwidth_gbps=round(bw, 3), latency_us=round(lat / steps * 1e6, 2))
    # measured peaks are achieved throughput already: the model's efficiencies start near 1
    return Cluster(name=f"calibrated-{socket.gethostname()}", platform=platform,
                   devices_per_host=jax.local_device_count(), hosts=jax.process_count(),
                   memory_gib=round(memory_per_device(), 2), peak_tflops=peaks, intra=link,
                   inter=link.model_copy(update={"bandwidth_gbps": link.bandwidth_gbps / 8}),
                   efficiency=Efficiency(matmul=0.9, comm=0.9, overlap=0.0, gather_overlap=0.0,
                                         layer_overhead_us=200.0 if platform == "cpu" else 20.0))
