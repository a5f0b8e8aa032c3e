"""The pipelined step computes the same loss and gradients as the plain one (float32), alone and
composed with data, ZeRO and tensor parallelism; 1f1b's memory stays flat in the microbatches."""
import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError, load_config
from tests.pipeline_util import loss_and_grads, temp_bytes

BASE = ["model.n_layers=4"]


@pytest.fixture(scope="module")
def reference(devices):
    return loss_and_grads(BASE + ["mesh.data=1"], devices[:1])


def assert_matches(got, ref, rtol=1e-5):
    (loss, grads), (ref_loss, ref_grads) = got, ref
    np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for (path, g), r in zip(flat, ref_flat):
        # relative to the gradient's scale (elementwise rtol is meaningless near zero)
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert err < rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


CASES = {  # each schedule alone: test_full_matrix; here composed with the other strategies
    "gpipe-p4-microbatches8": (["mesh.pipeline=4", "pipeline.schedule=gpipe", "pipeline.microbatches=8"], 4),
    "1f1b-p4-recompute": (["mesh.pipeline=4", "train.grad_accum=4", "pipeline.recompute=true"], 4),
    "dp2-pp2-tp2": (["mesh.data=2", "mesh.pipeline=2", "mesh.tensor=2", "train.grad_accum=2"], 8),
    "fsdp2-pp4-zero3": (["mesh.fsdp=2", "mesh.pipeline=4", "sharding.zero_stage=3",
                         "train.grad_accum=4"], 8),
    # sequence parallelism inside the stages: the residual stream split over `tensor` along the
    # sequence in every branch (stashed so too), zb_h1's split backward and ZeRO-3 beside it
    "dp2-pp2-tp2-seqpar": (["mesh.data=2", "mesh.pipeline=2", "mesh.tensor=2", "train.grad_accum=2",
                            "sharding.sequence_parallel=true"], 8),
    "fsdp2-pp2-tp2-seqpar-zb_h1-zero3": (["mesh.fsdp=2", "mesh.pipeline=2", "mesh.tensor=2",
                                          "train.grad_accum=2", "sharding.sequence_parallel=true",
                                          "pipeline.schedule=zb_h1", "sharding.zero_stage=3"], 8),
}


# with tests/test_pipeline_perf.py, whose gradient tests compare with the same one-device step
# (tests/pipeline_util.py computes it once per process)
@pytest.mark.xdist_group("pipeline_perf")
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_plain_step(name, reference, devices):
    overrides, n = CASES[name]
    layout = ["mesh.data=1"] if not any(o.startswith("mesh.data=") for o in overrides) else []
    assert_matches(loss_and_grads(BASE + layout + overrides, devices[:n]), reference)


def test_1f1b_memory_flat_gpipe_grows(devices):
    """Microbatch size fixed (2 sequences of 64 tokens), microbatches 4 -> 8 on 2 stages (1f1b
    holds 2p - 1 = 3 on device 0 from m = 3 on)."""
    def temp(schedule, m):
        return temp_bytes(["model.n_layers=4", "mesh.data=1", "mesh.pipeline=2", "train.seq_len=64",
                           f"train.global_batch={2 * m}", f"train.grad_accum={m}",
                           f"pipeline.schedule={schedule}"], devices[:2])
    one = [temp("1f1b", m) for m in (4, 8)]
    gp = [temp("gpipe", m) for m in (4, 8)]
    assert one[1] <= 1.1 * one[0], one
    # gpipe keeps every microbatch's residuals (more than its stage input, [2, 64, 128] float32)
    stage_input = 2 * 64 * 128 * 4
    assert gp[1] - gp[0] >= 4 * stage_input, gp


def test_sequence_parallel_beside_a_pipeline(devices):
    """Sequence parallelism in a pipeline's stages: the only collective-permutes of the compiled
    step are the pipeline's own sends (a halo exchange of the token ids inside a stage's branch
    would be a rendezvous the other stages never join: the step hung), and the stash is split
    over `tensor` along the sequence (temp memory below the same layout without it)."""
    from jaxpar.train.trainer import Trainer
    from tests.conftest import tiny_config
    layout = ["model.n_layers=4", "mesh.data=2", "mesh.pipeline=2", "mesh.tensor=2", "train.grad_accum=4",
              "train.seq_len=256", "pipeline.recompute=false"]
    temp = {}
    for sp in (False, True):
        t = Trainer(tiny_config(*layout, f"sharding.sequence_parallel={str(sp).lower()}"),
                    devices=devices, log=lambda s: None)
        compiled = t.compile()
        temp[sp] = compiled.memory_analysis().temp_size_in_bytes
        permutes = [line for line in compiled.as_text().split("\n")
                    if "collective-permute" in line and "op_name=" in line]
        assert permutes and all("/ppermute" in line for line in permutes), permutes[:3]
    assert temp[True] < 0.95 * temp[False], temp


def test_trainer_loss_curve_matches(devices):
    """The quickstart model trains to the same losses with a pipeline as in its own layout."""
    common = ["train.steps=3", "train.progress=false", "train.seq_len=32", "data.source=synthetic",
              "eval.every=0"]  # the losses are compared, not the held-out loss (its two compiles)

    def losses(overrides):
        from jaxpar.train.trainer import Trainer
        trainer = Trainer(load_config("configs/quickstart.yaml", common + overrides), devices=devices)
        return [h["loss"] for h in trainer.fit(progress=False)[1]]

    ref = losses([])
    got = losses(["mesh.fsdp=1", "mesh.pipeline=2", "train.grad_accum=2"])
    np.testing.assert_allclose(got, ref, rtol=1e-5)


@pytest.mark.parametrize("overrides,match", [
    (["model.n_layers=6", "mesh.pipeline=4", "train.grad_accum=4"],
     "model.n_layers=6 does not split evenly into mesh.pipeline=4"),
    (["model.n_layers=4", "mesh.pipeline=4", "train.grad_accum=2"],
     "at least as many microbatches as stages"),
    (["model.n_layers=4", "mesh.pipeline=2", "pipeline.microbatches=32"],
     "divisible by the batch-parallel size"),
    (["model.n_layers=8", "mesh.fsdp=2", "mesh.pipeline=4", "train.grad_accum=4",
      "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
      "sharding.rules={layers: [pipeline, fsdp]}"], r"sharding.rules.layers=\['pipeline', 'fsdp'\]"),
])
def test_config_errors(overrides, match, devices):
    from jaxpar.train.trainer import Trainer
    from tests.conftest import tiny_config
    with pytest.raises(ConfigError, match=match):
        Trainer(tiny_config("mesh.data=-1", *overrides), devices=devices)


FULL = [(s, p, m) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1") for p, m in ((2, 2), (4, 16))] + [
    ("1f1b_split", 4, 8)]  # zb_h1's split backward in Megatron's order: the same branches


@pytest.mark.slow  # ~1 min of CPU for the 8 cases; always run
@pytest.mark.xdist_group("pipeline_full")  # the 8-layer one-device reference, built once
@pytest.mark.parametrize("schedule,p,m", FULL)
def test_full_matrix(schedule, p, m, devices):
    """Every schedule on 2 stages with 2 microbatches (a timetable of warm-up and drain only) and
    on 4 stages with 16 (steady-state dominated), 8 layers, v = 2 interleaved. The runner executes
    whatever timetable it is given; tests/test_pipeline_schedule.py checks every timetable for
    p = 2, 4 and m = p, 2p, 4p, and the composed cases above run p = 2 and 4 with m = p and 2p."""
    base = ["model.n_layers=8", "mesh.data=1"]
    ref = loss_and_grads(base, devices[:1])  # computed once per process (tests/pipeline_util.py)
    extra = ["pipeline.virtual_stages=2"] if schedule == "interleaved_1f1b" else []
    got = loss_and_grads(base + [f"mesh.pipeline={p}", f"pipeline.schedule={schedule}",
                                 f"train.grad_accum={m}"] + extra, devices[:p])
    assert_matches(got, ref)
