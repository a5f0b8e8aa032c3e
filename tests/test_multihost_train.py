"""Training on several processes: `jaxpar launch` runs 2 processes x 4 CPU devices on
jax.distributed (gloo collectives). They reach the losses of 1 process x 8 devices, each reads
only its own rows, a SIGTERM to the launcher stops both at one step with a checkpoint, which
restores in 1 process on 8 devices, and a process killed
mid-run ends the group and, with restarts, the run resumes from its checkpoint (on fewer
processes when one keeps failing).

The runs allow one restart more than they need: XLA gives a new gloo communicator 30 s to form
(not configurable), and on a heavily loaded 2-core machine the processes' first collectives can
drift further apart than that; the launcher then restarts the group, which is what it is for.

The processes run this file as a driver (`python tests/test_multihost_train.py SPEC`): it counts
the batch rows each process computes and kills itself at a given step, then runs the real
`jaxpar train` CLI. The 1-process reference runs in the test process."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar.config import make_config
from jaxpar.train.trainer import Trainer
from tests.run_configs import CACHE_ENV, layout_run_yaml

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multihost_train")]
ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
CONFIG = layout_run_yaml("mh", STEPS, "every: 3, keep_last: 3")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("multihost")
    (d / "mh.yaml").write_text(CONFIG)
    return d


def _cfg(work: Path, run_dir: Path, *overrides: str):
    import yaml
    return make_config(yaml.safe_load(CONFIG), [f"run_dir={run_dir}", *overrides])


@pytest.fixture(scope="module")
def reference(work, devices):
    """1 process x 8 devices, uninterrupted: {step: loss}. It saves every 2nd step (2, 4, 6, 8),
    the checkpoints test_damage_seen_by_one_process_makes_both_fall_back_together resumes."""
    cfg = _cfg(work, work / "ref", "checkpoint.every=2", "checkpoint.keep_last=4")
    _, history = Trainer(cfg).fit(out_dir=cfg.out_dir, progress=False)
    return {h["step"]: h["loss"] for h in history}


def launch(work: Path, run_dir: Path, *opts: str, spec: dict | None = None, overrides=(), timeout=420,
           on_line=None):
    """`jaxpar launch --nprocs 2 --devices-per-proc 4 [opts] -- python <driver> SPEC`; returns
    (rc, [(seconds since start, line)])."""
    spec = {"argv": ["train", str(work / "mh.yaml"), f"run_dir={run_dir}", *overrides], **(spec or {})}
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                **CACHE_ENV})
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nprocs", "2", "--devices-per-proc", "4", *opts,
           "--", "python", __file__, json.dumps(spec)]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work)
    lines = []
    for line in p.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
        if on_line is not None:
            on_line(lines[-1][1], p)
        assert time.monotonic() - t0 < timeout, "\n".join(x for _, x in lines)
    p.wait(timeout=60)
    return p.returncode, lines


def text(lines) -> str:
    return "\n".join(x for _, x in lines)


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "mh" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"metrics.jsonl steps not one clean sequence: {steps}"
    return {r["step"]: r["loss"] for r in recs}


def close(got: dict[int, float], ref: dict[int, float], steps) -> None:
    for s in steps:
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (s, got[s], ref[s])


def test_two_processes_match_one_and_their_checkpoint_restores_on_one(work, reference, devices):
    """2 x 4 devices train until SIGTERM reaches the launcher after step 3: both processes stop
    at the same step and save it; this process (8 devices) resumes that checkpoint to the end."""
    run = work / "two"
    sent = []

    def sigterm_after_step_3(line, proc):
        if not sent and line == "[0] finished step 3":
            sent.append(proc.send_signal(signal.SIGTERM))

    rc, lines = launch(work, run, "--max-restarts", "1", spec={"sleep": 0.3}, on_line=sigterm_after_step_3)
    out = text(lines)
    assert rc == 0 and sent, out
    assert "[launch] SIGTERM: forwarding SIGTERM to every process" in out
    stop = int(re.search(r"^\[0\] stopped by preemption notice after step (\d+)", out, re.M)[1])
    assert 3 <= stop < STEPS, out
    assert "[launch] all 2 processes finished (stopped by SIGTERM)" in out
    assert "[0] jax.distributed: process 0 of 2, 4 local devices of 8" in out, out
    assert "[1] jax.distributed: process 1 of 2, 4 local devices of 8" in out
    assert "[launch] all 2 processes finished" in out
    # per-host data: each process computed only the rows of its data-parallel half of the batch
    rows = {int(r): json.loads(v) for r, v in re.findall(r"^\[(\d)\] rows read per step: (.*)$", out, re.M)}
    assert rows == {0: list(range(0, 8)), 1: list(range(8, 16))}, out
    # metrics and the banner from process 0 only
    assert f"[0] done: {stop} logged steps" in out and "[1] done:" not in out and "[1] resolved config" not in out
    got = losses(run)
    assert sorted(got) == list(range(1, stop + 1))
    close(got, reference, range(1, stop + 1))

    from jaxpar.checkpoint import read_meta
    meta = read_meta(run / "mh" / "checkpoints" / str(stop))  # saved at the step they stopped at
    assert meta["processes"] == 2 and meta["devices"] == 8
    # the checkpoint written by 2 processes restores in this process, on 8 devices
    trainer = Trainer(_cfg(work, run))
    _, history = trainer.fit(out_dir=run / "mh", progress=False)
    assert [h["step"] for h in history] == list(range(stop + 1, STEPS + 1))
    close(losses(run), reference, range(1, STEPS + 1))


def test_sigkill_ends_the_group_restart_resumes_then_on_fewer_processes(work, reference):
    """Rank 1 is SIGKILLed at step 5: the launcher ends rank 0 and restarts the group, which
    resumes from step 3 on 2 processes. Killed again at step 7, rank 1 counts as unable to come
    back: the group restarts on 1 process x 4 devices, which resumes the 8-device checkpoint of
    step 6 (mesh and grad_accum adapted) and finishes."""
    run = work / "killed"
    spec = {"kill": {"rank": 1, "steps": {"5": str(work / "kill5"), "7": str(work / "kill7")}}}
    # rank 0, stuck in a collective with the dead rank, is SIGKILLed after --kill-timeout
    rc, lines = launch(work, run, "--max-restarts", "3", "--min-nprocs", "1", "--kill-timeout", "2", spec=spec)
    out = text(lines)
    assert rc == 0, out
    i, killed = next((i, t) for i, (t, x) in enumerate(lines) if "[1] killing myself at step 5" in x)
    ended = next(t for t, x in lines[i:] if re.match(r"\[launch\] attempt \d ended", x))
    assert "[launch] rank 1 failed (killed by SIGKILL); stopping ranks 0" in out, out
    assert ended - killed < 60, (killed, ended)  # the other process ended, the attempt over
    assert "[launch] restart 1 of 3" in out
    assert re.search(r"^\[0\]\s+resumed from\b.*checkpoints/3 \(step 3", out, re.M), out
    assert "[1] killing myself at step 7" in out
    assert "rank 1 failed twice in a row: it cannot come back; restarting on 1 processes" in out, out
    assert "[0] elastic resume: mesh" in out and "train.grad_accum 1 -> 2" in out, out
    assert re.search(r"^\[0\]\s+resumed from\b.*checkpoints/6 \(step 6", out, re.M), out
    close(losses(run), reference, range(1, STEPS + 1))


def test_damage_seen_by_one_process_makes_both_fall_back_together(work, reference):
    """Steps 2 and 4 of the reference (saved by 1 process on 8 devices) resumed by 2 processes x
    4 devices; process 1 (only) reads step 4's meta file truncated, as from a host with a damaged
    copy. Both warn naming process 1 and the file, and both resume from step 2 (not each from its
    own newest readable step), reproducing the reference's losses of steps 3 and 4."""
    run, short = work / "damaged", ["train.steps=4", "checkpoint.every=2"]
    for step in (2, 4):
        shutil.copytree(work / "ref" / "mh" / "checkpoints" / str(step), run / "mh" / "checkpoints" / str(step))
    ref_lines = (work / "ref" / "mh" / "metrics.jsonl").read_text().splitlines()[:4]
    (run / "mh" / "metrics.jsonl").write_text("\n".join(ref_lines) + "\n")
    first = losses(run)
    assert sorted(first) == [1, 2, 3, 4]
    meta4 = run / "mh" / "checkpoints" / "4" / "meta" / "metadata"
    assert json.loads(meta4.read_text())["step"] == 4  # whole on disk, for process 0
    rc, lines = launch(work, run, "--max-restarts", "1", overrides=short,
                       spec={"damaged_view": {"rank": 1, "file": str(meta4)}})
    out = text(lines)
    assert rc == 0, out
    warned = re.findall(r"^\[(\d)\] jaxpar: warning: checkpoint (\S+) is unusable \(on process (\d): (.*)\); "
                        r"(.*)$", out, re.M)
    assert {w[0] for w in warned} == {"0", "1"} and {w[2] for w in warned} == {"1"}, out
    assert all(w[1].endswith("checkpoints/4") and str(meta4) in w[3] for w in warned), warned
    assert any(w[4] == "falling back to step 2" for w in warned), warned  # restore, after the plan
    assert re.search(r"^\[0\]\s+resumed from\b.*checkpoints/2 \(step 2", out, re.M), out
    read = dict(re.findall(r"^\[(\d)\] data steps read: (.*)$", out, re.M))
    assert read == {"0": "[2, 3]", "1": "[2, 3]"}, out  # both went on from step 2
    again = losses(run)
    assert sorted(again) == [1, 2, 3, 4]
    close(again, first, [3, 4])


# ---------------------------------------------------------------- the driver (each process)


def _main(spec: dict) -> int:
    rank = int(os.environ.get("JAXPAR_PROCESS_ID", "0"))
    kill = spec.get("kill") or {}
    markers = {int(k): Path(v) for k, v in kill.get("steps", {}).items()}  # kill once at each step
    from jaxpar.cli import main
    from jaxpar.train import trainer as trainer_module
    from jaxpar.data import loader
    from jaxpar.train.callbacks import Callback

    rows: dict[int, set] = {}
    orig = loader.global_batch

    class Counting:
        def __init__(self, source):
            self.source = source

        def rows(self, step, idx, seq_len):
            rows.setdefault(step, set()).update(int(i) for i in idx)
            return self.source.rows(step, idx, seq_len)

    loader.global_batch = lambda source, *a, **kw: orig(Counting(source), *a, **kw)

    class Kill(Callback):
        def on_step_end(self, trainer, step, state, metrics):
            if spec.get("sleep"):
                time.sleep(spec["sleep"])
                if rank == 0:
                    print(f"finished step {step}", flush=True)
            if kill.get("rank") == rank and step in markers and not markers[step].exists():
                if trainer.checkpointer is not None:
                    trainer.checkpointer.wait()  # the last save is whole before the kill
                markers[step].touch()
                print(f"killing myself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    view = spec.get("damaged_view") or {}
    if view.get("rank") == rank:  # this process reads that file truncated (its copy is damaged)
        read_text = Path.read_text
        Path.read_text = lambda p, *a, **kw: (read_text(p, *a, **kw)[:20] if str(p) == view["file"]
                                              else read_text(p, *a, **kw))
    build = trainer_module.build_callbacks  # what the trainer calls (imported from jaxpar.observe)
    trainer_module.build_callbacks = lambda *a, **kw: build(*a, **kw) + [Kill()]
    rc = main(spec["argv"])
    print(f"data steps read: {json.dumps(sorted(rows))}", flush=True)
    per_step = {tuple(sorted(r)) for r in rows.values()}
    if len(per_step) == 1:
        print(f"rows read per step: {json.dumps(list(per_step.pop()))}", flush=True)
    else:
        print(f"rows read differ between steps: {sorted(per_step)}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(_main(json.loads(sys.argv[1])))
