"""The compiled step costs what the model's math costs: structure, not wall time (issue 11).

Cause found: XLA:CPU's default dot library (YNNPACK) refuses bf16 dots whose left operand is
transposed. Inside jaxpar's shard_map every weight gradient ends up as one (XLA folds the
transpose of dot(dy, x) into dot(x, dy)); a plain GSPMD jit has its all-reduce between the dot
and the transpose, so it escaped. Refused dots run in XLA's naive loop emitter: the bf16 step was
2.4-3.2x slower than a hand-written jit. jaxpar now routes CPU dots through oneDNN for 16-bit
compute (`xla.cpu_dots`). Each case compiles in its own process, since XLA options are
per-process, with the options jaxpar itself picks for the config.
"""
import json
import os
import subprocess
import sys

import pytest

MODEL = ["model.preset=null", "model.n_layers=2", "model.dim=256", "model.n_heads=4",
         "model.n_kv_heads=4", "model.ffn_dim=1024", "model.vocab_size=256", "train.seq_len=64",
         "train.global_batch=8", "data.source=synthetic", "train.compute_dtype=bfloat16",
         "train.progress=false"]
LAYOUTS = {
    "data8": ["mesh.data=8", "mesh.fsdp=1", "sharding.zero_stage=0"],
    "fsdp8_zero3": ["mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=3"],
}
SCRIPT = """
import json, sys
from jaxpar.bench import load
from jaxpar.xla import apply_xla_flags
_, cfg = load("overhead-point", None, sys.argv[1:])
apply_xla_flags(cfg)  # before JAX starts, as `jaxpar train` does
from jaxpar.bench.overhead import compiled_structure
print(json.dumps(compiled_structure(cfg)))
"""


def _structure(overrides):
    # the test run's XLA_FLAGS (8 devices, LLVM at -O0: the dot emitters chosen and the cost
    # analysis are the same as at the default level, measured; the compile is ~30% cheaper)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *overrides], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_step_leaves_no_dot_to_the_naive_emitter(layout):
    res = _structure([*MODEL, *LAYOUTS[layout], "train.skip_nonfinite=false"])
    assert res["jaxpar"]["naive_bf16_dots"] == 0, res
    assert res["baseline"]["naive_bf16_dots"] == 0, res
    # no more math than the hand-written step (GSPMD's own ZeRO-3 partitioning does more)
    assert res["jaxpar"]["flops"] <= 1.05 * res["baseline"]["flops"], res
    if layout == "data8":  # like for like (GSPMD's ZeRO-3 gathers fp32 weights: not comparable)
        assert res["jaxpar"]["bytes_accessed"] <= 1.15 * res["baseline"]["bytes_accessed"], res


def test_default_cpu_dots_would_leave_the_weight_gradients_naive():
    """The check above can fail: with XLA's default CPU dots the weight gradients go naive."""
    from jaxpar.xla import _jaxlib_version
    if _jaxlib_version() < (0, 11):
        pytest.skip("jaxlib < 0.11: XLA:CPU's default dots emit no naive bf16 loop to catch "
                    "(measured on 0.10.2: 0), so the check above cannot fail there")
    res = _structure([*MODEL, *LAYOUTS["data8"], "xla.cpu_dots=default"])
    assert res["jaxpar"]["naive_bf16_dots"] >= 2, res
