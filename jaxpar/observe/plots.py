"""`jaxpar plot RUN_DIR...`: PNGs of loss, eval loss, throughput and MFU against step from metrics.jsonl.

Several run dirs are overlaid on the same axes (one line each, labelled with the run's name and
mesh layout from its config.yaml), to compare layouts. A step logged twice (a resumed run appends
to the same file) keeps its last record. Uses matplotlib's Agg canvas: no display needed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

# file stem -> (record key, y label, title)
PLOTS: dict[str, tuple[str, str, str]] = {
    "loss": ("loss", "loss", "Training loss"),
    "eval_loss": ("eval_loss", "held-out loss", "Evaluation loss (eval.every)"),
    "throughput": ("tokens_per_s", "tokens / s", "Throughput"),
    "mfu": ("mfu", "MFU (%)", "Model FLOPs utilisation"),
}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Records of `run_dir/metrics.jsonl` (or the file itself), sorted by step, last one per step."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if "step" in rec:
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def run_label(run_dir: str | Path) -> str:
    """`name (data=2 fsdp=2 tensor=2, zero 1)` from config.yaml, else the dir name."""
    run_dir = Path(run_dir)
    label = run_dir.name if run_dir.is_dir() else run_dir.parent.name
    cfg_path = (run_dir if run_dir.is_dir() else run_dir.parent) / "config.yaml"
    try:
        cfg = yaml.safe_load(cfg_path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return label
    # the axis sizes only: not `auto: false` (a bool is an int) nor `dcn: {...}`
    mesh = {k: v for k, v in (cfg.get("mesh") or {}).items()
            if isinstance(v, int) and not isinstance(v, bool) and v != 1}
    parts = [" ".join(f"{k}={v}" for k, v in mesh.items())]
    zero = (cfg.get("sharding") or {}).get("zero_stage")
    if zero is not None:
        parts.append(f"zero {zero}")
    inner = ", ".join(p for p in parts if p)
    return f"{label} ({inner})" if inner else label


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        if key not in r:
            continue
        try:
            y = float(r[key])  # "nan"/"inf" strings too
        except (TypeError, ValueError):
            continue
        xs.append(int(r["step"]))
        ys.append(y * 100 if key == "mfu" else y)
    return xs, ys


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> dict[str, dict]:
    """Write `loss.png`, `throughput.png` and (when any run logged them) `eval_loss.png` and
    `mfu.png` into `out_dir` (default: the first run dir). Returns
    `{png path: {run label: number of points}}`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: only when plotting
    from matplotlib.figure import Figure

    if not run_dirs:
        raise ValueError("give at least one run dir")
    runs = [(run_label(d), read_metrics(d)) for d in run_dirs]
    first = Path(run_dirs[0])
    out = Path(out_dir) if out_dir is not None else (first if first.is_dir() else first.parent)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file: the PNGs go into a directory (created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file on the way to it
        raise NotADirectoryError(f"cannot make the directory {out}: a part of its path is a file") from None
    written: dict[str, dict] = {}
    for stem, (key, ylabel, title) in PLOTS.items():
        lines = {label: _series(recs, key) for label, recs in runs}
        if not any(xs for xs, _ in lines.values()):
            continue
        fig = Figure(figsize=(8, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for label, (xs, ys) in lines.items():
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if key in ("loss", "eval_loss") and _positive(lines):
            ax.set_yscale("log")
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path)
        written[str(path)] = {label: len(xs) for label, (xs, _) in lines.items()}
    return written


def _positive(lines: dict) -> bool:
    ys = [y for _, yy in lines.values() for y in yy if math.isfinite(y)]
    return bool(ys) and min(ys) > 0 and max(ys) / min(ys) > 10
