"""train.loss_chunk: the loss formed a chunk of tokens at a time equals the whole-logits loss
(value and gradients, against one unsharded device), and the step's temporaries shrink by the
float32 logits it no longer holds."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ConfigError
from jaxpar.train.loss import DeferredLogits, cross_entropy_sum, token_loss_sum
from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.grad_util import first_step_grads


def _rel_err(grads, ref) -> float:
    return max(jax.tree.leaves(jax.tree.map(
        lambda a, b: float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12)), grads, ref)))


def test_chunked_sum_and_its_gradients_equal_the_whole_logits_in_float64():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 12, 8)).astype(np.float32)
    w = rng.normal(size=(8, 40)).astype(np.float32)
    t = rng.integers(0, 40, size=(2, 12))

    def ref(x, w):  # numpy float64 softmax cross entropy
        z = np.einsum("bsd,dv->bsv", x.astype(np.float64), w.astype(np.float64))
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return -np.take_along_axis(logp, t[..., None], -1).sum()

    chunked = lambda x, w: token_loss_sum(cross_entropy_sum, DeferredLogits(x, w, 4), jnp.asarray(t))
    whole = lambda x, w: cross_entropy_sum(jnp.einsum("bsd,dv->bsv", x, w), jnp.asarray(t))
    np.testing.assert_allclose(float(chunked(x, w)), ref(x, w), rtol=1e-6)
    gc = jax.grad(chunked, argnums=(0, 1))(x, w)
    gw = jax.grad(whole, argnums=(0, 1))(x, w)
    for a, b in zip(gc, gw):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def unchunked_one_device(devices):
    """(grads, norm) of the first step of the unchunked one-device run."""
    return first_step_grads(tiny_config("mesh.data=1"), devices[:1])


@pytest.mark.xdist_group("chunked_loss")  # the one-device reference is computed once
@pytest.mark.parametrize("layout", [["mesh.data=1"], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                                       "sharding.zero_stage=3"],
                                    ["mesh.data=4", "mesh.pipeline=2", "train.grad_accum=2"]])
def test_step_gradients_equal_the_unchunked_one_device_step(layout, devices, unchunked_one_device):
    ref, ref_norm = unchunked_one_device
    n = int(np.prod([int(o.split("=")[1]) for o in layout if o.startswith("mesh.")]))
    grads, norm = first_step_grads(tiny_config(*layout, "train.loss_chunk=8"), devices[:n])
    assert _rel_err(grads, ref) < 1e-5
    assert abs(norm - ref_norm) < 1e-5 * ref_norm


def _temp_bytes(*overrides) -> int:
    t = Trainer(tiny_config("mesh.data=8", "model.vocab_size=8192", "train.seq_len=256", *overrides),
                log=lambda s: None)
    return t.compile().memory_analysis().temp_size_in_bytes


def test_the_step_no_longer_holds_the_float32_logits():
    logits = 2 * 256 * 8192 * 4  # one device's float32 [2, 256, 8192]
    whole, chunked = _temp_bytes(), _temp_bytes("train.loss_chunk=32")
    assert chunked < whole - logits, (whole, chunked)


def test_a_chunk_that_does_not_divide_the_sequence_is_refused():
    with pytest.raises(ConfigError, match=r"train.loss_chunk=5 must divide train.seq_len=32; use a divisor"):
        tiny_config("train.loss_chunk=5")
