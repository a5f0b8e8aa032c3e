"""The tests' shared init (tests/shared_init.py) against each layout's own init program: the same
state, leaf by leaf, in values (bit for bit), dtypes and shardings, for every family of state the
layouts build (ZeRO shards and float32 masters, tensor splits, pipeline stages in interleaved
order, expert groups, context, compression residuals and PowerSGD's Q, local SGD replicas and
outer momentum, 1-bit Adam, a float16 loss scale)."""
import jax
import numpy as np
import pytest

from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.shared_init import REAL_INIT, shared_init_state

LAYOUTS = [
    "mesh.data=8",
    "mesh.data=2 mesh.fsdp=2 mesh.tensor=2 sharding.zero_stage=1",
    "mesh.data=2 mesh.fsdp=4 sharding.zero_stage=3 train.param_dtype=bfloat16 train.compute_dtype=bfloat16",
    "mesh.data=4 mesh.pipeline=2 model.n_layers=4 pipeline.schedule=interleaved_1f1b "
    "pipeline.virtual_stages=2 train.grad_accum=2",
    "mesh.data=2 mesh.expert=4 model.moe.num_experts=4",
    "mesh.data=4 mesh.context=2",
    "mesh.data=4 mesh.tensor=2 gradient_compression.method=powersgd",
    "mesh.data=2 mesh.pipeline=2 mesh.fsdp=2 sharding.zero_stage=1 train.grad_accum=2 "
    "gradient_compression.method=onebit",
    "mesh.data=4 mesh.fsdp=2 local_sgd.sync_every=2 local_sgd.outer=nesterov",
    "mesh.data=8 optimizer.name=onebit_adam",
    "mesh.data=8 train.compute_dtype=float16",
]


@pytest.mark.real_init
@pytest.mark.parametrize("overrides", LAYOUTS)
def test_shared_init_is_the_layouts_own(overrides, devices):
    trainer = Trainer(tiny_config(*overrides.split()), devices=devices, log=lambda s: None)
    own, shared = REAL_INIT(trainer), shared_init_state(trainer)
    assert jax.tree.structure(shared) == jax.tree.structure(own)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(own), jax.tree.leaves(shared)):
        where = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (where, a.sharding, b.sharding)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=where)
    # what a test replaces is this process's Trainer.init_state, outside `real_init` tests
    assert Trainer.init_state is REAL_INIT
