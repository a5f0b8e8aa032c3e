"""`jaxpar bench attention [--seqs 2048,8192] [--impls xla,blockwise,cudnn]`: per-device temporary
memory and time of attention implementations (model.attention) at the given lengths.

Three kinds of row, for each sequence length in `seqs` (default SEQS) and implementation in
`impls` (default IMPLS; `cudnn` only where it runs: a GPU in 16 bits, else skipped with the reason):
  - layer: one attention call, forward + backward (jax.vjp), one sequence, with the config's
    heads / kv heads / head_dim and train.compute_dtype; `temp` is the compiled
    memory_analysis().temp_size_in_bytes, `time` the median wall time of the timed calls after a
    warm-up. On a CPU a call is timed only when its forward is below TIME_FLOPS and its
    temporaries below TIME_MAX_TEMP (else compile-only: CPU runs are slow); on an accelerator
    whenever its temporaries fit the device's memory;
  - packed: the layer row of blockwise (and of cudnn, which gets the segments as a mask) with
    segment ids, the sequence packed with documents of PACKED_DOC tokens (data.packing), timed
    alike: what skipping the tiles the segments leave empty saves;
  - step: the whole train step of the config's model, one sequence per device (global_batch =
    the batch-parallel size of the layout); `temp` per device. Compile-only on a CPU; on an
    accelerator (or with time_steps=True) also timed: the mean step of STEP_TIMED steps after
    STEP_WARMUP, one state carried through every step row (the state does not depend on the
    sequence length or the attention), `host` the loop thread's time in the step call.
A row that fails (a compile error, memory exhausted) keeps its error and the others run on.
Default layout: fsdp over every device at ZeRO-3 (the issue's setting), synthetic data.
`scores` is one float32 [heads, seq, seq], what xla holds per sequence at least once.
"""
from __future__ import annotations

import functools
import gc
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxpar.attention import attention
from jaxpar.attention.blockwise import visited_tiles
from jaxpar.attention.cudnn import cudnn_problem
from jaxpar.bench.common import describe_config, fmt_bytes, mesh_overrides, table, with_overrides
from jaxpar.config import Config, ConfigError
from jaxpar.metrics import compiled_memory, device_memory_bytes
from jaxpar.train.step import DTYPES
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = [*mesh_overrides(fsdp=-1), "sharding.zero_stage=3", "data.source=synthetic"]
SEQS = (2048, 8192)
IMPLS = ("xla", "blockwise")
VALID_IMPLS = ("xla", "blockwise", "cudnn")
TIME_FLOPS = 5e10  # CPU: time a layer call only below this many forward FLOPs (CPU runs are slow)
TIME_MAX_TEMP = 4 * 2**30  # CPU: ... and only when its temporaries fit in this many bytes (host RAM)
TIMED = 3  # timed layer calls on a CPU
TIMED_ACCEL = 20  # ... on an accelerator (a call takes milliseconds there)
STEP_WARMUP, STEP_TIMED = 2, 5
PACKED_DOC = 512  # tokens per document of the packed rows


def layer_flops(cfg: Config, seq: int) -> float:
    """Forward FLOPs of causal-free attention (QK^T and PV) for one sequence."""
    m = cfg.model
    return 4.0 * seq * seq * m.n_heads * m.resolved_head_dim


def check_options(seqs: Sequence[int], impls: Sequence[str]) -> None:
    """One clear error for lengths or implementations the bench cannot take."""
    bad = [i for i in impls if i not in VALID_IMPLS]
    if bad or not impls:
        raise ConfigError(f"bench attention: implementations {list(impls)}: valid are "
                          f"{', '.join(VALID_IMPLS)}")
    if not seqs or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in seqs):
        raise ConfigError(f"bench attention: sequence lengths {list(seqs)}: expected positive integers")


def skipped_impls(cfg: Config, impls: Sequence[str]) -> dict[str, str]:
    """{implementation: why it cannot run here} (cudnn off a GPU or outside 16 bits)."""
    problem = cudnn_problem(jax.default_backend(), DTYPES[cfg.train.compute_dtype])
    return {"cudnn": problem} if "cudnn" in impls and problem else {}


def layer_timed(cfg: Config, seq: int, temp: int | None) -> bool:
    """Whether a layer row is timed: on a CPU below TIME_FLOPS and TIME_MAX_TEMP, elsewhere when
    its temporaries fit the device's memory."""
    if jax.default_backend() == "cpu":
        return layer_flops(cfg, seq) <= TIME_FLOPS and (temp or 0) <= TIME_MAX_TEMP
    limit, _ = device_memory_bytes(jax.local_devices()[0])
    return limit is None or (temp or 0) <= limit


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
    if layer_timed(cfg, seq, out["temp_bytes"]):
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        xs = [jax.random.normal(kk, a.shape, dtype) for kk, a in zip(keys, args)]
        times = []
        for i in range((TIMED if jax.default_backend() == "cpu" else TIMED_ACCEL) + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*xs))
            if i:
                times.append(time.perf_counter() - t0)
        out["time_s"] = statistics.median(times)
    return out


def measure_step(cfg: Config, seq: int, impl: str, per_batch: int, log: Callable[[str], None],
                 timing: dict | None = None) -> dict:
    """The step row; with `timing` ({"state": None or the state of the last timed row}) also its
    time, the state carried on in `timing` (the step donates it)."""
    c = with_overrides(cfg, [f"train.seq_len={seq}", f"train.global_batch={per_batch}", "train.grad_accum=1",
                             f"model.attention={impl}"])
    log(f"attention: step {impl} seq {seq}: compiling")
    t0 = time.perf_counter()
    trainer = Trainer(c, log=lambda s: None)
    mem = compiled_memory(trainer.compile())
    out = {"kind": "step", "impl": impl, "seq": seq, "temp_bytes": mem.get("temp_bytes"),
           "compile_s": time.perf_counter() - t0, "sequences_per_device": 1, "time_s": None}
    if timing is not None:
        out.update(_time_step(trainer, timing))
        out["time_s"] = out["step_s"]
    return out


def _time_step(trainer: Trainer, timing: dict) -> dict:
    """Mean step time over STEP_TIMED steps after STEP_WARMUP, and the loop thread's time per
    step inside the call (dispatch; it waits only when the devices fall behind)."""
    if timing.get("state") is None:
        timing["state"] = trainer.init_state()
    step, state = trainer.compiled, timing.pop("state")
    batches = [trainer.loader.batch(i) for i in range(STEP_WARMUP + STEP_TIMED)]
    for b in batches[:STEP_WARMUP]:
        state, _ = step(state, b)
    jax.block_until_ready(state)
    call_s, start = 0.0, time.perf_counter()
    for b in batches[STEP_WARMUP:]:
        t0 = time.perf_counter()
        state, _ = step(state, b)
        call_s += time.perf_counter() - t0
    jax.block_until_ready(state)
    timing["state"] = state
    wall = time.perf_counter() - start
    return {"step_s": wall / STEP_TIMED, "host_call_s": call_s / STEP_TIMED}


def _row(measure: Callable[[], dict], kind: str, impl: str, seq: int, log: Callable[[str], None]) -> dict:
    """One row, or its error (the other rows run on: one implementation failing to compile or
    running out of memory on an accelerator says something, and must not cost the rest)."""
    try:
        row = measure()
    except Exception as e:  # noqa: BLE001
        row = {"kind": kind, "impl": impl, "seq": seq, "temp_bytes": None, "time_s": None,
               "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        gc.collect()
    log(f"attention: {kind} {impl} seq {seq}: " + describe_row(row))
    return row


def describe_row(row: dict) -> str:
    """The row's figures on one line (the progress log: a run cut short keeps what it measured)."""
    if row.get("error"):
        return f"failed: {row['error']}"
    parts = [f"temp {fmt_bytes(row['temp_bytes'])}"]
    if row.get("time_s") is not None:
        parts.append(f"time {row['time_s'] * 1e3:.2f} ms")
    if row.get("host_call_s") is not None:
        parts.append(f"host call {row['host_call_s'] * 1e3:.2f} ms")
    if row.get("compile_s") is not None:
        parts.append(f"compiled in {row['compile_s']:.1f} s")
    return ", ".join(parts)


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, seqs: Sequence[int] = SEQS,
        impls: Sequence[str] = IMPLS, doc: int = PACKED_DOC, time_steps: bool | None = None) -> dict:
    """The rows for `seqs` x `impls`; `time_steps` None: time the step rows off a CPU only."""
    seqs, impls = list(seqs), list(dict.fromkeys(impls))
    check_options(seqs, impls)
    skipped = skipped_impls(cfg, impls)
    for impl, why in skipped.items():
        log(f"attention: {impl} skipped: {why}")
    run_impls = [i for i in impls if i not in skipped]
    rows: list[dict] = []
    timed = jax.default_backend() != "cpu" if time_steps is None else time_steps
    timing: dict[str, Any] | None = {"state": None} if timed else None
    interrupted = False
    try:
        for seq in seqs:
            for impl in run_impls:
                rows.append(_row(lambda: measure_layer(cfg, seq, impl, log), "layer", impl, seq, log))
            for impl in [i for i in ("blockwise", "cudnn") if i in run_impls]:
                rows.append(_row(lambda: measure_layer(cfg, seq, impl, log, doc=doc), "packed", impl, seq,
                                 log))
        # one sequence per device: the batch is the batch-parallel size of the layout
        small = with_overrides(cfg, ["train.seq_len=8"])
        per_batch = Trainer(small, log=lambda s: None).plan.batch_size_divisor
        for seq in seqs:
            for impl in run_impls:
                step = lambda: measure_step(cfg, seq, impl, per_batch, log, timing)
                rows.append(_row(step, "step", impl, seq, log))
    except KeyboardInterrupt:  # a time limit (SIGINT): the table of the rows measured so far
        interrupted = True
        log(f"attention: interrupted after {len(rows)} rows")
    if timing is not None:
        timing.clear()
    m = cfg.model
    return {"jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind, "attention_block": m.attention_block,
            "heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": m.resolved_head_dim, "rows": rows,
            "ratios": _ratios(rows), "skipped": skipped, "steps_timed": timed, "interrupted": interrupted,
            **describe_config(cfg)}


def _ratios(rows: list[dict]) -> dict:
    """blockwise temp / xla temp per (kind, seq)."""
    by = {(r["kind"], r["seq"], r["impl"]): r["temp_bytes"] for r in rows}
    return {f"{kind}@{seq}": by[(kind, seq, "blockwise")] / by[(kind, seq, "xla")]
            for kind, seq, impl in by
            if impl == "xla" and by.get((kind, seq, "blockwise")) and by[(kind, seq, impl)]}


def format_result(res: dict) -> str:
    head = (f"attention memory and time per device: {res['devices']} {res['backend']} devices "
            f"({res.get('device_kind', '?')}), jax {res['jax']}; {res['heads']} heads / {res['kv_heads']} kv "
            f"heads x {res['head_dim']}, {res['train']['compute_dtype']} compute, blockwise tile "
            f"{res['attention_block']}")
    rows = []
    for r in res["rows"]:
        scores = 4 * res["heads"] * r["seq"] ** 2
        ratio = res["ratios"].get(f"{r['kind']}@{r['seq']}") if r["impl"] == "blockwise" else None
        t = "-" if r.get("time_s") is None else f"{r['time_s'] * 1e3:.1f} ms"
        if r.get("error"):
            t = "failed"
        kind = r["kind"] if r.get("doc") is None else f"packed, documents of {r['doc']}"
        if r.get("tiles"):
            kind += f" ({r['tiles'][0]} of {r['tiles'][1]} tiles)"
        rows.append([kind, r["seq"], r["impl"], fmt_bytes(r["temp_bytes"]),
                     "-" if ratio is None else f"{ratio:.3f}", fmt_bytes(scores), t])
    step = "timed" if res.get("steps_timed") else "compile-only"
    note = ("layer: one attention fwd+bwd, one sequence; packed: the same with segment ids; step: the "
            f"whole train step ({step}), one sequence per device; ratio: blockwise temp / xla temp")
    lines = [head, table(["kind", "seq", "impl", "temp", "ratio", "scores f32", "time"], rows), note]
    lines += [f"skipped {impl}: {why}" for impl, why in res.get("skipped", {}).items()]
    if res.get("interrupted"):
        lines.append("interrupted (SIGINT, a time limit): the rows after these were not measured")
    lines += [f"failed: {r['kind']} {r['impl']} seq {r['seq']}: {r['error']}"
              for r in res["rows"] if r.get("error")]
    return "\n".join(lines)


__all__ = ["run", "format_result", "LAYOUT", "VALID_IMPLS"]
