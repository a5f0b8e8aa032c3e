"""Observability callbacks on a real (tiny) training run: Prometheus endpoint, profiler window,
hang/straggler watchdog. One compiled trainer is shared; each test runs a few steps of it."""
import contextlib
import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY, tiny_config
from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.observe import PrometheusExporter, Watchdog, build_callbacks, record_checkpoint_save
from jaxpar.observe.profiler import trace_files
from jaxpar.train.callbacks import Callback
from jaxpar.train.trainer import Trainer

pytestmark = pytest.mark.xdist_group("observe")
ROOT = Path(__file__).resolve().parents[1]
STEPS = 10


@pytest.fixture(scope="module")
def trainer(devices):
    tr = Trainer(tiny_config(f"train.steps={STEPS}"), log=lambda s: None)
    tr.compile()
    return tr


def scrape(port: int) -> dict:
    """name -> list of (labels, value), parsed with prometheus_client's own parser."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


class Scraper(Callback):
    def __init__(self, exporter, at):
        self.exporter, self.at, self.seen = exporter, at, {}

    def on_step_end(self, trainer, step, state, metrics):
        if step == self.at[0]:
            record_checkpoint_save(1.25)  # what the checkpoint code calls after a save
        if step in self.at:
            self.seen[step] = scrape(self.exporter.port)


class AddSkipped(Callback):
    def on_log(self, trainer, record):
        record["skipped_steps"] = 2.0  # as if the step reported skipped (non-finite) steps
        record.setdefault("mfu", 0.375)  # CPU has no known peak, so the loop logs no MFU


def test_prometheus_endpoint_during_training(trainer, tmp_path):
    cfg = tiny_config("observe.prometheus.enabled=true", "observe.prometheus.port=0", "name=prom")
    assert cfg.observe.prometheus.host == "127.0.0.1"
    cbs = build_callbacks(cfg, out_dir=tmp_path)
    [exporter] = [c for c in cbs if isinstance(c, PrometheusExporter)]
    scraper = Scraper(exporter, at=(6, 9))
    trainer.callbacks = [AddSkipped(), *cbs, scraper]
    trainer.fit(trainer.init_state(), start_step=4, out_dir=tmp_path)
    first, last = scraper.seen[6], scraper.seen[9]
    value = lambda m, name: m[name][0][1]
    assert value(first, "jaxpar_step") == 6 and value(last, "jaxpar_step") == 9
    assert value(first, "jaxpar_steps_total") == 2 and value(last, "jaxpar_steps_total") == 5
    assert first["jaxpar_step"][0][0] == {"run": "prom", "process": "0"}
    for name in ("jaxpar_loss", "jaxpar_grad_norm", "jaxpar_learning_rate", "jaxpar_step_time_seconds",
                 "jaxpar_tokens_per_second", "jaxpar_last_step_timestamp_seconds"):
        assert name in last, name
    assert 0 < value(last, "jaxpar_loss") < 10 and value(last, "jaxpar_tokens_per_second") > 0
    assert value(last, "jaxpar_skipped_steps") == 2 and value(last, "jaxpar_mfu_ratio") == 0.375
    assert value(last, "jaxpar_checkpoint_save_seconds") == 1.25
    coll = {lab["collective"]: v for lab, v in last["jaxpar_collective_bytes_per_step"]}
    assert coll["all-reduce"] > 0 and set(coll) >= {"all-gather", "reduce-scatter", "all-to-all"}
    mem = last["jaxpar_device_memory_in_use_bytes"]
    assert len(mem) == 8 and all(v > 0 for _, v in mem)
    assert {lab["source"] for lab, _ in mem} == {"compiled_estimate"}  # CPU gives no allocator stats
    assert last["jaxpar_device_memory_peak_bytes"][0][1] >= mem[0][1]
    # every metric the Grafana dashboard queries is one the exporter serves
    dash = json.loads((ROOT / "deploy/grafana/jaxpar-training.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bjaxpar_[a-z_]+", e)}
    served = set(last) | {"jaxpar_device_memory_limit_bytes",  # no allocator stats on CPU
                          "jaxpar_watchdog_last_report_step"}  # only after a report
    assert used and used <= served, used - served
    # closed with the loop
    with pytest.raises(urllib.error.URLError):
        scrape(exporter.port)


def _non_loopback_ip() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it picks the outgoing interface
        ip = s.getsockname()[0]
    except OSError:
        ip = None
    finally:
        s.close()
    if not ip or ip.startswith("127.") or ip == "0.0.0.0":
        try:
            ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            ip = None
    return None if not ip or ip.startswith("127.") else ip


def test_endpoint_only_on_loopback_by_default():
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try the endpoint on")
    cfg = tiny_config("observe.prometheus.enabled=true", "observe.prometheus.port=0")
    [exporter] = build_callbacks(cfg)
    exporter.on_start(SimpleNamespace(log=lambda s: None), 0, None)
    try:
        assert "jaxpar_step" in scrape(exporter.port)  # reachable on loopback
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((ip, exporter.port), timeout=5).close()
    finally:
        exporter.close()


def test_taken_prometheus_port_is_one_config_error(tmp_path, capsys):
    """A port something listens on was an OSError traceback from on_start, after the compile: it is
    one ConfigError naming the field, the address and the fix, before compiling (build_callbacks),
    and still one at on_start when the port was taken in between."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        msg = f"observe.prometheus.port={port}: 127.0.0.1:{port} is in use; use another port or port: 0"
        with pytest.raises(ConfigError, match=re.escape(msg)):
            build_callbacks(tiny_config("observe.prometheus.enabled=true", f"observe.prometheus.port={port}"))
        rc = main(["train", str(ROOT / "configs/quickstart.yaml"), f"run_dir={tmp_path}", "model.n_layers=1",
                   "data.source=synthetic", "observe.prometheus.enabled=true", f"observe.prometheus.port={port}"])
        captured = capsys.readouterr()
        assert rc == 2 and f"jaxpar: error: {msg}" in captured.err, captured.err
        assert "Traceback" not in captured.err and "compiled step" not in captured.out
    # free when the callbacks were built, taken by the time the loop starts
    [exporter] = build_callbacks(tiny_config("observe.prometheus.enabled=true", f"observe.prometheus.port={port}"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        with pytest.raises(ConfigError, match=re.escape(msg)):
            exporter.on_start(SimpleNamespace(log=lambda s: None), 0, None)
    exporter.close()


def test_a_host_nothing_can_listen_on_is_one_error_before_compiling_with_port_0():
    """port: 0 skipped the listen check at build_callbacks: a host not of this machine failed only
    at on_start, after the step compiled (a free port says nothing of the host)."""
    cfg = tiny_config("observe.prometheus.enabled=true", "observe.prometheus.port=0",
                      "observe.prometheus.host=192.0.2.1")  # TEST-NET-1: no machine's own address
    with pytest.raises(ConfigError, match=r"observe.prometheus.host='192.0.2.1': cannot listen on 192.0.2.1:0"):
        build_callbacks(cfg)


def test_profile_window_writes_trace(trainer, tmp_path, capsys):
    cfg = tiny_config(f"train.steps={STEPS}", "profile.steps=[8,9]")
    trainer.callbacks = build_callbacks(cfg, out_dir=tmp_path)
    trainer.fit(trainer.init_state(), start_step=6, out_dir=tmp_path)
    files = trace_files(tmp_path)
    assert any(f.name.endswith(".xplane.pb") for f in files), files
    assert all(f.stat().st_size > 0 for f in files)
    assert main(["profile", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "xprof --logdir" in out and "ui.perfetto.dev" in out and files[0].name in out
    assert main(["profile", str(tmp_path), "--summary"]) == 0  # a CPU trace: no device lines
    out = capsys.readouterr().out
    assert "profile window:" in out and "no device lines" in out and "PjitFunction(" in out


@pytest.mark.parametrize("sub", ["traces/window", "."])
def test_profile_window_names_the_run_dir_to_open(sub, tmp_path, monkeypatch):
    """With a nested profile.dir (or '.') the end-of-window message said `jaxpar profile` of the
    trace dir's parent, a dir without the run's config.yaml (so: no trace files)."""
    import jax
    [window] = build_callbacks(tiny_config("profile.steps=[1,1]", f"profile.dir={sub}"), out_dir=tmp_path)
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)  # no trace was started
    said = []
    window.active = True
    window._finish(SimpleNamespace(log=said.append))
    assert said == [f"profile written to {tmp_path / sub} (open it: jaxpar profile {tmp_path})"]


def _trace(path, events):
    import gzip
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(Nccl)"}},
            {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Modules"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "python3"}}]
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + [{"ph": "X", **e} for e in events]}, f)


def test_trace_summary_device_busy_idle_collectives_and_dispatch(tmp_path, capsys):
    """Two steps of 10 ms (µs below): compute 0-6 and 10-16, an all-reduce 5-8 on another stream
    (1 of its 3 ms under compute), the modules 0-8 and 10-16; two nested dispatch events per call."""
    ev = [dict(pid=1, tid=7, name="fusion.1", ts=0, dur=6000), dict(pid=1, tid=7, name="fusion.1", ts=10000, dur=6000),
          dict(pid=1, tid=8, name="all-reduce-start.3", ts=5000, dur=3000),
          dict(pid=1, tid=9, name="jit_step(1)", ts=0, dur=8000),
          dict(pid=1, tid=9, name="jit_step(1)", ts=10000, dur=6000),
          dict(pid=2, tid=1, name="PjitFunction(jit(step))", ts=-1000, dur=500),
          dict(pid=2, tid=1, name="PjitFunction(jit(step))", ts=-900, dur=300),
          dict(pid=2, tid=1, name="PjitFunction(jit(step))", ts=9000, dur=500),
          dict(pid=2, tid=1, name="PjitFunction(jit(step))", ts=9100, dur=300)]
    run = tmp_path / "run"
    _trace(run / "profile" / "plugins" / "profile" / "t" / "perfetto_trace.json.gz", ev)
    (run / "config.yaml").write_text("profile:\n  steps: [4, 5]\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0, "tokens_per_s": 5000.0,
                                                   "step_time_s": 0.01, "mfu": 0.42}) + "\n")
    from jaxpar.observe.trace_summary import load_trace, summarize
    s = summarize(load_trace(run / "profile/plugins/profile/t/perfetto_trace.json.gz"), steps=2)
    assert s["window_ms"] == pytest.approx(17.0) and s["basis"] == "CUDA streams"
    assert s["device_busy_ms"] == pytest.approx(14.0) and s["device_idle_per_step_ms"] == pytest.approx(1.5)
    assert s["collective_ms"] == pytest.approx(3.0) and s["collective_hidden_ms"] == pytest.approx(1.0)
    assert s["modules"] == {"count": 2, "ms": pytest.approx(14.0), "gaps_ms": pytest.approx(2.0),
                            "max_gap_ms": pytest.approx(2.0)}
    assert s["dispatch"] == [{"name": "PjitFunction(jit(step))", "count": 2, "mean_ms": pytest.approx(0.5)}]
    assert s["top_ops"][0] == {"name": "fusion.1", "count": 2, "ms": pytest.approx(12.0)}
    assert main(["profile", str(run), "--summary"]) == 0
    out = capsys.readouterr().out
    assert "(steps 4-5)" in out and "8.50 ms per step" in out and "33% overlapped" in out
    assert "logged step 10: 5000 tokens/s, step 10.0 ms, MFU 42.0%" in out
    (tmp_path / "none").mkdir()  # a run dir without a trace: rc 1, as before
    assert main(["profile", str(tmp_path / "none"), "--summary"]) == 1
    assert "no perfetto_trace.json.gz" in capsys.readouterr().out


def test_profile_summary_reads_a_metrics_file_cut_short(tmp_path, capsys):
    """A run killed mid-write leaves a partial last line in metrics.jsonl: `jaxpar profile
    --summary` ended in a JSONDecodeError traceback (jaxpar plot skips such a line)."""
    run = tmp_path / "run"
    _trace(run / "profile" / "plugins" / "profile" / "t" / "perfetto_trace.json.gz",
           [dict(pid=1, tid=7, name="fusion.1", ts=0, dur=6000)])
    (run / "config.yaml").write_text("profile:\n  steps: [4, 5]\n")
    good = {"step": 10, "loss": 1.0, "tokens_per_s": 5000.0, "step_time_s": 0.01}
    (run / "metrics.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(good)[:17])
    assert main(["profile", str(run), "--summary", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == [good]


def test_profile_of_a_missing_run_dir_is_an_error(tmp_path, capsys):
    """`jaxpar profile /nonexist` said "no trace files under /nonexist/profile yet" (rc 1), as if
    the run had not reached its window: a dir that is not there is an error naming it (as goodput)."""
    for extra in ([], ["--summary"]):
        assert main(["profile", str(tmp_path / "nope"), *extra]) == 2
        err = capsys.readouterr().err
        assert f"jaxpar: error: jaxpar profile: RUN_DIR '{tmp_path / 'nope'}' is not a directory" in err, err
    (tmp_path / "run").mkdir()
    assert main(["profile", str(tmp_path / "run")]) == 1
    assert "no trace files under" in capsys.readouterr().out


class Sleeper(Callback):
    def __init__(self, step, seconds):
        self.step, self.seconds = step, seconds

    def on_step_end(self, trainer, step, state, metrics):
        if step == self.step:
            time.sleep(self.seconds)


def test_watchdog_reports_hang_and_straggler_with_stacks(trainer, tmp_path, caplog):
    cfg = tiny_config("observe.watchdog.enabled=true", "observe.watchdog.timeout_s=1.5",
                      "observe.watchdog.straggler_factor=5", "observe.watchdog.min_steps=2")
    cbs = build_callbacks(cfg, out_dir=tmp_path)
    [wd] = cbs
    trainer.callbacks = [Sleeper(8, 3.0), *cbs]
    with caplog.at_level(logging.WARNING, logger="jaxpar.observe.watchdog"):
        trainer.fit(trainer.init_state(), start_step=3, out_dir=tmp_path)
    hangs = [r for r in wd.reports if r["kind"] == "hang" and r["step"] == 8]
    slow = [r for r in wd.reports if r["kind"] == "straggler" and r["step"] == 8]
    assert hangs and hangs[0]["elapsed_s"] > 1.5
    # the hang is reported while the step still runs: the stack shows where it waits
    assert "time.sleep(self.seconds)" in hangs[0]["stacks"] and "jaxpar-watchdog" in hangs[0]["stacks"]
    # the 3 s held, as the watchdog's clock saw it (its window may start a few ms into the sleep:
    # 2.997 s was read once on jax 0.10.2)
    assert slow and slow[0]["elapsed_s"] > 2.9 and "x the median" in slow[0]["message"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "no step finished within 1.5s" in logged and "Python stacks of all threads" in logged
    assert "step 8 took" in (tmp_path / "watchdog.log").read_text()
    assert "collectives in the compiled step" in hangs[0]["message"] and "all-reduce" in hangs[0]["message"]
    assert wd._thread is None  # stopped with the loop


def test_watchdog_abort_and_exemptions():
    codes = []
    wd = Watchdog(timeout_s=0.2, abort=True, exit_code=7, exit_fn=codes.append, poll_s=0.02)
    wd.on_start(SimpleNamespace(), 0, None)
    time.sleep(0.6)
    wd.close()
    assert codes == [7] and wd.reports[0]["kind"] == "hang" and wd.reports[0]["step"] == 1

    wd = Watchdog(timeout_s=60, straggler_factor=3, min_steps=2)
    wd.on_start(SimpleNamespace(), 0, None)
    for step in range(1, 5):  # warm-up step, then three timed steps
        time.sleep(0.02)
        wd.on_step_end(None, step, None, None)
    record_checkpoint_save(0.5)
    time.sleep(0.3)
    wd.on_step_end(None, 5, None, None)  # slow because it saved: not a straggler
    assert wd.reports == []
    time.sleep(0.5)
    wd.on_step_end(None, 6, None, None)
    wd.close()
    assert [r["step"] for r in wd.reports] == [6]


def test_an_evaluation_does_not_make_the_next_step_a_straggler():
    """The loop waits for an evaluation (eval.every; its first call also compiles) between two
    steps: the next step's time held it and the watchdog reported that step a straggler."""
    wd = Watchdog(timeout_s=60, straggler_factor=3, min_steps=2)
    wd.on_start(SimpleNamespace(), 0, None)
    for step in range(1, 5):  # warm-up step, then three timed steps
        time.sleep(0.02)
        wd.on_step_end(None, step, None, None)

    def evaluator(params):
        time.sleep(0.3)
        return {"eval_loss": 1.0, "eval_ppl": 2.7}

    loop = SimpleNamespace(evaluator=evaluator, cfg=tiny_config("eval.every=4", "data.eval_fraction=0.1"),
                           log=lambda msg: None)
    step_log = SimpleNamespace(paused=contextlib.nullcontext, bar=SimpleNamespace(write=lambda msg, log: None))
    assert Trainer._evaluate(loop, 4, {"params": None}, {}, step_log)  # after step 4's on_step_end
    wd.on_step_end(None, 5, None, None)  # slow because of the evaluation: not a straggler
    assert wd.reports == []
    time.sleep(0.5)
    wd.on_step_end(None, 6, None, None)
    wd.close()
    assert [r["step"] for r in wd.reports] == [6]


def test_observe_config_errors():
    with pytest.raises(ConfigError, match="profile.steps"):
        tiny_config("profile.steps=[5,2]")
    with pytest.raises(ConfigError, match="did you mean 'timeout_s'"):
        tiny_config("observe.watchdog.timeout=3")
    assert build_callbacks(tiny_config()) == []  # everything off by default


@pytest.mark.parametrize("bad", ["../../escprof", "/tmp/prof", "a/../../b"])
def test_profile_dir_stays_inside_the_run_dir(bad, tmp_path):
    """Traces go into <run dir>/<profile.dir>: a dir that leaves it is refused, naming the field
    and value; one that stays (even through '..') is fine."""
    with pytest.raises(ConfigError, match=r"profile.dir = '" + re.escape(bad) + "'.*relative path"):
        tiny_config(f"profile.dir={bad}")
    assert tiny_config("profile.dir=traces/../prof").profile.dir == "traces/../prof"
    # a hand-edited config.yaml never points `jaxpar profile` outside the run either
    from jaxpar.observe.profiler import run_profile_dir
    (tmp_path / "config.yaml").write_text(f"profile:\n  dir: {bad}\n")
    assert run_profile_dir(tmp_path) == "profile"


def test_jaxpar_train_attaches_callbacks(trainer, tmp_path):
    """The CLI builds the callbacks the config asks for. The model and its learning-rate schedule
    are the module trainer's (decay over its STEPS), so the step loads from the compilation cache."""
    (tmp_path / "obs.yaml").write_text("name: obs\n")
    rc = main(["train", str(tmp_path / "obs.yaml"), f"run_dir={tmp_path}", *TINY, f"optimizer.decay_steps={STEPS}",
               "profile.steps=[2,2]", "observe.watchdog.enabled=true", "observe.prometheus.enabled=true",
               "observe.prometheus.port=0"])
    assert rc == 0
    assert trace_files(tmp_path / "obs")
