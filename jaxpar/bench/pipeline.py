"""`jaxpar bench pipeline [--plot FILE.png]`: pipeline schedules read off their timetables, and
the per-device temporary memory of the compiled step.

For each schedule (gpipe, 1f1b, interleaved_1f1b with v = 2, zb_h1) and each (p, m, v):
  - idle: the idle fraction of the timetable the runner executes (idle slots / rows x devices),
    beside the formula (schedule.idle_formula; 1f1b's rows alternate forwards and backwards,
    zb_h1's are a third of an F + B + W);
  - stash: the peak number of microbatch(-chunk)s a device holds between a forward and its
    backward (zb_h1: its W; device 0, the most), and the residual slots the runner allocates
    (pipeline.recompute=false; with recompute: the stage-input slots);
  - lockstep t: the runner's wall time by Timetable.lockstep_time (forward 1, backward 2, each
    half of a split backward 1; a tick lasts as long as its slowest device), without and with
    pipeline.recompute (+1 per backward), beside the work m x 3;
  - temp: `compiled.memory_analysis().temp_size_in_bytes` of the whole train step, for
    p = mesh.pipeline only (one compile each), with the microbatch size held fixed
    (global_batch = data-parallel size x m x microbatch) so that only m changes.
p runs over 2, 4, 8 up to the device count for the timetable columns; a (schedule, p, v) whose
p x v stages model.n_layers does not split into is left out and the table says so. The compiled
column needs model.n_layers to split into mesh.pipeline stages (an error up front otherwise).
--plot draws the timetable of the configured schedule at (mesh.pipeline, m = 2p,
pipeline.virtual_stages); its directory is checked before anything compiles.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable

import jax

from jaxpar.bench.common import describe_config, fmt_bytes, mesh_overrides, table, with_overrides
from jaxpar.config import Config, ConfigError
from jaxpar.mesh import resolve_sizes
from jaxpar.parallel.pipeline.schedule import SCHEDULES, SPLIT, build_timetable, plot_timetable
from jaxpar.train.trainer import Trainer

# 4 pipeline stages x 2-way data on 8 devices; 8 layers so that interleaving (v = 2) divides.
LAYOUT: list[str] = [*mesh_overrides(data=-1, pipeline=4), "model.n_layers=8", "train.seq_len=64",
                     "data.source=synthetic"]
MICROBATCH = 2  # sequences per microbatch per data-parallel slice, for the memory column


def _variants(n_layers: int, p: int):
    for s in SCHEDULES:
        for v in ((2,) if s == "interleaved_1f1b" else (1,)):
            if n_layers % (p * v) == 0:
                yield s, v


def timetable_row(schedule: str, p: int, m: int, v: int) -> dict:
    tt = build_timetable(schedule, p, m, v)
    again = None if schedule in SPLIT else build_timetable(schedule, p, m, v, recompute=True)
    return {"schedule": schedule, "p": p, "m": m, "v": v, "ticks": tt.ticks,
            "idle": tt.idle_fraction(), "formula": tt.formula(), "stash": max(tt.in_flight()),
            "stash_per_device": tt.in_flight(), "buffer_slots": tt.n_r_slots,
            "lockstep_time": tt.lockstep_time(),
            "lockstep_time_recompute": None if again is None else again.lockstep_time(),
            "work": m * 3.0}


def lockstep_table(ps=(4, 8)) -> list[dict]:
    """The timetable columns of every schedule for each p in `ps` and m = p, 2p, 3p, 4p (no model:
    what docs/benchmarks.md records)."""
    return [timetable_row(s, p, m, 2 if s == "interleaved_1f1b" else 1)
            for p in ps for s in SCHEDULES for m in (p, 2 * p, 3 * p, 4 * p)]


def temp_memory(cfg: Config, schedule: str, m: int, v: int) -> dict:
    sizes = resolve_sizes(cfg.mesh, len(jax.devices()))
    dp = math.prod(sizes[a] for a in cfg.sharding.resolved_rules()["batch"] if a in sizes)
    trial = with_overrides(cfg, [f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={v}",
                                 "train.grad_accum=1", f"pipeline.microbatches={m}",
                                 f"train.global_batch={dp * m * MICROBATCH}"])
    trainer = Trainer(trial, log=lambda s: None)
    t0 = time.perf_counter()
    mem = trainer.compile().memory_analysis()
    return {"temp_bytes": int(mem.temp_size_in_bytes), "global_batch": dp * m * MICROBATCH,
            "compile_s": time.perf_counter() - t0}


def check_plot_path(plot: str) -> None:
    """--plot FILE.png: a file in an existing, writable directory (checked before any compile)."""
    path = Path(plot)
    where = path.parent
    if path.is_dir():
        raise ConfigError(f"jaxpar bench pipeline --plot {plot}: a directory; give a file name, "
                          f"e.g. --plot {path / 'timetable.png'}")
    if not where.is_dir():
        raise ConfigError(f"jaxpar bench pipeline --plot {plot}: the directory {str(where)!r} does not "
                          f"exist; create it or give a file in an existing directory")
    if not os.access(where, os.W_OK):
        raise ConfigError(f"jaxpar bench pipeline --plot {plot}: the directory {str(where)!r} is not "
                          f"writable")


def check_layers(cfg: Config) -> None:
    """The compiled column runs at mesh.pipeline: its stages must split model.n_layers."""
    n, p = cfg.model.n_layers, cfg.mesh.pipeline
    if any(True for _ in _variants(n, p)):
        return
    fits = [q for q in (2, 4, 8) if n % q == 0]
    alt = f" or mesh.pipeline={'/'.join(map(str, fits))} (mesh.data fills the rest)" if fits else ""
    raise ConfigError(f"jaxpar bench pipeline: model.n_layers={n} cannot be split into the benchmark's "
                      f"mesh.pipeline={p} stages (the compiled column runs at mesh.pipeline; the layers "
                      f"must be a multiple of {p}, {2 * p} for interleaved_1f1b with v=2); leave "
                      f"model.n_layers to the benchmark (8) or override model.n_layers={2 * p}{alt}")


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, plot: str | None = None,
        memory: bool = True) -> dict:
    if plot:
        check_plot_path(plot)
    if memory:
        check_layers(cfg)
    n_dev = len(jax.devices())
    p_cfg = cfg.mesh.pipeline
    rows, skipped = [], []
    for p in sorted({q for q in (2, 4, 8) if q <= n_dev} | {p_cfg}):
        fit = set(_variants(cfg.model.n_layers, p))
        skipped += [{"schedule": s, "p": p, "v": v, "stages": p * v} for s in SCHEDULES
                    for v in ((2,) if s == "interleaved_1f1b" else (1,)) if (s, v) not in fit]
        for s, v in _variants(cfg.model.n_layers, p):
            for m in (p, 2 * p, 4 * p):
                row = timetable_row(s, p, m, v)
                if memory and p == p_cfg:
                    log(f"compiling {s} p={p} m={m} v={v} ...")
                    row.update(temp_memory(cfg, s, m, v))
                rows.append(row)
    out = {"config": describe_config(cfg), "mesh_pipeline": p_cfg, "microbatch": MICROBATCH, "rows": rows,
           "n_layers": cfg.model.n_layers, "skipped": skipped}
    if plot:
        pc = cfg.pipeline
        v = pc.virtual_stages if pc.schedule == "interleaved_1f1b" else 1
        out["plot"] = plot_timetable(build_timetable(pc.schedule, p_cfg, 2 * p_cfg, v), plot)
        log(f"timetable drawn in {plot}")
    return out


def format_result(res: dict) -> str:
    headers = ["schedule", "p", "m", "v", "rows", "idle", "formula", "stash/dev", "slots", "lockstep t",
               "recompute", "temp/device"]
    again = lambda r: "-" if r["lockstep_time_recompute"] is None else f"{r['lockstep_time_recompute']:.1f}"
    rows = [[r["schedule"], r["p"], r["m"], r["v"], r["ticks"], f"{r['idle']:.3f}", f"{r['formula']:.3f}",
             r["stash"], r["buffer_slots"], f"{r['lockstep_time']:.1f}/{r['work']:.0f}", again(r),
             fmt_bytes(r.get("temp_bytes"))] for r in res["rows"]]
    lines = [f"pipeline schedules (temp/device: compiled step at mesh.pipeline={res['mesh_pipeline']}, "
             f"microbatch of {res['microbatch']} sequences per data-parallel slice)", table(headers, rows)]
    lines.append("lockstep t: the runner's wall time in device-forwards (forward 1, backward 2, a split "
                 "backward's halves 1 each; each row lasts as long as its slowest device) / the work; "
                 "recompute: the same with pipeline.recompute=true (+1 per backward)")
    if res.get("skipped"):
        left = ", ".join(f"{r['schedule']} p={r['p']}" + (f" v={r['v']}" if r["v"] > 1 else "")
                         + f" ({r['stages']} stages)" for r in res["skipped"])
        lines.append(f"not shown: {left}: model.n_layers={res.get('n_layers')} does not split into that many "
                     f"stages")
    if res.get("plot"):
        lines.append(f"timetable drawn in {res['plot']}")
    return "\n".join(lines)
