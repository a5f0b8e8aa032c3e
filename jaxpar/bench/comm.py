"""`jaxpar bench comm`: bytes each collective kind moves per step, from the compiled HLO, beside
the analytic minimum of the layout.

Rows: pure data parallel (mesh data=-1, zero 0) and zero_stage 0..3 on the benchmark's mesh
(default: fsdp over every device, fsdp=8 on 8 devices). Measured: every collective of
`trainer.compile().as_text()` (`jaxpar.metrics.collective_ops`, count_loops=True, so an op in the
layer scan counts n_layers times and one in the microbatch scan grad_accum times).

Two conventions, per device:
  - result bytes: the size of the op's result shape on one device (what jaxpar.metrics reports;
    all-gather: the gathered buffer, reduce-scatter: the local shard, all-reduce: the buffer);
  - wire bytes: what a ring algorithm sends per device over a group of N devices:
      all-reduce 2(N-1)/N * S,  all-gather (N-1)/N * S_out,  reduce-scatter (N-1)/N * S_in,
      all-to-all (N-1)/N * S,  collective-permute S.
    N comes from each op's replica groups, so collectives over size-1 groups count 0.

Analytic minimum, exact for what the plan shards: for every param, L = its per-device bytes
outside the batch axes (i.e. after tensor sharding), Z = the batch axes its optimizer state
is sharded over (fsdp from ZeRO-1), B = all batch axes, A = train.grad_accum:
  - Z empty (stage 0, or a param the plan does not shard, e.g. norm scales): one all-reduce of
    the gradient over B (result L);
  - stage 1: reduce-scatter of the gradient over Z (in L, out L/|Z|), all-reduce of that shard
    over B minus Z, then all-gather of the updated param over Z (result L)  [ZeRO paper sec. 7:
    same wire volume as data parallel];
  - stage 2: as stage 1 but one reduce-scatter per microbatch (A of them);
  - stage 3: per microbatch, all-gather forward + all-gather again in the backward (result L
    each, in the compute dtype) and one reduce-scatter of the gradient (in L, in
    train.grad_reduce_dtype, as every gradient reduction here);
    all-reduce of the shard over B minus Z; no all-gather after the update.
Scalars (loss, grad-norm partial sums) are left out of the analytic figure.
The rough formula is the same for the whole model with Psi params (4 bytes each), N = |Z|:
  DP: AR 4Psi;  ZeRO-1: RS 4Psi/N + AG 4Psi;  ZeRO-2: A*RS 4Psi/N + AG 4Psi;
  ZeRO-3: A*(2 AG 4Psi + RS 4Psi/N).
"""
from __future__ import annotations

import re
import time
from typing import Callable

import numpy as np

from jaxpar.bench.common import (describe_config, fmt_bytes, fmt_ratio, mesh_overrides, ratio, table,
                                 with_overrides)
from jaxpar.config import Config
from jaxpar.mesh import describe
from jaxpar.metrics import COLLECTIVE_KINDS, collective_ops
from jaxpar.metrics.hlo import conditional_collectives, group_size
from jaxpar.planner.comm import grad_sync_bytes as analytic, wire_bytes
from jaxpar.sharding import ZERO_AXIS
from jaxpar.train.precision import DTYPES
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = mesh_overrides(fsdp=-1)
DP_LAYOUT: list[str] = [*mesh_overrides(data=-1), "sharding.zero_stage=0"]
STAGES = (0, 1, 2, 3)

# --------------------------------------------------------------------------- wire bytes


def measured(hlo_text: str, n_devices: int) -> dict[str, dict]:
    """Per kind: ops, result bytes and ring wire bytes per step (loop trip counts applied)."""
    out = {k: {"ops": 0, "result_bytes": 0, "wire_bytes": 0.0, "group_sizes": set()}
           for k in COLLECTIVE_KINDS}
    for op in collective_ops(hlo_text, count_loops=True):
        n = group_size(op.replica_groups, n_devices)
        row = out[op.kind]
        row["ops"] += 1
        row["result_bytes"] += op.bytes
        row["wire_bytes"] += wire_bytes(op.kind, op.bytes, n)
        row["group_sizes"].add(n)
    for row in out.values():
        row["group_sizes"] = sorted(row["group_sizes"])
    return out


def measured_step(cfg: Config, mesh, hlo_text: str) -> dict[str, dict]:
    """The compiled step's bytes per kind (measured); a pipeline's per device, its tick's
    branches weighted by the ticks each stage runs them (pipelined: the mean over stages),
    where the loop count saw every branch on every tick ("all_branches")."""
    out = measured(hlo_text, mesh.devices.size)
    if cfg.mesh.pipeline > 1:
        from jaxpar.parallel.pipeline.schedule import build_timetable
        pc = cfg.pipeline
        tt = build_timetable(pc.schedule, cfg.mesh.pipeline, pc.resolved_microbatches(cfg.train.grad_accum),
                             pc.virtual_stages, pc.recompute)
        mean = pipelined(hlo_text, tt, pipeline_stage_of(mesh))["mean"]
        for kind, row in out.items():
            row["all_branches"], row["result_bytes"] = row["result_bytes"], mean[kind]["result_bytes"]
    return out


def pipeline_stage_of(mesh) -> Callable[[int], int]:
    """Device id as the HLO numbers it (its place in mesh.devices) -> its pipeline stage."""
    axis = mesh.axis_names.index("pipeline")
    return lambda i: int(np.unravel_index(i, mesh.devices.shape)[axis])


def _stage_pairs(pairs_text: str, stage_of: Callable[[int], int]) -> frozenset:
    pairs = re.findall(r"\{(\d+),(\d+)\}", pairs_text)
    return frozenset((stage_of(int(a)), stage_of(int(b))) for a, b in pairs)


def _send_index(cond: dict, moves: list, index, stage_of: Callable[[int], int]):
    """The per-tick branch index of the tick's send switch if `cond` is it (branch 0 sends
    nothing, branch j the forward and backward patterns of move j: runner.tick_plan); else None."""
    if len(cond["branches"]) != len(moves) + 1 or cond["pairs"][0]:
        return None
    for pairs, move in zip(cond["pairs"][1:], moves):
        want = {frozenset(pattern) for pattern in move if pattern}
        if not pairs or {_stage_pairs(t, stage_of) for t in pairs} != want:
            return None
    return index


def pipelined(hlo_text: str, tt, stage_of: Callable[[int], int]) -> dict:
    """A pipelined step's result bytes and ops per kind per device: {"stages": [per stage],
    "mean": over stages}. The tick is a switch over op kinds, a send switch (runner.tick_plan)
    and a switch that files into the rings (no collectives); collective_ops
    counts every branch on every tick, so here a stage counts what runs outside them, each op
    branch times the ticks it runs that op (the last stage's include the head and loss), and
    each send branch times the ticks that make its move.
    A conditional it cannot place (not the tick's) counts all branches, as collective_ops does."""
    from jaxpar.parallel.pipeline.runner import tick_plan
    codes, (moves, move_idx) = tick_plan(tt)
    res = conditional_collectives(hlo_text)
    rows = lambda: {k: {"result_bytes": 0.0, "ops": 0.0} for k in COLLECTIVE_KINDS}
    every, stages, op_switch = rows(), [rows() for _ in range(tt.p)], False

    def add(into, branch, times):
        for k, r in branch.items():
            into[k]["result_bytes"] += r["bytes"] * times
            into[k]["ops"] += r["ops"] * times

    add(every, res["outside"], 1)
    conds = res["conditionals"]
    send_idx = [_send_index(c, moves, move_idx, stage_of) if c["runs"] == tt.ticks and moves else None
                for c in conds]
    found_sends = sum(i is not None for i in send_idx)
    # the op switch: a tick's other conditional with a branch per op code; the filing switch (no
    # collectives) may have as many branches, so one that moves something is preferred
    shaped = [c for c, i in zip(conds, send_idx)
              if i is None and c["runs"] == tt.ticks and len(c["branches"]) == len(codes)]
    moving = [c for c in shaped if any(r["ops"] for b in c["branches"] for r in b.values())]
    op_cond = (moving or shaped or [None])[0]
    for cond, idx in zip(conds, send_idx):
        if idx is not None:
            for j, branch in enumerate(cond["branches"]):
                add(every, branch, int((idx == j).sum()))
        elif cond is op_cond:
            op_switch = True
            for d, into in enumerate(stages):
                for code, branch in zip(codes, cond["branches"]):
                    add(into, branch, int((tt.code[:, d] == code).sum()))
        else:
            for branch in cond["branches"]:
                add(every, branch, cond["runs"])
    if not op_switch or found_sends != (1 if moves else 0):
        raise ValueError(f"pipelined: the tick's switches are not in the HLO as runner.tick_plan says "
                         f"(op switch found: {op_switch}, send switches found: {found_sends})")
    for into in stages:
        add(into, {k: {"bytes": r["result_bytes"], "ops": r["ops"]} for k, r in every.items()}, 1)
    mean = {k: {f: sum(s[k][f] for s in stages) / tt.p for f in ("result_bytes", "ops")}
            for k in COLLECTIVE_KINDS}
    return {"stages": stages, "mean": mean}


# --------------------------------------------------------------------------- analytic


def rough(n_params: int, n: int, stage: int, grad_accum: int,
          dp: bool = False) -> dict[str, tuple[str, float]]:
    """Whole-model figures with Psi params of 4 bytes: kind -> (formula, result bytes)."""
    p = 4 * n_params
    if dp or stage == 0:
        return {"all-reduce": ("4Psi", p)}
    if stage in (1, 2):
        a = grad_accum if stage == 2 else 1
        return {"reduce-scatter": (f"{a}*4Psi/N" if a > 1 else "4Psi/N", a * p / n),
                "all-gather": ("4Psi", p)}
    return {"all-gather": (f"{2 * grad_accum}*4Psi", 2 * grad_accum * p),
            "reduce-scatter": (f"{grad_accum}*4Psi/N" if grad_accum > 1 else "4Psi/N", grad_accum * p / n)}


# --------------------------------------------------------------------------- run


def measure_layout(cfg: Config, label: str) -> dict:
    trainer = Trainer(cfg, log=lambda s: None)
    t0 = time.perf_counter()
    hlo = trainer.compile().as_text()
    compile_s = time.perf_counter() - t0
    plan, t = trainer.plan, cfg.train
    n_dev = trainer.mesh.devices.size
    meas = measured(hlo, n_dev)
    ana = analytic(plan, trainer.model.axes, trainer.model.shapes, grad_accum=t.grad_accum,
                   param_itemsize=np.dtype(DTYPES[t.param_dtype]).itemsize,
                   compute_itemsize=np.dtype(DTYPES[t.compute_dtype]).itemsize,
                   grad_itemsize=np.dtype(DTYPES[t.grad_reduce_dtype]).itemsize)
    n_z = trainer.mesh.shape[ZERO_AXIS]
    rgh = rough(trainer.model.n_params, n_z, plan.zero_stage, t.grad_accum, dp=label == "dp")
    kinds = {}
    for k in COLLECTIVE_KINDS:
        m, a = meas[k], ana[k]
        if not (m["ops"] or a["result_bytes"]):
            continue
        kinds[k] = {**m, "analytic_result_bytes": a["result_bytes"], "analytic_wire_bytes": a["wire_bytes"],
                    "rough_formula": rgh[k][0] if k in rgh else None,
                    "rough_result_bytes": rgh[k][1] if k in rgh else None,
                    "wire_ratio": ratio(m["wire_bytes"], a["wire_bytes"])}
    tot_m = sum(v["wire_bytes"] for v in meas.values())
    tot_a = sum(v["wire_bytes"] for v in ana.values())
    return {
        "label": label, "mesh": describe(trainer.mesh), "mesh_shape": dict(trainer.mesh.shape),
        "zero_stage": plan.zero_stage, "n_params": trainer.model.n_params, "compile_s": compile_s,
        "kinds": kinds,
        "total": {"wire_bytes": tot_m, "analytic_wire_bytes": tot_a, "wire_ratio": ratio(tot_m, tot_a),
                  "result_bytes": sum(v["result_bytes"] for v in meas.values()),
                  "analytic_result_bytes": sum(v["result_bytes"] for v in ana.values())},
    }


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, stages=STAGES, dp: bool = True) -> dict:
    layouts = []
    if dp:
        layouts.append(("dp", with_overrides(cfg, DP_LAYOUT)))
    layouts += [(f"zero{s}", with_overrides(cfg, [f"sharding.zero_stage={s}"])) for s in stages]
    rows = []
    for label, c in layouts:
        log(f"comm: {label}: compiling")
        rows.append(measure_layout(c, label))
    return {"n_params": rows[0]["n_params"], **describe_config(cfg), "layouts": rows}


def format_result(res: dict) -> str:
    t = res["train"]
    head = (f"collective bytes per step per device: {res['n_params']:,} params (Psi), batch "
            f"{t['global_batch']} x {t['seq_len']}, grad_accum {t['grad_accum']}, "
            f"{t['compute_dtype']} compute\n"
            "result = bytes of the op's result shape on one device; "
            "wire = ring-algorithm bytes sent per device "
            "(AR 2(N-1)/N*S, AG (N-1)/N*S_out, RS (N-1)/N*S_in);\n"
            "analytic = exact minimum for the plan's specs; "
            "rough = whole-model formula (N = fsdp size, A = grad_accum)")
    rows = []
    for lay in res["layouts"]:
        name = f"{lay['label']} ({', '.join(f'{a}={n}' for a, n in lay['mesh_shape'].items() if n > 1)})"
        for k, v in lay["kinds"].items():
            rows.append([name, k, v["ops"], ",".join(map(str, v["group_sizes"])) or "-",
                         fmt_bytes(v["result_bytes"]), fmt_bytes(v["analytic_result_bytes"]),
                         (f"{v['rough_formula']} = {fmt_bytes(v['rough_result_bytes'])}"
                          if v["rough_formula"] else "-"),
                         fmt_bytes(v["wire_bytes"]), fmt_bytes(v["analytic_wire_bytes"]),
                         fmt_ratio(v["wire_ratio"])])
            name = ""
        tot = lay["total"]
        rows.append(["", "total", "", "", fmt_bytes(tot["result_bytes"]),
                     fmt_bytes(tot["analytic_result_bytes"]),
                     "", fmt_bytes(tot["wire_bytes"]), fmt_bytes(tot["analytic_wire_bytes"]),
                     fmt_ratio(tot["wire_ratio"])])
    return "\n".join([head, "", table(
        ["layout", "kind", "ops", "N", "result", "analytic", "rough", "wire", "analytic wire", "wire ratio"],
        rows)])
