"""Write jaxpar params as a Hugging Face checkpoint: config.json + safetensors (and
generation_config.json when the model's bos/eos token ids are known).

One `model.safetensors` up to `max_shard_bytes`, else `model-0000i-of-0000n.safetensors` files
with a `model.safetensors.index.json` (as transformers writes them). One param is fetched to the
host at a time (a ZeRO-sharded param is gathered first), so the host holds at most one param
plus the shard being written.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import jax
import numpy as np

from jaxpar.hf.hfconfig import GENERATION, generation_config, hf_config
from jaxpar.hf.layout import entries, to_hf
from jaxpar.hf.reading import INDEX, SINGLE

DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}


def _host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def hf_tensors(params: dict, model_cfg, dtype: str = "float32") -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, tensor) pairs, one jaxpar param at a time."""
    for e in entries(model_cfg):
        x = params
        for k in e.path:
            x = x[k]
        x = _host(x).astype(DTYPES[dtype])
        flat = x.reshape(-1, *e.shape)
        for name, slab in zip(e.names, flat):
            yield name, to_hf(e.kind, slab)


def shard_plan(model_cfg, itemsize: int, max_shard_bytes: int) -> dict[str, int]:
    """HF tensor name -> shard number, filling shards in order up to `max_shard_bytes`."""
    plan, shard, size = {}, 0, 0
    for e in entries(model_cfg):
        nbytes = int(np.prod(e.shape)) * itemsize
        for name in e.names:
            if size and size + nbytes > max_shard_bytes:
                shard, size = shard + 1, 0
            plan[name] = shard
            size += nbytes
    return plan


def _save(save_file, tensors: dict, path: Path, write: bool) -> Path:
    if write:  # a temporary name first: a file that exists is whole
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # safetensors creates it private
        os.replace(tmp, path)
    return path


def write_hf(params: dict, model_cfg, out_dir: str | Path, dtype: str = "float32",
             max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """config.json (+ generation_config.json) and the safetensors of `params` into `out_dir`;
    returns the files written.
    Only process 0 writes (the others take part in gathering sharded params)."""
    from safetensors.numpy import save_file  # optional: only conversion needs it
    out = Path(out_dir)
    write = jax.process_index() == 0
    cfg = {**hf_config(model_cfg), "dtype": dtype}  # a model it cannot represent: before any file
    if write:
        out.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(model_cfg, np.dtype(DTYPES[dtype]).itemsize, max_shard_bytes)
    n = max(plan.values()) + 1
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    written, current, shard, total = [], {}, 0, 0
    for name, t in hf_tensors(params, model_cfg, dtype):
        total += t.nbytes
        if plan[name] != shard:  # the previous shard is whole: write it and let it go
            written.append(_save(save_file, current, out / names[shard], write))
            current, shard = {}, plan[name]
        current[name] = t
    written.append(_save(save_file, current, out / names[shard], write))
    if not write:
        return []
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: names[i] for k, i in plan.items()}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / INDEX)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    written.append(out / "config.json")
    gen = generation_config(model_cfg)
    if gen is not None:
        (out / GENERATION).write_text(json.dumps(gen, indent=2) + "\n")
        written.append(out / GENERATION)
    return written
