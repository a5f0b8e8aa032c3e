"""The built-in models by config: the dense Llama, or its MoE variant when model.moe has experts.
One choice, read by the trainer, the Hugging Face import and export."""
from __future__ import annotations

from typing import Callable

from flax import nnx

from models import llama, moe


def model_class(model_cfg) -> type[nnx.Module]:
    """Llama, or MoELlama when `model_cfg` (a config's `model`) has experts."""
    return moe.MoELlama if model_cfg.moe.num_experts else llama.Llama


def llama_model_factory(cfg) -> Callable[[nnx.Rngs], nnx.Module]:
    """rngs -> the model `cfg.model` describes (`cfg`: a jaxpar Config)."""
    cls = model_class(cfg.model)
    return lambda rngs: cls(cfg.model, rngs)


def init_cache(model_cfg, batch: int, length: int, dtype) -> dict:
    """An empty KV cache for the model's `decode` (models/llama.py, models/moe.py)."""
    return (moe if model_cfg.moe.num_experts else llama).init_cache(model_cfg, batch, length, dtype)
