"""`jaxpar bench packing`: what data.packing costs and keeps, on a real corpus.

  - corpus: CORPUS_FILES files of the Python standard library (or data.paths), one document each,
    tokenized by a byte-level BPE of VOCAB ids trained on them (no download);
  - per sequence length in SEQS: rows of the packing plan, the padding fraction (EOS fill), the
    documents cut into row-sized pieces, and the targets that count per row (the loss's count);
  - the train step of the config's model at STEP_SEQ tokens, compile-only, packed vs not, per
    model.attention in IMPLS: temp bytes per device and FLOPs (the segment mask's cost).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.bench.common import describe_config, fmt_bytes, table, with_overrides
from jaxpar.config import Config
from jaxpar.data import packing, text, tokenizer
from jaxpar.metrics import compiled_memory
from jaxpar.train.batch import Documents
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "data.source=synthetic", "eval.every=0",
                     "data.eval_fraction=0"]
SEQS = (512, 2048, 8192)
CORPUS_FILES = 400
VOCAB = 4096
STEP_SEQ = 2048
IMPLS = ("xla", "blockwise")


def corpus(cfg: Config, work: Path) -> tuple[np.ndarray, int, int]:
    """(tokens with EOS after each document, eos_id, documents)."""
    files = [f for f, _ in text.corpus_documents(tuple(cfg.data.paths), None)][:CORPUS_FILES]
    tok_path = tokenizer.train_bpe(files, VOCAB, work / "tok.json")
    tok = tokenizer.Tokenizer(tok_path)
    docs = tok.encode_batch([Path(f).read_text(errors="replace") for f in files])
    eos = np.array([tok.eos_id], np.int64)
    return np.concatenate([x for d in docs for x in (d, eos)]).astype(np.int32), tok.eos_id, len(docs)


def plan_row(source: packing.PackedSource, seq: int) -> dict:
    t0 = time.perf_counter()
    plan = source.plan(seq)
    seconds = time.perf_counter() - t0
    lengths = source.ends - source.starts
    counted = int((lengths - 1).clip(min=0).sum())
    return {"seq": seq, "rows": plan.rows, "padding": plan.padding_fraction(seq + 1),
            "split_docs": int((lengths > seq + 1).sum()), "counted_per_row": counted / plan.rows,
            "plan_s": seconds}


def step_row(cfg: Config, impl: str, packed: bool, eos: int) -> dict:
    c = with_overrides(cfg, [f"train.seq_len={STEP_SEQ}", f"model.attention={impl}", "train.global_batch=8",
                             "model.attention_block=512", f"model.vocab_size={VOCAB}"])
    trainer = Trainer(c, log=lambda s: None)
    step = trainer.make_step(documents=Documents(eos) if packed else None)
    state = trainer.abstract_state_sharded()
    batch = trainer.abstract_batch()
    compiled = step.lower(state, batch).compile(compiler_options=trainer.compiler_options)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"impl": impl, "packed": packed, "temp_bytes": compiled_memory(compiled).get("temp_bytes", 0),
            "flops": float((cost or {}).get("flops", 0.0))}


def run(cfg: Config, log=print) -> dict:
    with tempfile.TemporaryDirectory() as work:
        tokens, eos, n_docs = corpus(cfg, Path(work))
    starts, ends = packing.eos_boundaries(tokens, eos)
    source = packing.PackedSource(tokens, starts, ends, eos, cfg.train.seed, "bench")
    plans = [plan_row(source, s) for s in SEQS]
    log(f"{n_docs} documents, {tokens.size:,} tokens; compiling the steps")
    steps = [step_row(cfg, impl, packed, eos) for impl in IMPLS for packed in (False, True)]
    return {"benchmark": "packing", "config": describe_config(cfg), "documents": n_docs,
            "tokens": int(tokens.size), "plans": plans, "steps": steps}


def format_result(res: dict) -> str:
    m = res["config"]["model"]
    head = (f"packing: {res['documents']} documents, {res['tokens']:,} tokens (BPE vocab {VOCAB}); model dim "
            f"{m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads")
    plans = table(["seq", "rows", "padding", "docs split", "counted targets/row", "plan s"],
                  [[p["seq"], p["rows"], f"{p['padding']:.1%}", p["split_docs"],
                    f"{p['counted_per_row']:.0f}", f"{p['plan_s']:.2f}"] for p in res["plans"]])
    steps = table(["attention", "packed", "temp/device", "GFLOPs/device"],
                  [[s["impl"], s["packed"], fmt_bytes(s["temp_bytes"]), f"{s['flops'] / 1e9:.2f}"]
                   for s in res["steps"]])
    return "\n".join([head, plans, f"step at {STEP_SEQ} tokens, compile-only:", steps])
