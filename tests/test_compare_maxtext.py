"""scripts/compare_maxtext.py: its parsers, and that its jaxpar overrides still make a valid config
(MaxText itself is not installed here; the script makes its own venv)."""
import importlib.util
import json
import os
import sys
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


def test_tail_reads_growing_file_and_partial_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    tail = cm.Tail(p, cm.JAXPAR_STEP, offset=1)
    assert tail() == -1  # no file yet
    p.write_text('{"step": 1, "loss": 1}\n{"step": 2, "lo')
    assert tail() == 0  # the partial line is not counted yet
    with open(p, "a") as f:
        f.write('ss": 1}\n')
    assert tail() == 1


def test_table_marks_above_target():
    run = lambda ms, cpu: {"step_s": [ms / 1e3] * 3, "cpu_per_step_s": cpu}
    text = cm.format_table({"data8": {"jaxpar": [run(80, 1.0)], "maxtext": [run(100, 2.0)]},
                            "fsdp8": {"jaxpar": [run(100, None)], "maxtext": [run(100, 1.0)]},
                            "dp2fsdp2tp2": {"jaxpar": [], "maxtext": [run(1, 1.0)]}})
    lines = text.splitlines()
    assert "0.80" in lines[2] and "*" not in lines[2] and "0.50" in lines[2]
    assert "1.00 *" in lines[3] and "n/a" in lines[3]
    assert "(failed)" in lines[4]


def test_run_samples_cpu_time_between_steps(tmp_path):
    """A stand-in trainer that burns CPU between its step records: _run sees the records as
    they are written and reports CPU seconds per step over steps [skip, steps)."""
    metrics = tmp_path / "metrics.jsonl"
    fake = ("import json, sys, time\n"
            "for s in range(1, 4):\n"
            "    t = time.process_time()\n"
            "    while time.process_time() - t < 0.2: pass\n"
            "    with open(sys.argv[1], 'a') as f: f.write(json.dumps({'step': s, 'step_time_s': 0.2}) + '\\n')\n"
            "    time.sleep(0.2)\n")
    out, cpu = cm._run([sys.executable, "-c", fake, str(metrics)], dict(os.environ), tmp_path / "log",
                       60, tmp_path, cm.Tail(metrics, cm.JAXPAR_STEP, offset=1), skip=1, steps=3)
    assert cm.parse_jaxpar(metrics) == {0: 0.2, 1: 0.2, 2: 0.2}
    assert cpu is not None and 0.1 < cpu < 0.5
