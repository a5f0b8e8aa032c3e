"""Runs that are killed (SIGKILL at any step, also mid-save), preempted (SIGTERM) or brought back
on another device count continue the loss curve: bit for bit on the same mesh, within 1e-5
across meshes. Each run is a subprocess (`python tests/test_checkpoint_resume.py ...` drives
`jaxpar.train.trainer.run`, with a hook that kills it at a given step; the elastic runs use the
`jaxpar train` CLI). The subprocesses share a persistent compilation cache, and each gets its
own PYTHONHASHSEED (nothing in a run may depend on it: the order of a set of mesh axes did once,
and changed the last bit of the loss from one process to the next)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar.launch import forced_device_flags
from tests.run_configs import CACHE_ENV, layout_run_yaml

# one worker runs them all (with `--dist loadgroup`, as `make test` runs): they share the reference run
pytestmark = pytest.mark.xdist_group("checkpoint_resume")
ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
CONFIG = layout_run_yaml("ck", STEPS, "every: 2, keep_last: 3, keep_every: 4")


_SEEDS = iter(range(1, 1000))


def _env(tmp: Path, n_devices: int) -> dict:
    env = dict(os.environ)
    # the test process's XLA flags (tests/conftest.py: LLVM at -O0, which compiles faster) with
    # this run's device count, as `jaxpar launch` does: every run of a test has the same flags
    env.update({
        "PYTHONHASHSEED": str(next(_SEEDS)),
        "XLA_FLAGS": forced_device_flags(env.get("XLA_FLAGS", ""), n_devices),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        **CACHE_ENV,
    })
    return env


def drive(tmp: Path, run_dir: Path, *overrides: str, kill_at: int | None = None, kill_in: str = "step",
          sleep: float = 0.0, n_devices: int = 8, wait: bool = True):
    """Start one training run of CONFIG (+ overrides) in `run_dir`; returns the Popen / result."""
    cfg = tmp / "ck.yaml"
    cfg.write_text(CONFIG)
    spec = {"config": str(cfg), "overrides": [f"run_dir={run_dir}", *overrides],
            "kill_at": kill_at, "kill_in": kill_in, "sleep": sleep}
    cmd = [sys.executable, __file__, json.dumps(spec)]
    proc = subprocess.Popen(cmd, env=_env(tmp, n_devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def cli(tmp: Path, run_dir: Path, *overrides: str, n_devices: int = 8):
    cfg = tmp / "ck.yaml"
    cfg.write_text(CONFIG)
    r = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", str(cfg), f"run_dir={run_dir}", *overrides],
                       env=_env(tmp, n_devices), capture_output=True, text=True, timeout=300, cwd=tmp)
    return r.returncode, r.stdout + r.stderr


def records(run_dir: Path) -> dict[int, dict]:
    recs = [json.loads(x) for x in (run_dir / "ck" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"metrics.jsonl steps not one clean sequence: {steps}"
    return {r["step"]: r for r in recs}


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in records(run_dir).items()}


def assert_same_run(run_dir: Path, ref_dir: Path) -> None:
    """The resumed run is the uninterrupted one, bit for bit: the losses and gradient norms of
    every step in metrics.jsonl, and the final train state (its checksums)."""
    got, ref = records(run_dir), records(ref_dir)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    assert {s: r["loss"] for s, r in got.items()} == {s: r["loss"] for s, r in ref.items()}
    assert {s: r["grad_norm"] for s, r in got.items()} == {s: r["grad_norm"] for s, r in ref.items()}
    from jaxpar.checkpoint import read_meta
    final = lambda d: read_meta(d / "ck" / "checkpoints" / str(STEPS))["checksums"]
    assert final(run_dir) == final(ref_dir)


def finalized(run_dir: Path) -> list[int]:
    d = run_dir / "ck" / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt_resume")


@pytest.fixture(scope="module")
def reference(work):
    """The uninterrupted run (8 devices, data=2,fsdp=2,tensor=2)."""
    rc, out = drive(work, work / "ref")
    assert rc == 0, out
    assert "fresh start" in out
    ref = losses(work / "ref")
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert finalized(work / "ref") == [4, 6, 8, 10]  # latest 3 plus every 4th
    return ref


@pytest.mark.slow
def test_sigkill_anywhere_resumes_bit_for_bit(work, reference):
    run = work / "killed"

    # 1. killed after step 5 ran (the save of 2 is whole: the save of 4 waited for it)
    rc, out = drive(work, run, kill_at=5)
    assert rc == -signal.SIGKILL, out
    assert 2 in finalized(run) and max(losses(run)) == 4
    # 2. resumes from the latest whole checkpoint; killed right after the async save of 8 began
    rc, out = drive(work, run, kill_at=8, kill_in="save")
    assert rc == -signal.SIGKILL, out
    assert "resumed from" in out
    assert finalized(run)[-1] == 6, "the save of step 8 finished before the kill; the test needs it in flight"
    assert max(losses(run)) == 8  # metrics past the last whole checkpoint: dropped on resume
    # 3. resumes from 6 (the half-written 8 is not taken for a whole one) and finishes
    rc, out = drive(work, run)
    assert rc == 0, out
    assert "checkpoints/6 (step 6" in out
    assert_same_run(run, work / "ref")


@pytest.mark.slow
def test_sigterm_saves_at_current_step_and_exits_0(work, reference):
    run = work / "term"
    proc = drive(work, run, sleep=0.4, wait=False)
    metrics = run / "ck" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SIGTERM received" in out and "stopped by SIGTERM" in out
    got = losses(run)
    stop = max(got)
    assert stop < STEPS, out
    assert finalized(run)[-1] == stop  # a checkpoint at the step it stopped at
    rc, out = drive(work, run)
    assert rc == 0, out
    assert f"checkpoints/{stop} (step {stop}" in out
    assert_same_run(run, work / "ref")


@pytest.mark.slow
def test_elastic_resume_8_to_4_to_2_to_8(work, reference):
    """Saved on data=2,fsdp=2,tensor=2 over 8 devices; the same command on 4 devices (mesh and
    grad_accum adapt, ZeRO-3 this time), then on 2 devices with data=2 (tensor 2 -> 1), then 8 again."""
    run = work / "elastic"
    (run / "ck" / "checkpoints").mkdir(parents=True)
    shutil.copytree(work / "ref" / "ck" / "checkpoints" / "4", run / "ck" / "checkpoints" / "4")
    ref_lines = (work / "ref" / "ck" / "metrics.jsonl").read_text().splitlines()[:4]
    (run / "ck" / "metrics.jsonl").write_text("\n".join(ref_lines) + "\n")

    def check(upto):
        got = losses(run)
        for s in range(1, upto + 1):
            assert abs(got[s] - reference[s]) <= 1e-5 * abs(reference[s]), (s, got[s], reference[s])
        assert max(got) == upto

    rc, out = cli(work, run, "train.steps=6", "sharding.zero_stage=3", n_devices=4)
    assert rc == 0, out
    assert "elastic resume: mesh" in out and "data=1,fsdp=2,tensor=2" in out
    assert "train.grad_accum 1 -> 2" in out and "checkpoints/4 (step 4" in out
    check(6)
    rc, out = cli(work, run, "train.steps=8", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", n_devices=2)
    assert rc == 0, out
    assert "train.grad_accum 1 -> 2" in out and "checkpoints/6 (step 6" in out
    check(8)
    rc, out = cli(work, run, n_devices=8)
    assert rc == 0, out
    assert "checkpoints/8 (step 8" in out and "saved on data=2, 2 devices" in out
    check(STEPS)
    # a layout that cannot keep the global batch of 16 is refused with one clear message
    rc, out = cli(work, run, "train.steps=12", "optimizer.decay_steps=12", "mesh.data=-1", "mesh.fsdp=1",
                  "mesh.tensor=1", n_devices=6)
    assert rc == 2 and "cannot keep the global batch" in out and "Traceback" not in out, out


@pytest.mark.slow
def test_elastic_resume_replans_with_mesh_auto(work, reference):
    """`mesh: auto` resumed on 4 devices: the planner (not the fixed adaptation rule) picks the
    layout for the devices found, under the same global batch, and the losses go on unchanged."""
    run = work / "auto"
    (run / "ck" / "checkpoints").mkdir(parents=True)
    shutil.copytree(work / "ref" / "ck" / "checkpoints" / "4", run / "ck" / "checkpoints" / "4")
    ref_lines = (work / "ref" / "ck" / "metrics.jsonl").read_text().splitlines()[:4]
    (run / "ck" / "metrics.jsonl").write_text("\n".join(ref_lines) + "\n")
    rc, out = cli(work, run, "train.steps=6", "mesh=auto", n_devices=4)
    assert rc == 0, out
    assert "planner (mesh: auto, cluster cpu8, 4 devices)" in out and "elastic resume: mesh" not in out, out
    assert "checkpoints/4 (step 4" in out
    got = losses(run)
    for s in range(1, 7):
        assert abs(got[s] - reference[s]) <= 1e-5 * abs(reference[s]), (s, got[s], reference[s])


# ---------------------------------------------------------------- the driver (a subprocess)


def _main(spec: dict) -> int:
    from jaxpar.config import load_config
    from jaxpar.train.callbacks import Callback
    from jaxpar.xla import apply_xla_flags

    cfg = load_config(spec["config"], spec["overrides"])
    apply_xla_flags(cfg)
    from jaxpar import checkpoint
    from jaxpar.train.trainer import run

    kill_at, kill_in, sleep = spec["kill_at"], spec["kill_in"], spec["sleep"]

    def die():
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    class Hook(Callback):
        def on_step_end(self, trainer, step, state, metrics):
            if sleep:
                time.sleep(sleep)
            if kill_in == "step" and step == kill_at:
                die()

    if kill_in == "save":
        save = checkpoint.Checkpointer.save

        def save_then_die(self, step, *a, **kw):
            save(self, step, *a, **kw)
            if step == kill_at:
                die()
        checkpoint.Checkpointer.save = save_then_die
    run(cfg, callbacks=[Hook()])
    return 0


if __name__ == "__main__":
    sys.exit(_main(json.loads(sys.argv[1])))
