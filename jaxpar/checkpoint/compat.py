"""Does a checkpoint hold the state this config builds, and which settings changed since it?

Checked on the saved shapes and dtypes (the meta's `arrays`) before any array is read: a changed
optimizer, mu_dtype or param_dtype is one error naming the state and the settings that differ,
never an orbax traceback, nor a checksum mismatch that would make good steps look damaged.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxpar.checkpoint.errors import StateMismatch
from jaxpar.checkpoint.integrity import leaf_paths

# the settings that shape the train state (whole sections: every field of them)
STATE_FIELDS = ("optimizer.name", "optimizer.mu_dtype", "optimizer.clip_norm", "train.param_dtype",
                "train.master_dtype", "train.compute_dtype", "train.loss_scale", "gradient_compression",
                "local_sgd")
# settings a resume may change, but never silently: {field: what it means}
NOTICE_FIELDS = {"train.global_batch": "", "train.seq_len": "",
                 "train.seed": "the data order will differ from the original run's"}
SHOWN = 3  # differing state paths named in the error


def _get(tree: dict, dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted field in a config dict."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _expand(fields, *trees: dict) -> list[str]:
    """Dotted fields, a section name standing for every field it has in any of `trees`."""
    out = []
    for f in fields:
        subs = {k for t in trees for k in (_get(t, f)[1] or {})} if "." not in f else set()
        out += [f"{f}.{k}" for k in sorted(subs)] if subs else [f]
    return out


def changed_fields(saved: dict, now: dict, fields) -> list[tuple[str, Any, Any]]:
    """(field, checkpoint's value, config's value) for each field that differs; a field the saved
    config lacks (an older version wrote it) is skipped."""
    out = []
    for f in _expand(fields, saved, now):
        had, then = _get(saved, f)
        has, cur = _get(now, f)
        if had and has and then != cur:
            out.append((f, then, cur))
    return out


def field_differences(saved: dict, now: dict, fields) -> list[str]:
    """"field: checkpoint X, config Y" for each field of `fields` that differs."""
    return _describe(changed_fields(saved, now, fields))


def _describe(changed: list[tuple[str, Any, Any]]) -> list[str]:
    return [f"{f}: checkpoint {a!r}, config {b!r}" for f, a, b in changed]


def resume_notices(saved: dict, now: dict) -> list[str]:
    """"train.seed 0 -> 1 (...)" for each NOTICE_FIELDS field changed since the checkpoint."""
    return [f"{f} {a} -> {b}" + (f" ({NOTICE_FIELDS[f]})" if NOTICE_FIELDS[f] else "")
            for f, a, b in changed_fields(saved, now, NOTICE_FIELDS)]


SCHEDULE_FIELDS = ("optimizer.lr", "optimizer.warmup_steps", "optimizer.decay_steps",
                   "optimizer.min_lr_ratio", "train.steps")


def schedule_notices(saved: dict, now: Any, step: int) -> list[str]:
    """One line when the learning rate of the steps still to run differs from the checkpoint's
    schedule (a changed lr, warmup, decay, or train.steps with decay_steps null: the cosine is
    stretched): legitimate, but it moves the lr of the very next step (a jump up once extended)."""
    from jaxpar.config import OptimizerConfig
    from jaxpar.train.decay import schedule

    changed = changed_fields(saved, now.model_dump(mode="json"), SCHEDULE_FIELDS)
    if not changed:
        return []
    try:  # the checkpoint's schedule: its optimizer fields over today's (an older config lacks some)
        then = {k: v for k, v in saved["optimizer"].items() if k in OptimizerConfig.model_fields}
        then_opt = OptimizerConfig.model_validate({**now.optimizer.model_dump(), **then})
        then_lr = schedule(then_opt, int(saved["train"]["steps"]))
    except Exception:  # noqa: BLE001 - unreadable: the field notice alone
        then_lr = None
    what = ", ".join(f"{f} {a} -> {b}" for f, a, b in changed)
    if then_lr is None:
        return [f"the learning-rate schedule ({what})"]
    # the lrs of the steps to run, each schedule read once over all their optimizer counts (one
    # by one, a long run's resume evaluated the schedules for minutes)
    ahead = np.arange(step, max(step + 1, now.train.steps), dtype=np.int32)
    before = np.asarray(then_lr(ahead))
    after = np.asarray(schedule(now.optimizer, now.train.steps)(ahead))
    if np.all(np.abs(before - after) <= 1e-7 * now.optimizer.lr):
        return []  # e.g. train.steps with decay_steps set: the same learning rates
    return [f"the learning-rate schedule ({what}): lr of step {step + 1} {before[0]:.4g} -> {after[0]:.4g}"]


def _fmt(shape, dtype) -> str:
    return f"{dtype}[{'x'.join(map(str, shape))}]"


def state_differences(target: Any, meta: dict, dtypes: bool = True) -> list[str]:
    """How the state `target` (ShapeDtypeStructs) differs from the one saved in `meta`, one line per
    leaf path, under the target's top-level keys (empty: same paths, shapes and dtypes, or no
    record of them: an older format)."""
    saved = meta.get("arrays")
    if not saved:
        return []
    now = {p: (list(x.shape), str(x.dtype)) for p, x in zip(leaf_paths(target), jax.tree.leaves(target))}
    tops = set(target) if isinstance(target, dict) else {p.split("/")[0] for p in now}
    then = {p: (list(a["shape"]), str(a["dtype"])) for p, a in saved.items() if p.split("/")[0] in tops}
    out = []
    for p, x in now.items():
        if p not in then:
            out.append(f"{p}: not in the checkpoint (config {_fmt(*x)})")
        elif then[p] != x if dtypes else then[p][0] != x[0]:
            out.append(f"{p}: checkpoint {_fmt(*then[p])}, config {_fmt(*x)}")
    out += [f"{p}: only in the checkpoint ({_fmt(*then[p])})" for p in then if p not in now]
    return out


def _override(field: str, value: Any) -> str:
    v = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
    return f"{field}={v}"


def check_state(target: Any, meta: dict, where, saved_config: dict | None = None,
                config: dict | None = None) -> None:
    """StateMismatch when the checkpoint at `where` holds another state than `target`: the first
    differing paths, the state-shaping settings that differ between its config and `config`, and
    what to do. Nothing is read or moved, so every step stays as it was."""
    diffs = state_differences(target, meta)
    if not diffs:
        return
    more = f"\n  ... and {len(diffs) - SHOWN} more" if len(diffs) > SHOWN else ""
    msg = (f"checkpoint {where} holds another train state than this config builds (nothing was "
           f"restored or changed):\n  " + "\n  ".join(diffs[:SHOWN]) + more)
    changed = changed_fields(saved_config, config, STATE_FIELDS) if saved_config and config else []
    if changed:
        msg += ("\nthe settings that shape the state differ from the checkpoint's:\n  "
                + "\n  ".join(_describe(changed))
                + "\nresume with the checkpoint's values (" + " ".join(_override(f, a) for f, a, _ in changed)
                + "), or ")
    else:
        msg += ("\nno setting known to shape the state differs from the checkpoint's config (another "
                "model factory or jaxpar version?); resume with the code and config it was saved with, or ")
    msg += (f"start a new run (another name, or train.resume=never), from these weights if you like "
            f"with train.init_from={where} (the params only, a fresh optimizer state)")
    raise StateMismatch(msg)
