#!/usr/bin/env bash
# Fill .whl/ with the wheels scripts/gpu_check.sh installs on the GPU machine, whose image has jax,
# flax, optax, orbax, chex and pyyaml but not pydantic (with pydantic-core, annotated-types,
# typing-inspection and a typing-extensions new enough for them) nor tensorboardX (the train
# loop's TensorBoard writer). Versions: those of PYTHON's environment (default .venv/bin/python),
# so the carried set is the one the tests ran with here; x86-64 CPython 3.12 builds (the GPU
# machine's python3). Then name .whl in the device run's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PKGS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions tensorboardX)
pins=$("$PY" -c "
import importlib.metadata as m, sys
print(' '.join(f'{p}=={m.version(p)}' for p in sys.argv[1:]))" "${PKGS[@]}")
rm -rf .whl && mkdir -p .whl
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plats+=(--platform "$p")
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plats[@]}" -d .whl $pins
ls -la .whl
