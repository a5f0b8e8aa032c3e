"""Compile jaxpar's train step for 8 GPUs on a machine without one, and read what XLA:GPU made.

    pip install -e . "jax-cuda12-plugin[with-cuda]==$(python -c 'import jax; print(jax.__version__)')"
    python scripts/gpu_aot.py [--device h200|h100] [--config configs/llama_1b.yaml] [--json FILE]

The CUDA plugin compiles for a described device (a GpuTargetConfig: SMs, memory, bandwidth,
compute capability) with no GPU and no driver (its version check is skipped; JAX's own backend
stays the CPU). Per layout of the config: whether the step compiles, the cuDNN attention kernels
in it, XLA:GPU's memory_analysis (arguments, temporaries) beside the planner's prediction, the
collectives' bytes per kind beside the planner's (platform gpu), and how many async collectives
have compute scheduled between their start and done (the latency-hiding scheduler's overlap).
Wall time needs the GPU itself: scripts/gpu_check.sh."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX's own backend: this host
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Vendor figures (SXM parts): compute capability 9.0, 132 SMs, 50 MiB L2.
DEVICES = {
    "h100": {"memory": 80 * 2**30, "bandwidth": 3_350_000_000_000, "name": "NVIDIA H100 80GB HBM3"},
    "h200": {"memory": 141 * 10**9, "bandwidth": 4_800_000_000_000, "name": "NVIDIA H200"},
}
CLUSTERS = {"h100": "h100_80gb_x8", "h200": "h200_x8"}
LAYOUTS = [
    "mesh.data=1 mesh.fsdp=8 sharding.zero_stage=1",  # configs/llama_1b.yaml as it is
    "mesh.data=1 mesh.fsdp=8 sharding.zero_stage=3 train.remat=none",
    "mesh.data=1 mesh.fsdp=4 mesh.tensor=2 sharding.zero_stage=3 train.remat=none",  # the planner's pick
    "mesh.data=2 mesh.fsdp=2 mesh.tensor=2 sharding.zero_stage=1",
    "mesh.data=4 mesh.fsdp=1 mesh.pipeline=2 train.grad_accum=2",
]
COMPUTE = re.compile(r"= \S+ (fusion|custom-call|convolution|dot)\(")
ASYNC = re.compile(r"^\s*(?:ROOT )?%(\S+) = .* ((all-gather|all-reduce|reduce-scatter|collective-permute|"
                   r"all-to-all)-start|async-start)\(")


def target_config(device: str) -> str:
    d = DEVICES[device]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {d['bandwidth']}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {d['memory']}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
runtime_version {{ major: 12 minor: 8 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{d['name']}"
"""


def overlap(hlo: str) -> dict[str, int]:
    """Async collectives in the scheduled module, and how many have compute (a fusion, a library
    call such as cuBLAS / cuDNN) scheduled between their start and their done."""
    total = hidden = 0
    for comp in hlo.split("\n\n"):
        lines = comp.splitlines()
        for i, line in enumerate(lines):
            m = ASYNC.match(line)
            if not m:
                continue
            total += 1
            name = m.group(1)
            for later in lines[i + 1:]:
                if f"%{name})" in later or f"%{name}," in later:  # its done (first use)
                    break
                if COMPUTE.search(later):
                    hidden += 1
                    break
    return {"async": total, "with_compute_between": hidden}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=sorted(DEVICES), default="h200")
    ap.add_argument("--config", default=str(ROOT / "configs/llama_1b.yaml"))
    ap.add_argument("--layout", action="append", help="overrides of one layout (repeatable); default: a set")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()

    from jaxpar.config import load_config
    from jaxpar.xla import apply_xla_flags
    base = ["checkpoint.enabled=false", "train.progress=false"]
    apply_xla_flags(load_config(args.config, base))  # the GPU defaults, before JAX starts

    import jax
    from jax.experimental import topologies
    from jaxpar.bench.comm import measured, measured_step
    from jaxpar.planner.cluster import load_cluster
    from jaxpar.planner.comm import step_collectives
    from jaxpar.planner.layout import Layout, abstract_plan
    from jaxpar.planner.memory import estimate
    from jaxpar.train.trainer import Trainer

    topo = topologies.get_topology_desc(args.device, "cuda", target_config=target_config(args.device),
                                        topology="1x1x8")
    devices = list(topo.devices)
    cluster = load_cluster(CLUSTERS[args.device])
    print(f"jax {jax.__version__}; compiling for 8 x {devices[0].device_kind} (deviceless); "
          f"{args.config}", flush=True)
    rows = []
    for overrides in args.layout or LAYOUTS:
        row = {"layout": overrides}
        t0 = time.perf_counter()
        try:
            cfg = load_config(args.config, base + overrides.split())
            tr = Trainer(cfg, devices=devices, log=lambda s: None)
            exe = tr.compile()
        except Exception as e:  # a layout that does not compile is the finding: say why, go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(row)
            print(f"{overrides}: FAILED {row['error']}", flush=True)
            continue
        hlo = exe.as_text()
        mem = exe.memory_analysis()
        layout = Layout.of_config(cfg, 8)
        pred = estimate(cfg, layout, tr.model, platform="gpu")
        comm = step_collectives(cfg, layout, tr.model, abstract_plan(cfg, layout), platform="gpu")
        try:
            got, row["pipeline_branches_weighted"] = measured_step(cfg, tr.mesh, hlo), True
        except ValueError as e:  # XLA:GPU laid the tick's switches out otherwise (a loop unrolled by
            # while-loop double buffering): every branch counted on every tick
            got, row["pipeline_branches_weighted"] = measured(hlo, 8), f"no: {e}"
        row.update({
            "compile_s": round(time.perf_counter() - t0, 1),
            "cudnn_calls": sorted(set(re.findall(r'custom_call_target="(__cudnn\$[^"]+)"', hlo))),
            "argument_gib": mem.argument_size_in_bytes / 2**30, "temp_gib": mem.temp_size_in_bytes / 2**30,
            "predicted_gib": pred["total"] / 2**30,
            "collectives_mb": {k: {"hlo": v["result_bytes"] / 1e6,
                                   "planner": comm["kinds"].get(k, {}).get("result_bytes", 0.0) / 1e6}
                               for k, v in got.items() if v["result_bytes"] or k in comm["kinds"]},
            "overlap": overlap(hlo),
        })
        total = row["argument_gib"] + row["temp_gib"]
        print(f"{overrides}: compiled in {row['compile_s']} s; cuDNN {row['cudnn_calls']}; args "
              f"{row['argument_gib']:.2f} + temp {row['temp_gib']:.2f} = {total:.2f} GiB (planner "
              f"{row['predicted_gib']:.2f}, {row['predicted_gib'] / total:.2f}x); async collectives "
              f"{row['overlap']['async']}, {row['overlap']['with_compute_between']} with compute between",
              flush=True)
        if row["pipeline_branches_weighted"] is not True:
            print(f"    (collectives: every pipeline branch counted on every tick; {row['pipeline_branches_weighted']})")
        for k, v in row["collectives_mb"].items():
            print(f"    {k:20s} HLO {v['hlo']:10.1f} MB   planner {v['planner']:10.1f} MB", flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"jax": jax.__version__, "device": args.device, "rows": rows},
                                              indent=2))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
