"""The model the compile-only memory tests share (tests/test_planner.py's 15% check and
tests/test_remat_memory.py): one definition, so a layout both compile is one program, and the
run's compilation cache answers the second (they run on one worker: xdist group "planner").
4 layers, dim 128, 8 heads (4 KV), vocab 256, seq 128, float32, 16 sequences a step: activations
dominate the temp memory (remat full keeps 0.25-0.41 of it, 2026-12-07)."""
from jaxpar.config import Config, make_config

BASE = {"model": {"preset": "tiny", "n_layers": 4, "dim": 128, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 384,
                  "vocab_size": 256},
        "train": {"global_batch": 16, "seq_len": 128, "compute_dtype": "float32", "progress": False},
        "data": {"source": "synthetic"}, "checkpoint": {"enabled": False}}
TOL = "sharding.replicated_tolerance=0.3"  # pipeline stages and expert groups replicate the rest


def layout_config(overrides: str) -> Config:
    """BASE with space-separated `overrides` (a layout string of the tests)."""
    return make_config(BASE, overrides.split())
