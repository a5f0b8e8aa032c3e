"""Fault tolerance: orbax checkpoints, resume, preemption, elastic resume, integrity checks.

A checkpoint is one orbax step directory `<run dir>/checkpoints/<step>/` with three items:
  state   the train state (step, params, opt_state) as tensorstore arrays (OCDBT/zarr, no pickle)
  meta    JSON: step, data position and RNG seed, the mesh / device count / batch layout it was
          saved on, non-finite counters, and a checksum of every array (see `fingerprint`)
  config  JSON: the resolved config

Orbax writes a step into a temporary directory and renames it when every item is written, so a
step directory that exists is whole; a run killed mid-save leaves only a temporary directory,
which the next run deletes. A step saved with another state (another optimizer, mu_dtype,
param_dtype: see `compat`) is one error naming what differs, never taken for damage. A step whose
files were damaged afterwards (truncated, bit flips)
fails to restore or fails its checksum, and restore falls back to the previous step. With several
processes they fall back together: a step is used only when every process read it and it passed
its checksums (`agree`), so one host's damaged file never splits the group across two steps.

Restore builds the target from the *current* trainer (shapes + shardings of its mesh), so a
checkpoint saved on one mesh restores onto another (device count, ZeRO stage, tensor size).
`plan_resume` adapts the mesh and `train.grad_accum` before the trainer is built when the
device count changed, keeping the global batch (and so the data order and the loss curve).

One job per module:
  files       where checkpoints live (the checkpoints root), step directories, their JSON
  integrity   checksums of the arrays
  errors      CheckpointError, and which exceptions mean a damaged step
  agreement   every process's verdict on a step
  compat      does a step hold the state this config builds; settings changed since it
  store       the orbax Checkpointer: save, verified restore with fall back
  layout      the saved batch layout and the elastic one to resume with
  resume      train.resume planning, metrics.jsonl cut back to the resumed step
  preemption  SIGTERM / SIGINT: finish the step, save, exit
  report      `jaxpar checkpoint inspect`
"""
from jaxpar.checkpoint.agreement import agree
from jaxpar.checkpoint.errors import CheckpointError, StateMismatch, damage
from jaxpar.checkpoint.files import (DEFAULT_DIR, FORMAT, ITEMS, check_complete, checkpoint_dir,
                                     ensure_writable, list_steps, locate, read_config, read_meta)
from jaxpar.checkpoint.integrity import fingerprint, verify
from jaxpar.checkpoint.layout import adapt_layout, batch_parallel, fit_mesh, layout_meta
from jaxpar.checkpoint.preemption import Preemption
from jaxpar.checkpoint.report import inspect, inspect_report
from jaxpar.checkpoint.resume import ResumePlan, plan_resume, resolve_source, truncate_metrics
from jaxpar.checkpoint.store import CORE_KEYS, Checkpointer, restore_params

__all__ = [
    "CORE_KEYS", "DEFAULT_DIR", "FORMAT", "ITEMS", "CheckpointError", "Checkpointer", "Preemption",
    "ResumePlan", "StateMismatch", "adapt_layout", "agree", "batch_parallel", "check_complete",
    "checkpoint_dir", "damage", "ensure_writable", "fingerprint", "fit_mesh", "inspect",
    "inspect_report", "layout_meta", "list_steps", "locate", "plan_resume", "read_config",
    "read_meta", "resolve_source", "restore_params", "truncate_metrics", "verify",
]
