"""`jaxpar bench context`: long sequences per device, one device per sequence (xla, blockwise
attention) against one sequence split over mesh.context devices (ring, all_to_all, all_gather).

For each sequence length in SEQS and strategy in STRATEGIES, the config's model compiled for
the whole train step (AOT):
  - xla / blockwise: mesh.data = every device, one sequence per device;
  - ring / all_to_all / all_gather: mesh.context = every device, one sequence over all of them
    (all_to_all: the attention after the exchange is blockwise; all_gather: every device gathers
    the whole sequence's K and V, by one all-to-all of its chunk to every device, and attends
    blockwise over them);
`temp` is memory_analysis().temp_size_in_bytes per device, `state` the arguments' bytes per
device (params, optimizer state, batch); `permute` / `all-to-all` the collective bytes per step
in the compiled HLO (loops counted by their trip counts), `analytic` the ring's volume (each
device receives the K and V of the other C-1 chunks per layer forward, again backward, and the
float32 dK, dV on C hops: context.ring_bytes). `time` the median step time, measured only when
the whole host holds the run (temp x devices <= TIME_HOST_BYTES) and seq <= TIME_MAX_SEQ.
Then, per strategy, the longest sequence (doubling from the first of SEQS up to MAX_SEQ,
compile-only) whose temp + state per device fits BUDGET_BYTES.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import numpy as np

from jaxpar.bench.common import describe_config, fmt_bytes, mesh_overrides, table, with_overrides
from jaxpar.config import Config
from jaxpar.mesh import resolve_sizes
from jaxpar.metrics import compiled_memory
from jaxpar.metrics.hlo import collective_bytes
from jaxpar.parallel.context import check_layout as check_context, ring_bytes
from jaxpar.train.step import DTYPES
from jaxpar.train.trainer import Trainer

# 8 heads over 8 kv heads: all_to_all splits the heads of both over 8 devices
LAYOUT: list[str] = ["data.source=synthetic", "model.n_heads=8", "model.n_kv_heads=8", "train.grad_accum=1",
                     "model.attention_block=512", "checkpoint.enabled=false", "eval.every=0"]
SEQS = (2048, 8192, 32768)
STRATEGIES = ("xla", "blockwise", "ring", "all_to_all", "all_gather")
TIME_MAX_SEQ = 2048
TIME_HOST_BYTES = 3 * 2**30
TIMED = 1
BUDGET_BYTES = 1 * 2**30
MAX_SEQ = 1 << 20


def strategy_config(cfg: Config, strategy: str, seq: int) -> Config:
    n = jax.device_count()
    if strategy in ("xla", "blockwise"):
        layout = [*mesh_overrides(data=n), f"train.global_batch={n}", f"model.attention={strategy}"]
    else:
        layout = [*mesh_overrides(context=n), "train.global_batch=1", "model.attention=blockwise",
                  f"context.strategy={strategy}"]
    return with_overrides(cfg, [*layout, f"train.seq_len={seq}"])


def measure(cfg: Config, strategy: str, seq: int, log: Callable[[str], None], timed: bool = True) -> dict:
    c = strategy_config(cfg, strategy, seq)
    log(f"context: {strategy} seq {seq}: compiling")
    trainer = Trainer(c, log=lambda s: None)
    compiled = trainer.compile()
    mem = compiled_memory(compiled)
    comm = collective_bytes(compiled.as_text(), count_loops=True)
    row = {"strategy": strategy, "seq": seq, "temp_bytes": mem.get("temp_bytes"),
           "state_bytes": mem.get("argument_bytes"), "collective_bytes": comm, "time_s": None,
           "analytic_ring_bytes": None}
    if strategy == "ring":
        itemsize = np.dtype(DTYPES[c.train.compute_dtype]).itemsize
        row["analytic_ring_bytes"] = sum(ring_bytes(c, seq, 1, itemsize).values())
    log(f"context: {strategy} seq {seq}: temp {fmt_bytes(row['temp_bytes'])}, state "
        f"{fmt_bytes(row['state_bytes'])}, collectives {comm}")
    host = (row["temp_bytes"] or 0) * jax.device_count()
    if timed and seq <= TIME_MAX_SEQ and host <= TIME_HOST_BYTES:
        state, times = trainer.init_state(), []
        for i in range(TIMED + 1):
            batch = trainer.loader.batch(i)
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics["loss"])
            if i:
                times.append(time.perf_counter() - t0)
        row["time_s"] = statistics.median(times)
        log(f"context: {strategy} seq {seq}: {row['time_s']:.2f} s/step")
    return row


def fits(row: dict, budget: int) -> bool:
    return (row["temp_bytes"] or 0) + (row["state_bytes"] or 0) <= budget


def longest_fitting(cfg: Config, strategy: str, rows: list[dict], log, start: int, budget: int,
                    max_seq: int) -> int | None:
    """The longest of start, 2 x start, ... (up to max_seq) whose step fits `budget` per device."""
    known = {r["seq"]: fits(r, budget) for r in rows if r["strategy"] == strategy}
    seq, best = start, None
    while seq <= max_seq:
        ok = known[seq] if seq in known else fits(measure(cfg, strategy, seq, log, timed=False), budget)
        if not ok:
            break
        best, seq = seq, seq * 2
    return best


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, seqs=SEQS, strategies=STRATEGIES,
        budget: int = BUDGET_BYTES, max_seq: int = MAX_SEQ) -> dict:
    for seq in seqs:  # a length a strategy cannot split is an error before anything compiles
        for s in strategies:
            c = strategy_config(cfg, s, seq)
            check_context(c, resolve_sizes(c.mesh, jax.device_count()))
    rows = [measure(cfg, s, seq, log) for seq in seqs for s in strategies]
    longest = {s: longest_fitting(cfg, s, rows, log, min(seqs), budget, max_seq) for s in strategies}
    return {"jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(),
            "budget_bytes": budget, "rows": rows, "longest_fitting": longest, **describe_config(cfg)}


def format_result(res: dict) -> str:
    head = (f"context parallelism, per device: {res['devices']} {res['backend']} devices, jax {res['jax']}; "
            f"model dim {res['model']['dim']} x {res['model']['n_layers']} layers, "
            f"{res['model']['n_heads']} heads / {res['model']['n_kv_heads']} kv heads, "
            f"{res['train']['compute_dtype']} compute")
    rows = []
    for r in res["rows"]:
        comm = r["collective_bytes"]
        analytic = r.get("analytic_ring_bytes")
        permute = comm.get("collective-permute", 0)
        rows.append([r["strategy"], r["seq"], fmt_bytes(r["temp_bytes"]), fmt_bytes(r["state_bytes"]),
                     fmt_bytes(permute), fmt_bytes(analytic) if analytic else "-",
                     f"{permute / analytic:.3f}" if analytic else "-", fmt_bytes(comm.get("all-to-all", 0)),
                     fmt_bytes(comm.get("all-reduce", 0)),
                     "-" if r["time_s"] is None else f"{r['time_s']:.2f} s"])
    cols = ["strategy", "seq", "temp", "state", "permute", "analytic", "ratio", "all-to-all", "all-reduce",
            "step"]
    first = min(r["seq"] for r in res["rows"])
    longest = ", ".join(f"{s} {n if n else f'< {first}'}" for s, n in res["longest_fitting"].items())
    note = (f"xla/blockwise: one sequence per device (mesh.data); ring/all_to_all/all_gather: one sequence "
            f"over mesh.context = all devices. ratio: collective-permute bytes / analytic ring volume.\n"
            f"longest sequence with temp + state <= {fmt_bytes(res['budget_bytes'])} per device: {longest}")
    return "\n".join([head, table(cols, rows), note])


__all__ = ["run", "format_result", "LAYOUT"]
