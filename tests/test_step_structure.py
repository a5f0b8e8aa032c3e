"""The compiled step costs what the model's math costs: structure, not wall time (issue 11).

Cause found: XLA:CPU's default dot library (YNNPACK) refuses bf16 dots whose left operand is
transposed. Inside jaxpar's shard_map every weight gradient ends up as one (XLA folds the
transpose of dot(dy, x) into dot(x, dy)); a plain GSPMD jit has its all-reduce between the dot
and the transpose, so it escaped. Refused dots run in XLA's naive loop emitter: the bf16 step was
2.4-3.2x slower than a hand-written jit. jaxpar now routes CPU dots through oneDNN for 16-bit
compute (`xla.cpu_dots`), per program: the step's compile gets its options
(jaxpar.xla.compiler_options) whatever XLA_FLAGS holds, so these cases compile in this process,
after JAX started, as a user's script or notebook would (XLA_FLAGS of the test run: 8 devices,
LLVM at -O0, which picks the same dot emitters and cost analysis).

Then found at its source (session 14): the transposed weight-gradient dots are JAX's transpose of
a dot (dot(dy, x) then a transpose, which XLA folds into a dot with both operands transposed).
The models' projections (nn.project) form the weight gradient as einsum(x, dy) in the weight's
own order, which every XLA:CPU dot library takes: no naive dot with XLA's default dots either,
and float32 steps (YNNPACK) ~10% faster. oneDNN stays the bf16 default (measured faster here).
"""
import pytest

from jaxpar.bench import load
from jaxpar.bench.overhead import compiled_structure
from jaxpar.config import make_config
from jaxpar.metrics.hlo import naive_dots
from jaxpar.train.trainer import Trainer

MODEL = ["model.preset=null", "model.n_layers=2", "model.dim=256", "model.n_heads=4",
         "model.n_kv_heads=4", "model.ffn_dim=1024", "model.vocab_size=256", "train.seq_len=64",
         "train.global_batch=8", "data.source=synthetic", "train.compute_dtype=bfloat16",
         "train.progress=false"]
LAYOUTS = {
    "data8": ["mesh.data=8", "mesh.fsdp=1", "sharding.zero_stage=0"],
    "fsdp8_zero3": ["mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=3"],
}


def _structure(overrides):
    return compiled_structure(load("overhead-point", None, overrides)[1])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_step_leaves_no_dot_to_the_naive_emitter(layout):
    res = _structure([*MODEL, *LAYOUTS[layout], "train.skip_nonfinite=false"])
    assert res["jaxpar"]["naive_bf16_dots"] == 0, res
    assert res["baseline"]["naive_bf16_dots"] == 0, res
    # no more math than the hand-written step (GSPMD's own ZeRO-3 partitioning does more)
    assert res["jaxpar"]["flops"] <= 1.05 * res["baseline"]["flops"], res
    if layout == "data8":  # like for like (GSPMD's ZeRO-3 gathers fp32 weights: not comparable)
        assert res["jaxpar"]["bytes_accessed"] <= 1.15 * res["baseline"]["bytes_accessed"], res


def test_default_cpu_dots_leave_no_weight_gradient_naive():
    """With XLA's default CPU dots (YNNPACK) the weight gradients are library dots too: the
    projections form them in the weight's order (nn.project). Before, 4 bf16 dots per step went
    to the naive loop here. That the count can fail is tests/test_project.py's last test (the
    plain einsum's autodiff)."""
    # jaxpar's step alone, compiled as compiled_structure compiles it (Trainer.compile: the step's
    # own compiler options); the hand-written step is not read here
    cfg = load("overhead-point", None, [*MODEL, *LAYOUTS["data8"], "xla.cpu_dots=default"])[1]
    hlo = Trainer(cfg, log=lambda s: None).compile().as_text()
    assert naive_dots(hlo, "bf16") == 0
    assert "onednn" not in hlo.lower()  # an explicit `default` turns oneDNN off (next test's third case)


@pytest.mark.parametrize("layout", ["data8", "data2_fsdp2_tensor2"])
def test_float32_step_leaves_no_dot_to_xla_loops(layout):
    """Float32 steps use XLA's default dots (YNNPACK): every dot of the step is a library dot.
    Before nn.project, the MLP's three weight gradients and the head's ran in XLA's own dot
    loops (4 a step), ~10% of the step (docs/benchmarks.md, session 14)."""
    lay = LAYOUTS.get(layout, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=1"])
    hlo = Trainer(make_config({}, [*MODEL, *lay, "train.compute_dtype=float32"]),
                  log=lambda s: None).compile().as_text()
    assert naive_dots(hlo, "f32") == 0
    assert "onednn" not in hlo.lower()  # float32: XLA's default dots (next test's second case)


def test_each_step_compiles_with_its_own_cpu_dots():
    """JAX started long before these Trainers (XLA_FLAGS names no dot library): a bf16 step's
    dots are oneDNN's, a float32 one's XLA's default, an explicit `default` turns oneDNN off.
    Before, the choice went to XLA_FLAGS and was lost (a warning) once JAX had started. The
    float32 and `default` steps are the ones the two tests above compile (they assert no oneDNN
    in them); here a bf16 step, whose dots must be oneDNN's."""
    tiny = ["model.preset=tiny", "model.n_layers=1", "model.dim=64", "model.n_heads=2", "model.n_kv_heads=2",
            "model.ffn_dim=128", "model.vocab_size=64", "train.seq_len=16", "train.global_batch=8",
            "data.source=synthetic", "checkpoint.enabled=false", "train.progress=false"]
    hlo = Trainer(make_config({}, tiny + ["train.compute_dtype=bfloat16"]), log=lambda s: None).compile().as_text()
    assert "onednn" in hlo.lower()
