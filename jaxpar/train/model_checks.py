"""What a user's own model must be, checked once before anything compiles, each with one message.

A custom model (Trainer(model_factory=...)) is traced once abstractly on one small batch, the
way the step will call it: logits of the wrong shape, or a vocabulary other than the data's
(`model.vocab_size`), would otherwise surface as an optax broadcast error deep in the loss, or
as a NaN loss on the batches whose ids reach past the logits.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar import nn
from jaxpar.config import Config, ConfigError
from jaxpar.train.batch import Rows


def check_factory(factory: Any) -> None:
    """model_factory must be a callable taking one nnx.Rngs."""
    if not callable(factory):
        raise ConfigError(f"model_factory={factory!r} is not callable; give a function "
                          f"rngs -> nnx.Module (e.g. lambda rngs: MyModel(..., rngs=rngs))")
    try:
        inspect.signature(factory).bind(object())
    except TypeError:
        raise ConfigError(f"model_factory {getattr(factory, '__name__', factory)!r} must take one "
                          f"argument, an nnx.Rngs (e.g. lambda rngs: MyModel(..., rngs=rngs))") from None
    except ValueError:  # no signature to read (a builtin): let the call decide
        pass


def step_keywords(cfg: Config) -> tuple[str, ...]:
    """The keywords the step passes to the model besides the tokens (train/batch.Batch.apply)."""
    keys = ("segment_ids",) if cfg.data.packing else ()
    if (cfg.data.packing and cfg.data.reset_positions) or cfg.mesh.context > 1:
        keys += ("positions",)
    return keys


def check_custom_model(model_def, cfg: Config, plan) -> None:
    """A user's model against what the config will do with it: a pipeline needs a layer stack;
    the step's keywords and the logits' shape (check_model_output)."""
    if cfg.mesh.pipeline > 1 and not any(ax[:1] == ("layers",) for ax in
                                         model_def.leaves_with_paths(model_def.axes).values()):
        raise ConfigError(f"mesh.pipeline={cfg.mesh.pipeline} needs a model whose layers are stacked "
                          f"on a leading 'layers' dim and run with jaxpar.nn.scan_layers; this model "
                          f"has no such params: set mesh.pipeline=1")
    check_model_output(model_def, cfg, plan)


def check_model_output(model_def, cfg: Config, plan) -> None:
    """Trace the model abstractly on a [2, seq_len] batch as the step calls it, its
    constrain() names checked against the plan's rules; its logits must be
    [2, seq_len, model.vocab_size]."""
    module = model_def.merge(model_def.abstract)
    needs = step_keywords(cfg)
    params = inspect.signature(module).parameters if _has_signature(module) else None
    if params is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        missing = [k for k in needs if k not in params]
        if missing:
            why = "data.packing" if cfg.data.packing else f"mesh.context={cfg.mesh.context}"
            raise ConfigError(
                f"{why} calls the model as model(tokens, {', '.join(f'{k}=...' for k in needs)}), but "
                f"{type(module).__name__}.__call__ does not take {', '.join(missing)}: accept them "
                f"and pass them to jaxpar.nn.attention (which masks documents and splits sequences), "
                f"or turn {why.split('=')[0]} off")
    b, s, vocab = 2, cfg.train.seq_len, cfg.model.vocab_size
    ids = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def call(params, tokens, extra):
        rows = Rows(tokens, tokens, extra.get("segment_ids"), extra.get("positions"))
        return rows.apply(model_def.merge(model_def.state(params)))

    def constrain(x, axes):
        if len(axes) != x.ndim:
            raise ConfigError(f"constrain: axes {tuple(axes)} do not match an array of rank {x.ndim}")
        plan.spec(tuple(axes), None, use="act", name=f"constrain {tuple(axes)}")
        return x

    with nn.use_context(nn.Context(constrain=constrain)):
        out = jax.eval_shape(call, model_def.shapes, ids, {k: ids for k in needs})
    shape = getattr(out, "shape", None)
    if shape is None:
        raise ConfigError(f"the model returned {type(out).__name__}, not an array of logits "
                          f"[batch, seq, vocab]")
    if tuple(shape) != (b, s, vocab):
        what = (f"a vocabulary of {shape[-1]}, but the data's ids go up to model.vocab_size={vocab} "
                f"(set model.vocab_size={shape[-1]} if that is the model's vocabulary, or size the "
                f"model's output to {vocab})"
                if len(shape) == 3 and tuple(shape[:2]) == (b, s) else
                f"shape {list(shape)} where [batch, seq, vocab] = {[b, s, vocab]} was expected")
        raise ConfigError(f"the model's logits for tokens [{b}, {s}] have {what}")


def _has_signature(fn: Callable) -> bool:
    try:
        inspect.signature(fn)
        return True
    except (TypeError, ValueError):
        return False
