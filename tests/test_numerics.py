"""Trustworthy numerics (issue #12): the gradient the optimizer receives, compared with the same
computation on one device, unsharded (tests/grad_util.py); the optimizer updates by hand."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ConfigError, make_config
from jaxpar.train.optimizer import decay_mask, schedule, schedule_count
from jaxpar.train.loss import cross_entropy_sum
from tests.conftest import tiny_config
from tests.grad_util import global_norm, grad_trainer, place_batch, plain_grad, run_steps, to_numpy

LR = ["optimizer.warmup_steps=0", "optimizer.lr=1e-3"]  # a non-zero learning rate from step 1


def assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


# --------------------------------------------------------------------------- local SGD

LOCAL = ["mesh.data=4", "mesh.fsdp=2", "sharding.zero_stage=0"]  # 4 replicas of 2 devices
MODELS = {"dense": [], "moe": ["model.preset=moe_tiny", "model.n_layers=2"]}  # moe: sown aux losses


@pytest.mark.parametrize("model", list(MODELS))
def test_local_sgd_replica_grads_match_one_device(model, devices):
    """Each replica's first-step gradient is the one-device gradient of its share of the batch."""
    cfg = tiny_config(*LR, *MODELS[model], *LOCAL, "local_sgd.sync_every=4")
    trainer, step = grad_trainer(cfg, devices)
    tokens = trainer.loader.batch(0)
    _, m = step(trainer.init_state(), tokens)
    m, tokens = to_numpy(m), np.asarray(tokens)
    replicas, r = 4, 3
    rows = tokens.shape[0] // replicas  # the batch is split data-major: replica r holds rows r*4..
    ref_cfg = tiny_config(*LR, *MODELS[model], "mesh.data=1", f"train.global_batch={rows}")
    (ref,) = run_steps(ref_cfg, 1, devices[:1], batches=[tokens[r * rows:(r + 1) * rows]])
    replica = lambda i: jax.tree.map(lambda g: g[i], m["grads"])
    assert_trees_close(replica(r), ref["grads"], rtol=1e-4, atol=1e-6)
    # the logged norm: root mean square of the replicas' norms (each replica clips its own)
    norms = [global_norm(replica(i)) for i in range(replicas)]
    np.testing.assert_allclose(norms[r], ref["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(m["grad_norm"], np.sqrt(np.mean(np.square(norms))), rtol=1e-5)


def test_local_sgd_sync_every_1_is_data_parallel(devices):
    off = run_steps(tiny_config(*LR, *LOCAL), 2, devices)
    one = run_steps(tiny_config(*LR, *LOCAL, "local_sgd.sync_every=1"), 2, devices)
    for a, b in zip(off, one):
        assert_trees_close(b["grads"], a["grads"], rtol=0, atol=0)
        assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"]


# --------------------------------------------------------------------------- 1-bit Adam

def test_onebit_warmup_zero_is_refused():
    with pytest.raises(ConfigError, match=r"optimizer.onebit_warmup_steps = 0: .*onebit_warmup_steps >= 1"):
        make_config({}, ["optimizer.name=onebit_adam", "optimizer.onebit_warmup_steps=0"])


def test_onebit_adam_one_device_is_frozen_variance_momentum(devices):
    """One device: nothing to reduce, yet after the warm-up the optimizer gets the momentum
    b1 m + (1 - b1) g and steps with the frozen variance and clipping factor (numpy reference;
    g: jax.grad of the mean token loss at the same params, tests/grad_util.plain_grad)."""
    cfg = tiny_config(*LR, "mesh.data=1", "train.steps=4", "optimizer.clip_norm=0.5",
                      "optimizer.name=onebit_adam", "optimizer.onebit_warmup_steps=1")
    o = cfg.optimizer
    trainer, step = grad_trainer(cfg, devices[:1])
    grad = plain_grad(trainer.model)
    lr = schedule(o, cfg.train.steps)
    mask = decay_mask(trainer.model.axes)
    state = trainer.init_state()
    state, _ = step(state, trainer.loader.batch(0))  # the exact-Adam warm-up step
    for i in (1, 2):  # two steps with frozen variance
        before = to_numpy(state)
        p, (mu, nu, clip) = before["params"], (before["opt_state"].mu, before["opt_state"].nu,
                                              before["opt_state"].clip)
        g = to_numpy(grad(before["params"], np.asarray(trainer.loader.batch(i))))
        state, m = step(state, trainer.loader.batch(i))
        after = to_numpy(state)
        momentum = jax.tree.map(lambda m_, g_: o.b1 * m_ + (1 - o.b1) * g_, mu, g)
        assert_trees_close(to_numpy(m["grads"]), momentum, rtol=1e-5, atol=1e-8)
        new_mu = jax.tree.map(lambda m_, g_: o.b1 * m_ + (1 - o.b1) * clip * g_, mu, g)
        t = i + 1
        bc1, bc2 = 1 - o.b1 ** t, 1 - o.b2 ** 1  # the variance froze after 1 step
        step_lr = float(lr(i))
        new_p = jax.tree.map(
            lambda p_, m_, v_, d: p_ - step_lr * (m_ / bc1 / (np.sqrt(v_ / bc2) + o.eps) + (o.weight_decay * p_ if d else 0)),
            p, new_mu, nu, mask)
        assert_trees_close(after["opt_state"].mu, new_mu, rtol=1e-4, atol=1e-8)
        assert_trees_close(after["opt_state"].nu, nu, rtol=0, atol=0)
        assert_trees_close(after["params"], new_p, rtol=1e-5, atol=1e-6)
        assert float(after["opt_state"].clip) == float(clip) < 1  # the clipping factor froze (and clips)


# --------------------------------------------------------------------------- skipped steps

def nan_on_negative_target(logits, targets):
    """Cross entropy, NaN for a batch holding a negative target (the injected bad step)."""
    return cross_entropy_sum(logits, targets) * jnp.where(targets.min() < 0, jnp.nan, 1.0)


def test_skipped_step_logs_the_applied_lr(devices):
    """After a skipped non-finite step the optimizer's count lags the step; the logged lr is the
    schedule at that count (the lr applied), not at the step."""
    cfg = tiny_config("optimizer.warmup_steps=4", "optimizer.lr=1e-3", "mesh.data=1", "train.steps=8",
                      "train.skip_nonfinite=true")
    trainer, _ = grad_trainer(cfg, devices[:1])
    step = trainer.make_step(loss_sum_fn=nan_on_negative_target)
    lr = schedule(cfg.optimizer, cfg.train.steps)
    state, applied = trainer.init_state(), 0
    for i in range(4):
        tokens = np.array(trainer.loader.batch(i))
        if i == 1:
            tokens[0, 1] = -1
        state, m = step(state, place_batch(trainer, tokens))
        assert int(m["nonfinite"]) == (i == 1)
        np.testing.assert_allclose(float(m["lr"]), float(lr(applied)), rtol=1e-6)
        if i > 1:
            assert float(m["lr"]) != pytest.approx(float(lr(i)))  # the step's own lr differs
        applied += i != 1
        assert int(schedule_count(state["opt_state"])) == applied
