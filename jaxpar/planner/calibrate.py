"""`jaxpar plan calibrate [-o FILE]`: measure this machine into a cluster description: how many
devices share a compute unit (one device's matmul throughput alone against all devices' at
once; on a CPU the devices over its cores), a unit's matmul throughput per dtype and memory
bandwidth (every device at once, over the units; on a CPU also the rate of first touches of
fresh memory), all-reduce bandwidth and latency over the local devices, the fixed cost of a loop
iteration (efficiency.layer_overhead_us) and of a pipeline tick (the runner's switches and
sends: efficiency.tick_overhead_us), memory per device (the accelerator's, or the host's RAM shared by
forced CPU devices).

On a GPU (or TPU), one device alone included: larger problems (a [8192, 8192] matmul, 2 GiB of
memory traffic) so that one call runs well past its launch, random matmul inputs (a unit's
throughput on zeros or ones is above what training sees), no all-reduce on a single device
(its links are placeholders then) and no first-touch rate (the allocator reuses buffers)."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.planner.cluster import GIB, Cluster, Efficiency, Link


@dataclass(frozen=True)
class Plan:
    """What calibrate measures on a platform with `devices` local devices, and at what size."""

    matmul_n: int                 # [n, n] @ [n, n]
    memory_bytes: int             # per device, read and written back
    allreduce_bytes: int | None   # per device; None: one device, nothing to reduce over
    together: bool                # time every device's matmul at once too (shared compute units)
    first_touch: bool             # measure the rate of first touches of fresh memory (CPU)
    collective: str               # Link.collective of the intra-host link


def calibration_plan(platform: str, devices: int) -> Plan:
    """CPU: small sizes (forced devices share a few cores); an accelerator: sizes that keep one
    call well past its launch overhead and beyond the caches (an H200 holds 60 MB of L2)."""
    if devices < 1:
        raise ValueError(f"calibrate: no local devices ({devices})")
    cpu = platform == "cpu"
    return Plan(matmul_n=512 if cpu else 8192, memory_bytes=(16 if cpu else 2048) * 2**20,
                allreduce_bytes=None if devices == 1 else (4 if cpu else 64) * 2**20,
                together=devices > 1, first_touch=cpu,
                # one process's CPU devices: a collective is one rendezvous in shared memory
                collective="rendezvous" if cpu else "ring")


def _best(fn, repeats: int = 5) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def _everywhere(fn, per_device_shape, dtype=jnp.float32, out_specs=None):
    """(jitted fn over every local device at once, its sharded input): each device runs `fn` on
    its own block of `per_device_shape`."""
    devs = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devs), ("d",))
    spec = P("d")
    f = jax.jit(jax.shard_map(lambda x: fn(x[0])[None], mesh=mesh, in_specs=spec,
                              out_specs=spec if out_specs is None else out_specs))
    x = jax.device_put(_random((len(devs), *per_device_shape), dtype), NamedSharding(mesh, spec))
    return f, x


def _random(shape, dtype):
    """Normal values: a GPU's matmul runs measurably faster on constant inputs than on data."""
    return jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32).astype(dtype)


def matmul_tflops(dtype, n: int, everywhere: bool = False) -> float:
    """Matmul TFLOP/s of one device alone, or (everywhere) of all local devices at once."""
    if everywhere:
        f, a = _everywhere(lambda x: x @ x, (n, n), dtype)
        return jax.local_device_count() * 2 * n**3 / _best(lambda: f(a)) / 1e12
    a = _random((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    return 2 * n**3 / _best(lambda: f(a)) / 1e12


def devices_per_unit(single: float, together: float) -> int:
    """Devices that share a compute unit: n devices at once reach `together`, one alone
    `single`; on a CPU, the devices over the cores they may run on (one device's matmul can use
    several cores, which hides the sharing from the throughputs)."""
    n = jax.local_device_count()
    if jax.devices()[0].platform == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, n // cores)
    share = round(n * single / together) if together > 0 else 1
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(1, share))


def memory_gbps(size_bytes: int) -> tuple[float, float | None]:
    """(GB/s all devices move at once reading one array and writing it back in place, GB/s at
    which they first touch a fresh output of the same size beyond that: None where it costs
    nothing), in all. On a CPU a fresh output page-faults; a step's temporaries do so each call."""
    def run(donate: bool):
        f, x = _everywhere(lambda v: v * 1.5 + 1.0, (size_bytes // 4,))
        if not donate:
            return _best(lambda: f(x))
        g = jax.jit(f, donate_argnums=0)
        box = [g(x)]

        def step():
            box[0] = g(box[0])
            return box[0]
        return _best(step)
    n = jax.local_device_count()
    in_place, fresh = run(True), run(False)
    touch = fresh - in_place
    first_touch = n * size_bytes / touch / 1e9 if touch > 0.05 * in_place else None
    return n * 2 * size_bytes / in_place / 1e9, first_touch


def loop_overhead_us(iterations: int = 200) -> tuple[float, float]:
    """(a loop iteration's, a pipeline tick's) fixed seconds in microseconds, all devices at
    once: a scan over a tiny body; a scan whose body has the pipeline runner's conditionals
    (runner.make_pipeline_grads: an op switch on the device's row, a send switch that every
    device agrees on, one switch that files into a ring), less the bare scan. XLA:GPU reads each
    conditional's index back to the host, so the tick's cost is mostly theirs."""
    n = jax.local_device_count()
    forward = [(i, (i + 1) % n) for i in range(n)]
    backward = [(b, a) for a, b in forward]

    def bare(x):
        return jax.lax.scan(lambda c, _: (c * 0.5 + 1.0, None), x, None, length=iterations)[0]

    def ticked(x):
        def send(v, t):  # the tick's one send switch: nothing, one direction, or both
            moves = [jnp.zeros_like, lambda u: jax.lax.ppermute(u, "d", forward),
                     lambda u: jax.lax.ppermute(u, "d", forward) + jax.lax.ppermute(u, "d", backward)]
            return jax.lax.switch(t % 3, moves, v)

        def tick(carry, t):
            c, ring = carry
            i = (jax.lax.axis_index("d") + t) % 2
            c = jax.lax.switch(i, [lambda v: v * 0.5 + 1.0, lambda v: v * 0.25 + 2.0], c)
            c = send(c, t)
            ring = jax.lax.switch(i, [lambda r: r, lambda r: r.at[t % 2].set(c)], ring)
            return (c, ring), None
        ring = jnp.broadcast_to(x * 0, (2, *x.shape))  # varying over "d", as x is
        (c, ring), _ = jax.lax.scan(tick, (x, ring), jnp.arange(iterations))
        return c + ring[0]

    shape = (256,)
    fb, x = _everywhere(bare, shape)
    ft, _ = _everywhere(ticked, shape)
    loop = _best(lambda: fb(x)) / iterations
    tick = max(_best(lambda: ft(x)) / iterations - loop, 0.0)
    return loop * 1e6, tick * 1e6


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
    devices = jax.local_device_count()
    plan = calibration_plan(platform, devices)
    n = plan.matmul_n
    single = matmul_tflops(jnp.float32, n)
    together = matmul_tflops(jnp.float32, n, everywhere=True) if plan.together else single * devices
    per_unit = devices_per_unit(single, together)
    units = -(-devices // per_unit)
    # a unit's throughput: all devices at once over the units (each alone, without sharing)
    peaks = {"float32": together / units if per_unit > 1 else single}
    peaks["bfloat16"] = (matmul_tflops(jnp.bfloat16, n, everywhere=True) / units if per_unit > 1
                         else matmul_tflops(jnp.bfloat16, n))
    peaks = {k: round(v, 4) for k, v in peaks.items()}
    share = units if per_unit > 1 else devices
    mem, fresh = memory_gbps(plan.memory_bytes)
    mem, fresh = mem / share, (fresh / share if fresh and plan.first_touch else None)
    loop_us, tick_us = loop_overhead_us()
    bw, lat = allreduce(plan.allreduce_bytes) if plan.allreduce_bytes else (1.0, 1e-5)
    if plan.collective == "rendezvous":
        link = Link(bandwidth_gbps=round(bw, 3), latency_us=round(lat * 1e6, 2), collective="rendezvous")
    else:
        steps = 2 * max(1, devices - 1)  # ring steps of one all-reduce
        link = Link(bandwidth_gbps=round(bw, 3), latency_us=round(lat / steps * 1e6, 2))
    # measured peaks are achieved throughput already: the model's efficiencies start near 1
    # fixed costs as one device's work: on shared units, all devices' loops queue on them
    per_device = devices / units if per_unit > 1 else 1
    return Cluster(name=f"calibrated-{socket.gethostname()}", platform=platform,
                   devices_per_host=devices, hosts=jax.process_count(),
                   memory_gib=round(memory_per_device(), 2), devices_per_unit=per_unit, peak_tflops=peaks,
                   memory_gbps=round(mem, 3), fresh_gbps=fresh and round(fresh, 3), intra=link,
                   inter=link.model_copy(update={"bandwidth_gbps": link.bandwidth_gbps / 8,
                                                 "collective": "ring"}),
                   efficiency=Efficiency(matmul=0.9, comm=0.9, overlap=0.0, gather_overlap=0.0,
                                         layer_overhead_us=round(loop_us / per_device, 2),
                                         tick_overhead_us=round(tick_us / per_device, 2),
                                         memory_overlap=0.0 if platform == "cpu" else 1.0))
