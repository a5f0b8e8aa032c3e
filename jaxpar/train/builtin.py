"""The built-in models by config: the dense Llama, or its MoE variant when model.moe has experts.
One choice, read by the trainer, the Hugging Face import and export."""
from __future__ import annotations

from typing import Callable

from flax import nnx

from models.llama import Llama
from models.moe import MoELlama


def llama_model_factory(cfg) -> Callable[[nnx.Rngs], nnx.Module]:
    """rngs -> the model `cfg.model` describes (`cfg`: a jaxpar Config)."""
    if cfg.model.moe.num_experts:
        return lambda rngs: MoELlama(cfg.model, rngs)
    return lambda rngs: Llama(cfg.model, rngs)
