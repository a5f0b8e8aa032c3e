"""Helpers of the pipeline tests: one train step's loss and gradients (what the optimizer
receives, tests/grad_util.py) and compiled temp memory for a layout."""
import numpy as np

from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.grad_util import run_steps

# the tiny model's embedding and head (replicated over `pipeline`) are most of its bytes
PIPELINE_TINY = ["sharding.replicated_tolerance=1.0"]


def tokens_for(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1)).astype(np.int32)


def step_metrics(overrides, devices, seed=0) -> dict:
    """The numpy metrics (loss, grads, ...) of the first step of `overrides` on a seeded batch."""
    cfg = tiny_config(*PIPELINE_TINY, *overrides)
    return run_steps(cfg, 1, devices, batches=[tokens_for(cfg, seed)])[0]


def loss_and_grads(overrides, devices, seed=0):
    m = step_metrics(overrides, devices, seed)
    return float(m["loss"]), m["grads"]


def temp_bytes(overrides, devices) -> int:
    trainer = Trainer(tiny_config(*PIPELINE_TINY, *overrides), devices=devices, log=lambda s: None)
    return trainer.compile().memory_analysis().temp_size_in_bytes
