"""Mixed precision: float32 master weights under bf16 params, and the checks of the precision
settings (train.param_dtype / master_dtype / grad_reduce_dtype, optimizer.mu_dtype).

optax adds an update to the params; in bf16 an update below the weight's resolution (lr 1e-7 on
a weight near 0.02, whose bf16 spacing is 1.2e-4) is rounded away, every step, and training
stalls. `with_masters` wraps the optimizer so its state holds float32 masters: the inner
optimizer (AdamW) steps the masters on float32 gradients, with float32 moments since it sees
float32 weights, and hands back `bf16(masters) - params`, so the params come out as the masters
cast to bf16. The update is taken against the params as stored, so a rounding in that add (only
possible when a step shrinks a weight by more than 2**15) is undone on the next step.

The masters are laid out like the moments (make_step_spec maps every params-shaped tree of the
optimizer state to the "opt" specs: ZeRO-1/2/3 shard them over fsdp) and, being optimizer state,
are saved and restored with it by the checkpoints.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpar.config import Config, ConfigError, TrainConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class MasterState(NamedTuple):
    master: Any  # the weights in master_dtype, shaped like the params
    inner: Any   # the wrapped optimizer's state, built on the masters


def with_masters(inner: optax.GradientTransformation, dtype=jnp.float32) -> optax.GradientTransformation:
    """`inner` run on master weights in `dtype` (see the module doc)."""
    def init(params):
        master = jax.tree.map(lambda p: p.astype(dtype), params)
        return MasterState(master, inner.init(master))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("with_masters needs the params (their dtype is what the masters are cast to)")
        grads = jax.tree.map(lambda g: g.astype(dtype), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # exact in float32 while the two bf16 values are within 2**15 of each other
        out = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(dtype) - p.astype(dtype), master, params)
        return out, MasterState(master, inner_state)

    return optax.GradientTransformation(init, update)


def has_masters(train: TrainConfig) -> bool:
    """Whether the optimizer keeps master weights: params stored narrower than master_dtype."""
    return train.param_dtype != train.master_dtype


def apply_precision(tx: optax.GradientTransformation, train: TrainConfig) -> optax.GradientTransformation:
    """The optimizer of this precision policy: `tx` on float32 masters when params are bf16."""
    return with_masters(tx, DTYPES[train.master_dtype]) if has_masters(train) else tx


def check_precision(cfg: Config) -> None:
    """Combinations of the precision settings that are mistakes, or not supported yet."""
    t = cfg.train
    if t.master_dtype == "bfloat16" and t.param_dtype == "float32":
        raise ConfigError(
            "train.master_dtype='bfloat16' is narrower than train.param_dtype='float32': master weights "
            "are the optimizer's higher-precision copy of the params; use master_dtype float32 (the "
            "default; with float32 params there is no extra copy)")
    if t.grad_reduce_dtype == "bfloat16":
        method = cfg.gradient_compression.method
        other = (f"gradient_compression.method='{method}'" if method != "none"
                 else "optimizer.name='onebit_adam'" if cfg.optimizer.name == "onebit_adam" else None)
        if other:
            raise ConfigError(
                f"train.grad_reduce_dtype='bfloat16' is a plain bf16 gradient reduction, and {other} "
                f"sets the reduction's wire format itself (gradient_compression.method=bf16 is 16-bit "
                f"chunks summed in float32); use one of the two")

