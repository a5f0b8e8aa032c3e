"""Side-by-side step time of jaxpar and MaxText on the same model and layouts (issue 11).

Run by scripts/compare_maxtext.sh, which makes MaxText's venv; standard library only, so any
python3 runs it. Each trainer runs as its own process, alternating (jaxpar, maxtext, jaxpar,
maxtext, ...), and each run's per-step times are parsed from what the trainer itself records:
jaxpar's `<run dir>/metrics.jsonl` (`step_time_s`, train.log_every=1) and MaxText's
"completed step: N, seconds: X" log lines. Steps are counted from 0 for both (jaxpar's record
of step k is step k-1 here); reported: the mean of steps [skip, steps) of every run, per
trainer and layout, and jaxpar / maxtext; beside it the ratio of the medians and of each
process's CPU seconds per step over the same steps (sampled from /proc while it runs), which
load from other processes disturbs less than wall time.

Both keep one step in flight: MaxText reads a step's metrics after dispatching the next and
times dispatch to dispatch; jaxpar (log_every=1) reads them the same way (since 2026-12-05; it
waited for every step's metrics before) and times one step's end to the next's. Over 15 steps
both means are the steady-state time per step.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.9  # issue 11: jaxpar <= 0.9x MaxText

# The model, in each trainer's words: Llama-style, untied embeddings, SwiGLU, RMSNorm, RoPE;
# bf16 compute, fp32 weights, AdamW (both default b1 0.9, b2 0.95, wd 0.1, clip 1.0), remat full.
JAXPAR_MODEL = [
    "model.preset=null", "model.n_layers=4", "model.dim=256", "model.n_heads=4", "model.n_kv_heads=4",
    "model.ffn_dim=1024", "model.vocab_size=256", "model.tie_embeddings=false",
    "train.seq_len=128", "train.global_batch=8", "train.compute_dtype=bfloat16",
    "train.param_dtype=float32", "train.remat=full", "optimizer.name=adamw",
    "train.log_every=1", "train.progress=false", "data.source=synthetic", "checkpoint.enabled=false",
    "eval.every=0",  # MaxText evaluates nothing here; the last step's eval (its compile) counted as CPU
]
MAXTEXT_MODEL = [
    "dataset_type=synthetic", "hardware=cpu", "skip_jax_distributed_system=true",
    "enable_checkpointing=false", "enable_tensorboard=false", "enable_goodput_recording=false",
    "decoder_block=llama2", "base_num_decoder_layers=4", "base_emb_dim=256", "base_num_query_heads=4",
    "base_num_kv_heads=4", "head_dim=64", "base_mlp_dim=1024", "vocab_size=256",
    "logits_via_embedding=false", "max_target_length=128", "per_device_batch_size=1",
    "dtype=bfloat16", "weight_dtype=float32", "opt_type=adamw", "remat_policy=full", "scan_layers=true",
]
# layout -> (jaxpar overrides, MaxText overrides). MaxText's fsdp axis shards the weights and
# optimizer state (ZeRO-3), so jaxpar's fsdp runs at zero_stage 3 in both layouts that have it.
LAYOUTS = {
    "data8": (["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "sharding.zero_stage=0"],
              ["ici_data_parallelism=8", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=1"]),
    "fsdp8": (["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", "sharding.zero_stage=3"],
              ["ici_data_parallelism=1", "ici_fsdp_parallelism=8", "ici_tensor_parallelism=1"]),
    "dp2fsdp2tp2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=3"],
                    ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]),
}
ONEDNN_FLAGS = "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_DOT"
MAXTEXT_STEP = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")
JAXPAR_STEP = re.compile(r'^\{"step": (\d+),')


def parse_jaxpar(metrics_jsonl: Path) -> dict[int, float]:
    """{step counted from 0: seconds} from jaxpar's metrics.jsonl (one record per logged step)."""
    times = {}
    for line in metrics_jsonl.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "step_time_s" in rec:
            times[int(rec["step"]) - 1] = float(rec["step_time_s"])
    return times


def parse_maxtext(log: str) -> dict[int, float]:
    """{step: seconds} from MaxText's "completed step: N, seconds: X" lines (0-based already)."""
    return {int(m.group(1)): float(m.group(2)) for m in MAXTEXT_STEP.finditer(log)}


def window(times: dict[int, float], skip: int, steps: int) -> list[float]:
    missing = [s for s in range(skip, steps) if s not in times]
    if missing:
        raise ValueError(f"no step time for steps {missing}")
    return [times[s] for s in range(skip, steps)]


def _env(extra_xla: str = "") -> dict[str, str]:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += " --xla_force_host_platform_device_count=8"
    env["XLA_FLAGS"] = f"{flags} {extra_xla}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), None where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Tail:
    """The highest step (from 0) a growing file has reported so far, read incrementally."""

    def __init__(self, path: Path, pattern: re.Pattern, offset: int = 0) -> None:
        self.path, self.pattern, self.offset = path, pattern, offset
        self.pos, self.rest, self.latest = 0, "", -1

    def __call__(self) -> int:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.pos)
                chunk = f.read()
                self.pos = f.tell()
        except OSError:
            return self.latest
        lines = (self.rest + chunk).split("\n")
        self.rest = lines.pop()  # a partial last line waits for the next read
        for line in lines:
            m = self.pattern.search(line)
            if m:
                self.latest = max(self.latest, int(m.group(1)) - self.offset)
        return self.latest


def _run(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float, cwd: Path,
         latest: Tail, skip: int, steps: int) -> tuple[str, float | None]:
    """Run one trainer; returns its output and its CPU seconds per step over steps [skip, steps)
    (sampled when step skip-1 and step steps-1 are first reported; None if either was missed).
    CPU time is the work the process did, which load from other processes changes far less
    than wall time (XLA's spinning threads still inflate it somewhat under contention)."""
    t0 = time.perf_counter()
    marks: dict[str, float | None] = {}
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.perf_counter() - t0 > timeout:
                    proc.kill()
                    proc.wait()
                    raise RuntimeError(f"timed out after {timeout:.0f} s; log: {log_path}")
                step = latest()
                for key, at in (("start", skip - 1), ("end", steps - 1)):
                    if key not in marks and step >= at:
                        marks[key] = _cpu_seconds(proc.pid) if key == "end" or step < steps - 1 else None
                time.sleep(0.05)
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
    out = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(out.splitlines()[-15:])
        raise RuntimeError(f"exit {proc.returncode} after {time.perf_counter() - t0:.0f} s; log: {log_path}\n{tail}")
    start, end = marks.get("start"), marks.get("end")
    cpu = (end - start) / (steps - skip) if start is not None and end is not None and skip > 0 else None
    return out, cpu


def run_jaxpar(args, layout: str, rep: int, work: Path) -> tuple[dict[int, float], float | None]:
    name = f"{layout}_{rep}"
    cmd = [args.jaxpar_python, "-m", "jaxpar.cli", "train", str(ROOT / "configs/quickstart.yaml"),
           f"name={name}", f"run_dir={work / 'jaxpar'}", f"train.steps={args.steps}",
           *JAXPAR_MODEL, *LAYOUTS[layout][0], *args.jaxpar_override]
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    metrics = work / "jaxpar" / name / "metrics.jsonl"
    _, cpu = _run(cmd, env, work / f"jaxpar_{name}.log", args.timeout, ROOT,
                  Tail(metrics, JAXPAR_STEP, offset=1), args.skip, args.steps)
    return parse_jaxpar(metrics), cpu


def maxtext_base_yml(python: str) -> str:
    code = "import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))"
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def run_maxtext(args, layout: str, rep: int, work: Path) -> tuple[dict[int, float], float | None]:
    name = f"{layout}_{rep}"
    cmd = [args.maxtext_python, "-m", "maxtext.trainers.pre_train.train", args.base_yml,
           f"run_name={name}", f"base_output_directory={work / 'maxtext'}", f"steps={args.steps}",
           *MAXTEXT_MODEL, *LAYOUTS[layout][1], *args.maxtext_override]
    env = _env(ONEDNN_FLAGS if args.maxtext_onednn else "")
    log = work / f"maxtext_{name}.log"
    out, cpu = _run(cmd, env, log, args.timeout, work, Tail(log, MAXTEXT_STEP), args.skip, args.steps)
    return parse_maxtext(out), cpu


def versions(python: str, cwd: Path) -> str:
    code = "import jax, jaxlib, flax; print(f'jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}')"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd)
    return r.stdout.strip() or "unknown"


def format_table(results: dict[str, dict[str, list[dict]]]) -> str:
    cols = ["layout", "jaxpar ms", "maxtext ms", "jaxpar/maxtext", "median ratio", "CPU ratio"]
    rows = []
    for layout, r in results.items():
        if not (r["jaxpar"] and r["maxtext"]):
            rows.append([layout, "(failed)", "", "", "", ""])
            continue
        jp, mt = ([t for run in r[k] for t in run["step_s"]] for k in ("jaxpar", "maxtext"))
        cpu = [[run["cpu_per_step_s"] for run in r[k] if run["cpu_per_step_s"]] for k in ("jaxpar", "maxtext")]
        ratio = statistics.fmean(jp) / statistics.fmean(mt)
        rows.append([layout, f"{statistics.fmean(jp) * 1e3:.1f}", f"{statistics.fmean(mt) * 1e3:.1f}",
                     f"{ratio:.2f}" + ("" if ratio <= TARGET else " *"),
                     f"{statistics.median(jp) / statistics.median(mt):.2f}",
                     f"{statistics.fmean(cpu[0]) / statistics.fmean(cpu[1]):.2f}" if all(cpu) else "n/a"])
    width = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                                           enumerate(zip(cells, width))) + " |"
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in width) + "|", *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="data8,fsdp8,dp2fsdp2tp2", help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--repeats", type=int, default=1, help="runs of each trainer per layout (alternating)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=5, help="steps left out at the start (compile, warm-up)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--jaxpar-python", default=str(ROOT / ".venv/bin/python"))
    p.add_argument("--maxtext-python", required=True)
    p.add_argument("--maxtext-onednn", action="store_true",
                   help="give MaxText the oneDNN dot flags that jaxpar sets itself in bf16 on CPU")
    p.add_argument("--jaxpar-override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--maxtext-override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--work-dir", default=None, help="run dirs and logs (default: a new temp dir)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every step time here")
    args = p.parse_args(argv)
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    unknown = [s for s in layouts if s not in LAYOUTS]
    if unknown or not layouts:
        p.error(f"unknown layout(s) {unknown}; valid: {', '.join(LAYOUTS)}")
    if not 0 <= args.skip < args.steps or args.repeats < 1:
        p.error("need 0 <= --skip < --steps and --repeats >= 1")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="compare_maxtext_"))
    work.mkdir(parents=True, exist_ok=True)
    args.base_yml = maxtext_base_yml(args.maxtext_python)
    print(f"jaxpar : {versions(args.jaxpar_python, ROOT)} ({args.jaxpar_python})")
    print(f"maxtext: {versions(args.maxtext_python, work)} ({args.maxtext_python})")
    print(f"logs   : {work}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    trainers = {"jaxpar": run_jaxpar, "maxtext": run_maxtext}
    results: dict[str, dict[str, list[dict]]] = {}
    failed = False
    for layout in layouts:
        results[layout] = {"jaxpar": [], "maxtext": []}
        for rep in range(args.repeats):
            for name, fn in trainers.items():
                t0 = time.perf_counter()
                try:
                    times, cpu = fn(args, layout, rep, work)
                    times = window(times, args.skip, args.steps)
                except (RuntimeError, ValueError, OSError) as e:
                    print(f"{layout} {name} #{rep}: FAILED: {e}", file=sys.stderr, flush=True)
                    failed = True
                    continue
                results[layout][name].append({"step_s": times, "cpu_per_step_s": cpu})
                cpu_txt = f"{cpu * 1e3:.0f} ms" if cpu is not None else "n/a"
                print(f"{layout:12s} {name:8s} #{rep}: mean {statistics.fmean(times) * 1e3:8.1f} ms "
                      f"(median {statistics.median(times) * 1e3:.1f}, CPU {cpu_txt}) over steps "
                      f"{args.skip}-{args.steps - 1}; run {time.perf_counter() - t0:.0f} s; "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)

    print(f"\nmean step time of steps {args.skip}-{args.steps - 1}, {args.repeats} run(s) each, alternating; "
          f"target jaxpar/maxtext <= {TARGET}")
    print(format_table(results))
    print("(* above target; median ratio: of the medians; CPU ratio: of the processes' CPU seconds per step)")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "skip": args.skip, "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
