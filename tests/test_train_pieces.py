"""Optimizer schedule and masks, mesh splits, remat memory: each against an analytic reference."""
import math

import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError, make_config
from jaxpar.mesh import _dcn_sizes, build_mesh
from jaxpar.train.optimizer import decay_mask, schedule
from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config


def test_warmup_cosine_schedule_matches_formula():
    cfg = make_config({}, ["optimizer.lr=1e-3", "optimizer.warmup_steps=10", "optimizer.min_lr_ratio=0.1"])
    sched = schedule(cfg.optimizer, total_steps=110)
    for s in (0, 5, 10, 35, 60, 110):
        if s < 10:
            want = 1e-3 * s / 10
        else:
            frac = (s - 10) / 100
            want = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * frac))
        assert float(sched(s)) == pytest.approx(want, rel=1e-5, abs=1e-9)


def test_no_weight_decay_on_norms_and_vectors():
    mask = decay_mask({"norm": ("norm",), "layers": {"attn_norm": ("layers", "norm"),
                                                       "wq": ("layers", "embed", "heads", "head_dim")},
                       "bias": ("mlp",), "embed": ("vocab", "embed")})
    assert mask == {"norm": False, "layers": {"attn_norm": False, "wq": True}, "bias": False, "embed": True}


def test_dcn_default_spans_hosts_with_data_axis():
    cfg = make_config({}, ["mesh.data=4", "mesh.tensor=2"]).mesh
    assert _dcn_sizes(cfg, {"data": 4, "fsdp": 1, "pipeline": 1, "tensor": 2, "expert": 1}, 2)["data"] == 2
    bad = make_config({}, ["mesh.data=4", "mesh.tensor=2", "mesh.dcn.tensor=2"]).mesh
    with pytest.raises(ConfigError, match="mesh.dcn .* multiplies to 2, but there are 1 hosts"):
        _dcn_sizes(bad, {"data": 4, "fsdp": 1, "pipeline": 1, "tensor": 2, "expert": 1}, 1)


def test_mesh_axis_order_and_types(devices):
    mesh = build_mesh(make_config({}, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]).mesh, devices)
    assert mesh.axis_names == ("data", "fsdp", "pipeline", "context", "tensor", "expert")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "pipeline": 1, "context": 1, "tensor": 2, "expert": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_remat_lowers_compiled_temp_bytes(devices):
    def temp(remat):
        t = Trainer(tiny_config("mesh.data=8", "model.n_layers=4", "train.seq_len=64", f"train.remat={remat}"),
                    devices=devices)
        return t.compile().memory_analysis().temp_size_in_bytes
    none, full = temp("none"), temp("full")
    assert full < 0.8 * none, (none, full)


def test_params_placed_by_plan(devices):
    t = Trainer(tiny_config("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=3"),
                devices=devices)
    state = t.init_state()
    wq = state["params"]["layers"]["wq"]  # (layers, embed, heads, head_dim)
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert wq.addressable_shards[0].data.shape == (2, 64, 2, 32)
    mu = state["opt_state"][1][0].mu["layers"]["w_up"]
    assert mu.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    # same seed -> same initial params on any layout
    ref = Trainer(tiny_config("mesh.data=1"), devices=devices[:1]).init_state()
    np.testing.assert_array_equal(np.asarray(wq), np.asarray(ref["params"]["layers"]["wq"]))


@pytest.mark.parametrize("warmup,decay", [(5, 3), (5, 5)])
def test_decay_steps_within_the_warmup_is_one_clear_error(warmup, decay):
    """decay_steps counts the warmup: at or below warmup_steps there is no cosine (the schedule
    silently stayed at the peak, then fell to min_lr in one step). One error naming both fields."""
    with pytest.raises(ConfigError, match=rf"optimizer.decay_steps={decay} .*warmup_steps={warmup}.*"
                                          rf"decay_steps > {warmup}"):
        make_config({}, [f"optimizer.warmup_steps={warmup}", f"optimizer.decay_steps={decay}"])
    cfg = make_config({}, ["optimizer.lr=1.0", f"optimizer.warmup_steps={warmup}",
                           f"optimizer.decay_steps={warmup + 4}", "optimizer.min_lr_ratio=0.1"])
    sched = schedule(cfg.optimizer, total_steps=100)  # decay_steps set: train.steps plays no part
    want = [0.1 + 0.45 * (1 + math.cos(math.pi * k / 4)) for k in range(5)] + [0.1] * 3
    assert [float(sched(s)) for s in range(warmup, warmup + 8)] == pytest.approx(want, rel=1e-6)
