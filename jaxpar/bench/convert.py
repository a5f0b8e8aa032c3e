"""`jaxpar bench convert`: Hugging Face import / export throughput of a ~300 MB checkpoint.

A Llama-shaped model (default layout: dim 768, 6 layers, 12/4 heads, ffn 2048, vocab 24000,
untied: ~75M params, ~300 MB of float32) gets random weights, written once as an HF dir
(model.safetensors) into a temporary directory under $TMPDIR, then timed, best of `repeats`:

  import  safetensors -> params on the trainer's shardings (default ZeRO-3 over every device:
          each device's callback reads only its shard's rows), until every array is ready
  export  params on those shardings -> model.safetensors + config.json (gathered param by param)

MB/s = float32 tensor bytes / wall time. The file is in the page cache after the first write,
so import measures the conversion, not the disk.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxpar.bench.common import describe_config, mesh_overrides, table
from jaxpar.config import Config
from jaxpar.hf.layout import entries
from jaxpar.hf.reading import load_params
from jaxpar.hf.writing import write_hf
from jaxpar.mesh import describe
from jaxpar.train.model import nest
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = [*mesh_overrides(fsdp=-1), "sharding.zero_stage=3", "model.preset=null",
                     "model.vocab_size=24000", "model.dim=768", "model.n_layers=6", "model.n_heads=12",
                     "model.n_kv_heads=4", "model.ffn_dim=2048", "model.tie_embeddings=false",
                     "train.global_batch=8", "train.seq_len=32", "data.source=synthetic"]
# what an override that clashes with LAYOUT must respect (`jaxpar bench` adds it to the config error)
_HEADS = ("its 12 query heads need model.dim a multiple of 12 (768 by default; e.g. 384 or 192) and its "
          "4 key/value heads n_heads a multiple of 4; or override model.n_heads / model.n_kv_heads too "
          "(dim a multiple of n_heads, n_heads a multiple of n_kv_heads)")
LAYOUT_HINTS: dict[str, str] = {"model.n_heads": _HEADS, "model.n_kv_heads": _HEADS}


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, repeats: int = 3) -> dict:
    trainer = Trainer(cfg, log=log)
    shardings = trainer.spec.state_shardings["params"]
    rng = np.random.default_rng(0)
    host = nest({e.path: rng.standard_normal(e.full_shape, np.float32) * 0.02 for e in entries(cfg.model)})
    nbytes = sum(x.nbytes for x in jax.tree.leaves(host))
    mb = nbytes / 1e6
    log(f"convert: {describe(trainer.mesh)}, {trainer.model.n_params:,} params, {mb:.0f} MB float32")
    tmp = Path(tempfile.mkdtemp(prefix="jaxpar-bench-convert-"))
    imp, exp = [], []
    try:
        write_hf(host, cfg.model, tmp / "src")
        del host
        for i in range(repeats):
            t0 = time.perf_counter()
            params = jax.block_until_ready(load_params(tmp / "src", cfg.model, shardings))
            imp.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            write_hf(params, cfg.model, tmp / f"out{i}")
            exp.append(time.perf_counter() - t0)
            shutil.rmtree(tmp / f"out{i}")
            del params
            log(f"  round {i + 1}: import {imp[-1]:.2f}s, export {exp[-1]:.2f}s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"mesh": describe(trainer.mesh), "zero_stage": trainer.plan.zero_stage,
            "n_params": trainer.model.n_params, "bytes": nbytes, **describe_config(cfg),
            "jax": jax.__version__,
            "import": {"seconds": min(imp), "mb_per_s": mb / min(imp), "all_s": imp},
            "export": {"seconds": min(exp), "mb_per_s": mb / min(exp), "all_s": exp}}


def format_result(r: dict) -> str:
    rows = [[k, f"{r[k]['seconds']:.2f} s", f"{r[k]['mb_per_s']:.0f} MB/s"] for k in ("import", "export")]
    head = (f"convert (Hugging Face safetensors): {r['mesh']}, zero {r['zero_stage']}, "
            f"{r['n_params']:,} params ({r['bytes'] / 1e6:.0f} MB float32), jax {r['jax']}")
    return head + "\n" + table(["", "time (best)", "throughput"], rows)
