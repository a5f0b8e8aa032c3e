"""`jaxpar checkpoint inspect`: a text report of the steps under a directory, read from their JSON
(and with --verify, every complete step loaded onto one device and its checksums compared).
"""
from __future__ import annotations

import json
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
    return inspect_report(path, verify_data)[0]


def inspect_report(path: str | Path, verify_data: bool = False) -> tuple[str, bool]:
    """(the report of `inspect`, whether every finished step is usable): `jaxpar checkpoint
    inspect` exits 1 when one is not (corrupted, or a step directory with parts missing); an
    interrupted save (a temporary directory the next run deletes) is not damage."""
    p = Path(path).absolute()  # orbax reads only absolute paths
    if not p.exists():
        raise CheckpointError(f"{p}: no such directory")
    root, only = locate(p)
    entries = [e for e in list_steps(root) if only is None or e[0] == only]
    if not entries:
        raise CheckpointError(f"{p}: no checkpoints here (expected step directories like {root}/100)")
    lines = [f"checkpoints in {root}:"]
    latest_ok = None  # the newest step to describe in full
    usable = True
    for step, d, finalized in entries:
        problems = check_complete(d) if finalized else ["interrupted save (temporary directory)"]
        status = "complete" if not problems else "INCOMPLETE: " + "; ".join(problems)
        usable = usable and not (finalized and problems)
        extra = ""
        if not problems:
            meta = read_meta(d)
            mesh = ",".join(f"{a}={v}" for a, v in meta.get("mesh", {}).items() if v != 1) or "1 device"
            extra = (f"  mesh {mesh} on {meta.get('devices')} devices, zero {meta.get('zero_stage')}, "
                     f"batch {meta.get('global_batch')} (grad_accum {meta.get('grad_accum')}), "
                     f"saved {meta.get('time', '?')}")
            if verify_data:
                bad, warning = _verify_on_host(root, step, meta)
                status = "complete, checksums ok" if not bad else "CORRUPTED: " + bad
                status += f" (warning: {warning})" if warning else ""
                usable = usable and not bad
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
    return "\n".join(lines), usable


def _verify_on_host(root: Path, step: int, meta: dict) -> tuple[str, str]:
    """Load one step onto the first local device and compare checksums: (why it is unusable, a
    warning), '' for none. The step is read as a resume reads it, onto a target of its own; so
    orbax's record of the saved shardings (`state/_sharding`), which neither needs, is only
    checked for a warning: a resume uses the step, and calling it corrupted would invite deleting
    good data."""
    import orbax.checkpoint as ocp  # heavy (seconds): only --verify reads arrays
    state_dir = Path(root).absolute() / str(step) / "state"
    try:
        dev = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
        target = _saved_tree(state_dir, meta, dev)
        handler = ocp.PyTreeCheckpointHandler()
        try:
            state = handler.restore(state_dir, args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
        finally:
            handler.close()
        bad = verify(state, meta)
        if bad:
            return "checksum mismatch in " + ", ".join(bad[:3]), ""
    except Exception as e:  # noqa: BLE001
        return short(e), ""
    return "", _sharding_warning(state_dir)


def _saved_tree(state_dir: Path, meta: dict, sharding) -> dict:
    """The saved tree as ShapeDtypeStructs on `sharding`: its containers from orbax's `_METADATA`,
    the shapes and dtypes from the meta (not orbax's metadata(), which reads `_sharding` too)."""
    entries = json.loads((state_dir / "_METADATA").read_text())["tree_metadata"].values()
    arrays = meta.get("arrays") or {}
    tree: dict = {}
    sequences: set[int] = set()  # ids of the nodes orbax saved as lists
    for e in entries:
        keys = e["key_metadata"]
        node = tree
        for k in keys[:-1]:
            if k["key_type"] == 1:
                sequences.add(id(node))
            node = node.setdefault(k["key"], {})
        if keys[-1]["key_type"] == 1:
            sequences.add(id(node))
        path = "/".join(k["key"] for k in keys)
        if e["value_metadata"]["value_type"] == "None":
            node[keys[-1]["key"]] = None
        else:
            a = arrays[path]  # KeyError: a leaf the meta does not describe (damage)
            node[keys[-1]["key"]] = jax.ShapeDtypeStruct(tuple(a["shape"]), jax.numpy.dtype(a["dtype"]),
                                                         sharding=sharding)

    def build(node):
        if not isinstance(node, dict):
            return node
        kids = {k: build(v) for k, v in node.items()}
        return [kids[k] for k in sorted(kids, key=int)] if id(node) in sequences else kids
    return build(tree)


def _sharding_warning(state_dir: Path) -> str:
    """'' when orbax's `_sharding` record is absent or valid JSON, else what is wrong with it."""
    f = state_dir / "_sharding"
    try:
        if f.is_file():
            json.loads(f.read_text())
    except (OSError, ValueError) as e:
        return (f"{f} is unreadable ({short(e, 120)}): orbax's record of the saved shardings, which "
                f"a resume does not need (it restores onto the current mesh); the data is intact")
    return ""
