"""`jaxpar convert from-hf HF_DIR OUT_CKPT` and `jaxpar convert to-hf RUN_OR_CKPT OUT_DIR`.

from-hf writes a jaxpar checkpoint (step 0: the HF weights, a fresh AdamW state) that
`train.init_from: OUT_CKPT` (params only) or `train.resume: OUT_CKPT` start from, and copies the
HF dir's tokenizer files beside it (its saved data.tokenizer names the copy, so `jaxpar generate`
speaks the model's tokens); to-hf writes the params of a run's latest (or a named) step as
config.json (+ generation_config.json) + safetensors.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxpar.checkpoint import Checkpointer, CheckpointError, list_steps, read_config, restore_params
from jaxpar.config import DataConfig, ModelConfig, make_config
from jaxpar.data.tokenizer import Tokenizer, run_tokenizer
from jaxpar.hf.hfconfig import HFError, read_model_config
from jaxpar.hf.init import checkpoint_step_dir
from jaxpar.hf.layout import entries
from jaxpar.hf.reading import SafetensorsDir
from jaxpar.hf.writing import write_hf
from jaxpar.train.builtin import llama_model_factory
from jaxpar.train.model import ModelDef
from jaxpar.train.trainer import Trainer

# what a tokenizer of an HF dir is made of (tokenizer.json is the one jaxpar reads)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def from_hf(hf_dir: str | Path, out_ckpt: str | Path, log: Callable[[str], None] = print) -> Path:
    """Convert an HF model dir into a jaxpar checkpoints dir (one step, 0); returns its step dir."""
    out = Path(out_ckpt).absolute()
    # its errors name the HF dir alone (not a train.init_from never set), before anything is written
    m = read_model_config(hf_dir)
    SafetensorsDir(hf_dir).check(entries(m), m.tie_embeddings)
    if any(ok for _, _, ok in list_steps(out)):
        raise CheckpointError(f"{out} already holds checkpoints; convert into a new directory")
    n = jax.device_count()
    tokenizer = copy_tokenizer(Path(hf_dir), out)
    # ZeRO-3 over every device: each holds 1/n of the params (and of the fresh optimizer state)
    cfg = make_config({}, [f"train.init_from=hf:{Path(hf_dir).absolute()}", "data.source=synthetic",
                           "mesh.data=1", "mesh.fsdp=-1", "sharding.zero_stage=3",
                           "sharding.replicated_tolerance=1", f"train.global_batch={n}",
                           "train.progress=false", f"checkpoint.dir={out}"]
                      + ([f"data.tokenizer={tokenizer}"] if tokenizer else []))
    trainer = Trainer(cfg, log=lambda s: None)
    state = trainer.init_state()
    ckpt = Checkpointer(out, async_save=False, keep_last=1, log=log)
    try:
        trainer.save(ckpt, 0, state)
    finally:
        ckpt.close()
    m = trainer.cfg.model
    log(f"{hf_dir} -> {out / '0'}: {trainer.model.n_params:,} params "
        f"(model: dim {m.dim}, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} heads, vocab {m.vocab_size}"
        + (f", {m.moe.num_experts} experts top-{m.moe.top_k}" if m.moe.num_experts else "") + ")")
    return out / "0"


def copy_tokenizer(hf_dir: Path, out: Path) -> Path | None:
    """Copy the HF dir's tokenizer files into `out`; the copied tokenizer.json (or None)."""
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, out / name)
    return out / "tokenizer.json" if (hf_dir / "tokenizer.json").is_file() else None


def load_checkpoint_params(src: str | Path) -> tuple[dict, ModelConfig, Path]:
    """(float32 params on the first local device, model config, step dir) of a run or checkpoint."""
    step_dir = checkpoint_step_dir(src, what="checkpoint")
    try:
        model = ModelConfig.model_validate(read_config(step_dir).get("model"))
    except Exception:  # noqa: BLE001 (pydantic)
        raise CheckpointError(f"{step_dir}: its saved config has no valid model section") from None
    cfg = make_config({"model": model.model_dump(mode="json")})
    shapes = ModelDef.from_factory(llama_model_factory(cfg)).shapes
    dev = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32, sharding=dev), shapes)
    return restore_params(step_dir, abstract), model, step_dir


def to_hf(src: str | Path, out_dir: str | Path, dtype: str = "float32",
          max_shard_bytes: int = 5 * 2**30, log: Callable[[str], None] = print) -> list[Path]:
    """Write a run's (or checkpoint's) params as an HF model dir; returns the files written."""
    params, model, step_dir = load_checkpoint_params(src)
    out = Path(out_dir)
    if (out / "config.json").exists():
        raise HFError(f"{out} already holds a config.json; export into a new directory")
    saved = read_config(step_dir)
    if model.max_positions is None:  # the context it was trained for
        seq_len = (saved.get("train") or {}).get("seq_len")
        if isinstance(seq_len, int) and seq_len > 0:
            model = model.model_copy(update={"max_positions": seq_len})
    tokenizer = _saved_tokenizer(saved)
    if tokenizer is not None and model.eos_token_id is None:  # the token its documents ended with
        eos = Tokenizer(tokenizer, "the run's data.tokenizer").eos_id
        model = model.model_copy(update={"eos_token_id": eos})
    files = write_hf(params, model, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if tokenizer is not None and jax.process_index() == 0:
        files += export_tokenizer(tokenizer, out)
    log(f"{step_dir} -> {out}: " + ", ".join(p.name for p in files))
    return files


def _saved_tokenizer(saved: dict) -> Path | None:
    """The tokenizer.json a saved run config names (data.tokenizer or its prepared .bin's), if it
    is still there."""
    try:
        path = run_tokenizer(DataConfig.model_validate(saved.get("data") or {}))
    except Exception:  # noqa: BLE001 (pydantic: an older config; the export goes without it)
        return None
    return Path(path) if path and Path(path).is_file() else None


def export_tokenizer(tokenizer: Path, out: Path) -> list[Path]:
    """The run's tokenizer beside the exported weights: tokenizer.json and, from an HF import,
    its sibling files; else a tokenizer_config.json that loads tokenizer.json as it is
    (transformers' PreTrainedTokenizerFast, no special tokens added to a text)."""
    written = [out / "tokenizer.json"]
    shutil.copyfile(tokenizer, written[0])
    for name in TOKENIZER_FILES[1:3]:
        if (tokenizer.parent / name).is_file():
            shutil.copyfile(tokenizer.parent / name, out / name)
            written.append(out / name)
    if not (out / "tokenizer_config.json").exists():
        tok = Tokenizer(tokenizer, "the run's data.tokenizer")
        eos = tok.tok.id_to_token(tok.eos_id)
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "add_bos_token": False,
             "add_eos_token": False}, indent=2) + "\n")
        written.append(out / "tokenizer_config.json")
    return written
