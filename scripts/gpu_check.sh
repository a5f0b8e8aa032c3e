#!/usr/bin/env bash
# One prepared run for a lent GPU: the test suite (on 8 forced CPU devices, as in CI), a GPU smoke
# test, then tokens/s and MFU of the 1B preset in bf16. Writes logs under $OUT when set.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT/env.txt"
JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 timeout 300 \
  python3 -m pytest -q -x tests -m "not slow" -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/tests.txt"
# cuDNN attention on packed segments (bf16) vs the float64 reference: runs only on the GPU
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q tests/test_packing.py -k "honours and cudnn" \
  -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/cudnn_segments.txt"
timeout 240 python3 -m jaxpar.cli train configs/llama_1b.yaml train.steps=30 train.progress=false \
  run_dir=/tmp/runs 2>&1 | tail -25 | tee "$OUT/train_1b.txt"
cp /tmp/runs/llama_1b/metrics.jsonl "$OUT/" 2>/dev/null || true
