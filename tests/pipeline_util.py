"""Helpers of the pipeline tests: one train step's loss and gradients (what the optimizer
receives, tests/grad_util.py) and compiled temp memory for a layout."""
import functools

import numpy as np

from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.grad_util import run_steps

def tokens_for(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1)).astype(np.int32)


def step_metrics(overrides, devices, seed=0) -> dict:
    """The numpy metrics (loss, grads, ...) of the first step of `overrides` on a seeded batch
    (computed once per process: the one-device references are the same runs in several modules,
    tests/test_pipeline.py and test_pipeline_perf.py; treat the result as read-only)."""
    return _step_metrics(tuple(overrides), tuple(devices), seed)


@functools.cache
def _step_metrics(overrides: tuple, devices: tuple, seed: int) -> dict:
    cfg = tiny_config(*overrides)
    return run_steps(cfg, 1, list(devices), batches=[tokens_for(cfg, seed)])[0]


def loss_and_grads(overrides, devices, seed=0):
    m = step_metrics(overrides, devices, seed)
    return float(m["loss"]), m["grads"]


def temp_bytes(overrides, devices) -> int:
    trainer = Trainer(tiny_config(*overrides), devices=devices, log=lambda s: None)
    return trainer.compile().memory_analysis().temp_size_in_bytes


def step_flops(overrides, devices) -> float:
    trainer = Trainer(tiny_config(*overrides), devices=devices, log=lambda s: None)
    cost = trainer.compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def branch_flops(overrides, devices, codes) -> dict[int, float]:
    """XLA's FLOPs of one tick of each runner branch in `codes`, over an idle tick's (what the
    step does besides). XLA counts a loop body once and a conditional as its costliest branch,
    so the whole step's count says nothing per branch: each is compiled alone, as a one-tick
    timetable in which every device runs it. Such a table never writes the buffers its branch
    reads, so they stay zeros XLA can see; zb_h1's W reads nothing else (no param in its
    matmuls) and XLA would fold it away: its buffered inputs pass an optimization barrier."""
    import dataclasses
    from unittest import mock

    import jax

    import jaxpar.parallel.pipeline as pipeline
    from jaxpar.parallel.pipeline.schedule import IDLE
    from jaxpar.parallel.pipeline.split import LayerSplit

    real = pipeline.build_timetable
    weight_half = LayerSplit.weight_half

    def opaque_weight_half(self, kept, ring, slot, lk, top):
        # the ring's leaves are equal zeros here: leaves of one shape must not be one value, or
        # XLA merges the weight matmuls that read them (jaxlib 0.10.2 did: 2 of 7 dots a layer)
        ring = [b.at[slot].add(i) for i, b in enumerate(ring)]
        return weight_half(self, *jax.lax.optimization_barrier((kept, ring)), slot, lk, top)

    def one_tick(code):
        def build(*args):
            tt = real(*args)
            row = lambda fill: np.full((1, tt.p), fill, np.int32)
            return dataclasses.replace(tt, grid=[[None] * tt.p], code=row(code), mb=row(0), chunk=row(0),
                                       x_slot=row(0), g_slot=row(0), r_slot=row(0), recv_x=row(-1),
                                       recv_g=row(-1), r_put=row(-1), y_put=row(-1), w_slot=row(0),
                                       w_put=row(-1))
        return build

    out = {}
    for code in sorted({IDLE, *codes}):
        with (mock.patch.object(pipeline, "build_timetable", one_tick(code)),
              mock.patch.object(LayerSplit, "weight_half", opaque_weight_half)):
            out[code] = step_flops(overrides, devices)
    return {c: f - out[IDLE] for c, f in out.items() if c != IDLE}
