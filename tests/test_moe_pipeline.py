"""Mixture of experts inside pipeline stages: the MoE carry (activations + router-loss sums)
crosses stages, the last stage adds the sown router losses; loss, metrics and gradients equal
one device's."""
import jax
import numpy as np
import pytest

from tests.pipeline_util import step_metrics

MOE = ["model.preset=moe_tiny", "model.n_layers=2",
       "train.global_batch=8", "train.seq_len=16", "train.grad_accum=2", "model.moe.capacity_factor=1.0"]


def step_once(overrides, devices):
    m = step_metrics(MOE + overrides, devices)
    return {k: float(v) for k, v in m.items() if k != "grads"}, m["grads"]


def test_moe_pipeline_matches_one_device(devices):
    ref_metrics, ref_grads = step_once(["mesh.data=1"], devices[:1])
    metrics, grads = step_once(["mesh.data=2", "mesh.pipeline=2", "mesh.expert=2",
                                "pipeline.schedule=1f1b"], devices)
    assert ref_metrics["moe/dropped_fraction"] > 0 and ref_metrics["aux_loss"] > 0
    for key, value in ref_metrics.items():
        if key != "lr":
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))
