"""nn.project: the models' projections, whose weight gradient is formed in the weight's own dim
order so that XLA:CPU's library dots take it (issue 11's float32 cells). References: JAX's own
autodiff of the same jnp.einsum (the gradient it replaces), and a float64 numpy formula."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import nn
from jaxpar.metrics.hlo import naive_dots
from jaxpar.xla import jaxlib_version

# every spec the models use (models/llama.py, models/moe.py, nn.head): x's shape, w's shape
SPECS = {
    "bsd,dhk->bshk": ((2, 8, 16), (16, 4, 8)),
    "bshk,hkd->bsd": ((2, 8, 4, 8), (4, 8, 16)),
    "bsd,df->bsf": ((2, 8, 16), (16, 24)),
    "bsf,fd->bsd": ((2, 8, 24), (24, 16)),
    "etd,edf->etf": ((3, 8, 16), (3, 16, 24)),
    "etf,efd->etd": ((3, 8, 24), (3, 24, 16)),
    "bsd,dv->bsv": ((2, 8, 16), (16, 32)),
}


def _inputs(spec, seed=0):
    xs, ws = SPECS[spec]
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x, w = jax.random.normal(kx, xs), jax.random.normal(kw, ws)
    g = jax.random.normal(kg, jnp.einsum(spec, x, w).shape)  # a cotangent that is not all ones
    return x, w, g


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_project_equals_the_einsum_and_its_autodiff(spec):
    x, w, g = _inputs(spec)
    y, vjp = jax.vjp(lambda x, w: nn.project(spec, x, w), x, w)
    y_ref, vjp_ref = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)
    np.testing.assert_array_equal(y, y_ref)
    for got, want in zip(vjp(g), vjp_ref(g)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_project_weight_gradient_against_float64_numpy():
    spec = "bsd,df->bsf"
    x, w, g = _inputs(spec, seed=1)
    dx, dw = jax.vjp(lambda x, w: nn.project(spec, x, w), x, w)[1](g)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    np.testing.assert_allclose(dw, np.einsum("bsd,bsf->df", x64, g64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, np.einsum("bsf,df->bsd", g64, w64), rtol=1e-5, atol=1e-5)


def test_project_in_bf16_keeps_the_dtypes():
    spec = "bsd,df->bsf"
    x, w, g = (a.astype(jnp.bfloat16) for a in _inputs(spec))
    y, vjp = jax.vjp(lambda x, w: nn.project(spec, x, w), x, w)
    dx, dw = vjp(g)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    dx_ref, dw_ref = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)[1](g)
    # bf16 rounding of sums of 16 products of unit normals (|dw| up to ~10: a bf16 step is 0.06)
    np.testing.assert_allclose(np.float32(dw), np.float32(dw_ref), rtol=2e-2, atol=6e-2)


def test_replicated_weight_gets_the_sum_of_the_devices_gradients_in_a_shard_map():
    """Inside a shard_map (check_vma) a weight that does not vary over the batch axis gets the
    sum over its devices, as JAX's own transpose of the implicit broadcast gives it."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = "bsd,df->bsf"
    x = jax.device_put(jax.random.normal(jax.random.key(2), (8, 4, 16)), NamedSharding(mesh, P("data")))
    w = jax.device_put(jax.random.normal(jax.random.key(3), (16, 24)), NamedSharding(mesh, P()))

    def grads(f):
        def local(x, w):
            return jax.grad(lambda w: (f(spec, x, w) ** 2).sum())(w)
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(),
                                     check_vma=True))(x, w)

    got, want = grads(nn.project), grads(jnp.einsum)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    x1, w1 = jnp.asarray(np.asarray(x)), jnp.asarray(np.asarray(w))  # unsharded copies
    one_device = jax.grad(lambda w: (jnp.einsum(spec, x1, w) ** 2).sum())(w1)
    np.testing.assert_allclose(got, one_device, rtol=1e-5, atol=1e-4)


def _mlp_grad_hlo(einsum, dtype):
    """A two-layer MLP's weight gradients, compiled with XLA:CPU's default dots."""
    def loss(w1, w2, x):
        h = jnp.tanh(einsum("bsd,df->bsf", x, w1))
        return (einsum("bsf,fd->bsd", h, w2).astype(jnp.float32) ** 2).sum()
    args = (jnp.ones((256, 1024), dtype), jnp.ones((1024, 256), dtype), jnp.ones((1, 128, 256), dtype))
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile(
        compiler_options={"xla_cpu_use_onednn": False}).as_text()


@pytest.mark.parametrize("dtype,name", [(jnp.float32, "f32"), (jnp.bfloat16, "bf16")])
def test_weight_gradients_are_library_dots(dtype, name):
    """With nn.project no weight gradient is left to XLA's own dot loops; JAX's autodiff of the
    plain einsum leaves them there (the check can fail)."""
    assert naive_dots(_mlp_grad_hlo(nn.project, dtype), name) == 0
    if not (0, 11) <= jaxlib_version() < (0, 12, 1):
        pytest.skip("XLA:CPU's default dots leave no naive loop to catch outside jaxlib 0.11-0.12.0 "
                    "(0.10.2; 0.12.1 puts them in ynn fusions)")
    assert naive_dots(_mlp_grad_hlo(jnp.einsum, dtype), name) >= 1
