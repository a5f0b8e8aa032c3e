"""Pipeline parallelism over the `pipeline` mesh axis.

schedule.py   timetables (gpipe, 1f1b, interleaved_1f1b, zb_h1): what each device does at each
              tick; the runner executes them, `jaxpar bench pipeline` prints and draws them.
runner.py     the pipelined forward + backward inside the train step's shard_map.
residuals.py  a stage's vjp as stashable arrays (pipeline.recompute=false).
split.py      zb_h1, 1f1b_split: a layer's backward cut into its input half (Bx) and weight half (W).

Config: `pipeline.schedule`, `pipeline.virtual_stages`, `pipeline.microbatches` (null: the
microbatch count is train.grad_accum), `pipeline.recompute`; `mesh.pipeline` is the number of
devices (stages).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from jaxpar.config import ConfigError, PipelineConfig
from jaxpar.parallel.pipeline.runner import flatten, make_pipeline_grads
from jaxpar.parallel.pipeline.schedule import (SCHEDULES, Timetable, build_timetable, check_schedule,
                                               idle_formula, plot_timetable)


def stacked_paths(model) -> set[tuple]:
    """Param paths whose leading dim is `layers` (what the pipeline splits into stages)."""
    return {k for k, ax in flatten(model.axes).items() if ax[:1] == ("layers",)}


def check_pipeline_layout(cfg, plan, check_model: bool = True) -> None:
    """Config mistakes of a pipelined run, as one clear ConfigError each (Trainer.check_layout)."""
    p = plan.mesh.shape["pipeline"]
    pc, t = cfg.pipeline, cfg.train
    m = pc.resolved_microbatches(t.grad_accum)
    check_schedule(pc.schedule, p, m, pc.virtual_stages, cfg.model.n_layers if check_model else None,
                   pc.recompute)
    dp = plan.batch_size_divisor
    if t.global_batch % (dp * m):
        raise ConfigError(
            f"train.global_batch={t.global_batch} must be divisible by the batch-parallel size ({dp}) "
            f"times the pipeline microbatches ({m}) = {dp * m}")


@dataclass(frozen=True)
class PipelineAccumulation:
    """The step's accumulation interface (jaxpar/train/accumulate.py) run as a timetable:
    accumulate(params, mbs, loss, comm) -> (losses [1], local grads, sown [1], comm): the sync
    reduces nothing in the layers (no `in_scan`), so the comm state passes through."""

    run: Callable
    microbatches: int

    def __call__(self, params, mbs, loss, comm):
        return (*self.run(params, mbs, loss), comm)


def make_step_pipeline(model, plan, pipeline_cfg, grad_accum: int, ctx, prepare_top: Callable,
                       cast_layers: Callable, scatter: Callable, grad_specs: Any,
                       rows: Callable | None = None) -> PipelineAccumulation:
    """What the train step runs instead of the microbatch scan when mesh.pipeline > 1;
    `prepare_top` and `cast_layers` are the forward's (train/forward.py), `scatter(grads,
    specs)` is the sync's per-microbatch hook, `grad_specs` its `grad_out`, `rows(mb)` a
    microbatch's Rows on this device (under mesh.context: its part of each sequence,
    parallel/context.ContextParallel.split)."""
    cfg = pipeline_cfg or PipelineConfig()
    p = plan.mesh.shape["pipeline"]
    m = cfg.resolved_microbatches(grad_accum)
    stacked = stacked_paths(model)
    if not stacked:
        raise ValueError("mesh.pipeline > 1 needs a model whose layers are stacked on a `layers` dim "
                         "and run with jaxpar.nn.scan_layers")
    n_layers = {flatten(model.shapes)[k].shape[0] for k in stacked}
    if len(n_layers) != 1:
        raise ValueError(f"stacked params disagree on the layer count: {sorted(n_layers)}")
    check_schedule(cfg.schedule, p, m, cfg.virtual_stages, n_layers.pop(), cfg.recompute)
    if plan.layer_rounds != cfg.virtual_stages:
        raise ValueError(f"pipeline.virtual_stages={cfg.virtual_stages} runs each device's layers "
                         f"as {cfg.virtual_stages} chunks, but the plan stores them in "
                         f"layer_rounds={plan.layer_rounds}: build the Plan with "
                         f"layer_rounds=pipeline.virtual_stages (the Trainer does)")
    tt = build_timetable(cfg.schedule, p, m, cfg.virtual_stages, cfg.recompute)
    manual = frozenset(plan.batch_axes) | {"pipeline", "context"}
    busy = tuple(sorted(a for a in manual if plan.mesh.shape.get(a, 1) > 1))
    return PipelineAccumulation(make_pipeline_grads(model, tt, ctx, prepare_top, cast_layers, scatter,
                                                    grad_specs, stacked, busy, rows), m)


__all__ = ["SCHEDULES", "Timetable", "build_timetable", "check_pipeline_layout", "check_schedule",
           "idle_formula",
           "PipelineAccumulation", "make_step_pipeline", "plot_timetable", "stacked_paths"]
