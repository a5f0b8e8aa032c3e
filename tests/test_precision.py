"""Mixed precision (jaxpar/train/precision.py): bf16 params over float32 master weights and
float32 moments, float32 gradient accumulation, and the wire dtype of the gradient reduction."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar.parallel.data as data_parallel
from jaxpar.checkpoint import Checkpointer, read_meta
from jaxpar.config import ConfigError
from jaxpar.train.precision import MasterState, check_precision
from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.grad_util import grad_trainer, run_steps, to_numpy

BF16 = ["train.param_dtype=bfloat16"]
LR, B1, B2, EPS, WD, CLIP = 1e-7, 0.9, 0.95, 1e-8, 0.1, 1.0
TINY_LR = [f"optimizer.lr={LR}", "optimizer.warmup_steps=0"]


def _adam_states(opt_state):
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]


def _reference_adamw(master, grads, decay):
    """One AdamW step from zero moments (clip by global norm first), in float64 numpy."""
    g = jax.tree.map(lambda x: np.asarray(x, np.float64), grads)
    norm = np.sqrt(sum(np.sum(x * x) for x in jax.tree.leaves(g)))
    g = jax.tree.map(lambda x: x * min(1.0, CLIP / norm), g)

    def step(m, gg, d):
        mu, nu = (1 - B1) * gg, (1 - B2) * gg * gg
        u = (mu / (1 - B1)) / (np.sqrt(nu / (1 - B2)) + EPS) + (WD * m if d else 0.0)
        return m - LR * u
    return jax.tree.map(step, jax.tree.map(lambda x: np.asarray(x, np.float64), master), g, decay)


def test_masters_take_updates_below_bf16_resolution(devices):
    """lr 1e-7 moves every weight less than bf16 can see (spacing ~1e-4 near 0.02): the float32
    masters take the AdamW step exactly as a float64 reference does; the bf16 params are the
    masters cast (and mostly unchanged); mu and nu are float32. ZeRO-3: all of it fsdp-sharded."""
    cfg = tiny_config(*BF16, *TINY_LR, "mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=3")
    trainer, step = grad_trainer(cfg, devices)
    state = trainer.init_state()
    assert isinstance(state["opt_state"], MasterState)
    for mom in _adam_states(state["opt_state"]):
        assert {x.dtype for x in jax.tree.leaves((mom.mu, mom.nu))} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.bfloat16)}
    m0, p0 = to_numpy(state["opt_state"].master), to_numpy(state["params"])
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(m0))
    state, metrics = step(state, trainer.loader.batch(0))
    grads, m1, p1 = metrics["grads"], to_numpy(state["opt_state"].master), to_numpy(state["params"])
    from jaxpar.train.optimizer import decay_mask
    ref = _reference_adamw(m0, jax.device_get(grads), decay_mask(trainer.model.axes))
    for path, a, b, r, g in zip(trainer.model.leaves_with_paths(m1), jax.tree.leaves(m0), jax.tree.leaves(m1),
                                jax.tree.leaves(ref), jax.tree.leaves(jax.device_get(grads))):
        # the float32 add's rounding, and the float32 update's own (it matters near zero)
        tol = np.spacing(np.maximum(np.abs(a), np.abs(b))) + 4 * np.spacing(np.float32(LR))
        bad = np.abs(b - r) > tol
        assert not bad.any(), (path, a[bad][:3], b[bad][:3], r[bad][:3])
        moved = np.abs(np.asarray(g)) > 1e-6
        assert np.all(b[moved] != a[moved]), path  # every weight with a gradient moved
    for a, b, q in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), jax.tree.leaves(m1)):
        np.testing.assert_array_equal(np.asarray(b), q.astype(jnp.bfloat16))  # params = bf16(masters)
    same = sum(np.sum(np.asarray(a) == np.asarray(b)) for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)))
    assert same >= 0.99 * trainer.model.n_params  # bf16 alone would have lost the step


def test_onebit_adam_steps_float32_masters_as_it_steps_float32_params(devices):
    """1-bit Adam on float32 masters under bf16 params (its exact warm-up step, then two 1-bit
    momentum exchanges) against 1-bit Adam on float32 params with bf16 compute: the forward
    sees the same bf16 weights, so the gradients, the reduced momentum and the masters equal
    the float32 run's gradients, momentum and params bit for bit; the params are bf16(masters)."""
    base = ["optimizer.name=onebit_adam", "optimizer.onebit_warmup_steps=1", "mesh.data=8", "train.compute_dtype=bfloat16"]
    runs = [run_steps(tiny_config(*base, *extra), 3, devices, states=True) for extra in (BF16, [])]
    for (m_masters, s_masters), (m_f32, s_f32) in zip(*runs):
        assert isinstance(s_masters["opt_state"], MasterState)
        for a, b in zip(jax.tree.leaves(m_masters["grads"]), jax.tree.leaves(m_f32["grads"])):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(s_masters["opt_state"].master), jax.tree.leaves(s_f32["params"])):
            np.testing.assert_array_equal(a, b)
        for p, q in zip(jax.tree.leaves(s_masters["params"]), jax.tree.leaves(s_masters["opt_state"].master)):
            assert p.dtype == jnp.bfloat16
            np.testing.assert_array_equal(p, q.astype(jnp.bfloat16))
    assert int(runs[0][2][1]["opt_state"].inner.count) == 3  # two of the steps after the warm-up


def test_local_sgd_averages_float32_masters_as_it_averages_float32_params(devices):
    """Local SGD (DiLoCo's nesterov outer step, sync every 2 steps, 4 steps) on float32 masters
    under bf16 params against local SGD on float32 params with bf16 compute: each replica's
    masters equal the float32 run's replica params bit for bit, through the syncs (the masters
    averaged, the replicas restarted from the outer step's result), the outer params are the
    float32 run's cast to bf16, and the outer step's own float32 weights (local["outer_master"])
    are the float32 run's outer params. (outer: average takes the same averaged masters.)"""
    base = ["local_sgd.sync_every=2", "local_sgd.outer=nesterov", "mesh.data=8", "train.compute_dtype=bfloat16"]
    runs = [[state for _, state in run_steps(tiny_config(*base, *extra), 4, devices, states=True)]
            for extra in (BF16, [])]
    for masters, f32 in zip(*runs):
        for a, b in zip(jax.tree.leaves(masters["opt_state"].master), jax.tree.leaves(f32["local"]["params"])):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(masters["params"]), jax.tree.leaves(f32["params"])):
            assert a.dtype == jnp.bfloat16
            np.testing.assert_array_equal(a, b.astype(jnp.bfloat16))
        for a, b in zip(jax.tree.leaves(masters["local"]["outer_master"]), jax.tree.leaves(f32["params"])):
            np.testing.assert_array_equal(a, b)
    moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(runs[1][3]["params"]),
                                                   jax.tree.leaves(runs[1][1]["params"]))]
    assert max(moved) > 0  # the second sync moved the outer params


def test_checkpoint_holds_float32_masters_and_resume_is_exact(tmp_path, devices):
    """The masters are saved in float32 with the optimizer state; save at step 2, restore,
    continue to 4 == the uninterrupted run, bit for bit (ZeRO-1, masters sharded over fsdp)."""
    cfg = tiny_config(*BF16, "mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=1", "train.steps=4",
                      "checkpoint.every=2", "checkpoint.async_save=false")
    trainer = Trainer(cfg, devices=devices, log=lambda s: None)
    final, _ = trainer.fit(out_dir=tmp_path / "run", progress=False)
    final = to_numpy(final)
    root = tmp_path / "run" / "checkpoints"
    masters = {p: a["dtype"] for p, a in read_meta(root / "2")["arrays"].items() if "/master/" in f"/{p}/"}
    assert len(masters) == len(jax.tree.leaves(trainer.model.shapes)), masters
    assert set(masters.values()) == {"float32"}
    ckpt = Checkpointer(root, async_save=False, read_only=True, log=lambda s: None)
    state, _, step = ckpt.restore(trainer.abstract_state_sharded(), 2)
    ckpt.close()
    assert step == 2
    for s in (2, 3):
        state, _ = trainer.compiled(state, trainer.loader.batch(s))
    for a, b in zip(jax.tree.leaves(to_numpy(state)), jax.tree.leaves(final)):
        np.testing.assert_array_equal(a, b)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_grad_accumulation_is_float32_under_bf16_params(devices):
    """grad_accum=2 with bf16 params: the microbatch loop carries float32 gradients."""
    cfg = tiny_config(*BF16, "mesh.data=8", "sharding.zero_stage=0", "train.grad_accum=2")
    trainer = Trainer(cfg, devices=devices, log=lambda s: None)
    t = cfg.train
    batch = jax.ShapeDtypeStruct((t.global_batch, t.seq_len + 1), jnp.int32, sharding=trainer.spec.batch_sharding)
    jaxpr = jax.make_jaxpr(trainer.step_fn)(trainer.abstract_state_sharded(), batch).jaxpr
    shapes = {tuple(s.shape) for s in jax.tree.leaves(trainer.model.shapes)}
    embed = tuple(trainer.model.shapes["embed"].shape)
    # the microbatch loop: the scan that hands out the (input) embedding's gradient
    loops = [e for e in _eqns(jaxpr) if e.primitive.name == "scan" and e.params["length"] == 2
             and embed in {tuple(v.aval.shape) for v in e.outvars}]
    assert len(loops) == 1, "no microbatch loop found"
    carry = [v.aval for v in loops[0].outvars if tuple(v.aval.shape) in shapes]
    assert len(carry) >= len(shapes) and {a.dtype for a in carry} == {jnp.dtype(jnp.float32)}, carry


def test_pipeline_accumulates_in_float32_under_bf16_params(devices):
    """The pipeline timetable's loop (not a microbatch scan) carries the embedding's gradient
    accumulator in float32 too."""
    cfg = tiny_config(*BF16, "mesh.data=1", "mesh.pipeline=2", "train.grad_accum=2")
    trainer = Trainer(cfg, devices=devices[:2], log=lambda s: None)
    t = cfg.train
    batch = jax.ShapeDtypeStruct((t.global_batch, t.seq_len + 1), jnp.int32, sharding=trainer.spec.batch_sharding)
    jaxpr = jax.make_jaxpr(trainer.step_fn)(trainer.abstract_state_sharded(), batch).jaxpr
    embed = tuple(trainer.model.shapes["embed"].shape)
    held = [v.aval.dtype for e in _eqns(jaxpr) if e.primitive.name == "scan"
            for v in e.outvars if tuple(v.aval.shape) == embed]
    assert held and set(held) == {jnp.dtype(jnp.float32)}, held


REDUCE = ["mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=2", "train.grad_accum=2"]


def test_bf16_gradient_reduction_is_within_bf16_of_float32(devices):
    """grad_reduce_dtype=bfloat16 (ZeRO-2's per-microbatch reduce-scatter over fsdp and the
    all-reduce over data, of bf16 gradients; on CPU summed in float32, see
    jaxpar.parallel.data.native_bf16_collectives) gives the float32 reduction's gradient up to
    bf16 rounding, and not bit for bit."""
    from tests.grad_util import first_step_grads
    ref, _ = first_step_grads(tiny_config(*REDUCE), devices)
    got, _ = first_step_grads(tiny_config(*REDUCE, "train.grad_reduce_dtype=bfloat16"), devices)
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert err < 2 ** -6, err
        worst = max(worst, err)
    assert worst > 0  # the bf16 path was taken


def _collectives(text: str, op: str) -> set[str]:
    """The result element types of the `op` collectives in a StableHLO module's text (each op's
    reduction region sits between its name and its type signature)."""
    pattern = rf'"stablehlo\.{op}".*?\}}\) : \([^)]*\) -> tensor<[0-9x]*?x?(bf16|f32)>'
    return set(re.findall(pattern, text, flags=re.S))


def _lowered(cfg, devices) -> str:
    trainer = Trainer(cfg, devices=devices, log=lambda s: None)
    t = cfg.train
    batch = jax.ShapeDtypeStruct((t.global_batch, t.seq_len + 1), jnp.int32, sharding=trainer.spec.batch_sharding)
    return trainer.step_fn.lower(trainer.abstract_state_sharded(), batch).as_text()


def test_bf16_reduction_wire_dtype_in_the_lowered_program(devices, monkeypatch):
    """The gradient collectives carry float32 by default, bf16 with grad_reduce_dtype=bfloat16
    on a backend with bf16 collectives (GPU, TPU; stood in for here): ZeRO-3's reduce-scatter
    over fsdp. On CPU they stay float32 (XLA:CPU would widen them anyway, and aborts on some)."""
    zero3 = ["mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=3"]
    assert _collectives(_lowered(tiny_config(*zero3), devices), "reduce_scatter") == {"f32"}
    cpu = _lowered(tiny_config(*zero3, "train.grad_reduce_dtype=bfloat16"), devices)
    assert _collectives(cpu, "reduce_scatter") == {"f32"}
    monkeypatch.setattr(data_parallel, "native_bf16_collectives", lambda: True)
    gpu = _lowered(tiny_config(*zero3, "train.grad_reduce_dtype=bfloat16"), devices)
    assert _collectives(gpu, "reduce_scatter") == {"bf16"}


@pytest.mark.parametrize("override, field", [
    ("train.master_dtype=float16", "train.master_dtype"),
    ("train.grad_reduce_dtype=int8", "train.grad_reduce_dtype"),
    ("optimizer.mu_dtype=float64", "optimizer.mu_dtype"),
])
def test_bad_precision_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        tiny_config(override)


@pytest.mark.parametrize("overrides, words", [
    (["train.master_dtype=bfloat16"], ["train.master_dtype='bfloat16'", "param_dtype='float32'"]),
    (["train.grad_reduce_dtype=bfloat16", "gradient_compression.method=bf16"],
     ["train.grad_reduce_dtype='bfloat16'", "gradient_compression.method='bf16'", "one of the two"]),
])
def test_conflicting_precision_settings_are_refused(overrides, words):
    with pytest.raises(ConfigError) as err:
        check_precision(tiny_config(*overrides))
    for w in words:
        assert w in str(err.value)
    check_precision(tiny_config(*BF16, "train.master_dtype=bfloat16"))  # pure bf16 is allowed
