"""`train.init_from`: start a fresh run from other weights, a Hugging Face dir (`hf:DIR`) or a
jaxpar checkpoint (a run dir, its checkpoints dir, or one step dir; its params only).

The source decides the model's shape: `init_config` fills `model.*` from it, keeping the fields
a config sets that do not change the shape (e.g. moe.dispatch, init_std); a shape field set to
another value is a ConfigError naming it. `initial_params` loads the weights straight onto the
trainer's param shardings (each host reads what its devices hold).
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from jaxpar.checkpoint import CheckpointError, list_steps, locate, read_config, restore_params
from jaxpar.config import Config, ConfigError, ModelConfig
from jaxpar.hf.hfconfig import HFError, model_config, read_hf_config
from jaxpar.hf.reading import load_params
from jaxpar.train.builtin import llama_model_factory
from jaxpar.train.model import ModelDef

SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                "tie_embeddings")
MOE_SHAPE_FIELDS = ("num_experts", "every_n", "expert_ffn_dim", "shared_expert", "shared_ffn_dim")
HF = "hf:"


def hf_dir(spec: str) -> Path | None:
    """The HF dir of `train.init_from: hf:DIR` (None for a jaxpar checkpoint path)."""
    return Path(spec[len(HF):]).expanduser() if spec.startswith(HF) else None


def checkpoint_step_dir(spec: str | Path, what: str = "train.init_from") -> Path:
    """The step directory a checkpoint path names (its latest complete step when not one step)."""
    p = Path(spec).expanduser()
    if not p.exists():
        raise CheckpointError(f"{what}={str(spec)!r}: no such file or directory")
    root, step = locate(p)
    if step is None:
        done = [s for s, _, ok in list_steps(root) if ok]
        if not done:
            raise CheckpointError(f"{what}={str(spec)!r}: no complete checkpoint step in {root}")
        step = done[-1]
    return root / str(step)


def source_model(spec: str) -> ModelConfig:
    """The model config of an init_from source."""
    d = hf_dir(spec)
    if d is not None:
        try:
            return model_config(read_hf_config(d), where=str(d / "config.json"))
        except HFError as e:  # the message names the path; say which setting gave it
            raise HFError(f"train.init_from={spec!r}: {e}") from None
    saved = read_config(checkpoint_step_dir(spec)).get("model")
    try:
        return ModelConfig.model_validate(saved)
    except Exception:  # noqa: BLE001 (pydantic: the saved config is not ours)
        raise CheckpointError(f"train.init_from={spec!r}: its saved config has no valid model "
                              f"section") from None


def init_config(cfg: Config) -> Config:
    """`cfg` with model.* taken from train.init_from's source (unchanged without one)."""
    spec = cfg.train.init_from
    if not spec:
        return cfg
    src = source_model(spec)
    mine = cfg.model
    theirs = src.model_dump()
    conflicts = [f"model.{k}={getattr(mine, k)!r} (the source has {theirs[k]!r})"
                 for k in SHAPE_FIELDS if k in mine.model_fields_set and getattr(mine, k) != theirs[k]]
    if "moe" in mine.model_fields_set:
        conflicts += [f"model.moe.{k}={getattr(mine.moe, k)!r} (the source has {theirs['moe'][k]!r})"
                      for k in MOE_SHAPE_FIELDS
                      if k in mine.moe.model_fields_set and getattr(mine.moe, k) != theirs["moe"][k]]
    if conflicts:
        raise ConfigError(f"train.init_from={spec!r} sets the model's shape, but the config says "
                          f"otherwise: {'; '.join(conflicts)}; remove those model fields (or the preset)")
    keep = {k: getattr(mine, k) for k in mine.model_fields_set
            if k not in SHAPE_FIELDS and k not in ("moe", "preset")}
    if "moe" in mine.model_fields_set:
        keep["moe"] = {**theirs["moe"], **{k: getattr(mine.moe, k) for k in mine.moe.model_fields_set
                                           if k not in MOE_SHAPE_FIELDS}}
    model = ModelConfig.model_validate({**theirs, **keep, "preset": None})
    return cfg.model_copy(update={"model": model})


def initial_params(cfg: Config, shardings) -> dict | None:
    """float32 params of train.init_from placed on `shardings` (a nested dict like the params),
    or None (random init) without one."""
    spec = cfg.train.init_from
    if not spec:
        return None
    d = hf_dir(spec)
    if d is not None:
        return load_params(d, cfg.model, shardings, dtype=np.float32)
    step_dir = checkpoint_step_dir(spec)
    shapes = ModelDef.from_factory(llama_model_factory(cfg)).shapes
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, np.float32, sharding=sh),
                            shapes, shardings)
    return restore_params(step_dir, abstract)
