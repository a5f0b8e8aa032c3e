"""Trustworthy numerics (issue #12): the gradient the optimizer receives, compared with the same
computation on one device, unsharded (tests/grad_util.py); the optimizer updates by hand."""
import jax
import numpy as np
import pytest

from tests.conftest import tiny_config
from tests.grad_util import global_norm, grad_trainer, run_steps

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
    trainer, _ = grad_trainer(cfg, devices)
    tokens = np.asarray(trainer.loader.batch(0))
    (m,) = run_steps(cfg, 1, devices)
    grads = m["grads"]
    replicas, rows = 4, tokens.shape[0] // 4  # the batch is split data-major: replica r, rows r*4..
    norms = []
    for r in (0, 3):
        ref_cfg = tiny_config(*LR, *MODELS[model], "mesh.data=1", f"train.global_batch={rows}")
        (ref,) = run_steps(ref_cfg, 1, devices[:1], batches=[tokens[r * rows:(r + 1) * rows]])
        assert_trees_close(jax.tree.map(lambda g: g[r], grads), ref["grads"], rtol=1e-4, atol=1e-6)
        norms.append(ref["grad_norm"])
    # the logged norm: root mean square of the replicas' norms (each replica clips its own)
    per_replica = [global_norm(jax.tree.map(lambda g: g[r], grads)) for r in range(replicas)]
    np.testing.assert_allclose(per_replica[0], norms[0], rtol=1e-5)
    np.testing.assert_allclose(m["grad_norm"], np.sqrt(np.mean(np.square(per_replica))), rtol=1e-5)


def test_local_sgd_sync_every_1_is_data_parallel(devices):
    off = run_steps(tiny_config(*LR, *LOCAL), 2, devices)
    one = run_steps(tiny_config(*LR, *LOCAL, "local_sgd.sync_every=1"), 2, devices)
    for a, b in zip(off, one):
        assert_trees_close(b["grads"], a["grads"], rtol=0, atol=0)
        assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"]
