"""Compressed reductions and 1-bit Adam beside a pipeline and context parallelism.

Under mesh.pipeline the embeddings, final norm and head are summed over the stages too, under
mesh.context every gradient over the sequence chunks: the reducer sums those axes in float32
(an outer group, like an in-host axis) and compresses over the batch axes. So a layout with
data=4 beside pipeline=2 or context=2 reduces exactly as data=4 alone on 4 devices does, which
is the reference here; a lossless method (topk keeping every value) is checked against one
device.
"""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.metrics import collective_ops
from tests.conftest import tiny_config
from tests.grad_util import canonical_grads, grad_trainer, run_steps, to_numpy
from tests.test_layout_grads import TOL, reference, relative_errors

pytestmark = pytest.mark.xdist_group("compression_layouts")

LOSSLESS = ["gradient_compression.method=topk", "gradient_compression.topk_fraction=1.0"]
LOSSLESS_LAYOUTS = {
    "data2-fsdp2-pipeline2-zero1-1f1b": ["mesh.data=2", "mesh.fsdp=2", "mesh.pipeline=2", "sharding.zero_stage=1",
                                         "train.grad_accum=2"],
    "data2-fsdp2-context2-zero1": ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "sharding.zero_stage=1"],
}


@pytest.mark.parametrize("name", list(LOSSLESS_LAYOUTS))
def test_lossless_compression_beside_pipeline_and_context_equals_one_device(name, devices):
    """The compressed path (buckets, ZeRO-1's scattered layout, the float32 outer sums over
    pipeline / context) with a method that drops nothing gives one device's gradients."""
    cfg = tiny_config(*LOSSLESS_LAYOUTS[name], *LOSSLESS)
    ref = reference(["mesh.data=1"], devices)
    got = run_steps(cfg, 2, devices)
    for step, (g, r) in enumerate(zip(got, ref), start=1):
        leaf_err, norm_err = relative_errors(g, r)
        assert leaf_err < TOL[step] and norm_err < TOL[step], (step, leaf_err, norm_err)


DATA4 = ["mesh.data=4", "train.grad_accum=2", "model.n_layers=4"]
BESIDE = {
    "context2": ["mesh.context=2"],
    "pipeline2-interleaved": ["mesh.pipeline=2", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],
}
_data4: dict = {}


def data4_reference(method: tuple, steps: int, devices) -> list[dict]:
    """`steps` steps of `method` on data=4 alone, 4 devices: the same compressed group."""
    if method not in _data4:
        _data4[method] = run_steps(tiny_config(*DATA4, *method), steps, devices[:4])
    return _data4[method]


@pytest.mark.parametrize("beside", list(BESIDE))
def test_powersgd_beside_pipeline_and_context_equals_data_parallel_alone(beside, devices):
    """PowerSGD over data=4 with pipeline=2 (interleaved: each stage's layers in the stored
    order) or context=2 beside it: the float32 sum over the outer axis, then the same low-rank
    factors, error feedback and warm-started Q as data=4 alone, over three steps (the residuals
    and Q of steps 1-2 feed steps 2-3). The first Q of a stack split over stages is its stage's
    slice of the whole stack's; the residual joins the outer sum in equal parts."""
    method = ("gradient_compression.method=powersgd",)
    ref = data4_reference(method, 3, devices)
    got = run_steps(tiny_config(*DATA4, *BESIDE[beside], *method), 3, devices)
    for step, (g, r) in enumerate(zip(got, ref), start=1):
        leaf_err, norm_err = relative_errors(g, r)
        tol = TOL[min(step, 2)]  # after an Adam step: float32 noise grown (test_layout_grads.TOL)
        assert leaf_err < tol and norm_err < tol, (step, leaf_err, norm_err)
    # and it is PowerSGD's rank-4 approximation, not the float32 gradient: each layer's matrix
    # (d_model x the rest, powersgd.matrix_split) of the reduced gradient has rank 4
    for name in ("w_gate", "wq"):
        g = got[0]["grads"]["layers"][name]
        ranks = [np.linalg.matrix_rank(m, tol=1e-5 * np.abs(m).max()) for m in g.reshape(*g.shape[:2], -1)]
        assert ranks == [4] * g.shape[0], (name, ranks)


def test_onebit_adam_beside_context_equals_data_parallel_alone(devices):
    """1-bit Adam's exact warm-up step and its first 1-bit momentum exchange over data=4, the
    momentum summed over context in float32 first, equal data=4 alone's: step 1 to float32
    rounding; step 2's reduced momentum element by element but in the blocks where that
    rounding flips the sign of a near-zero entry (one bit decides +-scale), which moves the
    block's scale in the second stage (2 blocks of 256 of 853k elements, 0.4% apart, here). A
    reduction that missed the context sum, or counted it twice, would differ everywhere."""
    method = ("optimizer.name=onebit_adam", "optimizer.onebit_warmup_steps=1")
    ref = data4_reference(method, 3, devices)  # shared with the pipeline test below
    got = run_steps(tiny_config(*DATA4, *BESIDE["context2"], *method), 2, devices)
    leaf_err, norm_err = relative_errors(got[0], ref[0])
    assert leaf_err < TOL[1] and norm_err < TOL[1], (leaf_err, norm_err)
    close = [np.abs(g - r) <= 1e-4 * np.abs(r).max()
             for g, r in zip(jax.tree.leaves(got[1]["grads"]), jax.tree.leaves(ref[1]["grads"]))]
    differ = sum(int((~c).sum()) for c in close)
    assert differ <= 1e-2 * sum(c.size for c in close), (differ, sum(c.size for c in close))
    np.testing.assert_allclose(got[1]["loss"], ref[1]["loss"], rtol=1e-5)


def test_onebit_adam_beside_a_pipeline_is_adam_then_trains_as_data_parallel_alone(devices):
    """1-bit Adam over data=4 with a 2-stage pipeline beside it: the warm-up step is data=4
    alone's exact Adam step; after it each stage compresses its own layers (its blocks are not
    data=4's, so the 1-bit momentum differs block by block) and the losses stay data=4 alone's
    to 1e-4."""
    method = ("optimizer.name=onebit_adam", "optimizer.onebit_warmup_steps=1")
    ref = data4_reference(method, 3, devices)
    got = run_steps(tiny_config(*DATA4, "mesh.pipeline=2", *method), 3, devices)
    leaf_err, norm_err = relative_errors(got[0], ref[0])
    assert leaf_err < TOL[1] and norm_err < TOL[1], (leaf_err, norm_err)
    np.testing.assert_allclose([g["loss"] for g in got], [r["loss"] for r in ref], rtol=1e-4)
    assert got[1]["grads"]["embed"].dtype == np.float32  # the reduced momentum, after the warm-up


_lossless_onebit: dict = {}


@pytest.mark.parametrize("zero", [1, 3])  # ZeRO-2 lays the momentum out as ZeRO-3 does
def test_onebit_adam_under_zero_exchanges_the_momentum_of_data_parallel(zero, devices, monkeypatch):
    """1-bit Adam at ZeRO 1/2/3 over data=2 x fsdp=4 against ZeRO-0 over data=8, with its 1-bit
    compressor swapped for a lossless one (topk keeping every value) so that the exchange's
    arithmetic is what is compared: the warm-up step and the first momentum exchange (the
    optimizer receives b1 m + (1 - b1) g, reduced) equal. At ZeRO-1 the momentum is sharded over
    fsdp while the gradient is whole: each device puts its shard's share in its place
    (OneBitAdamReducer._spread); at ZeRO-3 (and 2) it is laid out like the scattered gradient."""
    import jaxpar.collectives.onebit_adam as onebit_adam
    from jaxpar.collectives import TopK
    monkeypatch.setattr(onebit_adam, "OneBit", lambda block_size: TopK(block_size=block_size, fraction=1.0))
    method = ("optimizer.name=onebit_adam", "optimizer.onebit_warmup_steps=1")
    if not _lossless_onebit:
        _lossless_onebit["ref"] = run_steps(tiny_config("mesh.data=8", *method), 2, devices)
    got = run_steps(tiny_config("mesh.data=2", "mesh.fsdp=4", f"sharding.zero_stage={zero}", *method), 2, devices)
    for step, (g, r) in enumerate(zip(got, _lossless_onebit["ref"]), start=1):
        leaf_err, norm_err = relative_errors(g, r)
        assert leaf_err < 1e-5 and norm_err < 1e-5, (step, leaf_err, norm_err)


def test_int8_beside_a_pipeline_sends_int8_and_keeps_residuals_per_stage(devices):
    """data=4 x pipeline=2 (1F1B) with int8: the buckets are reduced after the timetable, int8
    over data, the stages' embeddings and head summed over pipeline in float32; the gradient is
    one device's within int8's rounding; the error-feedback residuals have one row per device
    of (data, pipeline), each stage's its own."""
    cfg = tiny_config("mesh.data=4", "mesh.pipeline=2", "train.grad_accum=2", "gradient_compression.method=int8")
    t, step = grad_trainer(cfg, devices)
    sync = t.spec.sync
    assert not sync.in_scan  # a pipeline's stages run their layers in per-tick branches
    assert sync.describe() == "data: int8 over data; data+pipeline: int8 over data (float32 over pipeline)"
    state = t.init_state()
    exe = step.lower(state, t.loader.batch(0)).compile()
    by = {}
    for op in collective_ops(exe.as_text(), count_loops=True):
        by[(op.kind, op.dtype)] = by.get((op.kind, op.dtype), 0) + op.bytes
    assert by.get(("all-to-all", "s8"), 0) > 0 and by.get(("all-gather", "s8"), 0) > 0, by
    ref = reference(["mesh.data=1"], devices)
    for k in range(2):
        state, metrics = exe(state, t.loader.batch(k))
        got = canonical_grads(t, to_numpy(metrics))
        leaf_err, norm_err = relative_errors(got, ref[k])
        assert 1e-6 < leaf_err < 3e-2 and norm_err < 3e-2, (k, leaf_err, norm_err)
    rows = P(("data", "fsdp", "expert", "pipeline"))
    for x in jax.tree.leaves(state["comm"]):
        assert x.shape[0] == 8 and x.sharding.spec == rows, (x.shape, x.sharding.spec)
    worker = np.asarray(state["comm"]["data"]["worker"])  # the stacked layers' bucket: per stage
    assert not np.array_equal(worker[0], worker[1])

