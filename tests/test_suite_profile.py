"""scripts/suite_profile.py's report sums its plugin's records by program and by file."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_report_sums_programs_and_files(tmp_path):
    spec = importlib.util.spec_from_file_location("suite_profile", ROOT / "scripts/suite_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"test": "tests/test_a.py::t1", "wall": 3.0, "cpu": 2.0, "child_cpu": 0.0,
             "jax": {"compile:step": 1.5, "n_compile:step": 1, "trace:step": 0.25, "n_trace:step": 1}},
            {"test": "tests/test_a.py::t2", "wall": 1.0, "cpu": 1.0, "child_cpu": 4.0,
             "jax": {"compile:step": 0.5, "n_compile:step": 1, "n_hit:step": 1}},
            {"test": "tests/test_b.py::t3", "wall": 2.0, "cpu": 0.5, "child_cpu": 0.0, "jax": {}}]
    (tmp_path / "gw0.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n")
    (tmp_path / "gw1.jsonl").write_text(json.dumps(rows[2]) + "\n")
    out = mod.report(tmp_path).splitlines()
    assert out[0] == "3 tests: 4 CPU s in the workers, 4 in child processes, 6 s of test wall time"
    assert next(x for x in out if x.startswith("step")).split() == ["step", "2", "1", "2.0", "0.2", "0.0"]
    a = next(x for x in out if x.startswith("tests/test_a.py")).split()
    assert a == ["tests/test_a.py", "2", "3.0", "4.0", "4.0", "2.2"]
    assert out[-1].split()[0] == "tests/test_b.py"  # ordered by CPU, workers' and children's
