"""The SLURM path, run on a real one-node SLURM (tests/slurm_cluster.py): the rendered
deploy/slurm/jaxpar.sbatch, CPU variant (2 tasks, 4 forced CPU devices each), trains with jax's
SLURM cluster detection to the losses and gradient norms of one process on the 8 devices;
`scancel --signal=TERM` makes both tasks save at one step and exit 0, and the job, requeued
(`scontrol requeue`), resumes from that checkpoint and ends on the same losses.

Needs root and the Debian packages slurm-wlm and munge (`.ci/run` installs them when it can);
skipped otherwise. A requeued job is held for SLURM's credential lifetime (cred_expire, 120 s)
before it may start again; the test makes it eligible at once (scontrol update StartTime=now),
a few seconds after the first run ended (slurmd refuses credentials of a job id issued in the
second it revoked that job's).
On a failure the messages carry the job's output and the daemons' logs."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import missing, one_node_slurm, short_dir
from tests.run_configs import CACHE_ENV, layout_run_yaml

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]
ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
TIMES: dict = {}  # what the run measured, printed at the end (docs/benchmarks.md)
CONFIG = layout_run_yaml("sl", STEPS, "every: 1000, keep_last: 2")
if missing():
    pytest.skip(f"a one-node SLURM needs {', '.join(missing())} (apt-get install slurm-wlm munge)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm")
    os.chmod(d, 0o755)
    (d / "sl.yaml").write_text(CONFIG)
    return d


def _env(work: Path) -> dict:
    """What the jaxpar processes see, under the launcher and under sbatch alike."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                **CACHE_ENV})
    return env


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """{step: loss} (or another per-step metric) from the run's metrics.jsonl."""
    path = run_dir / "sl" / "metrics.jsonl"
    if not path.exists():
        return {}
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"metrics.jsonl steps not one clean sequence: {steps}"
    return {r["step"]: r[key] for r in recs}


@pytest.fixture(scope="module")
def reference(work, devices):
    """1 process x 8 devices (this one), uninterrupted, no checkpoints: {metric: {step: value}}.
    (2 processes x 4 devices under `jaxpar launch` reach these within 1e-5 too:
    test_multihost_train.py.)"""
    import yaml
    from jaxpar.config import make_config
    from jaxpar.train.trainer import Trainer
    cfg = make_config(yaml.safe_load(CONFIG), [f"run_dir={work / 'ref'}", "checkpoint.enabled=false"])
    t0 = time.monotonic()
    _, history = Trainer(cfg).fit(progress=False)
    TIMES["reference_s"] = time.monotonic() - t0
    got = {k: {h["step"]: h[k] for h in history} for k in ("loss", "grad_norm")}
    assert sorted(got["loss"]) == list(range(1, STEPS + 1)), got
    return got


def _job(env: dict, job: str) -> dict:
    r = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def _tails(*paths: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + (p.read_text(errors="replace")[-2500:] if p.exists() else "(none)")
                     for p in paths)


def _wait(pred, timeout: float, what: str, logs: tuple):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout:.0f}s\n{_tails(*logs)}")
        time.sleep(0.2)


def _finished(env: dict, job: str, restarts: int):
    info = _job(env, job)
    if int(info.get("Restarts", 0)) == restarts and info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED",
                                                                          "TIMEOUT", "NODE_FAIL"):
        return info
    return None


def test_sbatch_trains_like_launch_saves_on_scancel_and_resumes_when_requeued(work, reference):
    sys.path.insert(0, str(ROOT / "deploy"))
    from render import render
    sys.path.pop(0)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]  # as jaxpar launch does
    run = work / "slurm"
    script = render((ROOT / "deploy/slurm/jaxpar.sbatch").read_text(), dict(
        JOB_NAME="sl", NODES="1", TASKS_PER_NODE="2", CPUS_PER_TASK="1", TIME="10:00",
        XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=4"]),
        CONFIG=str(work / "sl.yaml"), WORKDIR=str(work), VENV=sys.prefix, RUN_DIR=str(run),
        PORT=str(_free_port()), PREEMPT_NOTICE_S="120", SAVE_GRACE_S="90"))
    (work / "job.sbatch").write_text(script)
    times = TIMES
    with short_dir() as slurm_dir, one_node_slurm(slurm_dir) as cluster:
        env = {**_env(work), "SLURM_CONF": cluster["SLURM_CONF"]}
        t0 = time.monotonic()
        r = subprocess.run(["sbatch", "--parsable", "job.sbatch"], env=env, cwd=work, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().split(";")[0]
        out = work / f"sl-{job}.out"
        logs = (out, slurm_dir / "slurmctld.log", slurm_dir / "slurmd.log")
        _wait(lambda: _job(env, job)["JobState"] == "RUNNING", 30, "the job running", logs)
        times["submit_to_running_s"] = time.monotonic() - t0
        # config.yaml: both processes joined and agreed on the resume plan, the step is compiling.
        # SIGTERM now, not after a step: however fast the steps, it lands before the end.
        _wait(lambda: (run / "sl" / "config.yaml").exists(), 240, "the run's config.yaml", logs)
        times["submit_to_joined_s"] = time.monotonic() - t0
        subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True)
        t1 = time.monotonic()
        info = _wait(lambda: _finished(env, job, 0), 180, "the job stopping on SIGTERM", logs)
        times["sigterm_to_end_s"] = time.monotonic() - t1
        first = out.read_text()
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, _tails(*logs))
        assert "jax.distributed: process 1 of 2, 4 local devices of 8 (coordinator localhost:" in first, first
        stop = int(re.search(r"^stopped by preemption notice after step (\d+)", first, re.M)[1])
        assert 1 <= stop < STEPS, first
        saved = sorted(int(p.name) for p in (run / "sl" / "checkpoints").iterdir() if p.name.isdigit())
        assert saved == [stop], saved  # checkpoint.every=1000: the preemption save and nothing else
        assert sorted(losses(run)) == list(range(1, stop + 1))

        time.sleep(2)
        subprocess.run(["scontrol", "requeue", job], env=env, check=True)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
        t2 = time.monotonic()
        info = _wait(lambda: _finished(env, job, 1), 240, "the requeued job", logs)
        times["requeue_to_end_s"] = time.monotonic() - t2
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, _tails(*logs))
    second = out.read_text()[len(first):]  # --open-mode=append: the requeued run's output follows
    assert f"jaxpar: job {job} (restart 1)" in second, second
    assert re.search(rf"resumed from .*\b{stop}\b", second), second
    for key, ref in reference.items():  # the loss and the gradient norm, before the stop and after
        got = losses(run, key)
        assert sorted(got) == list(range(1, STEPS + 1)), got
        for s in range(1, STEPS + 1):
            assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (key, s, got[s], ref[s])
    times.update(stop_step=stop, steps=STEPS)
    print("slurm check:", json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in times.items()}))


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
