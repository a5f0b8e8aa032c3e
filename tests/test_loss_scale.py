"""Loss scaling for float16 compute (jaxpar/train/loss_scale.py, train.loss_scale): gradients
against the one-device float32 step, the dynamic scale's policy step by step, and the config's
errors."""
import re

import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError
from jaxpar.train.loss import cross_entropy_sum
from jaxpar.train.loss_scale import DYNAMIC_INIT
from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.grad_util import global_norm, grad_trainer, run_steps, to_numpy

LAYOUT = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=3"]
FP16 = ["train.compute_dtype=float16"]
SMALL = 1e-4  # the token loss times this: float16 gradients as small as a batch of ~5M tokens gives


def scaled_loss(factor: float):
    def loss_sum(logits, targets, weights=None):
        return cross_entropy_sum(logits, targets, weights) * factor
    return loss_sum


def first_grads(cfg, devices, factor: float) -> dict:
    trainer, _ = grad_trainer(cfg, devices)
    step = trainer.make_step(return_grads=True, loss_sum_fn=scaled_loss(factor))
    _, metrics = step(trainer.init_state(), trainer.loader.batch(0))
    return to_numpy(metrics)


def relative_error(got, ref) -> float:
    diff = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), got, ref)
    return global_norm(diff) / global_norm(ref)


@pytest.fixture(scope="module")
def reference(devices):
    """The one-device float32 step's first gradients of the small loss (no scaling)."""
    return first_grads(tiny_config(), devices[:1], SMALL)


PIPELINE = ["mesh.data=4", "mesh.pipeline=2", "pipeline.schedule=1f1b", "train.grad_accum=2"]


@pytest.mark.xdist_group("loss_scale")  # the one-device reference is computed once
@pytest.mark.parametrize("layout", [LAYOUT, PIPELINE], ids=["data2_fsdp2_tensor2_zero3", "pipeline2_1f1b"])
def test_float16_gradients_survive_with_the_dynamic_scale(devices, reference, layout):
    """Small gradients underflow in the float16 backward: without scaling most of the gradient is
    lost (relative error ~0.86 measured); with the default dynamic scale (2**15) the gradient is
    the float32 one within float16's rounding (7e-4 measured; bf16 compute: 5e-3), and the loss
    reported is the loss, not the scaled one. The pipeline's runner differentiates the same
    microbatch loss on its last stage."""
    scaled = first_grads(tiny_config(*FP16, *layout), devices, SMALL)
    assert scaled["loss_scale"] == DYNAMIC_INIT
    assert np.isclose(scaled["loss"], reference["loss"], rtol=1e-3)
    assert relative_error(scaled["grads"], reference["grads"]) < 3e-3
    assert np.isclose(scaled["grad_norm"], reference["grad_norm"], rtol=3e-3)
    if layout is PIPELINE:
        return
    plain = first_grads(tiny_config(*FP16, *LAYOUT, "train.loss_scale=none"), devices, SMALL)
    assert "loss_scale" not in plain
    assert relative_error(plain["grads"], reference["grads"]) > 0.5


@pytest.mark.xdist_group("loss_scale")
def test_a_static_scale_in_float32_changes_no_gradient(devices, reference):
    """Scaling by a power of two and dividing again is exact: a gradient off by the scale (or any
    factor) fails here."""
    got = first_grads(tiny_config(*LAYOUT, "train.loss_scale=1024"), devices, SMALL)
    assert "loss_scale" not in got  # static: nothing to report, no state
    assert relative_error(got["grads"], reference["grads"]) < 1e-5
    assert np.isclose(got["loss"], reference["loss"], rtol=1e-6)


def expected_scales(finite: list[bool], start: float, window: int) -> list[float]:
    """The scale of each step under the policy: halve after an overflow, double after `window`
    finite steps in a row (an independent restatement of LossScale.next_state)."""
    scales, scale, good = [], start, 0
    for ok in finite:
        scales.append(scale)
        if not ok:
            scale, good = max(scale / 2, 1.0), 0
            continue
        good += 1
        if good == window:
            scale, good = scale * 2, 0
    return scales


def test_the_dynamic_scale_halves_on_overflow_skips_the_update_and_grows_after_its_window(devices):
    """A loss 4096x larger overflows float16's backward at the first scales: those steps leave
    params and optimizer state as they were, halve the scale and are not non-finite steps for
    the watch (metrics["nonfinite"] 0); after loss_scale_window=2 finite steps it doubles."""
    cfg = tiny_config(*FP16, "mesh.data=8", "train.loss_scale_window=2", "train.steps=12")
    trainer, _ = grad_trainer(cfg, devices)
    step = trainer.make_step(loss_sum_fn=scaled_loss(4096.0))
    state = trainer.init_state()
    finite, scales, overflows = [], [], []
    for i in range(12):
        before = to_numpy({"params": state["params"], "opt": state["opt_state"]})
        state, m = step(state, trainer.loader.batch(i))
        m, after = to_numpy(m), to_numpy({"params": state["params"], "opt": state["opt_state"]})
        ok = bool(np.isfinite(m["grad_norm"]))
        finite.append(ok)
        scales.append(float(m["loss_scale"]))
        overflows.append(int(m["overflow_steps"]))
        assert np.isfinite(m["loss"]) and m["nonfinite"] == 0
        same = jax.tree.all(jax.tree.map(np.array_equal, before, after))
        assert same != ok, f"step {i}: finite={ok} but params {'kept' if same else 'changed'}"
    assert scales == expected_scales(finite, DYNAMIC_INIT, window=2), (scales, finite)
    assert overflows == list(np.cumsum([not ok for ok in finite]))  # logged: the count so far
    assert not finite[0] and any(finite) and max(scales[finite.index(True):]) > min(scales)  # halved, then grew
    assert float(state["loss_scale"]["scale"]) == expected_scales(finite + [True], DYNAMIC_INIT, 2)[-1]


def test_overflow_at_the_smallest_scale_is_a_nonfinite_step(devices):
    """At the floor (scale 1) an overflow can no longer be the scaler's: it counts for
    train.max_nonfinite like a non-finite loss."""
    cfg = tiny_config(*FP16, "mesh.data=8", "train.steps=20")
    trainer, _ = grad_trainer(cfg, devices)
    step = trainer.make_step(loss_sum_fn=scaled_loss(1e9))  # overflows at every scale
    state = trainer.init_state()
    flags = []
    for i in range(17):  # 2**15 halved 15 times is 1
        state, m = step(state, trainer.loader.batch(0))
        flags.append(int(m["nonfinite"]))
    assert flags == [0] * 15 + [1, 1]
    assert float(state["loss_scale"]["scale"]) == 1.0


def test_loss_scale_settings_are_checked():
    with pytest.raises(ConfigError, match=r"train.loss_scale=-2.*auto, dynamic, none or a positive number"):
        tiny_config("train.loss_scale=-2")
    with pytest.raises(ConfigError, match=r"train.loss_scale='bogus'"):
        tiny_config("train.loss_scale=bogus")


STATEFUL = {  # syncs that keep gradient-shaped state across steps
    "int8_error_feedback": ["gradient_compression.method=int8"],  # reduced in the layer scan's taps
    "onebit_adam": ["optimizer.name=onebit_adam", "optimizer.onebit_warmup_steps=1"],  # after it
    "local_sgd": ["local_sgd.sync_every=2"],  # per-replica gradients and params
}


@pytest.mark.parametrize("sync", list(STATEFUL))
def test_stateful_syncs_see_the_unscaled_gradient(devices, sync):
    """In float32 a power-of-two scale is exact: two steps with train.loss_scale=1024 (the second
    after 1-bit Adam's warm-up: compressed momentum) give the gradients and the sync's state of
    the unscaled run. Divided after the sync instead, the error-feedback residuals and 1-bit
    Adam's momentum would hold scaled values (and differ here by up to 1024x)."""
    over = ["mesh.data=8", *STATEFUL[sync]]
    runs = {}
    for scale in ("none", "1024"):
        trainer, step = grad_trainer(tiny_config(*over, f"train.loss_scale={scale}"), devices)
        state, metrics = trainer.init_state(), []
        for i in range(2):
            state, m = step(state, trainer.loader.batch(i))
            metrics.append(to_numpy(m))
        runs[scale] = metrics, to_numpy({k: state[k] for k in ("comm", "opt_state", "params") if k in state})
    (m_ref, s_ref), (m_got, s_got) = runs["none"], runs["1024"]
    for ref, got in zip(m_ref, m_got):
        assert relative_error(got["grads"], ref["grads"]) < 1e-6
        assert got["loss"] == ref["loss"]
    for a, b in zip(jax.tree.leaves(s_got), jax.tree.leaves(s_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_dynamic_scale_is_checkpointed(devices, tmp_path):
    """The scale is train state: a resumed run goes on with the scale it had, not the start."""
    over = [*FP16, "mesh.data=8", "train.loss_scale_window=1", "checkpoint.every=2", "train.steps=3"]
    trainer = Trainer(tiny_config(*over), devices=devices, log=lambda s: None)
    trainer.cfg.train.steps = 2  # the run stops after its step-2 checkpoint (one compiled step for both)
    trainer.fit(out_dir=tmp_path, progress=False)
    trainer.cfg.train.steps = 3  # the same command again: fit resumes from the checkpoint
    _, history = trainer.fit(out_dir=tmp_path, progress=False)
    # window 1: every finite step doubles it (2**15, 2**16 at steps 1, 2; 2**17 at step 3)
    assert [(h["step"], h["loss_scale"]) for h in history] == [(3, DYNAMIC_INIT * 4)]


def test_the_banner_says_how_the_loss_is_scaled(devices):
    banner = Trainer(tiny_config(*FP16, "mesh.data=8"), devices=devices, log=lambda s: None).banner()
    assert re.search(r"loss scale +: dynamic from 32768, x2 after 1000 finite steps, /2 on an overflow", banner)
    static = Trainer(tiny_config("mesh.data=8", "train.loss_scale=128"), devices=devices, log=lambda s: None)
    assert re.search(r"loss scale +: static 128\n", static.banner())
    assert "loss scale" not in Trainer(tiny_config("mesh.data=8"), devices=devices, log=lambda s: None).banner()
