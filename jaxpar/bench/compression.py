"""`jaxpar bench compression`: bytes the gradient reduction moves per step for each
gradient_compression method, from the compiled HLO, and the loss after the same training steps.

Layout: pure data parallel over every device (mesh data=-1, zero 0), so every collective in the
step is the data-parallel reduction (plus the loss). For each variant the step is compiled, every
collective of its HLO is counted (`jaxpar.metrics.collective_ops`, loop trip counts applied) and
turned into ring-algorithm wire bytes per device (all-reduce 2(N-1)/N*S, all-gather and
all-to-all (N-1)/N*S, reduce-scatter (N-1)/N*S_in); the ratio is none's wire bytes over the
variant's. Then it trains train.steps steps (default 100) from the same init on the same
batches and reports the mean loss of the last 10 steps, beside none's.

PowerSGD also gets the analytic ratio over the model's matrices alone (m*n vs (m+n)*rank per
matrix; 1-D norm scales are all-reduced in float32 and counted in the HLO figure).
Local SGD's bytes are amortised: the HLO's collectives (the parameter all-reduce of the sync, in a
conditional) divided by sync_every. 1-bit Adam's and PowerSGD's bytes are those of their compressed
steps (compiled with no warm-up); their losses are runs that start with float32 steps:
`optimizer.onebit_warmup_steps` (default here: a fifth of the steps) of exact Adam,
`gradient_compression.warmup_steps` (two fifths) of float32 reduction for PowerSGD; "over the run"
averages the bytes over all steps of this run.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from jaxpar.bench.common import describe_config, fmt_bytes, mesh_overrides, table, with_overrides
from jaxpar.config import Config, OptimizerConfig
from jaxpar.metrics import collective_ops
from jaxpar.metrics.hlo import group_size
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = [*mesh_overrides(data=-1), "sharding.zero_stage=0", "train.steps=100",
                     "train.log_every=1"]

# label -> overrides; none first (the reference)
VARIANTS: dict[str, list[str]] = {
    "none": [],
    "bf16": ["gradient_compression.method=bf16"],
    "fp16": ["gradient_compression.method=fp16"],
    "int8": ["gradient_compression.method=int8"],
    "onebit": ["gradient_compression.method=onebit"],
    "topk 1%": ["gradient_compression.method=topk", "gradient_compression.topk_fraction=0.01"],
    "powersgd r4": ["gradient_compression.method=powersgd", "gradient_compression.rank=4"],
    "local sgd H=8": ["local_sgd.sync_every=8"],
    "diloco H=8": ["local_sgd.sync_every=8", "local_sgd.outer=nesterov"],
}
TARGETS = {"local sgd H=8": (8.0, None), "bf16": (2.0, 0.02), "int8": (3.5, 0.02), "onebit": (20.0, None),
           "powersgd r4": (20.0, 0.02), "onebit adam": (None, 0.02)}


def wire_bytes(hlo_text: str, n_devices: int) -> tuple[float, int, dict[str, float]]:
    """(ring wire bytes per device per step, result bytes, wire bytes per 'kind dtype')."""
    total, result, by = 0.0, 0, {}
    for op in collective_ops(hlo_text, count_loops=True):
        n = group_size(op.replica_groups, n_devices)
        if n <= 1:
            continue
        f = (n - 1) / n
        w = {"all-reduce": 2 * f * op.bytes, "reduce-scatter": f * op.bytes * n,
             "collective-permute": float(op.bytes)}.get(op.kind, f * op.bytes)
        total += w
        result += op.bytes
        key = f"{op.kind} {op.dtype}"
        by[key] = by.get(key, 0.0) + w
    return total, result, by


def powersgd_matrix_ratio(trainer) -> float | None:
    red = trainer.spec.sync
    if not hasattr(getattr(red, "comp", None), "rank"):
        return None
    full = sum(b * m * n for bk in red.buckets for (b, m, n) in bk.matrices.values())
    low = sum(b * (m + n) * red.comp.rank for bk in red.buckets for (b, m, n) in bk.matrices.values())
    return full / low if low else None


def measure(cfg: Config, label: str, log, train: bool = True, bytes_cfg: Config | None = None) -> dict:
    quiet = lambda s: None
    tb = Trainer(bytes_cfg or cfg, log=quiet)
    t0 = time.perf_counter()
    hlo = tb.compile().as_text()
    compile_s = time.perf_counter() - t0
    n_dev = tb.mesh.devices.size
    wire, result, by = wire_bytes(hlo, n_dev)
    every = cfg.local_sgd.sync_every
    if every > 1:  # the parameter all-reduce runs once per `every` steps (a conditional in the HLO)
        wire, result, by = wire / every, result / every, {k: v / every for k, v in by.items()}
    row = {"label": label, "wire_bytes": wire, "result_bytes": result, "by_kind": by,
           "compile_s": compile_s,
           "reducer": tb.spec.sync.describe(),
           "matrix_ratio": powersgd_matrix_ratio(tb)}
    if train:
        tt = tb if bytes_cfg is None else Trainer(cfg, log=quiet)
        log(f"compression: {label}: training {cfg.train.steps} steps")
        t0 = time.perf_counter()
        _, hist = tt.fit(progress=False)
        row["train_s"] = time.perf_counter() - t0
        losses = [h["loss"] for h in hist]
        row["losses"] = losses
        row["final_loss"] = float(np.mean(losses[-10:]))
    return row


def variants(cfg: Config) -> dict[str, list[str]]:
    out = dict(VARIANTS)
    # PowerSGD starts after a float32 phase (as PyTorch's PowerSGD hook's start_powerSGD_iter)
    out["powersgd r4"] = [*out["powersgd r4"],
                          f"gradient_compression.warmup_steps={2 * cfg.train.steps // 5}"]
    try:  # 1-bit Adam, where the optimizer option exists
        if "onebit_warmup_steps" in OptimizerConfig.model_fields:
            out["onebit adam"] = ["optimizer.name=onebit_adam",
                                  f"optimizer.onebit_warmup_steps={max(1, cfg.train.steps // 5)}"]
    except ImportError:
        pass
    return out


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, methods=None, train: bool = True) -> dict:
    rows = []
    for label, ov in variants(cfg).items():
        if methods is not None and label not in methods and label.split()[0] not in methods:
            continue
        c = with_overrides(cfg, ov)
        bytes_cfg = None
        if c.optimizer.name == "onebit_adam":  # its bytes: the compressed phase
            bytes_cfg = with_overrides(c, ["optimizer.onebit_warmup_steps=0"])
        elif c.gradient_compression.warmup_steps:  # the compressed steps, not the float32 warm-up
            bytes_cfg = with_overrides(c, ["gradient_compression.warmup_steps=0"])
        log(f"compression: {label}: compiling")
        rows.append(measure(c, label, log, train=train, bytes_cfg=bytes_cfg))
        rows[-1]["warmup_steps"] = (c.optimizer.onebit_warmup_steps if c.optimizer.name == "onebit_adam"
                                    else c.gradient_compression.warmup_steps)
    ref = next((r for r in rows if r["label"] == "none"), None)
    for r in rows:
        r["ratio"] = ref["wire_bytes"] / r["wire_bytes"] if ref and r["wire_bytes"] else None
        if ref and r["warmup_steps"]:  # float32 steps first: the average over this run
            w, n = r["warmup_steps"], cfg.train.steps
            avg = (w * ref["wire_bytes"] + (n - w) * r["wire_bytes"]) / n
            r["run_ratio"] = ref["wire_bytes"] / avg
        if ref and train:
            r["loss_vs_none"] = r["final_loss"] / ref["final_loss"] - 1
        tgt = TARGETS.get(r["label"])
        if tgt:
            r["target_ratio"], r["target_loss"] = tgt
    return {**describe_config(cfg), "steps": cfg.train.steps, "mesh": f"data={cfg.mesh.data}",
            "block_size": cfg.gradient_compression.block_size, "rows": rows}


def format_result(res: dict) -> str:
    t = res["train"]
    head = (f"gradient reduction per step per device, data parallel ({res['mesh']}), "
            f"batch {t['global_batch']} x {t['seq_len']}, block {res['block_size']}; "
            "wire = ring bytes sent per device from the compiled HLO; "
            f"loss = mean of the last 10 of {res['steps']} steps")
    rows = []
    for r in res["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        if r.get("matrix_ratio"):
            ratio += f" ({r['matrix_ratio']:.1f}x matrices)"
        run = (f"{r['run_ratio']:.2f}x ({r['warmup_steps']} fp32 steps)" if r.get("run_ratio")
               else ratio.split()[0])
        tr = r.get("target_ratio")
        tl = r.get("target_loss")
        target = ", ".join(x for x in [f">= {tr:g}x" if tr else "", f"loss within {tl:.0%}" if tl else ""]
                           if x)
        kinds = ", ".join(f"{k} {fmt_bytes(v)}"
                          for k, v in sorted(r["by_kind"].items(), key=lambda kv: -kv[1])
                          if v >= 0.01 * r["wire_bytes"])
        loss = f"{r['final_loss']:.4f}" if "final_loss" in r else "-"
        dl = f"{r['loss_vs_none']:+.2%}" if "loss_vs_none" in r else "-"
        rows.append([r["label"], fmt_bytes(r["wire_bytes"]), ratio, run, loss, dl, target or "-", kinds])
    return "\n".join([head, "", table(["method", "wire/step", "vs float32", "over the run", "loss", "vs none",
                                        "target", "collectives (>= 1%)"], rows)])
