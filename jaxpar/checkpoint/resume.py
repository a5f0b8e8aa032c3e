"""Where a run resumes from (train.resume), with which layout, and its metrics cut back to match.

Planning reads only the steps' JSON, before the trainer is built, so the layout can adapt to the
device count; the arrays are restored by `Checkpointer.restore` onto the trainer it builds.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import jax

from jaxpar.checkpoint.agreement import agree, attempt, steps_anywhere
from jaxpar.checkpoint.compat import field_differences, resume_notices, schedule_notices
from jaxpar.checkpoint.errors import CheckpointError, print_warning
from jaxpar.checkpoint.files import checkpoint_dir, list_steps, locate, read_config, read_meta
from jaxpar.checkpoint.layout import adapt_layout
from jaxpar.config import Config


def resolve_source(spec: str, default_root: Path) -> tuple[Path, int | None] | None:
    """`train.resume` -> (checkpoints root, a step or None for the latest), or None for `never`.

    `auto`: this run's own checkpoints. A path may name a run dir (with `checkpoints/`), a
    checkpoints dir, or one step directory in it (see `locate`)."""
    if spec == "never":
        return None
    if spec == "auto":
        return default_root, None
    p = Path(spec)
    if not p.exists():
        raise CheckpointError(f"train.resume={spec!r}: no such directory")
    root, step = locate(p)
    if root == p and not any(ok for _, _, ok in list_steps(p)):
        raise CheckpointError(f"train.resume={spec!r}: no checkpoint steps in this directory")
    return root, step


@dataclass
class ResumePlan:
    """Where a run resumes from, and the config to build the trainer with."""

    cfg: Config
    root: Path | None = None          # checkpoints dir to restore from
    step: int | None = None           # a fixed step, or None for the latest good one
    meta: dict | None = None          # meta of the step the layout was planned from
    changes: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)  # settings changed since the checkpoint

    @property
    def resuming(self) -> bool:
        return self.root is not None


def _first_readable_meta(root: Path, step: int | None) -> tuple[int, dict, dict] | None:
    """The newest step whose JSON every process reads (with its meta and config)."""
    mine = [s for s, _, ok in list_steps(root) if ok]
    steps = [step] if step is not None else steps_anywhere(mine)
    for s in steps:
        d = root / str(s)
        found, problem = attempt(lambda: (read_meta(d), read_config(d)))
        bad = agree(problem)
        if not bad:
            return s, *found
        for reason in bad:
            print_warning(f"checkpoint {d} is unusable ({reason}); trying the previous one")
    return None


MODEL_SHAPE_FIELDS = tuple(f"model.{k}" for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                                                    "head_dim", "ffn_dim", "tie_embeddings"))


def _model_differences(saved: dict, cfg: Config) -> list[str]:
    return field_differences(saved, cfg.model_dump(mode="json"), MODEL_SHAPE_FIELDS)


def plan_resume(cfg: Config, n_devices: int | None = None, own_root: Path | None = None,
                adapt: bool = True) -> ResumePlan:
    """Decide where `cfg` resumes from (train.resume) and adapt its layout to the device count
    (when checkpoint.elastic and `adapt`: not for a layout the planner chose for these devices).
    Reads only JSON; the arrays are restored by `Trainer.restore`."""
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
    if adapt and cfg.checkpoint.elastic and int(meta.get("devices", n)) != n:
        cfg, adapted = adapt_layout(cfg, meta, n)
        changes += adapted
    notices = resume_notices(saved_cfg, cfg.model_dump(mode="json")) + schedule_notices(saved_cfg, cfg, s)
    return ResumePlan(cfg, root, step, meta, changes, notices)


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
