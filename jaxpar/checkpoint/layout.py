"""The batch layout a step was saved on, and the layout to resume it with on another device count.

Elastic resume keeps the global batch (so the data order and the loss curve) and lets the mesh
and train.grad_accum change; the arrays themselves reshard on restore (see store.py).
"""
from __future__ import annotations

import math

import jax

from jaxpar.checkpoint.errors import CheckpointError
from jaxpar.config import MESH_AXES, Config, ConfigError, make_config
from jaxpar.mesh import resolve_sizes


def batch_parallel(cfg: Config, n_devices: int) -> int:
    """The batch-parallel size (product of the mesh axes the `batch` rule uses) of `cfg` on n devices."""
    sizes = resolve_sizes(cfg.mesh, n_devices)
    return math.prod(sizes[a] for a in cfg.sharding.resolved_rules().get("batch", ()) if a in sizes)


def layout_meta(cfg: Config, mesh) -> dict:
    """The layout a step is saved on, in its meta: what `adapt_layout` reads on another device count."""
    return {"mesh": {a: int(mesh.shape[a]) for a in mesh.axis_names},
            "devices": int(mesh.devices.size), "processes": jax.process_count(),
            "zero_stage": cfg.sharding.zero_stage, "global_batch": cfg.train.global_batch,
            "grad_accum": accumulation(cfg, int(mesh.shape.get("pipeline", 1))),
            "batch_parallel": batch_parallel(cfg, mesh.devices.size)}


def accumulation(cfg: Config, pipeline: int) -> int:
    """How many microbatches a step's batch-parallel slice is cut into: train.grad_accum, or
    with a pipeline of `pipeline` stages its pipeline.microbatches when set (it replaces grad_accum)."""
    if pipeline > 1 and cfg.pipeline.microbatches is not None:
        return cfg.pipeline.resolved_microbatches(cfg.train.grad_accum)
    return cfg.train.grad_accum


def fit_mesh(cfg: Config, n_devices: int, data: int | None = None) -> dict[str, int]:
    """Axis sizes for `n_devices` close to `cfg.mesh`: keep pipeline, context and tensor where they divide
    the device count (else their largest divisor that does), then fsdp and expert likewise; data
    takes the rest. With `data` (a size that must stay: local SGD's replicas), data is that and
    fsdp takes the rest."""
    sizes = {a: max(getattr(cfg.mesh, a), 1) for a in MESH_AXES}
    left = n_devices // (data or 1)
    out = {}
    for a in ("pipeline", "context", "tensor", "expert", "fsdp"):
        out[a] = math.gcd(sizes[a], left)
        left //= out[a]
    if data:
        out["data"], out["fsdp"] = data, out["fsdp"] * left
    else:
        out["data"] = left
    return {a: out[a] for a in MESH_AXES}


def kept_replicas(cfg: Config, meta: dict, n_devices: int) -> int | None:
    """The `data` size a resume must keep, or None when any will do. Local SGD's state holds one
    optimizer state and one copy of the params per data replica, and the replica count is part of
    the algorithm: on another device count the mesh keeps it (CheckpointError when it cannot)."""
    saved = (meta.get("mesh") or {}).get("data")
    if cfg.local_sgd.sync_every <= 1 or not saved:
        return None
    if n_devices % int(saved):
        raise CheckpointError(
            f"cannot resume this local SGD run on {n_devices} devices: its state holds one optimizer "
            f"state per data-parallel replica and the checkpoint has {saved} (mesh.data={saved}), which "
            f"does not divide {n_devices}; use a device count divisible by {saved}, or start a new run "
            f"from its weights (train.init_from=<its step dir>: the params, a fresh optimizer state)")
    return int(saved)


def adapt_layout(cfg: Config, meta: dict, n_devices: int) -> tuple[Config, list[str]]:
    """The config for resuming a checkpoint saved on another device count: a mesh that fits
    n_devices (when the configured one does not) and a grad_accum that keeps the global batch
    and does not grow the per-device microbatch (local SGD keeps its replica count, `data`).
    ConfigError when no layout keeps the batch."""
    changes: list[str] = []
    raw = cfg.model_dump(mode="json")
    replicas = kept_replicas(cfg, meta, n_devices)
    try:
        fits = replicas in (None, resolve_sizes(cfg.mesh, n_devices)["data"])
    except ConfigError:
        fits = False
    if not fits:
        new = fit_mesh(cfg, n_devices, replicas)
        old = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
        raw["mesh"].update(new)
        changes.append("mesh " + ",".join(f"{a}={old[a]}" for a in MESH_AXES if old[a] != 1 or new[a] != 1)
                       + " -> " + ",".join(f"{a}={new[a]}" for a in MESH_AXES if new[a] != 1 or old[a] != 1)
                       + f" (the checkpoint was saved on {meta.get('devices')} devices, now {n_devices})")
        cfg = make_config(raw, [])
    G = cfg.train.global_batch
    dp = batch_parallel(cfg, n_devices)
    old_dp, old_acc = int(meta.get("batch_parallel", dp)), int(meta.get("grad_accum", 1))
    saved_G = int(meta.get("global_batch", G))
    if G % dp:
        raise CheckpointError(
            f"cannot keep the global batch on {n_devices} devices: train.global_batch={G} is not "
            f"divisible by the batch-parallel size {dp} of mesh {_fmt_mesh(cfg, n_devices)}; "
            f"use a device count whose batch-parallel size divides {G}, or change train.global_batch "
            f"(that changes the data order and the loss curve)")
    need = max(1, -(-old_dp * old_acc // dp))  # per-device microbatch no larger than before
    now = accumulation(cfg, resolve_sizes(cfg.mesh, n_devices)["pipeline"])
    acc = now
    if acc < need or (G // dp) % acc:
        acc = next(a for a in range(need, G // dp + 1) if (G // dp) % a == 0)
    if acc != now:
        # a pipeline's microbatches, when set, are its accumulation steps (grad_accum 1 or equal)
        fields = ["train.grad_accum"] if now == cfg.train.grad_accum else []
        fields = fields if now != cfg.pipeline.microbatches else fields + ["pipeline.microbatches"]
        changes.append(f"{' and '.join(fields)} {now} -> {acc} (global batch {G} = "
                       f"{dp} batch-parallel x {acc} microbatches x {G // (dp * acc)} rows; saved as "
                       f"{old_dp} x {old_acc} x {saved_G // max(old_dp * old_acc, 1)})")
        raw = cfg.model_dump(mode="json")
        for f in fields:
            section, key = f.split(".")
            raw[section][key] = acc
        cfg = make_config(raw, [])
    return cfg, changes


def _fmt_mesh(cfg: Config, n: int) -> str:
    return ",".join(f"{a}={v}" for a, v in resolve_sizes(cfg.mesh, n).items() if v != 1) or "1 device"
