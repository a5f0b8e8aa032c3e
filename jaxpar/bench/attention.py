"""`jaxpar bench attention`: per-device temporary memory and step time of attention
implementations (model.attention: xla vs blockwise) at 2K and 8K tokens.

Two kinds of row, for each sequence length in SEQS and implementation in IMPLS:
  - layer: one attention call, forward + backward (jax.vjp), one sequence, with the config's
    heads / kv heads / head_dim and train.compute_dtype; `temp` is the compiled
    memory_analysis().temp_size_in_bytes, `time` the median wall time of TIMED calls after a
    warm-up, measured only when the call's forward is below TIME_FLOPS and its temporaries below
    TIME_MAX_TEMP (else compile-only);
  - packed: the layer row of blockwise with segment ids, the sequence packed with documents of
    PACKED_DOC tokens (data.packing), timed alike: what skipping the tiles the segments leave
    empty saves;
  - step: the whole train step of the config's model, compile-only (nothing allocated), one
    sequence per device (global_batch = the batch-parallel size); `temp` per device.
Default layout: fsdp over every device at ZeRO-3 (the issue's setting), synthetic data.
`scores` is one float32 [heads, seq, seq], what xla holds per sequence at least once.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.attention import attention
from jaxpar.attention.blockwise import visited_tiles
from jaxpar.bench.common import describe_config, fmt_bytes, mesh_overrides, table, with_overrides
from jaxpar.config import Config
from jaxpar.metrics import compiled_memory
from jaxpar.train.step import DTYPES
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = [*mesh_overrides(fsdp=-1), "sharding.zero_stage=3", "data.source=synthetic"]
SEQS = (2048, 8192)
IMPLS = ("xla", "blockwise")
TIME_FLOPS = 5e10  # time a layer call only below this many forward FLOPs (CPU runs are slow)
TIME_MAX_TEMP = 4 * 2**30  # ... and only when its temporaries fit in this many bytes (host RAM)
TIMED = 3
PACKED_DOC = 512  # tokens per document of the packed rows


def layer_flops(cfg: Config, seq: int) -> float:
    """Forward FLOPs of causal-free attention (QK^T and PV) for one sequence."""
    m = cfg.model
    return 4.0 * seq * seq * m.n_heads * m.resolved_head_dim


def measure_layer(cfg: Config, seq: int, impl: str, log: Callable[[str], None],
                  doc: int | None = None) -> dict:
    """The layer row; with `doc`, the packed row (one sequence of seq / doc documents)."""
    m = cfg.model
    dtype = DTYPES[cfg.train.compute_dtype]
    shapes = [(1, seq, m.n_heads, m.resolved_head_dim), (1, seq, m.n_kv_heads, m.resolved_head_dim)]
    seg = None if doc is None else jnp.arange(seq, dtype=jnp.int32)[None] // doc
    fn = functools.partial(attention, segment_ids=seg, implementation=impl, block=m.attention_block)

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(do)

    args = [jax.ShapeDtypeStruct(s, dtype) for s in (shapes[0], shapes[1], shapes[1], shapes[0])]
    kind = "layer" if doc is None else "packed"
    log(f"attention: {kind} {impl} seq {seq}: compiling")
    compiled = jax.jit(fwd_bwd).lower(*args).compile()
    out = {"kind": kind, "impl": impl, "seq": seq, "time_s": None, "doc": doc,
           "temp_bytes": compiled_memory(compiled).get("temp_bytes")}
    if impl == "blockwise":  # the (query, key) tiles it computes, of those under the causal mask
        visited, causal = visited_tiles(seg, seq, block=m.attention_block)
        out["tiles"] = [int(visited), causal]
    if layer_flops(cfg, seq) <= TIME_FLOPS and (out["temp_bytes"] or 0) <= TIME_MAX_TEMP:
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        xs = [jax.random.normal(kk, a.shape, dtype) for kk, a in zip(keys, args)]
        times = []
        for i in range(TIMED + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*xs))
            if i:
                times.append(time.perf_counter() - t0)
        out["time_s"] = statistics.median(times)
    return out


def measure_step(cfg: Config, seq: int, impl: str, per_batch: int, log: Callable[[str], None]) -> dict:
    c = with_overrides(cfg, [f"train.seq_len={seq}", f"train.global_batch={per_batch}", "train.grad_accum=1",
                             f"model.attention={impl}"])
    log(f"attention: step {impl} seq {seq}: compiling")
    t0 = time.perf_counter()
    mem = compiled_memory(Trainer(c, log=lambda s: None).compile())
    return {"kind": "step", "impl": impl, "seq": seq, "temp_bytes": mem.get("temp_bytes"),
            "compile_s": time.perf_counter() - t0, "sequences_per_device": 1}


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, seqs=SEQS, impls=IMPLS,
        doc: int = PACKED_DOC) -> dict:
    rows = []
    for seq in seqs:
        for impl in impls:
            rows.append(measure_layer(cfg, seq, impl, log))
        if "blockwise" in impls:
            rows.append(measure_layer(cfg, seq, "blockwise", log, doc=doc))
    # one sequence per device: the batch is the batch-parallel size of the layout
    per_batch = Trainer(with_overrides(cfg, ["train.seq_len=8"]), log=lambda s: None).plan.batch_size_divisor
    for seq in seqs:
        for impl in impls:
            rows.append(measure_step(cfg, seq, impl, per_batch, log))
    m = cfg.model
    return {"jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(),
            "attention_block": m.attention_block, "heads": m.n_heads, "kv_heads": m.n_kv_heads,
            "head_dim": m.resolved_head_dim, "rows": rows, "ratios": _ratios(rows), **describe_config(cfg)}


def _ratios(rows: list[dict]) -> dict:
    """blockwise temp / xla temp per (kind, seq)."""
    by = {(r["kind"], r["seq"], r["impl"]): r["temp_bytes"] for r in rows}
    return {f"{kind}@{seq}": by[(kind, seq, "blockwise")] / by[(kind, seq, "xla")]
            for kind, seq, impl in by
            if impl == "xla" and by.get((kind, seq, "blockwise")) and by[(kind, seq, impl)]}


def format_result(res: dict) -> str:
    head = (f"attention memory and time per device: {res['devices']} {res['backend']} devices, "
            f"jax {res['jax']}; {res['heads']} heads / {res['kv_heads']} kv heads x {res['head_dim']}, "
            f"{res['train']['compute_dtype']} compute, blockwise tile {res['attention_block']}")
    rows = []
    for r in res["rows"]:
        scores = 4 * res["heads"] * r["seq"] ** 2
        ratio = res["ratios"].get(f"{r['kind']}@{r['seq']}") if r["impl"] == "blockwise" else None
        t = "-" if r.get("time_s") is None else f"{r['time_s'] * 1e3:.1f} ms"
        kind = r["kind"] if r.get("doc") is None else f"packed, documents of {r['doc']}"
        if r.get("tiles"):
            kind += f" ({r['tiles'][0]} of {r['tiles'][1]} tiles)"
        rows.append([kind, r["seq"], r["impl"], fmt_bytes(r["temp_bytes"]),
                     "-" if ratio is None else f"{ratio:.3f}", fmt_bytes(scores), t])
    note = ("layer: one attention fwd+bwd, one sequence; packed: the same with segment ids; step: the "
            "whole train step (compile-only), one sequence per device; ratio: blockwise temp / xla temp")
    cols = ["kind", "seq", "impl", "temp", "ratio", "scores f32", "time"]
    return "\n".join([head, table(cols, rows), note])


__all__ = ["run", "format_result", "LAYOUT"]
