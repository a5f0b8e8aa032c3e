#!/usr/bin/env bash
# jaxpar vs MaxText, step time side by side on 8 forced CPU devices (issue 11):
#   scripts/compare_maxtext.sh [--layouts data8,fsdp8,dp2fsdp2tp2] [--repeats N] [more options of
#   scripts/compare_maxtext.py, e.g. --maxtext-onednn, --json FILE, --work-dir DIR]
# The same Llama-style model in both (4 layers, dim 256, 4 heads, ffn 1024, vocab 256, seq 128,
# global batch 8, bf16 compute, fp32 weights, AdamW, remat full, synthetic data); the trainers run
# alternately, and the mean step time of steps 5-19 of each is printed with jaxpar/maxtext.
#
# MaxText is no dependency of jaxpar: it lives in its own venv outside the repository,
# ${MAXTEXT_VENV:-$HOME/.cache/jaxpar/maxtext-venv}, made here on first use (Python 3.12,
# maxtext[tpu]==${MAXTEXT_VERSION:-0.2.5} from PyPI; plain maxtext if the [tpu] extra fails).
# jaxpar runs from this checkout with ${JAXPAR_PYTHON:-.venv/bin/python} (`make venv`).
set -euo pipefail
cd "$(dirname "$0")/.."
MAXTEXT_VENV=${MAXTEXT_VENV:-$HOME/.cache/jaxpar/maxtext-venv}
MAXTEXT_VERSION=${MAXTEXT_VERSION:-0.2.5}
JAXPAR_PYTHON=${JAXPAR_PYTHON:-.venv/bin/python}
export XLA_FLAGS=${XLA_FLAGS:---xla_force_host_platform_device_count=8}

if [ ! -x "$JAXPAR_PYTHON" ]; then
  echo "compare_maxtext: no jaxpar venv at $JAXPAR_PYTHON; run 'make venv' or set JAXPAR_PYTHON" >&2
  exit 2
fi

if ! "$MAXTEXT_VENV/bin/python" -c 'import maxtext.trainers.pre_train.train' >/dev/null 2>&1; then
  # Python 3.12 as the Makefile finds it (MaxText needs >= 3.12)
  PY=""
  for p in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3; do
    if "$p" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then PY=$p; break; fi
  done
  if [ -z "$PY" ]; then
    echo "compare_maxtext: MaxText needs Python >= 3.12 and none was found" >&2
    exit 2
  fi
  echo "compare_maxtext: installing maxtext $MAXTEXT_VERSION into $MAXTEXT_VENV with $PY (a few minutes)" >&2
  mkdir -p "$(dirname "$MAXTEXT_VENV")"
  test -x "$MAXTEXT_VENV/bin/python" || "$PY" -m venv "$MAXTEXT_VENV"
  "$MAXTEXT_VENV/bin/python" -m pip install -q --upgrade pip
  if ! "$MAXTEXT_VENV/bin/python" -m pip install -q "maxtext[tpu]==$MAXTEXT_VERSION"; then
    echo "compare_maxtext: maxtext[tpu] did not install; trying plain maxtext" >&2
    "$MAXTEXT_VENV/bin/python" -m pip install -q "maxtext==$MAXTEXT_VERSION"
  fi
fi

exec "$JAXPAR_PYTHON" scripts/compare_maxtext.py --jaxpar-python "$JAXPAR_PYTHON" \
  --maxtext-python "$MAXTEXT_VENV/bin/python" "$@"
