"""Local SGD, and 1-bit Adam's layout check (its training tests share test_compression's runs)."""
import functools

import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError
from jaxpar.metrics import collective_ops
from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config

pytestmark = pytest.mark.xdist_group("compression_optim")  # its module fixtures are built once, on one worker

DP = ["mesh.data=8", "sharding.zero_stage=0", "train.steps=5", "optimizer.lr=3e-3"]


def train(overrides, devices, steps=None):
    t = Trainer(tiny_config(*DP, *overrides), devices=devices, log=lambda s: None)
    t.compile()
    state, hist = t.fit(progress=False)
    return t, state, [h["loss"] for h in hist]


def test_onebit_adam_under_zero1_ends_at_the_momentum_shard(devices):
    """ZeRO-1 over fsdp=8: the momentum exchange's buckets end at each device's fsdp shard (the
    optimizer's), as the compressed gradient reductions do (the arithmetic against ZeRO-0:
    tests/test_compression_layouts.py); a ZeRO stage over fsdp=1 shards nothing."""
    t = Trainer(tiny_config("mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=1", "optimizer.name=onebit_adam"),
                devices=devices, log=lambda s: None)
    assert t.spec.sync.describe() == "fsdp: onebit over fsdp; fsdp_scattered: onebit over fsdp"
    t = Trainer(tiny_config("mesh.data=8", "sharding.zero_stage=3", "optimizer.name=onebit_adam"), devices=devices,
                log=lambda s: None)
    assert t.spec.sync.describe() == "data: onebit over data"


# --------------------------------------------------------------------------- local SGD

@pytest.fixture(scope="module")
def local_sgd(devices):
    return train(["local_sgd.sync_every=2", "train.steps=3"], devices)


@pytest.fixture(scope="module")
def local_sgd_synced(local_sgd):
    """The local SGD run's state after step 2 (a sync), refit from its start with the same
    compiled step: read by the two tests below."""
    t, _, _ = local_sgd
    steps = t.cfg.train.steps
    t.cfg.train.steps = 2
    synced, _ = t.fit(progress=False)
    t.cfg.train.steps = steps
    return synced


def replica_spread(state):
    return max(float(np.abs(np.asarray(x) - np.asarray(x)[:1]).max()) for x in jax.tree.leaves(state["local"]["params"]))


def test_local_sgd_replicas_step_alone_then_average(local_sgd, local_sgd_synced):
    t, state, losses = local_sgd
    assert losses[-1] < losses[0] - 0.05, losses
    leaf = jax.tree.leaves(state["local"]["params"])[0]
    assert leaf.shape[0] == 8 and leaf.sharding.spec[0] == "data"
    assert replica_spread(state) > 0  # step 3: one step since the last sync, replicas differ
    synced = local_sgd_synced
    assert replica_spread(synced) == 0  # step 2 synced: every replica restarts from the average
    for p, r in zip(jax.tree.leaves(synced["params"]), jax.tree.leaves(synced["local"]["params"])):
        np.testing.assert_array_equal(np.asarray(r)[0], np.asarray(p))


def test_local_sgd_sync_averages_independent_replica_runs(local_sgd, local_sgd_synced, devices):
    """Reference: each of the 8 replicas trained alone on one device on its rows of the batch
    (split data-major) for the 2 steps before the first sync; the synced params are their mean."""
    t, _, _ = local_sgd
    synced = local_sgd_synced
    batches = [np.asarray(t.loader.batch(i)) for i in range(2)]
    rows = batches[0].shape[0] // 8
    alone = Trainer(tiny_config(*DP, "train.steps=3", "mesh.data=1", f"train.global_batch={rows}"),
                    devices=devices[:1], log=lambda s: None)
    finals = []
    for r in range(8):
        state = alone.init_state()
        for b in batches:
            state, _ = alone.step_fn(state, jax.device_put(b[r * rows:(r + 1) * rows], alone.spec.batch_sharding))
        finals.append(jax.tree.map(np.asarray, jax.device_get(state["params"])))
    mean = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *finals)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(synced["params"])),
                            jax.tree.leaves(mean)):
        # atol: two Adam steps of lr 3e-3 turn float32 noise in near-zero gradients into ~1e-6
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_local_sgd_moves_no_gradients(local_sgd):
    """The only large collective is the parameter all-reduce of the sync (in a conditional)."""
    t, _, _ = local_sgd
    big = [o for o in collective_ops(t.compiled.as_text(), count_loops=True) if o.bytes > 1024]
    assert sum(o.bytes for o in big) <= 4 * t.model.n_params * 1.01, big
    assert {o.kind for o in big} == {"all-reduce"}


def test_local_sgd_config_errors(devices):
    with pytest.raises(ConfigError, match="local_sgd syncs parameters, not gradients"):
        Trainer(tiny_config(*DP, "local_sgd.sync_every=2", "gradient_compression.method=int8"), devices=devices)
    with pytest.raises(ConfigError, match="mesh.data > 1"):
        Trainer(tiny_config("mesh.data=1", "mesh.fsdp=8", "local_sgd.sync_every=2"), devices=devices)



# train.steps=4: the 4 steps run are the schedule's (the lr of each step is that of a 4-step run)
LOCAL4 = ["local_sgd.sync_every=2", "mesh.data=4", "train.grad_accum=2", "model.n_layers=4", "train.steps=4"]
INTERLEAVED = ["mesh.pipeline=2", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"]
_local4: list = []


def local4_reference(devices) -> list[tuple[dict, dict]]:
    """4 steps of local SGD over data=4 alone, 4 devices, computed once: (numpy metrics with the
    grads, numpy state after the step) per step."""
    from tests.grad_util import run_steps
    if not _local4:
        _local4.extend(run_steps(tiny_config(*LOCAL4), 4, devices[:4], states=True))
    return _local4


@functools.cache
def _local4_beside(beside: tuple, devices: tuple) -> tuple:
    """(trainer, step, numpy metrics of 4 steps, the numpy state after step 2, the device state
    after step 4) of LOCAL4 with `beside`, under the step with return_grads (tests/grad_util.
    grad_trainer): one compile per layout, shared by the replica test and (interleaved) the
    checkpoint test."""
    from tests.grad_util import canonical_grads, grad_trainer, to_numpy
    t, step = grad_trainer(tiny_config(*LOCAL4, *beside), list(devices))
    state, metrics, at2 = t.init_state(), [], None
    for i in range(4):
        state, m = step(state, t.loader.batch(i))
        metrics.append(canonical_grads(t, to_numpy(m)))
        if i == 1:
            at2 = to_numpy(state)  # on the host: the next step donates the device state
    return t, step, metrics, at2, state


@pytest.mark.parametrize("beside", [["mesh.context=2"], INTERLEAVED])
def test_local_sgd_replicas_sum_context_and_pipeline_within(beside, devices):
    """Local SGD over data=4 with context=2 (each replica's sequences split over two devices) or
    a 2-stage interleaved pipeline beside it equals data=4 alone on 4 devices: the replicas'
    step-1 gradients (each replica's sum over its context devices / stages) and the losses of 4
    steps, two syncs among them."""
    from tests.test_layout_grads import relative_errors
    ref = [metrics for metrics, _ in local4_reference(devices)]
    got = _local4_beside(tuple(beside), tuple(devices))[2]
    leaf_err, norm_err = relative_errors(got[0], ref[0])
    assert leaf_err < 1e-5 and norm_err < 1e-5, (leaf_err, norm_err)
    assert got[0]["grads"]["embed"].shape[0] == 4  # one gradient per replica
    np.testing.assert_allclose([g["loss"] for g in got], [r["loss"] for r in ref], rtol=1e-5)


def test_local_sgd_beside_expert_parallelism_equals_data_parallel_replicas(devices):
    """Dropless MoE, local SGD over data=4 with the experts split over expert=2 inside each
    replica: the replicas' step-1 gradients and 3 losses (a sync among them) are data=4 alone's."""
    from tests.grad_util import run_steps
    from tests.test_layout_grads import relative_errors
    base = ["local_sgd.sync_every=2", "mesh.data=4", "model.preset=moe_tiny", "model.n_layers=2",
            "model.moe.dispatch=dropless"]
    ref = run_steps(tiny_config(*base), 3, devices[:4])
    got = run_steps(tiny_config(*base, "mesh.expert=2"), 3, devices)
    leaf_err, norm_err = relative_errors(got[0], ref[0])
    assert leaf_err < 1e-5 and norm_err < 1e-5, (leaf_err, norm_err)
    np.testing.assert_allclose([g["loss"] for g in got], [r["loss"] for r in ref], rtol=1e-5)


def test_local_sgd_sums_within_a_replica_in_grad_reduce_dtype(devices):
    """train.grad_reduce_dtype applies to local SGD's within-replica sums (here over fsdp=2, bf16
    compute): bf16 hands the optimizer bf16 sums, within bf16's rounding of the float32 ones."""
    from tests.grad_util import run_steps
    from tests.test_layout_grads import relative_errors
    base = ["local_sgd.sync_every=2", "mesh.data=4", "mesh.fsdp=2", "sharding.zero_stage=1",
            "train.compute_dtype=bfloat16"]
    f32 = run_steps(tiny_config(*base), 1, devices)[0]
    bf16 = run_steps(tiny_config(*base, "train.grad_reduce_dtype=bfloat16"), 1, devices)[0]
    assert {g.dtype for g in jax.tree.leaves(f32["grads"])} == {np.dtype(np.float32)}
    assert {str(g.dtype) for g in jax.tree.leaves(bf16["grads"])} == {"bfloat16"}
    leaf_err, norm_err = relative_errors(bf16, f32)
    assert 1e-4 < leaf_err < 1e-2 and norm_err < 1e-3, (leaf_err, norm_err)


def test_local_sgd_beside_an_interleaved_pipeline_checkpoints_canonical_layers(tmp_path, devices):
    """The replicas' params and optimizer states (a replica dim before the layers dim) are saved
    in the model's layer order like the params: restored at step 2 and run on, the state equals
    the straight run's bit for bit; the checkpoint's params and replica params are data=4
    alone's (the model's layer order, whatever the layout). The run is the replica test's
    (interleaved: the same layout and step, compiled once); its step-2 state is saved as fit
    saves it (Trainer.save: canonical order, then the Checkpointer)."""
    from tests.grad_util import to_numpy
    from jaxpar.checkpoint import Checkpointer
    t, step, _, at2, final = _local4_beside(tuple(INTERLEAVED), tuple(devices))
    final = to_numpy(final)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", async_save=False, log=lambda s: None)
    t.save(ckpt, 2, jax.device_put(at2, t.spec.state_shardings))  # as fit saves its step-2 state
    ckpt.wait()
    ckpt.close()
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", async_save=False, read_only=True, log=lambda s: None)
    state, _, got_step = t.restore_step(ckpt, 2)
    ckpt.close()
    assert got_step == 2
    canonical = to_numpy(t.in_order(state, "canonical"))
    for s in (2, 3):
        state, _ = step(state, t.loader.batch(s))
    for a, b in zip(jax.tree.leaves(to_numpy(state)), jax.tree.leaves(final)):
        np.testing.assert_array_equal(a, b)
    ref = local4_reference(devices)[1][1]  # data=4 alone's state after step 2
    # two AdamW steps from gradients equal to float rounding (whose noise in near-zero entries
    # Adam scales up to a fraction of lr = 3e-3); a layer out of order would be ~0.02 off
    for key in ("params", "local"):
        for a, b in zip(jax.tree.leaves(canonical[key]), jax.tree.leaves(ref[key])):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * np.abs(b).max())
