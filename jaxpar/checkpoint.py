"""Fault tolerance: orbax checkpoints, resume, preemption, elastic resume, integrity checks.

A checkpoint is one orbax step directory `<run dir>/checkpoints/<step>/` with three items:
  state   the train state (step, params, opt_state) as tensorstore arrays (OCDBT/zarr, no pickle)
  meta    JSON: step, data position and RNG seed, the mesh / device count / batch layout it was
          saved on, non-finite counters, and a checksum of every array (see `fingerprint`)
  config  JSON: the resolved config

Orbax writes a step into a temporary directory and renames it when every item is written, so a
step directory that exists is whole; a run killed mid-save leaves only a temporary directory,
which the next run deletes. A step whose files were damaged afterwards (truncated, bit flips)
fails to restore or fails its checksum, and restore falls back to the previous step. With several
processes they fall back together: a step is used only when every process read it and it passed
its checksums (`agree`), so one host's damaged file never splits the group across two steps.

Restore builds the target from the *current* trainer (shapes + shardings of its mesh), so a
checkpoint saved on one mesh restores onto another (device count, ZeRO stage, tensor size).
`plan_resume` adapts the mesh and `train.grad_accum` before the trainer is built when the
device count changed, keeping the global batch (and so the data order and the loss curve).
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import MESH_AXES, Config, ConfigError

FORMAT = "jaxpar-checkpoint/1"
ITEMS = ("state", "meta", "config")
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (none good, wrong model, no layout fits): one clear message."""


def _warn(msg: str) -> None:
    print(f"jaxpar: warning: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- checksums


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """uint32 checksum of the exact bits of `x`: sum over elements of (bits + c) * w(index) mod 2**32
    with odd position weights. Integer sums wrap exactly in any order, so the value does not depend
    on the sharding (save on 8 devices, verify on 2); any single flipped bit changes it."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        u = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        u = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    idx = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= x.shape[d]
    w = idx * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15) | jnp.uint32(1)
    return jnp.sum((u + jnp.uint32(0x2545F491)) * w, dtype=jnp.uint32)


@jax.jit
def _checksums(tree: Any) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    return jnp.stack([_leaf_checksum(x) for x in leaves]) if leaves else jnp.zeros((0,), jnp.uint32)


def _paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p, simple=True, separator="/")
            for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def fingerprint(tree: Any) -> dict[str, str]:
    """{leaf path: 8 hex digits} for a tree of arrays (jax, on any mesh, or numpy)."""
    sums = np.asarray(jax.device_get(_checksums(tree)))
    return {p: f"{int(s):08x}" for p, s in zip(_paths(tree), sums)}


# ---------------------------------------------------------------------------- layout


def batch_parallel(cfg: Config, n_devices: int) -> int:
    """The batch-parallel size (product of the mesh axes the `batch` rule uses) of `cfg` on n devices."""
    from jaxpar.mesh import resolve_sizes
    sizes = resolve_sizes(cfg.mesh, n_devices)
    return math.prod(sizes[a] for a in cfg.sharding.resolved_rules().get("batch", ()) if a in sizes)


def layout_meta(cfg: Config, mesh) -> dict:
    return {"mesh": {a: int(mesh.shape[a]) for a in mesh.axis_names},
            "devices": int(mesh.devices.size), "processes": jax.process_count(),
            "zero_stage": cfg.sharding.zero_stage, "global_batch": cfg.train.global_batch,
            "grad_accum": cfg.train.grad_accum, "batch_parallel": batch_parallel(cfg, mesh.devices.size)}


# ---------------------------------------------------------------------------- directories


def checkpoint_dir(cfg: Config, out_dir: Path | None = None) -> Path:
    """Where this run saves: `checkpoint.dir` (a relative one inside the run dir), or
    `<run dir>/checkpoints`. `out_dir` is the run dir when it is not `cfg.out_dir`."""
    run = Path(out_dir) if out_dir is not None else cfg.out_dir
    return run / (cfg.checkpoint.dir or "checkpoints")  # an absolute dir replaces `run`


def ensure_writable(root: Path, cfg: Config) -> None:
    """Create the checkpoint directory and write a file in it, so a path that cannot hold
    checkpoints stops the run before training, with the OS's reason (not a traceback later)."""
    probe = Path(root) / f".jaxpar-write-test-{os.getpid()}-{jax.process_index()}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        what = f"checkpoint.dir={cfg.checkpoint.dir!r}" if cfg.checkpoint.dir else \
            "the checkpoint directory (checkpoint.dir unset: <run dir>/checkpoints)"
        raise CheckpointError(f"{what}: cannot create or write {root}: {e.strerror or e}; "
                              f"set checkpoint.dir to a writable directory") from None


def _is_step_name(name: str) -> bool:
    return name.isdigit()


def list_steps(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, path, finalized) for every step directory and interrupted save under `root`, by step."""
    out = []
    if not root.is_dir():
        return out
    for p in root.iterdir():
        if not p.is_dir():
            continue
        if _is_step_name(p.name):
            out.append((int(p.name), p, True))
        elif _TMP_MARK in p.name and _is_step_name(p.name.split(_TMP_MARK)[0]):
            out.append((int(p.name.split(_TMP_MARK)[0]), p, False))
    return sorted(out, key=lambda t: (t[0], t[2]))


def resolve_source(spec: str, default_root: Path) -> tuple[Path, int | None] | None:
    """`train.resume` -> (checkpoints root, a step or None for the latest), or None for `never`.

    `auto`: this run's own checkpoints. A path may name a run dir (with `checkpoints/`), a
    checkpoints dir, or one step directory in it."""
    if spec == "never":
        return None
    if spec == "auto":
        return default_root, None
    p = Path(spec)
    if not p.exists():
        raise CheckpointError(f"train.resume={spec!r}: no such directory")
    if _is_step_name(p.name) and (p / "state").is_dir():
        return p.parent, int(p.name)
    if (p / "checkpoints").is_dir() and not any(s for s in list_steps(p) if s[2]):
        return p / "checkpoints", None
    if not any(s for s in list_steps(p) if s[2]):
        raise CheckpointError(f"train.resume={spec!r}: no checkpoint steps in this directory")
    return p, None


def _read_json_item(step_dir: Path, item: str) -> dict:
    path = step_dir / item / "metadata"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir}: missing {item} ({path} not found)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{step_dir}: {item} is not valid JSON ({path}: {e})") from None


def read_meta(step_dir: Path) -> dict:
    return _read_json_item(step_dir, "meta")


def read_config(step_dir: Path) -> dict:
    return _read_json_item(step_dir, "config")


def check_complete(step_dir: Path) -> list[str]:
    """What is missing from a step directory (empty: structurally complete)."""
    problems = []
    if not (step_dir / "_CHECKPOINT_METADATA").is_file():
        problems.append("no _CHECKPOINT_METADATA")
    for item in ITEMS:
        if not (step_dir / item).is_dir():
            problems.append(f"no {item}/")
    state = step_dir / "state"
    if state.is_dir() and not (state / "_METADATA").is_file():
        problems.append("no state/_METADATA")
    for item in ("meta", "config"):
        try:
            _read_json_item(step_dir, item)
        except CheckpointError as e:
            problems.append(str(e).split(": ", 1)[-1])
    return problems


# ---------------------------------------------------------------------------- the manager


class Checkpointer:
    """An orbax CheckpointManager for one run: async saves with a keep policy, restore with
    checksum verification and fall back to older steps."""

    def __init__(self, root: str | Path, *, keep_last: int = 3, keep_every: int | None = None,
                 async_save: bool = True, log: Callable[[str], None] = print,
                 read_only: bool = False) -> None:
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as cm

        self.ocp = ocp
        self.root = Path(root).absolute()
        self.log = log
        policies = [cm.LatestN(keep_last)]
        if keep_every:
            policies.append(cm.EveryNSteps(keep_every))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=cm.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only, create=not read_only, read_only=read_only,
        )
        self.mngr = ocp.CheckpointManager(self.root, options=options, item_names=ITEMS)
        self.read_only = read_only
        self.last_saved: int | None = None
        self.save_seconds: list[float] = []

    # -- steps
    def all_steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- save
    def save(self, step: int, state: Any, meta: dict, config: dict) -> None:
        """Start saving `state` as `step` (returns once the arrays are copied off the device
        when async; the files are written in the background)."""
        ocp = self.ocp
        t0 = time.perf_counter()
        arrays = {p: {"shape": list(x.shape), "dtype": str(x.dtype)}
                  for p, x in zip(_paths(state), jax.tree.leaves(state))}
        meta = {"format": FORMAT, "step": int(step), **meta, "arrays": arrays, "checksums": fingerprint(state),
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.mngr.save(int(step), args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta),
            config=ocp.args.JsonSave(config)), force=True)
        self.last_saved = int(step)
        dt = time.perf_counter() - t0
        self.save_seconds.append(dt)
        try:  # the observability module, when present, exports save times
            from jaxpar.observe import record_checkpoint_save
            record_checkpoint_save(dt)
        except Exception:
            pass

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()

    # -- restore
    def restore(self, abstract_state: Any, step: int | None = None,
                warn: Callable[[str], None] = _warn) -> tuple[Any, dict, int]:
        """(state, meta, step) from `step`, or the latest good step. `abstract_state` holds
        ShapeDtypeStructs with the shardings to restore onto (any mesh). A step that fails to
        load on any process, or whose checksums differ, is reported with `warn` and every
        process tries the previous one."""
        steps = [step] if step is not None else _steps_anywhere(self.all_steps())
        if not steps:
            raise CheckpointError(f"no checkpoints in {self.root}")
        failures = []
        for s in steps:
            where = self.root / str(s)
            loaded, problem = _attempt(lambda: self._load(abstract_state, s))
            bad = agree(problem)
            if not bad:  # every process holds its part: the checksums are one global computation
                _, problem = _attempt(lambda: _check_sums(*loaded))
                bad = agree(problem)
            if not bad:
                self._set_aside([x for x in steps if x > s])
                return loaded[0], loaded[1], s
            failures += [f"step {s}: {reason}" for reason in bad]
            rest = [x for x in steps if x < s]
            then = f"falling back to step {rest[0]}" if rest else "no earlier checkpoint"
            for reason in bad:
                warn(f"checkpoint {where} is unusable ({reason}); {then}")
        raise CheckpointError(f"no good checkpoint in {self.root}:\n  " + "\n  ".join(failures))

    def _set_aside(self, unusable: list[int]) -> None:
        """Rename unusable newer steps to `<step>.unusable` (kept for inspection), so the resumed
        run can save those steps again. Process 0 renames (shared storage); all reload."""
        if not unusable or self.read_only:
            return
        if jax.process_index() == 0:
            for s in unusable:
                src, dst = self.root / str(s), self.root / f"{s}.unusable"
                n = 1
                while dst.exists():
                    dst, n = self.root / f"{s}.unusable.{n}", n + 1
                if src.is_dir():
                    src.rename(dst)
                    _warn(f"moved the unusable checkpoint {src} aside to {dst}")
        from jaxpar.distributed import barrier
        barrier("checkpoint set aside")
        self.mngr.reload()

    def _load(self, abstract_state: Any, s: int) -> tuple[Any, dict]:
        """This process's part of step `s` (raises a damage error when it cannot be read)."""
        ocp = self.ocp
        where = self.root / str(s)
        if not where.is_dir():
            raise CheckpointError(f"{where} not found")
        problems = check_complete(where)
        if problems:
            raise CheckpointError("incomplete: " + "; ".join(problems))
        meta = read_meta(where)
        # parts of the state that cannot carry over are left out (partial restore)
        target, dropped = _restorable(abstract_state, meta)
        item = ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=bool(dropped))
        # the handler, not the manager: the manager's barrier after a restore would wait forever
        # for a process whose read failed; the processes meet in `agree` instead
        handler = ocp.PyTreeCheckpointHandler()
        try:
            state = handler.restore(where / "state", args=item)
        finally:
            handler.close()
        return state, {**meta, "reset": dropped}


def _check_sums(state: Any, meta: dict) -> None:
    bad = verify(state, meta)
    if bad:
        raise CheckpointError(f"checksum mismatch in {', '.join(bad[:3])}"
                              + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))


# ---------------------------------------------------------------------------- damage and agreement

# absl status codes tensorstore puts first in the ValueError it raises for a failed read
_STORE_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION", "INVALID_ARGUMENT",
                "PERMISSION_DENIED", "UNAVAILABLE", "UNKNOWN", "INTERNAL", "ABORTED")


def damage(e: BaseException | None) -> BaseException | None:
    """The error in `e`'s cause chain that means "this step's files cannot be used" (missing,
    truncated, not JSON, a checksum mismatch, a tensorstore read error, which orbax wraps in a
    plain Exception), or None: anything else is a bug and propagates."""
    while e is not None:
        if isinstance(e, (CheckpointError, OSError, json.JSONDecodeError, UnicodeDecodeError)):
            return e
        if isinstance(e, ValueError) and str(e).split(":", 1)[0] in _STORE_CODES:
            return e
        e = e.__cause__
    return None


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn(), None), or (None, why) when fn fails with a damage error."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised unless it means damage
        cause = damage(e)
        if cause is None:
            raise
        return None, _short(cause, 500)


def agree(problem: str | None) -> list[str]:
    """Every process's verdict on the same step: why it cannot be used, one reason per process
    that cannot (naming the process when there are several), [] when all can. One process: its
    own verdict, nothing sent."""
    from jaxpar.distributed import allgather_json
    verdicts = allgather_json(problem, "checkpoint verdict")
    if len(verdicts) == 1:
        return [v for v in verdicts if v is not None]
    return [f"on process {i}: {v}" for i, v in enumerate(verdicts) if v is not None]


def _steps_anywhere(mine: list[int]) -> list[int]:
    """Every step any process has, newest first (a step missing on one fails there, for all)."""
    from jaxpar.distributed import allgather_json
    lists = allgather_json(sorted(mine), "checkpoint steps")
    return sorted({s for steps in lists for s in steps}, reverse=True)


CORE_KEYS = ("step", "params", "opt_state")


def _restorable(abstract_state: Any, meta: dict) -> tuple[Any, list[str]]:
    """The part of the target state a checkpoint can fill, and the top-level keys it cannot:
    state beside step/params/opt_state (e.g. gradient-compression residuals, one row per batch
    device) whose saved shapes differ from the current ones, or that is new or gone."""
    saved = meta.get("arrays")
    if not saved or not isinstance(abstract_state, dict):
        return abstract_state, []
    saved_tops = {p.split("/")[0] for p in saved}
    dropped = []
    for key, sub in abstract_state.items():
        if key in CORE_KEYS:
            continue
        now = {f"{key}/{p}" if p else key: list(x.shape) for p, x in zip(_paths(sub), jax.tree.leaves(sub))}
        then = {p: a["shape"] for p, a in saved.items() if p == key or p.startswith(key + "/")}
        if now != then:
            dropped.append(key)
    extra = sorted(saved_tops - set(abstract_state))
    if not dropped and not extra:
        return abstract_state, []
    return {k: v for k, v in abstract_state.items() if k not in dropped}, dropped + extra


def _short(e: BaseException, n: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
    # a tensorstore error: its code and the file, without the driver chain and spec
    msg = re.sub(r'Error opening "\w+" driver: ', "", msg.split(" [tensorstore_spec")[0])
    msg = " ".join(msg.split())
    return msg if len(msg) <= n else msg[:n] + "..."


def verify(state: Any, meta: dict) -> list[str]:
    """Leaf paths whose checksum differs from the one saved in `meta` (empty: all match)."""
    saved = meta.get("checksums")
    if not saved:
        return []
    now = fingerprint(state)
    skipped = tuple(meta.get("reset", ()))  # parts not restored on purpose
    bad = [p for p, v in now.items() if saved.get(p) != v]
    bad += [p for p in saved if p not in now and p.split("/")[0] not in skipped]
    return bad


# ---------------------------------------------------------------------------- resume planning


@dataclass
class ResumePlan:
    """Where a run resumes from, and the config to build the trainer with."""

    cfg: Config
    root: Path | None = None          # checkpoints dir to restore from
    step: int | None = None           # a fixed step, or None for the latest good one
    meta: dict | None = None          # meta of the step the layout was planned from
    changes: list[str] = field(default_factory=list)

    @property
    def resuming(self) -> bool:
        return self.root is not None


def _first_readable_meta(root: Path, step: int | None) -> tuple[int, dict, dict] | None:
    """The newest step whose JSON every process reads (with its meta and config)."""
    mine = [s for s, _, ok in list_steps(root) if ok]
    steps = [step] if step is not None else _steps_anywhere(mine)
    for s in steps:
        d = root / str(s)
        found, problem = _attempt(lambda: (read_meta(d), read_config(d)))
        bad = agree(problem)
        if not bad:
            return s, *found
        for reason in bad:
            _warn(f"checkpoint {d} is unusable ({reason}); trying the previous one")
    return None


def _model_differences(saved: dict, cfg: Config) -> list[str]:
    now = cfg.model.model_dump(mode="json")
    then = saved.get("model", {})
    shape_fields = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                    "tie_embeddings")
    return [f"model.{k}: checkpoint {then.get(k)!r}, config {now.get(k)!r}"
            for k in shape_fields if k in then and then.get(k) != now.get(k)]


def fit_mesh(cfg: Config, n_devices: int) -> dict[str, int]:
    """Axis sizes for `n_devices` close to `cfg.mesh`: keep pipeline and tensor where they divide
    the device count (else their largest divisor that does), then fsdp and expert likewise; data
    takes the rest."""
    sizes = {a: max(getattr(cfg.mesh, a), 1) for a in MESH_AXES}
    left = n_devices
    out = {}
    for a in ("pipeline", "tensor", "expert", "fsdp"):
        out[a] = math.gcd(sizes[a], left)
        left //= out[a]
    out["data"] = left
    return {a: out[a] for a in MESH_AXES}


def adapt_layout(cfg: Config, meta: dict, n_devices: int) -> tuple[Config, list[str]]:
    """The config for resuming a checkpoint saved on another device count: a mesh that fits
    n_devices (when the configured one does not) and a grad_accum that keeps the global batch
    and does not grow the per-device microbatch. ConfigError when no layout keeps the batch."""
    from jaxpar.config import make_config
    from jaxpar.mesh import resolve_sizes

    changes: list[str] = []
    raw = cfg.model_dump(mode="json")
    try:
        resolve_sizes(cfg.mesh, n_devices)
    except ConfigError:
        new = fit_mesh(cfg, n_devices)
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
    acc = cfg.train.grad_accum
    if acc < need or (G // dp) % acc:
        acc = next(a for a in range(need, G // dp + 1) if (G // dp) % a == 0)
    if acc != cfg.train.grad_accum:
        changes.append(f"train.grad_accum {cfg.train.grad_accum} -> {acc} (global batch {G} = "
                       f"{dp} batch-parallel x {acc} microbatches x {G // (dp * acc)} rows; saved as "
                       f"{old_dp} x {old_acc} x {saved_G // max(old_dp * old_acc, 1)})")
        raw = cfg.model_dump(mode="json")
        raw["train"]["grad_accum"] = acc
        cfg = make_config(raw, [])
    return cfg, changes


def _fmt_mesh(cfg: Config, n: int) -> str:
    from jaxpar.mesh import resolve_sizes
    return ",".join(f"{a}={v}" for a, v in resolve_sizes(cfg.mesh, n).items() if v != 1) or "1 device"


def plan_resume(cfg: Config, n_devices: int | None = None, own_root: Path | None = None) -> ResumePlan:
    """Decide where `cfg` resumes from (train.resume) and adapt its layout to the device count
    (when checkpoint.elastic). Reads only JSON; the arrays are restored by `Trainer.restore`."""
    n = n_devices or jax.device_count()
    own = Path(own_root) if own_root is not None else checkpoint_dir(cfg)
    src = resolve_source(cfg.train.resume, own)
    if src is None:
        if any(ok for _, _, ok in list_steps(own)):
            raise CheckpointError(
                f"train.resume=never but {own} already holds checkpoints of an earlier run; "
                f"delete them, choose another name, or resume (train.resume=auto)")
        return ResumePlan(cfg)
    root, step = src
    changes: list[str] = []
    if cfg.train.resume not in ("auto", "never") and Path(root).absolute() != own.absolute() \
            and any(ok for _, _, ok in list_steps(own)):
        # a restarted run (same command) continues from its own, newer checkpoints
        changes.append(f"train.resume={cfg.train.resume!r} not used: this run already has its own "
                       f"checkpoints in {own}")
        root, step = own, None
    found = _first_readable_meta(root, step)
    if found is None:
        if cfg.train.resume != "auto":
            raise CheckpointError(f"train.resume={cfg.train.resume!r}: no readable checkpoint in {root}")
        if any(ok for _, _, ok in list_steps(root)):
            raise CheckpointError(f"no good checkpoint in {root} (every step is unreadable); "
                                  f"move it away or set train.resume=never with another run name")
        return ResumePlan(cfg)
    s, meta, saved_cfg = found
    diffs = _model_differences(saved_cfg, cfg)
    if diffs:
        raise CheckpointError(f"checkpoint {root / str(s)} was saved for another model:\n  "
                              + "\n  ".join(diffs))
    if cfg.checkpoint.elastic and int(meta.get("devices", n)) != n:
        cfg, adapted = adapt_layout(cfg, meta, n)
        changes += adapted
    return ResumePlan(cfg, root, step, meta, changes)


# ---------------------------------------------------------------------------- metrics.jsonl


def truncate_metrics(path: Path, step: int) -> int:
    """Drop records with step > `step` (and any torn last line) so a resumed run's metrics.jsonl
    reads like an uninterrupted one. Returns how many lines were dropped. When the kept records
    are a prefix of the file (the usual case) the file is truncated in place, so a writer that
    has it open in append mode carries on correctly."""
    path = Path(path)
    if not path.is_file():
        return 0
    data = path.read_bytes()
    keep, dropped, prefix, offset, in_prefix = [], 0, 0, 0, True
    for raw in data.splitlines(keepends=True):
        offset += len(raw)
        try:
            rec = json.loads(raw)
            ok = raw.endswith(b"\n") and int(rec["step"]) <= step
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError):
            ok = False
        if ok:
            keep.append(raw)
            if in_prefix:
                prefix = offset
        else:
            dropped += 1
            in_prefix = False
    if not dropped:
        return 0
    if prefix == sum(len(r) for r in keep):
        with open(path, "r+b") as f:
            f.truncate(prefix)
    else:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(keep))
        os.replace(tmp, path)
    return dropped


# ---------------------------------------------------------------------------- preemption


class Preemption:
    """SIGTERM / SIGINT: finish the current step, save, exit cleanly.

    With jax.distributed (more than one process), every process asks jax's preemption sync point
    (which learns of SIGTERM through the coordination service), so all agree on the step to save.
    Otherwise jaxpar installs its own handlers; a second signal restores the default behaviour.
    A grace timer started by the signal ends the process if saving takes longer than `grace_s`."""

    def __init__(self, grace_s: float = 60.0, log: Callable[[str], None] = print) -> None:
        self.grace_s = grace_s
        self.log = log
        self.requested: str | None = None
        self.distributed = jax.process_count() > 1
        self._old: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is not threading.main_thread():
            return self
        sigs = (signal.SIGINT,) if self.distributed else (signal.SIGTERM, signal.SIGINT)
        for sig in sigs:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except (ValueError, OSError):
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError):
                pass
        self._old.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:  # second signal: the default behaviour
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        self.requested = name
        print(f"jaxpar: {name} received: finishing this step, saving, exiting "
              f"(grace {self.grace_s:g}s)", file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.grace_s, self._expired)
        self._timer.daemon = True
        self._timer.start()

    def _expired(self) -> None:
        print(f"jaxpar: error: the preemption grace period ({self.grace_s:g}s) ran out before the "
              f"save finished; exiting without it (the previous complete checkpoint is kept)",
              file=sys.stderr, flush=True)
        os._exit(1)

    def should_stop(self, step: int) -> bool:
        if self.requested is not None:
            return True
        if self.distributed:
            from jax.experimental import multihost_utils
            try:
                if multihost_utils.reached_preemption_sync_point(step):
                    self.requested = "preemption notice"
                    return True
            except Exception:  # no preemption service configured
                return False
        return False


# ---------------------------------------------------------------------------- inspect


def inspect(path: str | Path, verify_data: bool = False) -> str:
    """A report of the checkpoints under `path` (a run dir, its checkpoints dir or one step)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such directory")
    if _is_step_name(p.name) and (p / "state").exists():
        root, only = p.parent, int(p.name)
    elif (p / "checkpoints").is_dir():
        root, only = p / "checkpoints", None
    else:
        root, only = p, None
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
        import yaml
        lines.append("\nconfig:")
        lines.append("  " + yaml.safe_dump(read_config(d), sort_keys=False).rstrip().replace("\n", "\n  "))
    return "\n".join(lines)


def _verify_on_host(root: Path, step: int, meta: dict) -> str:
    """Load one step onto the first local device and compare checksums ('' when good)."""
    import orbax.checkpoint as ocp
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
        return _short(e)
