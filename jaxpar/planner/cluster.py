"""Cluster descriptions: what the cost model knows about the hardware, as validated data.

A description (YAML) gives devices per host, hosts, memory per device, how many devices share a
compute unit (forced XLA:CPU devices share the host's cores), peak FLOP/s per dtype and memory
bandwidth of a unit (on a CPU also the rate of first touches of fresh memory), and per link
(intra-host: NVLink / ICI / shared memory; inter-host: InfiniBand / DCN) the bandwidth one
device sees and the latency of one collective step (or op). `efficiency` holds the factors the
cost model multiplies the peaks by and its fixed costs (what `jaxpar plan fit` learns from
measured runs). Built-in presets live in jaxpar/planner/clusters/*.yaml; `jaxpar plan
calibrate` writes one for this machine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxpar.config import ConfigError, load_yaml, validation_lines

PRESET_DIR = Path(__file__).parent / "clusters"
GIB = 2**30


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Link(_Strict):
    bandwidth_gbps: float = Field(gt=0, description="GB/s (1e9 bytes) one device sends over this link")
    latency_us: float = Field(ge=0, description="microseconds per collective step (ring) or op (rendezvous)")
    collective: Literal["ring", "rendezvous"] = Field(
        "ring", description="ring: a collective pays latency_us per ring step (NCCL, ICI); rendezvous: "
                            "once per op (devices of one process sharing memory, XLA:CPU)")


class Efficiency(_Strict):
    """Achieved fractions of the peaks (fit by `jaxpar plan fit`)."""

    matmul: float = Field(0.6, gt=0, le=1, description="of peak FLOP/s, for the model's matmuls")
    comm: float = Field(0.8, gt=0, le=1, description="of link bandwidth, for collectives")
    overlap: float = Field(0.0, ge=0, le=1, description="fraction of gradient-reduction time hidden "
                                                        "behind the backward")
    gather_overlap: float = Field(0.7, ge=0, le=1, description="fraction of ZeRO-3 gather time hidden "
                                                               "behind the layer compute")
    layer_overhead_us: float = Field(20.0, ge=0, description="fixed cost per layer and microbatch "
                                                             "(kernel launches, loop steps)")
    tick_overhead_us: float = Field(0.0, ge=0, description="fixed cost per pipeline tick and device "
                                                           "(the runner's switch, sends, buffer filing)")
    memory_overlap: float = Field(1.0, ge=0, le=1, description="fraction of the shorter of compute and "
                                  "memory traffic hidden behind the longer (1: a roofline's max; 0: "
                                  "they add up)")


class Cluster(_Strict):
    name: str
    platform: Literal["cpu", "gpu", "tpu"]
    devices_per_host: int = Field(gt=0)
    hosts: int = Field(1, gt=0)
    memory_gib: float = Field(gt=0, description="memory per device usable by one process")
    devices_per_unit: int = Field(1, ge=1, description="devices that share one compute unit (8 forced "
                                  "XLA:CPU devices on 2 cores: 4); peak_tflops and memory_gbps are one "
                                  "unit's")
    peak_tflops: dict[str, float] = Field(description="per dtype: float32, bfloat16, float16")
    memory_gbps: float | None = Field(None, gt=0, description="GB/s one compute unit moves to and from "
                                      "its memory (HBM; on a CPU what a step's fresh buffers see); "
                                      "null: no memory-traffic term")
    fresh_gbps: float | None = Field(None, gt=0, description="GB/s at which a unit first touches the "
                                     "temporaries a step allocates afresh on each call (XLA:CPU: page "
                                     "faults); null: the allocator reuses them (GPU, TPU)")
    intra: Link
    inter: Link
    efficiency: Efficiency = Field(default_factory=Efficiency)

    @property
    def devices(self) -> int:
        return self.devices_per_host * self.hosts

    @property
    def shared_compute(self) -> bool:
        """Whether devices share compute units: then a step lasts at least all devices' work
        over the units (replicated work counts each time; a device's idle time is another's
        compute)."""
        return self.devices_per_unit > 1

    @property
    def compute_units(self) -> int:
        """Compute units of the whole cluster (a host with fewer devices than devices_per_unit
        has one per started group: 2 forced CPU devices on a 2-core, 4-per-unit host: 1)."""
        return self.hosts * -(-self.devices_per_host // self.devices_per_unit)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of one device in `dtype` (float16 falls back to bfloat16)."""
        table = self.peak_tflops
        for name in (dtype, "bfloat16" if dtype == "float16" else dtype, "float32"):
            if name in table:
                return table[name] * 1e12
        raise ConfigError(f"cluster {self.name!r}: no peak_tflops for {dtype!r} (has {', '.join(table)})")

    def with_devices(self, n: int) -> "Cluster":
        """This cluster cut or grown to n devices (whole hosts where n allows)."""
        if n <= self.devices_per_host:
            return self.model_copy(update={"devices_per_host": n, "hosts": 1})
        if n % self.devices_per_host:
            raise ConfigError(f"--devices {n} is not a multiple of the cluster's devices_per_host="
                              f"{self.devices_per_host}")
        return self.model_copy(update={"hosts": n // self.devices_per_host})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A preset by name (see `presets()`) or a YAML file; one clear error for a bad one."""
    path = Path(name_or_path)
    if not path.suffix and str(name_or_path) in presets():
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"cluster {str(name_or_path)!r}: not a preset ({', '.join(presets())}) "
                          "nor a YAML file")
    try:
        raw = load_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"cluster file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"cluster file {str(path)!r} must hold a mapping")
    raw.setdefault("name", path.stem)
    try:
        return Cluster.model_validate(raw)
    except ValidationError as err:
        lines = validation_lines(err, Cluster)
        raise ConfigError(f"invalid cluster file {str(path)!r}:\n  " + "\n  ".join(lines)) from None
