"""The train step's shard_map checks replication (check_vma, issue 12): a missing gradient
reduction fails at trace time instead of handing the optimizer one device's gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.collectives.base import Group, unchecked
from jaxpar.collectives.reducer import GradientReducer
from jaxpar.parallel.data import AllReduce
from jaxpar.sharding import varying_axes
from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config

LAYOUTS = {
    "data8": ["mesh.data=8", "sharding.zero_stage=0"],
    "dp2-fsdp4-zero3": ["mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=3"],
    "dp4-pp2": ["mesh.data=4", "mesh.pipeline=2", "model.n_layers=4", "train.grad_accum=2"],
    "data8-int8": ["mesh.data=8", "sharding.zero_stage=0", "gradient_compression.method=int8"],
}


def trace(overrides, devices):
    """The step traced to a jaxpr on abstract inputs (the check runs while tracing; nothing is
    lowered or compiled)."""
    t = Trainer(tiny_config(*overrides), devices=devices, log=lambda s: None)
    batch = jax.ShapeDtypeStruct((t.cfg.train.global_batch, t.cfg.train.seq_len + 1), jnp.int32,
                                 sharding=t.spec.batch_sharding)
    return t.step_fn.trace(t.abstract_state_sharded(), batch)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_missing_reduction_fails_at_trace_time(name, devices, monkeypatch):
    trace(LAYOUTS[name], devices)  # the step as it is traces

    def local_only(self, grads, comm, extra=None):
        return grads, comm  # each device's own gradient

    for sync in (AllReduce, GradientReducer):
        monkeypatch.setattr(sync, "reduce", local_only)
    with pytest.raises(ValueError, match="out_specs which require replication"):
        trace(LAYOUTS[name], devices)


@pytest.mark.parametrize("name", ["data8", "dp2-fsdp4-zero3"])
def test_missing_layer_reduction_fails_at_trace_time(name, devices, monkeypatch):
    """The layer gradients reduced inside the backward scan (train/layer_grads.py) are checked
    too: a layer's unreduced gradient does not have its sink's (reduced) type. (That the step
    traces unpatched: test_missing_reduction_fails_at_trace_time.)"""
    monkeypatch.setattr(AllReduce, "finish_layer", lambda self, g, path, state: (g, state))
    with pytest.raises(ValueError, match="must produce an output with the same type"):
        trace(LAYOUTS[name], devices)


def primitives(jaxpr) -> list[str]:
    """Every primitive in a jaxpr and the jaxprs nested in its equations' params."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += primitives(sub)
    return out


def find(jaxpr, name):
    """The first equation named `name`, depth first."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns") and (hit := find(sub, name)):
                    return hit
    return None


def test_the_check_adds_no_reduction_of_its_own(devices):
    """Under check_vma JAX sums the gradient of a replicated input inside the backward (the
    transpose of the implicit pvary where it meets per-device activations). The step types its
    params as varying first, so at ZeRO-0 the microbatch loop holds no reduction at all and the
    gradient is summed once, after it (a naive flip of the flag summed it twice: 8x the gradient
    on data=8, which an Adam step all but hides)."""
    t = Trainer(tiny_config(*LAYOUTS["data8"], "train.grad_accum=2"), devices=devices, log=lambda s: None)
    batch = jax.ShapeDtypeStruct((t.cfg.train.global_batch, t.cfg.train.seq_len + 1), jnp.int32)
    jaxpr = jax.make_jaxpr(t.step_fn)(t.abstract_state(), batch).jaxpr
    loop = find(jaxpr, "scan")
    assert loop is not None
    assert not [p for p in primitives(loop.params["jaxpr"].jaxpr) if "psum" in p or "all_" in p]
    assert any("psum" in p for p in primitives(find(jaxpr, "shard_map").params["jaxpr"]))


def test_unchecked_confines_the_exemption_to_grouped_collectives(devices):
    """Collectives over axis_index_groups (gradient_compression.scope: dcn) cannot be checked: a
    grouped psum is not even implemented under the check. `unchecked` runs just that reduction
    unchecked and types its total as replicated, its state as per device (its nested shard_map
    goes manual over the spare size-1 axis `tensor` too)."""
    mesh = Mesh(np.asarray(devices).reshape(8, 1), ("data", "tensor"))
    in_host, across = Group(("data",), 4, ((0, 1, 2, 3), (4, 5, 6, 7))), Group(("data",), 2, tuple(
        (i, i + 4) for i in range(4)))

    def reduce(x, state):
        return across.psum(in_host.psum(x)), state + x

    def f(x, state):
        with pytest.raises(NotImplementedError):
            reduce(x, state)
        total, state = unchecked(reduce, x, state, replicated=("data",))
        assert varying_axes(total) == frozenset() and varying_axes(state) == {"data"}
        return total, state

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P("data")),
                                   axis_names={"data"}))
    total, state = fn(x, x)
    assert float(total[0]) == 28.0
    np.testing.assert_array_equal(state, 2 * np.arange(8.0))

