"""Where checkpoints live and what a step directory holds (read without orbax or arrays).

The one rule for the checkpoints root: a run saves into `checkpoint_dir(cfg)`, and a path a user
names (train.resume, `jaxpar checkpoint inspect`) is read by `locate`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax

from jaxpar.checkpoint.errors import CheckpointError
from jaxpar.config import Config

FORMAT = "jaxpar-checkpoint/1"
ITEMS = ("state", "meta", "config")
DEFAULT_DIR = "checkpoints"  # inside the run dir, when checkpoint.dir is unset
TMP_MARK = ".orbax-checkpoint-tmp"


def checkpoint_dir(cfg: Config, out_dir: Path | None = None) -> Path:
    """Where this run saves: `checkpoint.dir` (a relative one inside the run dir), or
    `<run dir>/checkpoints`. `out_dir` is the run dir when it is not `cfg.out_dir`."""
    run = Path(out_dir) if out_dir is not None else cfg.out_dir
    return run / (cfg.checkpoint.dir or DEFAULT_DIR)  # an absolute dir replaces `run`


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
            f"the checkpoint directory (checkpoint.dir unset: <run dir>/{DEFAULT_DIR})"
        raise CheckpointError(f"{what}: cannot create or write {root}: {e.strerror or e}; "
                              f"set checkpoint.dir to a writable directory") from None


def is_step_name(name: str) -> bool:
    return name.isdigit()


def list_steps(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, path, finalized) for every step directory and interrupted save under `root`, by step."""
    out = []
    if not root.is_dir():
        return out
    for p in root.iterdir():
        if not p.is_dir():
            continue
        if is_step_name(p.name):
            out.append((int(p.name), p, True))
        elif TMP_MARK in p.name and is_step_name(p.name.split(TMP_MARK)[0]):
            out.append((int(p.name.split(TMP_MARK)[0]), p, False))
    return sorted(out, key=lambda t: (t[0], t[2]))


def locate(p: Path) -> tuple[Path, int | None]:
    """(checkpoints root, the step or None) for an existing path a user named: one step directory,
    a checkpoints dir, or a run dir holding `checkpoints/` (a dir with steps of its own is a root)."""
    p = Path(p)
    if is_step_name(p.name) and (p / "state").is_dir():
        return p.parent, int(p.name)
    if (p / DEFAULT_DIR).is_dir() and not any(ok for _, _, ok in list_steps(p)):
        return p / DEFAULT_DIR, None
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
