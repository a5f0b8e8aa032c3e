"""The one device mesh: named axes data, fsdp, pipeline, context, tensor, expert.

Each axis size splits into an in-host part (fast links: NVLink, ICI) and an across-hosts part
(`mesh.dcn`, slow links). jax's mesh utilities order devices so that the chatty axes (tensor,
expert, context, fsdp) stay inside a host and the data axis spans hosts.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpar.config import MESH_AXES, ConfigError, MeshConfig


def resolve_sizes(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    """Fill the -1 axis and check that the product is the device count."""
    sizes = cfg.sizes()
    known = math.prod(v for v in sizes.values() if v != -1)
    fill = [a for a, v in sizes.items() if v == -1]
    if fill:
        if n_devices % known:
            raise ConfigError(
                f"mesh: the fixed axes {_fmt(sizes)} multiply to {known}, which does not divide "
                f"the {n_devices} devices, so mesh.{fill[0]}=-1 cannot fill the rest"
            )
        sizes[fill[0]] = n_devices // known
    elif known != n_devices:
        raise ConfigError(
            f"mesh: {_fmt(sizes)} multiplies to {known} but there are {n_devices} devices; "
            f"make the product {n_devices} or set one axis to -1"
        )
    return sizes


def _fmt(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={v}" for a, v in sizes.items())


def _dcn_sizes(cfg: MeshConfig, sizes: dict[str, int], n_granules: int) -> dict[str, int]:
    dcn = {a: cfg.dcn.get(a, 1) for a in MESH_AXES}
    if not cfg.dcn and n_granules > 1:
        # Default: span hosts with the data-parallel axes, which talk least.
        left = n_granules
        for a in ("data", "fsdp", "pipeline", "expert", "context", "tensor"):
            g = math.gcd(left, sizes.get(a, 1))
            dcn[a], left = g, left // g
    for a in MESH_AXES:
        if sizes.get(a, 1) % dcn[a]:
            raise ConfigError(
                f"mesh.dcn.{a}={dcn[a]} does not divide mesh.{a}={sizes[a]}"
            )
    if math.prod(dcn.values()) != n_granules:
        raise ConfigError(
            f"mesh.dcn {_fmt(dcn)} multiplies to {math.prod(dcn.values())}, "
            f"but there are {n_granules} hosts (processes)"
        )
    return dcn


def build_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_sizes(cfg, len(devices))
    n_proc = len({d.process_index for d in devices})
    dcn = _dcn_sizes(cfg, sizes, n_proc)
    shape = tuple(sizes[a] for a in MESH_AXES)
    if n_proc > 1:
        ici = tuple(sizes[a] // dcn[a] for a in MESH_AXES)
        arr = mesh_utils.create_hybrid_device_mesh(
            ici, tuple(dcn[a] for a in MESH_AXES), devices, process_is_granule=True
        )
    else:
        try:
            arr = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            arr = np.asarray(devices).reshape(shape)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    parts = [f"{a}={n}" for a, n in mesh.shape.items() if n > 1] or ["1 device"]
    return f"mesh({', '.join(parts)}; {mesh.devices.size} x {mesh.devices.flat[0].platform})"
