"""`jaxpar bench overhead`: jaxpar's step against a hand-written `jax.jit` step over the settings
users run: compute dtype x remat x layout (each cell is `jaxpar bench overhead-point`).

Layouts: data=8 (ZeRO-0), fsdp=8 ZeRO-1, fsdp=8 ZeRO-3, data=2 x fsdp=2 x tensor=2 (ZeRO-1). The
baseline of each cell is plain GSPMD with jaxpar's param and optimizer-state shardings, so the
compiler places its own collectives. Each cell runs in its own process, as `jaxpar train` would
(a fresh heap and XLA_FLAGS per cell; the CPU dots are each step's own compile option).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import yaml

from jaxpar.bench.common import fmt_ratio, mesh_overrides, table
from jaxpar.config import Config

# A Llama block big enough that the matmuls dominate (dim >= 256), small enough for 2 CPU cores.
LAYOUT: list[str] = [
    "model.preset=null", "model.n_layers=4", "model.dim=256", "model.n_heads=4", "model.n_kv_heads=4",
    "model.ffn_dim=1024", "model.vocab_size=256", "train.seq_len=128", "train.global_batch=8",
    "data.source=synthetic",
]
LAYOUTS: dict[str, list[str]] = {
    "data=8": [*mesh_overrides(data=8), "sharding.zero_stage=0"],
    "fsdp=8 zero1": [*mesh_overrides(fsdp=8), "sharding.zero_stage=1"],
    "fsdp=8 zero3": [*mesh_overrides(fsdp=8), "sharding.zero_stage=3"],
    "data2 fsdp2 tensor2": [*mesh_overrides(data=2, fsdp=2, tensor=2), "sharding.zero_stage=1"],
}
DTYPES = ("float32", "bfloat16")
REMATS = ("none", "full")
TARGET = 1.05


def cells() -> list[tuple[str, str, str]]:
    return [(d, r, lay) for d in DTYPES for r in REMATS for lay in LAYOUTS]


def run_cell(config_file: Path, dtype: str, remat: str, layout: str) -> dict:
    """One cell in a fresh process (its own XLA options); the overhead-point result."""
    args = ["bench", "overhead-point", str(config_file), *LAYOUTS[layout],
            f"train.compute_dtype={dtype}", f"train.remat={remat}", "--json"]
    code = "import sys; from jaxpar.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"overhead cell {dtype}/{remat}/{layout} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def run(cfg: Config, log: Callable[[str], None] = lambda s: None) -> dict:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        for dtype, remat, layout in cells():
            log(f"overhead: {dtype}, remat {remat}, {layout}")
            res = run_cell(path, dtype, remat, layout)
            out.append({"compute_dtype": dtype, "remat": remat, "layout": layout,
                        "jaxpar_ms": res["jaxpar"]["median_s"] * 1e3,
                        "baseline_ms": res["baseline"]["median_s"] * 1e3,
                        "ratio": res["ratio"], "ratio_paired_median": res["ratio_paired_median"],
                        "cpu_ratio": res["cpu_ratio"], "first_loss": res["jaxpar"]["first_loss"],
                        "baseline_first_loss": res["baseline"]["first_loss"]})
    ratios = [c["ratio"] for c in out]
    return {"steps": cfg.train.steps, "cells": out, "target": TARGET,
            "median_ratio": statistics.median(ratios), "worst_ratio": max(ratios),
            "within_target": all(r <= TARGET for r in ratios)}


def format_result(res: dict) -> str:
    rows = [[c["compute_dtype"], c["remat"], c["layout"], f"{c['jaxpar_ms']:.1f}", f"{c['baseline_ms']:.1f}",
             fmt_ratio(c["ratio"]), fmt_ratio(c["ratio_paired_median"]), fmt_ratio(c["cpu_ratio"])]
            for c in res["cells"]]
    verdict = "all within" if res["within_target"] else "NOT all within"
    return "\n".join([
        f"overhead matrix: median step time of {res['steps']} interleaved steps per cell; baseline: "
        f"hand-written jax.jit (GSPMD) with jaxpar's param shardings", "",
        table(["compute", "remat", "layout", "jaxpar ms", "jit ms", "ratio", "paired", "cpu ratio"], rows),
        "",
        f"median ratio {fmt_ratio(res['median_ratio'])}, worst {fmt_ratio(res['worst_ratio'])} "
        f"({verdict} target <= {res['target']})",
    ])
