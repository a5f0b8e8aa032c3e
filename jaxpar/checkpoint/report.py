"""`jaxpar checkpoint inspect`: a text report of the steps under a directory, read from their JSON
(and with --verify, every complete step loaded onto one device and its checksums compared).
"""
from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import yaml

from jaxpar.checkpoint.errors import CheckpointError, short
from jaxpar.checkpoint.files import check_complete, list_steps, locate, read_config, read_meta
from jaxpar.checkpoint.integrity import verify


def inspect(path: str | Path, verify_data: bool = False) -> str:
    """A report of the checkpoints under `path` (a run dir, its checkpoints dir or one step)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such directory")
    root, only = locate(p)
    entries = [e for e in list_steps(root) if only is None or e[0] == only]
    if not entries:
        raise CheckpointError(f"{p}: no checkpoints here (expected step directories like {root}/100)")
    lines = [f"checkpoints in {root}:"]
    latest_ok = None  # the newest step to describe in full
    for step, d, finalized in entries:
        problems = check_complete(d) if finalized else ["interrupted save (temporary directory)"]
        status = "complete" if not problems else "INCOMPLETE: " + "; ".join(problems)
        extra = ""
        if not problems:
            meta = read_meta(d)
            mesh = ",".join(f"{a}={v}" for a, v in meta.get("mesh", {}).items() if v != 1) or "1 device"
            extra = (f"  mesh {mesh} on {meta.get('devices')} devices, zero {meta.get('zero_stage')}, "
                     f"batch {meta.get('global_batch')} (grad_accum {meta.get('grad_accum')}), "
                     f"saved {meta.get('time', '?')}")
            if verify_data:
                bad = _verify_on_host(root, step, meta)
                status = "complete, checksums ok" if not bad else "CORRUPTED: " + bad
            if not verify_data or not bad:
                latest_ok = (step, d)
        lines.append(f"  step {step:>8}  {status}{extra}")
    if latest_ok is not None:
        step, d = latest_ok
        meta = read_meta(d)
        rows = [(name, "x".join(map(str, a["shape"])) if a["shape"] else "scalar", a["dtype"])
                for name, a in meta.get("arrays", {}).items()]
        total = 0
        for name, shape, dtype in rows:
            if shape != "scalar" and shape and shape[0].isdigit():
                try:
                    total += math.prod(int(x) for x in shape.split("x")) * np.dtype(dtype).itemsize
                except TypeError:
                    pass
        lines.append(f"\nstep {step}: {len(rows)} arrays, {total / 2**20:.2f} MiB; data position "
                     f"{meta.get('data', {}).get('position')}, seed {meta.get('rng', {}).get('seed')}, "
                     f"non-finite steps skipped {meta.get('nonfinite', {}).get('skipped', 0)}")
        w = max((len(r[0]) for r in rows), default=10)
        for name, shape, dtype in rows:
            lines.append(f"  {name.ljust(w)}  {shape:>16}  {dtype}")
        lines.append("\nconfig:")
        lines.append("  " + yaml.safe_dump(read_config(d), sort_keys=False).rstrip().replace("\n", "\n  "))
    return "\n".join(lines)


def _verify_on_host(root: Path, step: int, meta: dict) -> str:
    """Load one step onto the first local device and compare checksums ('' when good)."""
    import orbax.checkpoint as ocp  # heavy (seconds): only --verify reads arrays
    try:
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        md = ocp.StandardCheckpointHandler().metadata(root / str(step) / "state")
        tree = getattr(md, "item_metadata", None) or getattr(md, "tree", None) or md
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), tree,
                              is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
        with ocp.StandardCheckpointer() as c:
            state = c.restore(root / str(step) / "state", target)
        bad = verify(state, meta)
        return "" if not bad else "checksum mismatch in " + ", ".join(bad[:3])
    except Exception as e:  # noqa: BLE001
        return short(e)
