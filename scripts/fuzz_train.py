"""Random config combinations through `jaxpar train`, each checked against a reference run.

    .venv/bin/python scripts/fuzz_train.py --mode equal --runs 60 --seed 1
    .venv/bin/python scripts/fuzz_train.py --mode mixed --runs 60 --seed 2
    .venv/bin/python scripts/fuzz_train.py --mode resume --runs 12 --seed 3
    .venv/bin/python scripts/fuzz_train.py --mode mixed --mesh-axis pipeline --compressed --runs 20

Modes (the tiny model with 4 layers, 3 or 4 steps, 8 forced CPU devices, one process a run):
  equal   float32 on a random layout (mesh, ZeRO stage, remat, accumulation, pipeline schedule and
          recompute, context strategy and layout, sequence parallel, XLA or blockwise attention,
          chunked loss, tied embeddings, MoE (dropless or capacity, with or without a shared
          expert; --moe: every run), packed documents with or without per-document positions
          (--packed: every run)): the losses of steps 1-3 and the first grad norm equal the
          data=8 run of the same model
  mixed   the same with bf16/fp16 compute, bf16 params, each compression method and scope, 1-bit
          Adam, local SGD, bf16 moments and reductions, the non-finite guard: trains, finite, its
          step-1 loss (and grad norm, unless the wire is lossier than 16 bits) within 3e-2 of
          the float32 data=8 run
  resume  save at step 2 on one random layout, resume to step 4 on another: steps 3-4 equal a
          straight run on the first (--compressed: with a compressed sync, 1-bit Adam or local
          SGD, resumed on the same layout: its residuals / replicas are restored exactly)
In every mode a run may instead refuse its config with one line (exit 2, no traceback). Each
failure prints its overrides (a reproduction) and the end of its stderr; the exit code is 1 if
any run failed. Not a test: each run compiles its own step (~5-15 s here), and which combinations
a seed draws changes with the option lists below.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model.preset=tiny", "model.n_layers=4", "train.global_batch=16", "train.seq_len=32",
        "train.progress=false", "data.source=synthetic", "optimizer.warmup_steps=0",
        "optimizer.decay_steps=100",  # the schedule must not follow train.steps (resume runs 2, then 4)
        "train.log_every=1", "eval.every=0", "optimizer.clip_norm=1000", "checkpoint.async_save=false"]
DENSE = ["mesh.data=8", "mesh.data=1 mesh.fsdp=8", "mesh.data=2 mesh.fsdp=2 mesh.tensor=2",
         "mesh.data=4 mesh.pipeline=2", "mesh.data=2 mesh.pipeline=2 mesh.tensor=2",
         "mesh.data=1 mesh.fsdp=2 mesh.pipeline=4", "mesh.data=4 mesh.context=2", "mesh.data=2 mesh.context=4",
         "mesh.data=1 mesh.fsdp=2 mesh.context=2 mesh.tensor=2", "mesh.data=1 mesh.fsdp=4 mesh.tensor=2",
         "mesh.data=2 mesh.fsdp=4", "mesh.data=1 mesh.pipeline=2 mesh.fsdp=2 mesh.tensor=2",
         "mesh.data=2 mesh.pipeline=2 mesh.context=2"]
MOE = ["mesh.data=8", "mesh.data=2 mesh.expert=4", "mesh.data=1 mesh.expert=2 mesh.tensor=2 mesh.fsdp=2",
       "mesh.data=2 mesh.expert=2 mesh.pipeline=2", "mesh.data=1 mesh.fsdp=4 mesh.expert=2",
       "mesh.data=4 mesh.expert=2", "mesh.data=2 mesh.context=2 mesh.expert=2", "mesh.data=4 mesh.context=2",
       "mesh.data=2 mesh.pipeline=2 mesh.context=2"]
LOSS_TOL, NORM_TOL = 1e-4, 1e-3
MIXED_TOL = 3e-2  # 16-bit compute and params against float32, before any update


PACKED = ["data.source=bin", "data.bin_path=corpus.bin", "data.packing=true"]  # Runner writes it


def model_opts(r: random.Random, moe: bool = False, packed: bool = False) -> list[str]:
    """The model and its data (the reference run shares them)."""
    out = []
    if packed or r.random() < 0.25:
        out += PACKED + (["data.reset_positions=true"] if r.random() < 0.5 else [])
    if moe or r.random() < 0.3:
        out += ["model.moe.num_experts=4", "model.moe.top_k=2"]
        # capacity drops per sequence in its priority order on every layout (0.5: about half)
        out += r.choice([["model.moe.dispatch=dropless"], ["model.moe.dispatch=capacity"],
                         ["model.moe.dispatch=capacity", "model.moe.capacity_factor=0.5"]])
        if r.random() < 0.3:
            out += ["model.moe.shared_expert=true"]
    if r.random() < 0.25:
        out += ["model.tie_embeddings=true"]
    return out


def layout_opts(r: random.Random, moe: bool, axis: str | None = None) -> list[str]:
    """A random layout; `axis`: only meshes that split it (--mesh-axis)."""
    meshes = [m for m in (MOE if moe else DENSE) if axis is None or f"{axis}=" in m]
    mesh = r.choice(meshes or DENSE)
    size = lambda axis: int(mesh.split(f"{axis}=")[1].split()[0]) if f"{axis}=" in mesh else 1
    out = mesh.split() + [f"sharding.zero_stage={r.randint(0, 3)}",
                          f"train.remat={r.choice(['none', 'full', 'dots_saveable', 'dots_with_no_batch_dims_saveable'])}"]
    # accumulation that divides the batch rows each batch device gets (16 rows), at least the
    # stages for a pipeline: the draws go to combinations that can run
    rows = 16 // (size("data") * size("fsdp") * size("expert"))
    accums = [a for a in (1, 2, 4) if rows % a == 0 and a >= size("pipeline")] or [1]
    if size("pipeline") > 1:
        schedule = r.choice(["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "1f1b_split"])
        out += [f"pipeline.schedule={schedule}", f"train.grad_accum={r.choice(accums)}"]
        if schedule == "interleaved_1f1b":
            out += ["pipeline.virtual_stages=2"]
        if schedule not in ("zb_h1", "1f1b_split") and r.random() < 0.3:
            out += ["pipeline.recompute=true"]
    else:
        out += [f"train.grad_accum={r.choice([1, *accums])}"]
    if size("context") > 1:
        # the ring's collective-permutes cannot run in a pipeline stage's branch (refused)
        strategies = (['ring', 'all_to_all', 'all_gather'] if size("pipeline") == 1
                      else ['all_to_all', 'all_gather'])
        out += [f"context.strategy={r.choice(strategies)}",
                f"context.layout={r.choice(['zigzag', 'contiguous'])}"]
    if size("tensor") > 1 and r.random() < 0.5:
        out += ["sharding.sequence_parallel=true"]
    out += (["model.attention=blockwise", f"model.attention_block={r.choice([8, 16])}"] if r.random() < 0.4
            else ["model.attention=xla"])
    if r.random() < 0.3:
        out += ["train.loss_chunk=8"]
    return out


def mixed_opts(r: random.Random, compressed: bool = False) -> list[str]:
    """Precision and sync options; `compressed`: always a sync of sync_opts'."""
    out = [f"train.compute_dtype={r.choice(['float32', 'bfloat16', 'bfloat16', 'float16'])}"]
    if r.random() < 0.3:
        out += ["train.param_dtype=bfloat16"]
    out += sync_opts(r, compressed)
    for p, opt in ((0.2, "optimizer.mu_dtype=bfloat16"), (0.2, "train.grad_reduce_dtype=bfloat16"),
                   (0.2, "train.skip_nonfinite=true")):
        if r.random() < p:
            out += [opt]
    return out


def sync_opts(r: random.Random, always: bool = False) -> list[str]:
    """A compressed reduction, 1-bit Adam or local SGD (sometimes, or `always`)."""
    out = []
    c = r.random() * (0.55 if always else 1)
    if c < 0.35:
        out += [f"gradient_compression.method={r.choice(['bf16', 'fp16', 'int8', 'onebit', 'topk', 'powersgd'])}"]
        if r.random() < 0.3:
            out += ["gradient_compression.scope=dcn", "gradient_compression.dcn_size=2"]
    elif c < 0.45:
        out += ["optimizer.name=onebit_adam", "optimizer.onebit_warmup_steps=1"]
    elif c < 0.55:
        out += ["local_sgd.sync_every=2"]
    return out


def write_corpus(path: Path, docs: int = 400, eos: int = 0, seed: int = 0) -> None:
    """Documents of random tokens in the tiny model's vocabulary (256), each ending with `eos`,
    some longer than a row: a .bin with its .idx and .json, as `jaxpar data prepare` writes."""
    import numpy as np
    rng = np.random.default_rng(seed)
    lengths = rng.choice([3, 5, 9, 14, 20, 33, 40, 75], size=docs)
    tokens = np.concatenate([np.append(rng.integers(1, 256, n - 1), eos) for n in lengths])
    tokens.astype("<u2").tofile(path)
    np.cumsum([0, *lengths]).astype("<u8").tofile(f"{path}.idx")
    Path(f"{path}.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256, "eos_id": eos}))


class Runner:
    def __init__(self, work: Path):
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        (work / "empty.yaml").write_text("{}\n")
        write_corpus(work / "corpus.bin")
        self.env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
                        XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
                        JAX_COMPILATION_CACHE_DIR=str(work / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")

    def __call__(self, name: str, overrides: list[str]) -> dict:
        args = [sys.executable, "-m", "jaxpar.cli", "train", str(self.work / "empty.yaml"), *BASE,
                f"run_dir={self.work / 'runs'}", f"name={name}", *overrides]
        p = subprocess.run(args, capture_output=True, text=True, env=self.env, cwd=str(self.work), timeout=1200)
        f = self.work / "runs" / name / "metrics.jsonl"
        records = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []
        steps = {x["step"]: x for x in records if "loss" in x}
        refused = p.returncode == 2 and "Traceback" not in p.stderr
        return {"rc": p.returncode, "refused": refused, "stderr": p.stderr[-1500:], "steps": steps}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def check_equal(run: Runner, key: str, overrides: list[str], ref: dict) -> tuple[str, str]:
    res = run(key, overrides + ["train.steps=3", "checkpoint.enabled=false"])
    if res["rc"]:
        return ("refused" if res["refused"] else "FAILED"), res["stderr"]
    got, want = res["steps"], ref["steps"]
    dl = max(rel(got[s]["loss"], want[s]["loss"]) for s in (1, 2, 3))
    dg = rel(got[1]["grad_norm"], want[1]["grad_norm"])
    return ("ok" if dl < LOSS_TOL and dg < NORM_TOL else "MISMATCH"), f"loss {dl:.2e}, grad norm {dg:.2e}"


def check_mixed(run: Runner, key: str, overrides: list[str], ref: dict) -> tuple[str, str]:
    res = run(key, overrides + ["train.steps=3", "checkpoint.enabled=false"])
    if res["rc"]:
        return ("refused" if res["refused"] else "FAILED"), res["stderr"]
    losses = [s["loss"] for s in res["steps"].values()]
    if not losses or not all(map(math.isfinite, losses)):
        return "NONFINITE", f"losses {losses}"
    # step 1's loss comes before any update: the float32 one within 16-bit rounding; its
    # gradient too where nothing lossier than a 16-bit cast is on the wire
    dl = rel(res["steps"][1]["loss"], ref["steps"][1]["loss"])
    lossless = not any(o.startswith(("gradient_compression.method=", "optimizer.name=", "local_sgd."))
                       and not o.endswith(("=bf16", "=fp16")) for o in overrides)
    dg = rel(res["steps"][1]["grad_norm"], ref["steps"][1]["grad_norm"]) if lossless else 0.0
    ok = dl < MIXED_TOL and dg < MIXED_TOL
    return ("ok" if ok else "MISMATCH"), f"step-1 loss {dl:.2e}, grad norm {dg:.2e} vs float32"


def check_resume(run: Runner, key: str, model: list[str], a: list[str], b: list[str]) -> tuple[str, str]:
    f32 = ["train.compute_dtype=float32"]
    straight = run(key + "_straight", model + a + f32 + ["train.steps=4", "checkpoint.enabled=false"])
    first = run(key, model + a + f32 + ["train.steps=2", "checkpoint.every=2"])
    second = run(key, model + b + f32 + ["train.steps=4", "checkpoint.every=2"])
    for res in (straight, first, second):
        if res["rc"]:
            return ("refused" if res["refused"] else "FAILED"), res["stderr"]
    dl = max(rel(second["steps"][s]["loss"], straight["steps"][s]["loss"]) for s in (3, 4))
    dg = max(rel(second["steps"][s]["grad_norm"], straight["steps"][s]["grad_norm"]) for s in (3, 4))
    return ("ok" if dl < LOSS_TOL and dg < NORM_TOL else "MISMATCH"), f"loss {dl:.2e}, grad norm {dg:.2e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["equal", "mixed", "resume"], default="equal")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", default=None, help="scratch dir (default: a temporary one, removed)")
    ap.add_argument("--mesh-axis", default=None, help="draw only layouts that split this mesh axis "
                    "(pipeline, context, tensor, expert, fsdp); MoE models fall back to the dense layouts")
    ap.add_argument("--compressed", action="store_true", help="every run a compressed reduction, 1-bit "
                    "Adam or local SGD (resume mode: resumed on the same layout, whose state it is)")
    ap.add_argument("--moe", action="store_true", help="every run a MoE model (dropless or capacity)")
    ap.add_argument("--packed", action="store_true", help="every run on packed documents (with or "
                    "without data.reset_positions)")
    args = ap.parse_args(argv)
    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="jaxpar-fuzz-")
    run = Runner(Path(args.work or tmp.name))
    r = random.Random(args.seed)
    jobs = []
    for i in range(args.runs):
        model = model_opts(r, args.moe, args.packed)
        moe = any("moe" in o for o in model)
        if args.mode == "resume" and args.compressed:  # its state (residuals, replicas) is the layout's
            a = layout_opts(r, moe, args.mesh_axis) + sync_opts(r, always=True)
            jobs.append((f"r{i}", model, a, a))
        elif args.mode == "resume":
            jobs.append((f"r{i}", model, layout_opts(r, moe, args.mesh_axis), layout_opts(r, moe, args.mesh_axis)))
        else:
            extra = (["train.compute_dtype=float32"] if args.mode == "equal"
                     else mixed_opts(r, args.compressed))
            jobs.append((f"{args.mode}{i}", model, layout_opts(r, moe, args.mesh_axis) + extra, None))
    counts: dict[str, int] = {}
    with cf.ThreadPoolExecutor(args.workers) as pool:
        refs = {}
        if args.mode in ("equal", "mixed"):
            models = {tuple(m) for _, m, _, _ in jobs}
            futs = {m: pool.submit(run, f"ref{k}", list(m) + ["mesh.data=8", "model.attention=xla",
                                                           "train.compute_dtype=float32", "train.steps=3",
                                                           "checkpoint.enabled=false"])
                    for k, m in enumerate(sorted(models))}
            for m, fut in futs.items():
                refs[m] = fut.result()
                if refs[m]["rc"]:
                    print(f"reference run failed for {list(m)}:\n{refs[m]['stderr']}")
                    return 1

        def one(job):
            key, model, a, b = job
            if args.mode == "equal":
                return check_equal(run, key, model + a, refs[tuple(model)])
            if args.mode == "mixed":
                return check_mixed(run, key, model + a, refs[tuple(model)])
            return check_resume(run, key, model, a, b)

        futs = {pool.submit(one, job): job for job in jobs}
        for fut in cf.as_completed(futs):
            key, model, a, b = futs[fut]
            verdict, detail = fut.result()
            counts[verdict] = counts.get(verdict, 0) + 1
            what = " ".join(model + a) + (f"  ->  {' '.join(b)}" if b else "")
            line = detail.strip().splitlines()[-1] if verdict == "refused" else detail if verdict == "ok" else ""
            print(f"{verdict:9s} {what}   {line}", flush=True)
            if verdict not in ("ok", "refused"):
                print("    " + detail.replace("\n", "\n    "), flush=True)
    print("summary:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return int(any(k not in ("ok", "refused") for k in counts))


if __name__ == "__main__":
    sys.exit(main())
