"""`train.init_from`: start a fresh run from other weights, a Hugging Face dir (`hf:DIR`) or a
jaxpar checkpoint (a run dir, its checkpoints dir, or one step dir; its params only).

The source decides the model's shape: `init_config` fills `model.*` from it, keeping the fields
a config sets that do not change the shape (e.g. moe.dispatch, init_std); a shape field set to
another value is a ConfigError naming it. `initial_params` loads the weights straight onto the
trainer's param shardings (each host reads what its devices hold).

The source also fixes the vocabulary: data whose ids go past it is an error saying so here (the
data's own check would advise a larger model.vocab_size, which the source refuses). `hf:DIR`
with byte-level text data (no data.tokenizer) takes DIR/tokenizer.json when there is one.
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import yaml

from jaxpar.checkpoint import CheckpointError, list_steps, locate, read_config, restore_params
from jaxpar.config import Config, ConfigError, ModelConfig
from jaxpar.data import binfile
from jaxpar.data.tokenizer import Tokenizer
from jaxpar.hf.hfconfig import HFError, read_model_config
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


def is_hf_dir(p: Path) -> bool:
    """A Hugging Face model dir: config.json beside safetensors."""
    return (p / "config.json").is_file() and any(p.glob("*.safetensors*"))


def run_checkpoint_dir(run: Path) -> Path | None:
    """The checkpoint.dir of a run dir's saved config.yaml (a relative one inside the run), or None."""
    try:
        saved = yaml.safe_load((run / "config.yaml").read_text()) or {}
        d = (saved.get("checkpoint") or {}).get("dir")
    except (OSError, ValueError, AttributeError):
        return None
    return None if not d else run / Path(d).expanduser()  # an absolute dir replaces `run`


def _complete(root: Path) -> list[int]:
    return [s for s, _, ok in list_steps(root) if ok]


def checkpoint_step_dir(spec: str | Path, what: str = "train.init_from") -> Path:
    """The step directory a checkpoint path names (its latest complete step when not one step):
    one step dir, a checkpoints dir, or a run dir (its config.yaml's checkpoint.dir, default
    RUN/checkpoints)."""
    p = Path(spec).expanduser()
    if not p.exists():
        raise CheckpointError(f"{what}={str(spec)!r}: no such file or directory")
    if is_hf_dir(p):
        use = (f"start from it with train.init_from=hf:{p}" if what == "train.init_from" else
               f"import it with `jaxpar convert from-hf {p} OUT_CKPT` first")
        raise CheckpointError(f"{what}={str(spec)!r}: {p} is a Hugging Face model dir (config.json + "
                              f"safetensors), not a jaxpar checkpoint; {use}")
    root, step = locate(p)
    if step is None:
        done = _complete(root)
        own = run_checkpoint_dir(p)
        if not done and own is not None and own.is_dir():
            root, done = own, _complete(own)
        if not done:
            raise CheckpointError(
                f"{what}={str(spec)!r}: no complete checkpoint step in {root} (a run dir's checkpoints "
                f"are looked for in the checkpoint.dir of its config.yaml, else RUN/checkpoints; "
                f"name a run whose checkpoints lie elsewhere by its checkpoint.dir)")
        step = done[-1]
    return root / str(step)


def source_model(spec: str) -> ModelConfig:
    """The model config of an init_from source."""
    d = hf_dir(spec)
    if d is not None:
        try:
            return read_model_config(d)
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
    cfg = cfg.model_copy(update={"model": model})
    d = hf_dir(spec)
    if (d is not None and cfg.data.source == "text" and not cfg.data.tokenizer
            and (d / "tokenizer.json").is_file()):
        tok = str((d / "tokenizer.json").absolute())
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"tokenizer": tok})})
    check_data_vocab(cfg)
    return cfg


def check_data_vocab(cfg: Config) -> None:
    """A ConfigError when the data's ids go past the vocabulary train.init_from fixes."""
    v, data = cfg.model.vocab_size, cfg.data
    fixed = f"train.init_from={cfg.train.init_from!r}: the source model's vocabulary is fixed at {v}"
    if data.source == "text" and data.tokenizer:
        n = Tokenizer(data.tokenizer).vocab_size
        if n > v:
            raise ConfigError(f"{fixed}, but data.tokenizer={data.tokenizer!r} has vocab_size {n}; the "
                              f"tokenizer must fit the model (use the source's own tokenizer.json)")
    elif data.source == "text" and v < 256:
        raise ConfigError(f"{fixed}, too small for byte-level text (256); set data.tokenizer to the "
                          f"source's own tokenizer.json")
    elif data.source == "bin":
        for field, path in (("data.bin_path", data.bin_path), ("data.eval_paths",
                            data.eval_paths[0] if data.eval_paths else None)):
            n = int(binfile.read_meta(path).get("vocab_size", 0)) if path else 0
            if n > v:
                raise ConfigError(f"{fixed}, but {field}={path!r} was tokenized with a vocabulary of {n}; "
                                  f"prepare the data with a tokenizer that fits the model (the source's own)")


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
