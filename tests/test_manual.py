"""jaxpar/manual.py: a function run with every mesh axis manual from inside the step's partly
manual shard_map (what cuDNN attention needs on a GPU) equals the same function on one device,
forward and gradient; and jaxpar/platform.py: what is traced follows the devices it is built for.

The cuDNN call itself needs a GPU's compiler (scripts/gpu_aot.py compiles the 1B preset's steps
for 8 H200s without one, docs/benchmarks.md); here the same path runs XLA's attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxpar.attention import attention
from jaxpar.manual import axes_left, fully_manual
from jaxpar.parallel.data import native_bf16_collectives
from jaxpar.platform import building_for

SHAPE = (8, 64, 4, 16)  # batch, seq, heads, head_dim
HEADS = P(None, None, "tensor", None)


def _attention(q, k, v, mask):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def _inputs():
    q, k, v = (jax.random.normal(key, SHAPE, jnp.float32) for key in jax.random.split(jax.random.key(0), 3))
    seg = jnp.repeat(jnp.arange(2), SHAPE[1] // 2)
    mask = jnp.broadcast_to((seg[:, None] == seg[None, :])[None, None], (SHAPE[0], 1, SHAPE[1], SHAPE[1]))
    return q, k, v, mask


def test_fully_manual_in_a_partly_manual_shard_map_equals_one_device(devices):
    """Manual over `data` outside (as the step's batch axes), `tensor` (2) and `pipeline` (1)
    left to the compiler: f sees no axis left, and the output and the gradients of q, k, v equal
    the unsharded attention's (heads split over tensor; pipeline, of size 1, named nowhere)."""
    spec = HEADS
    mesh = jax.make_mesh((4, 1, 2), ("data", "pipeline", "tensor"), devices=devices,
                         axis_types=(AxisType.Auto,) * 3)
    seen = []

    def f(q, k, v, mask):
        seen.append(axes_left())
        return _attention(q, k, v, mask)

    def loss(q, k, v, mask, weights):
        def inner(q, k, v, mask, w):
            assert axes_left() == ("pipeline", "tensor")
            o = fully_manual(f, (q, k, v, mask), (spec, spec, spec, P()), spec, diff=3)
            return (o * w).sum()[None]
        part = jax.shard_map(inner, mesh=mesh, in_specs=(P("data"),) * 5, out_specs=P("data"),
                             axis_names={"data"})(q, k, v, mask, weights)
        return part.sum()

    q, k, v, mask = _inputs()
    weights = jax.random.normal(jax.random.key(1), SHAPE)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    args = (put(q, P("data", None, "tensor")), put(k, P("data", None, "tensor")),
            put(v, P("data", None, "tensor")), put(mask, P("data")), put(weights, P("data")))
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    ref_value, ref_grads = jax.value_and_grad(lambda q, k, v: (_attention(q, k, v, mask) * weights).sum(),
                                              argnums=(0, 1, 2))(q, k, v)
    assert seen and all(s == () for s in seen)  # f ran with every axis manual
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * float(jnp.abs(r).max()))


def test_an_axis_left_unsplit_is_an_error(devices):
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), devices=devices, axis_types=(AxisType.Auto,) * 2)
    q, k, v, mask = _inputs()
    inner = lambda q, k, v: fully_manual(_attention, (q, k, v, None), (P(),) * 4, P(), diff=3)
    with pytest.raises(ValueError, match=r"leaves the mesh axes \['tensor'\] unsplit"):
        jax.shard_map(inner, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"), axis_names={"data"})(q, k, v)


def test_fully_manual_outside_a_shard_map_is_the_function():
    q, k, v, mask = _inputs()
    assert axes_left() == ()
    out = fully_manual(_attention, (q, k, v, mask), (HEADS,) * 3 + (P(),), HEADS, diff=3)
    np.testing.assert_array_equal(out, _attention(q, k, v, mask))


def test_what_is_traced_follows_the_platform_built_for():
    """A deviceless compile for GPUs runs on a CPU host: inside building_for("gpu") attention
    `auto` is cuDNN's (here: its clear error for float32) and bf16 goes on the wire as bf16."""
    q, k, v, _ = _inputs()
    assert not native_bf16_collectives()  # this host: XLA:CPU widens bf16 collectives
    with building_for("gpu"):
        assert native_bf16_collectives()
        with pytest.raises(Exception, match="cuDNN flash attention runs in bfloat16 or float16"):
            attention(q, k, v, implementation="cudnn")
    np.testing.assert_array_equal(attention(q, k, v, implementation="auto", threshold=10**6),
                                  attention(q, k, v, implementation="xla"))
