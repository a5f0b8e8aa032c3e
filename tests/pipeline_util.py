"""Helpers of the pipeline tests: one train step's loss and exact gradients for a layout."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.mesh import build_mesh
from jaxpar.sharding import Plan
from jaxpar.train.model import ModelDef
from jaxpar.train.step import make_init, make_step_spec, make_train_step
from jaxpar.train.trainer import llama_model_factory
from tests.conftest import tiny_config


def grad_capture() -> optax.GradientTransformation:
    """An 'optimizer' whose state is the last gradients (params unchanged)."""
    return optax.GradientTransformation(
        lambda params: {"g": jax.tree.map(jnp.zeros_like, params)},
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), {"g": grads}))


def build(overrides, devices):
    cfg = tiny_config(*overrides)
    plan = Plan(build_mesh(cfg.mesh, devices), cfg.sharding.resolved_rules(), cfg.sharding.zero_stage)
    model = ModelDef.from_factory(llama_model_factory(cfg))
    tx = grad_capture()
    spec = make_step_spec(model, plan, tx)
    step = make_train_step(model, plan, tx, spec, grad_accum=cfg.train.grad_accum, pipeline=cfg.pipeline,
                           compute_dtype=cfg.train.compute_dtype, remat=cfg.train.remat)
    init = make_init(model, tx, spec, jnp.float32)
    return cfg, spec, step, init


def tokens_for(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1)).astype(np.int32)


def loss_and_grads(overrides, devices, seed=0):
    cfg, spec, step, init = build(overrides, devices)
    tokens = jax.device_put(tokens_for(cfg, seed), spec.batch_sharding)
    state, metrics = step(init(cfg.train.seed), tokens)
    grads = jax.tree.map(np.asarray, jax.device_get(state["opt_state"]["g"]))
    return float(metrics["loss"]), grads


def temp_bytes(overrides, devices) -> int:
    cfg, spec, step, init = build(overrides, devices)
    state = jax.eval_shape(init, cfg.train.seed)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state,
                         spec.state_shardings)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32,
                                 sharding=spec.batch_sharding)
    return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
