"""`jaxpar bench checkpoint`: save / restore throughput, and what an async save costs the steps
that overlap it.

The state is a real train state (params + AdamW moments + step) of a Llama-style model sized
to a few hundred MB (default layout: dim 512, 8 layers, ffn 1536: ~27M params, ~320 MB of
float32 state), sharded ZeRO-3 over every device (fsdp=-1), saved with jaxpar's Checkpointer
(orbax, OCDBT/zarr, checksums) into a temporary directory under $TMPDIR.

  save      synchronous save, best of 3: MB/s = state bytes / wall time (checksums included)
  async     the blocking part of an async save (until `save` returns: device-to-host copy and
            checksums) and its total time until the files are committed
  restore   restore onto the same shardings (and checksum verification), best of 3: MB/s
  overlap   3 rounds of: train.steps steps timed one by one (each to `block_until_ready`) with
            no save, then an async save started and the steps that run while it is in flight,
            timed the same way; ratio = mean overlapped step time / median step time without a
            save. The save's own blocking part is `async` above, not in the ratio.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import jax

from jaxpar.bench.common import describe_config, fmt_bytes, fmt_ratio, mesh_overrides, table
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import Config
from jaxpar.mesh import describe
from jaxpar.train.trainer import Trainer

LAYOUT: list[str] = [*mesh_overrides(fsdp=-1), "sharding.zero_stage=3", "model.dim=512", "model.n_layers=8",
                     "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=1536", "train.global_batch=8",
                     "train.seq_len=32", "train.steps=4", "train.compute_dtype=float32",
                     "data.source=synthetic"]


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, repeats: int = 3) -> dict:
    trainer = Trainer(cfg, log=log)
    step_fn = trainer.compile()
    state = trainer.init_state()
    nbytes = _nbytes(state)
    mb = nbytes / 1e6
    log(f"checkpoint: {describe(trainer.mesh)}, {trainer.model.n_params:,} params, state {mb:.1f} MB")
    meta = lambda s: trainer.checkpoint_meta(s)
    config = cfg.model_dump(mode="json")
    tmp = Path(tempfile.mkdtemp(prefix="jaxpar-bench-ckpt-"))
    try:
        # warm up: one step and one small save compile everything the timings would include
        state, _ = step_fn(state, trainer.loader.batch(0))
        jax.block_until_ready(state)
        sync = Checkpointer(tmp / "sync", async_save=False, keep_last=repeats + 2)  # no deletes timed
        sync.save(1, state, meta(1), config)
        save_s = []
        for i in range(repeats):
            t0 = time.perf_counter()
            sync.save(2 + i, state, meta(2 + i), config)
            save_s.append(time.perf_counter() - t0)
        log(f"  sync save: {min(save_s):.3f}s best")
        target = trainer.abstract_state_sharded()
        restore_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            restored, _, _ = sync.restore(target)
            jax.block_until_ready(restored)
            restore_s.append(time.perf_counter() - t0)
            del restored
        sync.close()
        log(f"  restore: {min(restore_s):.3f}s best")

        # `repeats` rounds of: train.steps steps without a save, then an async save and the steps
        # that run while it is in flight (alternating, so load from other processes hits both)
        n = cfg.train.steps
        asy = Checkpointer(tmp / "async", async_save=True, keep_last=repeats + 2)
        asy.save(0, state, meta(0), config)  # warm the async path
        asy.wait()
        base, overlapped, blocking, async_total, step = [], [], [], [], 1

        def timed_step(out):
            nonlocal state, step
            batch = trainer.loader.batch(step)
            t1 = time.perf_counter()
            state, m = step_fn(state, batch)
            jax.block_until_ready(m)
            out.append(time.perf_counter() - t1)
            step += 1

        for _ in range(repeats):
            for _ in range(n):
                timed_step(base)
            t0 = time.perf_counter()
            asy.save(step, state, meta(step), config)
            blocking.append(time.perf_counter() - t0)
            k = 0
            while asy.mngr.is_saving_in_progress() and k < 10 * n:
                timed_step(overlapped)
                k += 1
            asy.wait()
            async_total.append(time.perf_counter() - t0)
        asy.close()
        log(f"  async save: blocking {statistics.median(blocking):.3f}s, total "
            f"{statistics.median(async_total):.3f}s (medians), {len(overlapped)} steps overlapped")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base_med = statistics.median(base)
    over_mean = statistics.fmean(overlapped) if overlapped else None
    return {
        "mesh": describe(trainer.mesh), "zero_stage": trainer.plan.zero_stage,
        "n_params": trainer.model.n_params, "state_bytes": nbytes, **describe_config(cfg),
        "save": {"seconds": min(save_s), "mb_per_s": mb / min(save_s), "all_s": save_s},
        "restore": {"seconds": min(restore_s), "mb_per_s": mb / min(restore_s), "all_s": restore_s},
        "async_save": {"blocking_s": statistics.median(blocking), "total_s": statistics.median(async_total),
                       "blocking_fraction": statistics.median(blocking) / statistics.median(async_total),
                       "all_blocking_s": blocking, "all_total_s": async_total},
        "overlap": {"step_s_no_save": base_med, "step_s_overlapping_save": over_mean,
                    "overlapped_steps": len(overlapped),
                    "ratio": (over_mean / base_med) if over_mean is not None else None,
                    "steps_no_save": base, "steps_overlapping": overlapped},
    }


def format_result(r: dict) -> str:
    o = r["overlap"]
    rows = [
        ["sync save", f"{r['save']['seconds']:.3f} s", f"{r['save']['mb_per_s']:.0f} MB/s"],
        ["restore", f"{r['restore']['seconds']:.3f} s", f"{r['restore']['mb_per_s']:.0f} MB/s"],
        ["async save: blocking part", f"{r['async_save']['blocking_s']:.3f} s",
         f"{r['async_save']['blocking_fraction']:.0%} of its total"],
        ["async save: until committed", f"{r['async_save']['total_s']:.3f} s", ""],
        ["step, no save (median)", f"{o['step_s_no_save']:.3f} s", ""],
        ["step overlapping the save (mean)",
         f"{o['step_s_overlapping_save']:.3f} s" if o["step_s_overlapping_save"] is not None else "-",
         f"{o['overlapped_steps']} steps"],
        ["slowdown while saving (ratio)", fmt_ratio(o["ratio"]), ""],
    ]
    head = (f"checkpoint: {r['mesh']}, zero {r['zero_stage']}, {r['n_params']:,} params, "
            f"state {fmt_bytes(r['state_bytes'])} ({r['state_bytes'] / 1e6:.0f} MB)")
    return head + "\n" + table(["", "time", "throughput / note"], rows)
