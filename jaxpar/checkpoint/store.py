"""The orbax store: save a step (async, keep policy), restore it onto any mesh, verified.

Restore goes from the newest step down and takes the first one every process reads and whose
checksums match; newer unusable steps are renamed `<step>.unusable` so the run can save them again.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import jax

from jaxpar import distributed
from jaxpar.checkpoint.agreement import agree, attempt, steps_anywhere
from jaxpar.checkpoint.compat import check_state, state_differences
from jaxpar.checkpoint.errors import CheckpointError, print_warning
from jaxpar.checkpoint.files import FORMAT, ITEMS, check_complete, ensure_writable, read_config, read_meta
from jaxpar.checkpoint.integrity import fingerprint, leaf_paths, verify
from jaxpar.config import Config


class Checkpointer:
    """An orbax CheckpointManager for one run: async saves with a keep policy, restore with
    checksum verification and fall back to older steps."""

    def __init__(self, root: str | Path, *, keep_last: int = 3, keep_every: int | None = None,
                 async_save: bool = True, log: Callable[[str], None] = print,
                 read_only: bool = False) -> None:
        import orbax.checkpoint as ocp  # heavy (seconds): only runs that checkpoint pay for it
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

    @classmethod
    def for_run(cls, cfg: Config, root: Path, log: Callable[[str], None] = print) -> "Checkpointer":
        """The checkpointer a run saves with: `root` checked writable first (one clear error),
        `cfg.checkpoint`'s keep policy and async setting."""
        ensure_writable(root, cfg)
        c = cfg.checkpoint
        return cls(root, keep_last=c.keep_last, keep_every=c.keep_every, async_save=c.async_save, log=log)

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
                  for p, x in zip(leaf_paths(state), jax.tree.leaves(state))}
        meta = {"format": FORMAT, "step": int(step), **meta, "arrays": arrays,
                "checksums": fingerprint(state), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.mngr.save(int(step), args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta),
            config=ocp.args.JsonSave(config)), force=True)
        self.last_saved = int(step)
        dt = time.perf_counter() - t0
        self.save_seconds.append(dt)
        try:  # the observability module, when present, exports save times (a save never fails for it)
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
                warn: Callable[[str], None] = print_warning,
                config: dict | None = None, at_most: int | None = None) -> tuple[Any, dict, int]:
        """(state, meta, step) from `step`, or the latest good step (`at_most`: the latest good
        one up to that step, a rollback's). `abstract_state` holds ShapeDtypeStructs with the
        shardings to restore onto (any mesh). A step that fails to load on any process, or whose
        checksums differ, is reported with `warn` and every process tries the previous one (not
        when `step` is given). A step saved with another state structure or dtypes (a config
        change, not damage) stops it with one StateMismatch naming the differences from `config`
        (the current config, as JSON), before any array is read."""
        if step is not None:
            steps = [step]
        else:
            steps = [s for s in steps_anywhere(self.all_steps()) if at_most is None or s <= at_most]
        if not steps:
            raise CheckpointError(f"no checkpoints in {self.root}"
                                  + (f" up to step {at_most}" if at_most is not None else ""))
        failures = []
        for s in steps:
            where = self.root / str(s)
            loaded, problem = attempt(lambda: self._load(abstract_state, s, config))
            bad = agree(problem)
            if not bad:  # every process holds its part: the checksums are one global computation
                _, problem = attempt(lambda: _check_sums(*loaded))
                bad = agree(problem)
            if not bad:
                self.set_aside([x for x in steps if x > s], "unusable")
                return loaded[0], loaded[1], s
            failures += [f"step {s}: {reason}" for reason in bad]
            rest = [x for x in steps if x < s]
            then = f"falling back to step {rest[0]}" if rest else "no earlier checkpoint"
            for reason in bad:
                warn(f"checkpoint {where} is unusable ({reason}); {then}")
        raise CheckpointError(f"no good checkpoint in {self.root}:\n  " + "\n  ".join(failures))

    def set_aside(self, steps: list[int], why: str) -> None:
        """Rename steps to `<step>.<why>` (kept for inspection, no longer restorable), so the run
        can save those steps again: newer unusable steps on a restore, the steps after a rollback.
        Process 0 renames (shared storage); all reload."""
        if not steps or self.read_only:
            return
        self.wait()  # a save in flight lands before its directory moves
        if jax.process_index() == 0:
            for s in steps:
                src, dst = self.root / str(s), self.root / f"{s}.{why}"
                n = 1
                while dst.exists():
                    dst, n = self.root / f"{s}.{why}.{n}", n + 1
                if src.is_dir():
                    src.rename(dst)
                    print_warning(f"moved the {why.replace('_', ' ')} checkpoint {src} aside to {dst}")
        distributed.barrier("checkpoint set aside")
        self.mngr.reload()

    def _load(self, abstract_state: Any, s: int, config: dict | None = None) -> tuple[Any, dict]:
        """This process's part of step `s` (raises a damage error when it cannot be read, and
        StateMismatch when it holds another state than `abstract_state`)."""
        ocp = self.ocp
        where = self.root / str(s)
        if not where.is_dir():
            raise CheckpointError(f"{where} not found")
        problems = check_complete(where)
        if problems:
            raise CheckpointError("incomplete: " + "; ".join(problems))
        meta = read_meta(where)
        # parts of the state that cannot carry over are left out (partial restore)
        target, dropped = restorable(abstract_state, meta)
        check_state(target, meta, where, _config_or_none(where) if config is not None else None, config)
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


def _config_or_none(step_dir: Path) -> dict | None:
    """The step's saved config, or None when it cannot be read (only named in an error)."""
    try:
        return read_config(step_dir)
    except CheckpointError:
        return None


def _check_sums(state: Any, meta: dict) -> None:
    bad = verify(state, meta)
    if bad:
        raise CheckpointError(f"checksum mismatch in {', '.join(bad[:3])}"
                              + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))


CORE_KEYS = ("step", "params", "opt_state")
# state laid out by the mesh's sizes, not only its shapes: the compression residuals' rows and
# slots follow the batch axes' sizes (collectives/reducer.py), so data 4 x fsdp 2 and data 2 x
# fsdp 4 give the same shapes with each gradient element in another place. Kept on the same mesh only.
MESH_BOUND = ("comm",)


def restorable(abstract_state: Any, meta: dict) -> tuple[Any, list[str]]:
    """The part of the target state a checkpoint can fill, and the top-level keys it cannot:
    state beside step/params/opt_state (e.g. gradient-compression residuals, one row per batch
    device) whose saved shapes or dtypes differ from the current ones, or that is new or gone.
    (The core keys must match: `compat.check_state`.)"""
    saved = meta.get("arrays")
    if not saved or not isinstance(abstract_state, dict):
        return abstract_state, []
    saved_tops = {p.split("/")[0] for p in saved}
    dropped = []
    for key, sub in abstract_state.items():
        if key in CORE_KEYS:
            continue
        now = {f"{key}/{p}" if p else key: [list(x.shape), str(x.dtype)]
               for p, x in zip(leaf_paths(sub), jax.tree.leaves(sub))}
        then = {p: [list(a["shape"]), str(a.get("dtype"))] for p, a in saved.items()
                if p == key or p.startswith(key + "/")}
        if now != then or (key in MESH_BOUND and _mesh_sizes(sub) not in (None, meta.get("mesh"))):
            dropped.append(key)
    extra = sorted(saved_tops - set(abstract_state))
    if not dropped and not extra:
        return abstract_state, []
    return {k: v for k, v in abstract_state.items() if k not in dropped}, dropped + extra


def _mesh_sizes(tree: Any) -> dict | None:
    """{axis: size} of the mesh `tree`'s leaves are sharded over (None: no sharding to read)."""
    for x in jax.tree.leaves(tree):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if mesh is not None:
            return {a: int(n) for a, n in mesh.shape.items()}
    return None


def restore_params(step_dir: str | Path, abstract_params: Any) -> Any:
    """Only the params of one step directory (no optimizer state: any optimizer can start from
    them), onto `abstract_params`' shapes, dtypes and shardings (ShapeDtypeStructs). Their
    checksums are verified when the saved dtype is the one asked for."""
    import orbax.checkpoint as ocp  # heavy (seconds)
    step_dir = Path(step_dir).absolute()
    problems = check_complete(step_dir)
    if problems:
        raise CheckpointError(f"{step_dir}: incomplete: " + "; ".join(problems))
    meta = read_meta(step_dir)
    target = {"params": abstract_params}
    diffs = state_differences(target, meta, dtypes=False)  # a dtype is converted; a shape is not
    if diffs:
        raise CheckpointError(
            f"{step_dir}: its params are not those of the model its saved config describes: "
            + "; ".join(diffs[:3]) + (f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else "")
            + ". A run of your own model (Trainer(model_factory=...)) is read back by a Trainer "
              "with that factory; generate, convert and train.init_from read jaxpar's built-in models")
    handler = ocp.PyTreeCheckpointHandler()
    try:
        restored = handler.restore(step_dir / "state", args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True))
    except Exception as e:  # noqa: BLE001 (orbax/tensorstore errors: one line, the step named)
        raise CheckpointError(f"{step_dir}: cannot restore its params: {str(e).splitlines()[0]}") from None
    finally:
        handler.close()
    saved = meta.get("arrays", {})
    now = fingerprint(restored)
    same = all(saved.get(p, {}).get("dtype") == str(x.dtype)
               for p, x in zip(leaf_paths(restored), jax.tree.leaves(restored)))
    bad = [p for p, v in now.items() if same and meta.get("checksums", {}).get(p, v) != v]
    if bad:
        raise CheckpointError(f"{step_dir}: checksum mismatch in {', '.join(bad[:3])}")
    return restored["params"]
