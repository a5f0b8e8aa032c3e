"""Goodput (issue 18, deliverable 3): the accounting of observe/goodput.py on event logs whose
figures are worked out by hand, `jaxpar goodput` and its errors, and one real run under `jaxpar
launch` killed once at a given step: the trainer's and the launcher's events, the redone steps,
productive + lost = wall time, and the same figures on the Prometheus exporter.

The killed run's process runs this file as a driver (`python tests/test_goodput.py SPEC`): it
runs the real `jaxpar train` CLI, kills itself once at each of the logged steps `kill_at` and
prints what its own exporter serves at step `scrape_at` (docs/benchmarks.md's three-failure run
uses it too)."""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.launch import run_dir_of
from jaxpar.observe.events import read_events, record
from jaxpar.observe.goodput import CAUSES, account, goodput_of
from tests.run_configs import CACHE_ENV, layout_run_yaml

pytestmark = pytest.mark.xdist_group("goodput")  # its module fixtures are built once, on one worker

ROOT = Path(__file__).resolve().parents[1]


def ev(t, event, source="train", **fields):
    return {"time": float(t), "event": event, "source": source, **fields}


def check(g, wall, productive, **lost):
    """The figures, each cause (the rest 0), and productive + lost = wall (exactly: a partition)."""
    assert g.wall_s == pytest.approx(wall)
    assert g.productive_s == pytest.approx(productive)
    assert g.lost_s == pytest.approx({c: lost.get(c, 0.0) for c in CAUSES})
    assert g.productive_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s, abs=1e-9)


# ---------------------------------------------------------------- the accounting, by hand


def test_a_finished_run_startup_saves_and_the_tail():
    events = [ev(0, "group_start", "launch", attempt=0, nprocs=1), ev(2, "start", restart_count=0),
              ev(5, "compiled", seconds=2.5), ev(7, "first_step", step=1), ev(17, "progress", step=10),
              ev(18, "checkpoint_save", step=10, blocking_s=0.5), ev(28, "progress", step=20),
              ev(28.5, "checkpoint_save", step=20, blocking_s=0.4), ev(29, "end", step=20),
              ev(30, "group_end", "launch", attempt=0, reason="done")]
    g = account(events[::-1])  # any order: sorted by time
    # start-up 0..7; training 7..29 less 0.9 of saves; 29..30 the launcher's tail
    check(g, 30, 22 - 0.9, startup=7, checkpoint_save=0.9, other=1)
    assert (g.sessions, g.crashes, g.preemptions, g.redone_steps) == (1, 0, 0, 0)
    assert (g.status, g.last_step) == ("finished", 20)
    assert g.ratio == pytest.approx(21.1 / 30)


def test_a_crash_counts_the_steps_after_the_resumed_checkpoint_as_redone():
    events = [ev(0, "wait_nodes_start", "ray", have=1, want=2), ev(3, "wait_nodes_end", "ray", have=2),
              ev(3, "group_start", "ray", attempt=0, nprocs=2), ev(4, "start", restart_count=0),
              ev(10, "first_step", step=1), ev(20, "progress", step=10),
              ev(21, "checkpoint_save", step=10, blocking_s=1.0), ev(30, "progress", step=20),
              # killed here, unseen; the launcher notices
              ev(32, "group_end", "ray", attempt=0, reason="node_lost"),
              ev(33, "group_start", "ray", attempt=1, nprocs=1), ev(35, "start", restart_count=1),
              ev(38, "compiled", seconds=2), ev(40, "checkpoint_restore", step=10, blocking_s=2.0),
              ev(40, "resume", step=10), ev(42, "first_step", step=11), ev(52, "progress", step=20),
              ev(62, "progress", step=30), ev(63, "checkpoint_save", step=30, blocking_s=1.0),
              ev(63, "end", step=30), ev(64, "group_end", "ray", attempt=1, reason="done")]
    g = account(events)
    # session 1 trained 10..30 (20 s), its save 1 s; step 10 was done at 20, so 20..30 less the
    # save is redone (9 s) and 10..20 productive; 30..33 other (the crash, the restart).
    # session 2: start-up 33..42 less the 2 s restore; trained 42..63 less its 1 s save.
    check(g, 64, 10 + 20, wait_nodes=3, startup=7 + 7, checkpoint_restore=2, checkpoint_save=2,
          redone=9, other=2 + 1 + 1)
    assert (g.sessions, g.crashes, g.redone_steps, g.status, g.last_step) == (2, 1, 10, "finished", 30)


def test_a_crash_before_any_checkpoint_redoes_the_whole_session():
    events = [ev(0, "start"), ev(2, "first_step", step=1), ev(12, "progress", step=10),
              ev(15, "start", restart_count=1),  # no end before it: a crash
              ev(20, "first_step", step=1), ev(30, "progress", step=10)]  # fresh start (no resume)
    g = account(events)
    check(g, 30, 10, startup=2 + 5, redone=10, other=3)
    assert (g.crashes, g.redone_steps, g.status) == (1, 10, "running")


def test_a_preemption_then_resume_redoes_nothing_and_the_gap_is_other():
    events = [ev(0, "start"), ev(4, "first_step", step=1), ev(14, "progress", step=10),
              ev(15, "checkpoint_save", step=10, blocking_s=0.5), ev(15, "preempted", step=10),
              ev(45, "start"),  # requeued by the scheduler 30 s later
              ev(50, "checkpoint_restore", step=10, blocking_s=1.0), ev(50, "resume", step=10),
              ev(52, "first_step", step=11), ev(62, "progress", step=20),
              ev(62.5, "checkpoint_save", step=20, blocking_s=0.5), ev(62.5, "end", step=20)]
    g = account(events)
    check(g, 62.5, 10.5 + 10, startup=4 + 6, checkpoint_restore=1, checkpoint_save=1, other=30)
    assert (g.sessions, g.crashes, g.preemptions, g.redone_steps, g.status) == (2, 0, 1, 0, "finished")


def test_no_end_is_a_run_still_going_and_a_failed_group_without_restart_is_a_crash():
    events = [ev(0, "start"), ev(5, "first_step", step=1), ev(15, "progress", step=10),
              ev(25, "progress", step=20)]
    g = account(events)
    check(g, 25, 20, startup=5)
    assert (g.status, g.crashes, g.redone_steps, g.last_step) == ("running", 0, 0, 20)
    g = account(events + [ev(27, "group_end", "launch", attempt=0, reason="failed")])
    check(g, 27, 20, startup=5, other=2)  # nothing resumed: nothing redone
    assert (g.status, g.crashes) == ("crashed", 1)


# ---------------------------------------------------------------- the CLI and its errors


def test_cli_prints_the_report_and_json(tmp_path, capsys):
    for e in [ev(100, "start"), ev(103, "first_step", step=1), ev(110, "progress", step=5),
              ev(110.5, "end", step=5)]:
        record(tmp_path, e.pop("event"), **e)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"time": 111, "event": "progr')  # a line cut short by a crash: skipped
    assert main(["goodput", str(tmp_path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["wall_s"] == 10.5 and got["productive_s"] == 7.5 and got["lost_s"]["startup"] == 3
    assert got["goodput"] == pytest.approx(7.5 / 10.5) and got["status"] == "finished"
    assert main(["goodput", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"productive\s+7\.5 s\s+71\.4%", out) and "start-up and compile" in out, out


def test_malformed_events_are_left_out_like_cut_lines_and_named(tmp_path, capsys):
    """A line with `"time": "abc"` was a ValueError traceback from the sort: a line that is not a
    well-formed event is left out as a line cut short by a crash is, and `jaxpar goodput` names
    the file and the line (on stderr: --json stays one document)."""
    for e in [ev(100, "start"), ev(103, "first_step", step=1), ev(110, "progress", step=5),
              ev(110.5, "end", step=5)]:
        record(tmp_path, e.pop("event"), **e)
    lines = (tmp_path / "events.jsonl").read_text().splitlines(keepends=True)
    lines.insert(2, '{"event": "progress", "source": "train", "step": 3, "time": "abc"}\n')
    lines.insert(4, '{"event": "progress", "source": "train", "step": "x", "time": 109}\n')
    lines.append('{"time": 111, "event": "progr')  # cut short by a crash
    (tmp_path / "events.jsonl").write_text("".join(lines))
    skipped = []
    assert [e["time"] for e in read_events(tmp_path, skipped)] == [100, 103, 110, 110.5]
    assert [n for n, _ in skipped] == [3, 5, 7], skipped
    assert main(["goodput", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["wall_s"] == 10.5
    path = tmp_path / "events.jsonl"
    assert (f"left out 3 lines of {path} that are not a well-formed event, as a line cut short by a crash "
            f"is: line 3: \"time\": 'abc' is not a number of seconds; line 5: \"step\": 'x'") in out.err, out.err
    assert "Traceback" not in out.err and out.err.count("\n") == 1


def test_bad_run_dirs_are_one_clear_error(tmp_path, capsys):
    assert main(["goodput", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "RUN_DIR" in err and "nope" in err and "not a directory" in err and "Traceback" not in err
    (tmp_path / "runs" / "a").mkdir(parents=True)
    record(tmp_path / "runs" / "a", "start")
    with pytest.raises(ConfigError, match=r"runs/events\.jsonl is missing or has no events; runs inside "
                                          r"it: .*runs/a"):
        goodput_of(tmp_path / "runs")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "events.jsonl").write_text("")
    with pytest.raises(ConfigError, match="has no events"):
        goodput_of(tmp_path / "empty")


def test_launch_finds_the_run_dir_of_a_train_command(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: mine\nrun_dir: somewhere\n")
    assert run_dir_of(["train", str(cfg), "name=other"]) == Path("somewhere/other")
    assert run_dir_of(["python", "x.py"]) is None
    assert run_dir_of(["train", str(tmp_path / "missing.yaml")]) is None  # the child reports it


# ---------------------------------------------------------------- a real run, killed once

STEPS, KILL_AT, EVERY = 8, 5, 3
# the layout of the other multi-process files (tests/run_configs.py): a test run compiles its
# step once for all of them
CONFIG = layout_run_yaml("gp", STEPS, f"every: {EVERY}, keep_last: 3") + (
    "observe: {prometheus: {enabled: true, port: 0}}\n")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """`jaxpar launch --nprocs 1 --max-restarts 1`: killed at step 5 (after its log), resumed
    from step 3, finished. Returns (run dir, launcher output, seconds the launcher ran)."""
    work = tmp_path_factory.mktemp("goodput")
    (work / "gp.yaml").write_text(CONFIG)
    run = work / "runs" / "gp"
    spec = {"argv": ["train", str(work / "gp.yaml"), f"run_dir={work / 'runs'}"],
            "kill_at": [KILL_AT], "markers": str(work), "scrape_at": STEPS}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **CACHE_ENV}
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nprocs", "1", "--devices-per-proc", "8",
           "--max-restarts", "1", "--run-dir", str(run), "--", "python", __file__, json.dumps(spec)]
    t0 = time.time()
    r = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=300)
    took = time.time() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    return run, r.stdout, took


def test_killed_run_events_from_trainer_and_launcher(killed_run):
    run, out, _ = killed_run
    assert f"[0] killing myself at step {KILL_AT}" in out and "[launch] restart 1 of 1" in out, out
    events = list(read_events(run))
    kinds = [(e["source"], e["event"]) for e in events]
    launch = [(e["event"], e.get("attempt"), e.get("reason")) for e in events if e["source"] == "launch"]
    assert launch == [("group_start", 0, None), ("group_end", 0, "failed"), ("group_start", 1, None),
                      ("group_end", 1, "done")]
    train = lambda kind, key="step": [e[key] for e in events if e["event"] == kind]
    assert train("start", "restart_count") == [0, 1]
    assert len(train("compiled", "seconds")) == 2 and all(s > 0 for s in train("compiled", "seconds"))
    assert train("first_step") == [1, EVERY + 1] and train("resume") == [EVERY]
    assert train("checkpoint_restore") == [EVERY] and train("end") == [STEPS]
    assert train("progress") == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]  # 4, 5 twice: redone
    assert train("checkpoint_save") == [EVERY, 6, STEPS]  # the crashed run saved only 3
    assert all(e["blocking_s"] >= 0 for e in events if e["event"].startswith("checkpoint_"))
    assert ("train", "preempted") not in kinds


def test_killed_run_goodput_accounts_for_the_redone_steps(killed_run):
    run, _, took = killed_run
    g = goodput_of(run)
    events = list(read_events(run))
    assert g.wall_s == pytest.approx(events[-1]["time"] - events[0]["time"])
    assert g.wall_s <= took and g.wall_s > 0.7 * took  # the launcher's own start-up is outside
    assert abs(g.productive_s + sum(g.lost_s.values()) - g.wall_s) <= 0.02 * g.wall_s
    assert (g.sessions, g.crashes, g.status, g.last_step) == (2, 1, "finished", STEPS)
    assert g.redone_steps == KILL_AT - EVERY
    # against the run's own step timings (metrics.jsonl, log_every=1: each step's host time; the
    # first of a session also times its start, the one after a save the save: left out)
    recs = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(recs) == list(range(1, STEPS + 1))
    per_step = statistics.median(r["step_time_s"] for s, r in recs.items() if s not in (1, 4, 7))
    assert 0.4 * STEPS * per_step < g.productive_s < 2.5 * STEPS * per_step + 1.0, (g.to_dict(), per_step)
    redo = (KILL_AT - EVERY) * per_step
    assert 0.3 * redo < g.lost_s["redone"] < 3 * redo + 0.5, (g.lost_s, redo)
    assert g.lost_s["startup"] > sum(e["seconds"] for e in events if e["event"] == "compiled")
    assert g.lost_s["checkpoint_restore"] > 0 and g.lost_s["other"] > 1.0  # restart_delay is 1 s
    assert g.lost_s["wait_nodes"] == 0


def test_killed_run_goodput_on_the_prometheus_exporter(killed_run):
    """At the last logged step the run's own exporter served the goodput of the events so far."""
    run, out, _ = killed_run
    served = dict(re.findall(r"^\[0\] scraped (jaxpar_goodput_\w+(?:\{[^}]*\})?) (\S+)$", out, re.M))
    events = list(read_events(run))
    last = next(i for i, e in enumerate(events) if e["event"] == "progress" and e["step"] == STEPS)
    g = account(events[:last + 1])
    base = 'process="0",run="gp"'
    assert float(served[f"jaxpar_goodput_ratio{{{base}}}"]) == pytest.approx(g.ratio, rel=1e-9)
    assert float(served[f"jaxpar_goodput_wall_seconds{{{base}}}"]) == pytest.approx(g.wall_s, rel=1e-9)
    for cause in CAUSES:
        got = float(served[f'jaxpar_goodput_lost_seconds{{cause="{cause}",{base}}}'])
        assert got == pytest.approx(g.lost_s[cause], rel=1e-9, abs=1e-9), cause
    assert float(served[f'jaxpar_goodput_lost_seconds{{cause="redone",{base}}}']) > 0


# ---------------------------------------------------------------- the driver (the launched process)


def _main(spec: dict) -> int:
    from jaxpar.observe.prometheus import PrometheusExporter
    from jaxpar.train import trainer as trainer_module
    from jaxpar.train.callbacks import Callback
    import urllib.request

    PrometheusExporter.goodput_every_s = 0.0  # every log step (the test compares at one)
    markers = {int(s): Path(spec["markers"]) / f"killed_at_{s}" for s in spec.get("kill_at", [])}

    class Hook(Callback):
        def on_log(self, trainer, record):
            step = record["step"]
            if step in markers and not markers[step].exists():  # once at each of these steps
                trainer.checkpointer.wait()  # the last save is whole before the kill
                markers[step].touch()
                print(f"killing myself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if step == spec.get("scrape_at"):
                [ex] = [c for c in trainer.callbacks if isinstance(c, PrometheusExporter)]
                text = urllib.request.urlopen(f"http://127.0.0.1:{ex.port}/metrics", timeout=10).read().decode()
                for line in text.splitlines():
                    if line.startswith("jaxpar_goodput_"):
                        print(f"scraped {line}", flush=True)

    build = trainer_module.build_callbacks
    trainer_module.build_callbacks = lambda *a, **kw: build(*a, **kw) + [Hook()]
    return main(spec["argv"])


if __name__ == "__main__":
    sys.exit(_main(json.loads(sys.argv[1])))
