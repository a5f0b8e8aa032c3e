#!/usr/bin/env bash
# One prepared run for a lent GPU (one H200), about 8 minutes after start-up (GPU_CHECK_BUDGET
# seconds, default 480). The parts run in this order, the most needed first, each under `timeout`
# (its cap or the budget left, whichever is less), each into one file under $OUT (the device
# machine sends back at most 8 files):
#   1. env.txt       jax / jaxlib / flax versions, the devices, nvidia-smi; at the end one line per
#                    part: exit code, seconds taken of its allowance, the log's tail if it failed (~15 s)
#   2. attention.txt issue 14: `jaxpar bench attention configs/llama_1b.yaml --seqs 4096,8192
#                    --impls cudnn,blockwise,xla` (bf16, 1B preset): per implementation and length,
#                    one attention layer's fwd+bwd time and compiled temp memory, blockwise packed
#                    rows, then the 1B train step's temp memory and time, one sequence per device on
#                    a mesh of 1 GPU. Each row is logged as it is measured (a cut run keeps them)
#                    (~3-4 min: 6 step compiles; cap 240 s)
#   3. train_1b.txt  issue 16: `jaxpar train configs/llama_1b.yaml` (bf16) for 40 steps, checkpoints
#                    off, steps 32-34 profiled: the log (tokens/s and MFU in its `done:` line) and
#                    metrics.jsonl appended (tokens_per_s, step_time_s, mfu at steps 10-40; 10-30
#                    are unprofiled) (~1.5 min; cap 150 s)
#   4. profile.txt   `jaxpar profile RUN_DIR --summary` of that trace: device busy vs idle time per
#                    step (the loop's host gap; one GPU has no collectives to overlap), top device
#                    ops, dispatch calls; and profile_trace.json.gz, the Perfetto trace, when under
#                    15 MB (~10 s; cap 60 s)
#   5. cluster_gpu.yaml  issue 17: `jaxpar plan calibrate`: bf16 / fp32 matmul TFLOP/s, HBM GB/s
#                    (memory_gbps), loop and tick overhead, memory per device (~30 s; cap 90 s)
#   5b. plan_fit.txt issue 17: `jaxpar plan fit` of part 3's run on that calibrated description:
#                    the planner's predicted step against the measured one, and the constants
#                    refitted (~15 s; cap 60 s)
#   6. tests.txt     cuDNN attention on packed segments (bf16) vs the float64 reference, on the GPU
#                    (~40 s; cap 90 s); then the not-slow test subset on 8 forced CPU devices, as in
#                    CI, with whatever is left of the budget (interrupted when it runs out)
# Python packages the GPU image lacks (pydantic and its parts, tensorboardX) travel as wheels in
# .whl/: fill it here with scripts/gpu_wheels.sh and name .whl in the run's `carry`.
# GPU_CHECK_DRY=1: a CPU dry run of the same plumbing with tiny sizes (quickstart model, short
# sequences, one small test file): `GPU_CHECK_DRY=1 PYTHON=.venv/bin/python bash scripts/gpu_check.sh`.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-480}
START=$SECONDS
RUNS=/tmp/gpu_check_runs
rm -rf "$RUNS" /tmp/gpu_check_tests.log /tmp/gpu_check_calibrate.log
for f in env.txt attention.txt train_1b.txt profile.txt profile_trace.json.gz cluster_gpu.yaml plan_fit.txt \
    tests.txt; do
  rm -f "${OUT:?}/$f"  # a second run on the same machine starts clean (parts append to their files)
done
export PYTHONUNBUFFERED=1

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >/tmp/gpu_check_pip.log 2>&1; then
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    WHEELS="installed: $(cd .whl && ls *.whl | tr '\n' ' ')"
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; WHEELS="install FAILED: $(tail -3 /tmp/gpu_check_pip.log)"
  fi
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; WHEELS="none carried (.whl/ absent)"
fi

if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then  # plumbing check on a CPU: tiny sizes, same steps
  GPU=cpu
  ATTN=(configs/quickstart.yaml model.n_layers=1 model.attention_block=16 --seqs 64,128)
  TRAIN=(configs/quickstart.yaml mesh.data=1 mesh.fsdp=-1 mesh.tensor=1 eval.every=0)
  RUN_NAME=quickstart
  CPU_TESTS=(tests/test_metrics.py)
else
  GPU=cuda
  ATTN=(configs/llama_1b.yaml --seqs 4096,8192)
  TRAIN=(configs/llama_1b.yaml)
  RUN_NAME=llama_1b
  CPU_TESTS=(tests -m "not slow")
fi

left() { echo $((BUDGET - (SECONDS - START))); }

# part NAME CAP LOG CMD...: CMD under `timeout` (CAP or the budget left), output appended to LOG;
# its exit code and time (and the log's tail when it failed) go to env.txt.
part() {
  local name=$1 cap=$2 log=$3 t rc t0 tail
  shift 3
  t=$(left); ((t > cap)) && t=$cap
  if ((t < 15)); then
    echo "part $name: skipped, ${t} s left of the ${BUDGET} s budget" >>"$OUT/env.txt"; return 1
  fi
  t0=$SECONDS
  timeout -s INT -k 15 "$t" "$@" >>"$log" 2>&1
  rc=$?
  tail=$( ((rc != 0)) && tail -5 "$log" | sed 's/^/    /')  # before env.txt (env's own log) grows
  echo "part $name: rc $rc$( ((rc == 124)) && echo ' (timed out)'), $((SECONDS - t0)) s of $t s" >>"$OUT/env.txt"
  if [ -n "$tail" ]; then echo "$tail" >>"$OUT/env.txt"; fi
  return $rc
}

# 1. the environment: is it the GPU we expect, does jaxpar import
{
  echo "gpu_check.sh: budget ${BUDGET} s, mode $([ "$GPU" = cpu ] && echo 'CPU dry run' || echo GPU); wheels $WHEELS"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv,noheader
} >"$OUT/env.txt" 2>&1
part env 60 "$OUT/env.txt" env JAX_PLATFORMS=$GPU "$PY" -c "
import jax, jaxlib, flax, optax, pydantic
import jaxpar.cli  # pydantic and the rest of jaxpar's imports are there
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__,
      'pydantic', pydantic.VERSION)
print('backend', jax.default_backend(), [(d.platform, d.device_kind) for d in jax.devices()])
"
ENV_RC=$?
if ((ENV_RC != 0)); then
  echo "no $GPU backend or jaxpar does not import: the GPU parts are skipped" >>"$OUT/env.txt"
else
  # 2. issue 14: attention implementations at 4K / 8K, layer and 1B step
  part attention 240 "$OUT/attention.txt" env JAX_PLATFORMS=$GPU \
    "$PY" -m jaxpar.cli bench attention "${ATTN[@]}" --impls cudnn,blockwise,xla

  # 3. issue 16: tokens/s and MFU of the 1B preset in bf16, three steps profiled
  part train 150 "$OUT/train_1b.txt" env JAX_PLATFORMS=$GPU \
    "$PY" -m jaxpar.cli train "${TRAIN[@]}" train.steps=40 train.progress=false checkpoint.enabled=false \
    "profile.steps=[32,34]" run_dir=$RUNS
  if [ -f "$RUNS/$RUN_NAME/metrics.jsonl" ]; then
    { echo "--- $RUNS/$RUN_NAME/metrics.jsonl"; cat "$RUNS/$RUN_NAME/metrics.jsonl"; } >>"$OUT/train_1b.txt"
  fi

  # 4. the profile's summary: device busy vs the loop's host gap per step, top ops
  part profile 60 "$OUT/profile.txt" "$PY" -m jaxpar.cli profile "$RUNS/$RUN_NAME" --summary
  trace=$(find "$RUNS/$RUN_NAME/profile" -name perfetto_trace.json.gz 2>/dev/null | sort | tail -1)
  if [ -n "$trace" ] && (($(stat -c %s "$trace") < 15 * 2**20)); then
    cp "$trace" "$OUT/profile_trace.json.gz"
  elif [ -n "$trace" ]; then
    echo "trace not copied: $(stat -c %s "$trace") bytes (over 15 MB)" >>"$OUT/profile.txt"
  fi

  # 5. issue 17: a cluster description of this GPU
  part calibrate 90 /tmp/gpu_check_calibrate.log env JAX_PLATFORMS=$GPU \
    "$PY" -m jaxpar.cli plan calibrate -o "$OUT/cluster_gpu.yaml"

  # 5b. issue 17: the planner's prediction for part 3's run on this GPU, against its measured step
  if [ -f "$OUT/cluster_gpu.yaml" ] && [ -f "$RUNS/$RUN_NAME/metrics.jsonl" ]; then
    part plan-fit 60 "$OUT/plan_fit.txt" env JAX_PLATFORMS=$GPU \
      "$PY" -m jaxpar.cli plan fit "$RUNS/$RUN_NAME" --cluster "$OUT/cluster_gpu.yaml"
  fi

  # 6a. cuDNN attention on packed segments (bf16) vs the float64 reference: runs only on the GPU
  echo "--- cuDNN attention on packed segments (GPU)" >>"$OUT/tests.txt"
  part cudnn-test 90 "$OUT/tests.txt" env JAX_PLATFORMS=$GPU \
    "$PY" -m pytest -q tests/test_packing.py -k "honours and cudnn" -p no:cacheprovider
fi

# 6b. last: the not-slow test subset on 8 forced CPU devices (as in CI), in whatever time is left
echo "--- the not-slow tests on 8 forced CPU devices (what $(left) s of the budget allowed)" >>"$OUT/tests.txt"
part cpu-tests 100000 /tmp/gpu_check_tests.log env JAX_PLATFORMS=cpu \
  XLA_FLAGS=--xla_force_host_platform_device_count=8 "$PY" -m pytest -q -x "${CPU_TESTS[@]}" -p no:cacheprovider
tail -15 /tmp/gpu_check_tests.log >>"$OUT/tests.txt" 2>/dev/null
echo "total: $((SECONDS - START)) s; files: $(cd "$OUT" && ls | tr '\n' ' ')" >>"$OUT/env.txt"
