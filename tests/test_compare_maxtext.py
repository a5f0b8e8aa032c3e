"""scripts/compare_maxtext.py: its parsers, and that its jaxpar overrides still make a valid config
(MaxText itself is not installed here; the script makes its own venv)."""
import importlib.util
import json
from pathlib import Path

import pytest

from jaxpar.config import load_config

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compare_maxtext", ROOT / "scripts/compare_maxtext.py")
cm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cm)


def test_parse_maxtext_log():
    log = ("I1201 metric_logger.py:265] completed step: 0, seconds: 0.828, TFLOP/s/device: 0.004, loss: 6.0\n"
           "noise\nI1201 metric_logger.py:265] completed step: 1, seconds: 1.992, TFLOP/s/device: 0.002\n")
    assert cm.parse_maxtext(log) == {0: 0.828, 1: 1.992}


def test_parse_jaxpar_metrics_counts_from_zero(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join(json.dumps({"step": s, "loss": 1.0, "step_time_s": 0.5 + s}) for s in (1, 2, 3)) + "\n")
    assert cm.parse_jaxpar(p) == {0: 1.5, 1: 2.5, 2: 3.5}


def test_window_needs_every_step():
    assert cm.window({5: 1.0, 6: 2.0}, 5, 7) == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"\[6\]"):
        cm.window({5: 1.0}, 5, 7)


@pytest.mark.parametrize("layout", list(cm.LAYOUTS))
def test_jaxpar_overrides_are_a_valid_config(layout):
    cfg = load_config(str(ROOT / "configs/quickstart.yaml"),
                      ["train.steps=20", *cm.JAXPAR_MODEL, *cm.LAYOUTS[layout][0]])
    m, t = cfg.model, cfg.train
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (4, 256, 4, 4, 1024, 256)
    assert (t.seq_len, t.global_batch, t.compute_dtype, t.param_dtype, t.remat) == (
        128, 8, "bfloat16", "float32", "full")
    sizes = cfg.mesh.sizes()
    n = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
    assert n == 8 and cfg.data.source == "synthetic"
