"""`jaxpar plot RUN_DIR...`: PNGs of loss, throughput and MFU from metrics.jsonl, runs overlaid."""
import json

from jaxpar.cli import main
from jaxpar.observe.plots import plot_runs, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def _run(path, n, mfu=True, mesh="data: 2\n  fsdp: 2\n  tensor: 2"):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"name: {path.name}\nmesh:\n  {mesh}\nsharding:\n  zero_stage: 1\n")
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, n + 1):
            rec = {"step": step, "loss": 5.5 / step, "grad_norm": 1.0, "lr": 1e-3,
                   "tokens_per_s": 1000.0 + step, "step_time_s": 0.5}
            if mfu:
                rec["mfu"] = 0.3
            f.write(json.dumps(rec) + "\n")
    return path


def test_plot_one_run(tmp_path, capsys):
    run = _run(tmp_path / "a", 7)
    assert main(["plot", str(run)]) == 0
    n_lines = len((run / "metrics.jsonl").read_text().splitlines())
    for name in ("loss", "throughput", "mfu"):
        png = run / f"{name}.png"
        data = png.read_bytes()
        assert data.startswith(PNG) and len(data) > 1000
    assert "(7 points)" in capsys.readouterr().out
    written = plot_runs([run], tmp_path / "again")
    assert len(written) == 3 and all(list(v.values()) == [n_lines] for v in written.values())


def test_plot_overlays_runs(tmp_path):
    a = _run(tmp_path / "a", 7)
    b = _run(tmp_path / "b", 4, mfu=False, mesh="data: 8")
    out = tmp_path / "cmp"
    written = plot_runs([a, b], out)
    loss = written[str(out / "loss.png")]
    assert loss == {"a (data=2 fsdp=2 tensor=2, zero 1)": 7, "b (data=8, zero 1)": 4}
    assert written[str(out / "mfu.png")]["b (data=8, zero 1)"] == 0  # b logged no MFU
    assert (out / "throughput.png").read_bytes().startswith(PNG)


def test_read_metrics_tolerates_resume_and_nan(tmp_path):
    run = _run(tmp_path / "r", 3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": "nan", "tokens_per_s": 1.0}) + "\n")  # resumed: step 3 again
        f.write('{"step": 4, "loss": 1.0')  # cut short by a crash
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[-1]["loss"] == "nan"


def test_plot_missing_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "no metrics file" in capsys.readouterr().err


def test_plot_out_must_be_a_directory(tmp_path, capsys):
    """-o naming an existing file was a FileExistsError traceback: one error, exit 2, nothing written."""
    run = _run(tmp_path / "a", 3)
    taken = tmp_path / "loss.txt"
    taken.write_text("mine")
    assert main(["plot", str(run), "-o", str(taken)]) == 2
    err = capsys.readouterr().err
    assert f"jaxpar plot -o {taken}: an existing file; -o must be a directory" in err, err
    assert taken.read_text() == "mine"
    assert main(["plot", str(run), "-o", str(taken / "sub")]) == 2  # a file on the way
    err = capsys.readouterr().err
    assert "-o must be a directory" in err and "Traceback" not in err, err


def test_plot_labels_name_only_mesh_sizes(tmp_path):
    """A saved config.yaml has `auto: false` and `dcn: {}` in its mesh: the label was
    `a (data=2 fsdp=2 tensor=2 auto=False, zero 1)`; only axis sizes belong there."""
    run = _run(tmp_path / "a", 3, mesh="data: 2\n  fsdp: 2\n  pipeline: 1\n  tensor: 2\n  dcn: {}\n  auto: false")
    written = plot_runs([run], tmp_path / "out")
    assert list(written[str(tmp_path / "out" / "loss.png")]) == ["a (data=2 fsdp=2 tensor=2, zero 1)"]
