"""`jaxpar launch --ray` on a real local Ray cluster (ray.cluster_utils.Cluster on this machine):
a head without the node resource and worker nodes offering {"jaxpar_node": 1}, one jaxpar process
each with 4 forced CPU devices (2 nodes = the 8 devices of the 1-process reference).

A SIGTERM to the driver stops both nodes at one step with a checkpoint; a removed node shrinks
the run to 1 node (elastic resume: grad_accum 2) and a returning one grows it back to 2 after the
next checkpoint, with the losses of an uninterrupted run (global batch kept) and no step lost
beyond the checkpoint the loss fell back to. The processes run this file as a driver (`python
tests/test_launch_ray.py SPEC`): it slows the steps (more when on 1 node, so the test can act
between steps) and prints each finished step, then runs the real `jaxpar train` CLI."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar.config import ConfigError, make_config
from tests.run_configs import CACHE_ENV, layout_run_yaml

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
# the other multi-process files' layout (tests/run_configs.py): their programs, so a test run
# compiles each once (the 1-process reference, 2 nodes x 4 devices, 1 node x 4 with grad_accum 2)
CONFIG = layout_run_yaml("rr", STEPS, "every: 2, keep_last: 3")
MB = 2 ** 20
NODE = dict(num_cpus=1, resources={"jaxpar_node": 1}, object_store_memory=80 * MB)
SLEEP = {"2": 0.3, "1": 1.5}  # seconds per step by process count
# the tests on the cluster share one xdist worker, so one cluster (`make test`: --dist loadgroup)
on_cluster = pytest.mark.xdist_group("launch_ray")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch_ray")
    (d / "rr.yaml").write_text(CONFIG)
    return d


@pytest.fixture(scope="module")
def cluster(work):
    """One Ray cluster for the module: a head (no node resource) and 2 jaxpar nodes."""
    from ray.cluster_utils import Cluster
    t0 = time.monotonic()
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, object_store_memory=100 * MB))
    try:
        for _ in range(2):
            c.add_node(**NODE)
        c.wait_for_nodes()
        print(f"ray cluster (head + 2 nodes) up in {time.monotonic() - t0:.1f}s")
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def reference(work, devices):
    """1 process x 8 devices, uninterrupted, no checkpoints: {step: (loss, gradient norm)}."""
    import yaml
    from jaxpar.train.trainer import Trainer
    cfg = make_config(yaml.safe_load(CONFIG), [f"run_dir={work / 'ref'}", "checkpoint.enabled=false"])
    _, history = Trainer(cfg).fit(progress=False)
    return {h["step"]: (h["loss"], h["grad_norm"]) for h in history}


def drive(cluster, work: Path, run_dir: Path, *opts: str, on_line=None, timeout=300):
    """`jaxpar launch --ray ADDRESS --nodes 2 --devices-per-node 4 --run-dir .. -- python <this
    file> SPEC`; (rc, [(seconds since start, line)])."""
    spec = {"argv": ["train", str(work / "rr.yaml"), f"run_dir={run_dir}"], "sleep": SLEEP}
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                **CACHE_ENV})
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--ray", cluster.address, "--nodes", "2",
           "--devices-per-node", "4", "--run-dir", str(run_dir / "rr"), "--kill-timeout", "5", *opts,
           "--", "python", __file__, json.dumps(spec)]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work)
    lines = []
    try:
        for line in p.stdout:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))
            if on_line is not None:
                on_line(lines[-1][1], p)
            assert time.monotonic() - t0 < timeout, text(lines)
        p.wait(timeout=60)
    finally:
        if os.environ.get("JAXPAR_TEST_LOG"):  # debugging aid: the timed lines
            Path(os.environ["JAXPAR_TEST_LOG"], run_dir.name + ".log").write_text(
                "\n".join(f"{s:7.2f} {x}" for s, x in lines))
        if p.poll() is None:
            p.kill()
    return p.returncode, lines


def text(lines) -> str:
    return "\n".join(x for _, x in lines)


def losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    """{step: (loss, gradient norm)} from the run's metrics.jsonl, whose steps must not repeat."""
    recs = [json.loads(x) for x in (run_dir / "rr" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"metrics.jsonl steps not one clean sequence: {steps}"
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs}


def close(got: dict, ref: dict, steps) -> None:
    """Loss and gradient norm of each step within 1e-5 (relative) of the reference."""
    for s in steps:
        for g, r in zip(got[s], ref[s]):
            assert abs(g - r) <= 1e-5 * abs(r), (s, got[s], ref[s])


def launcher_events(run_dir: Path) -> list[dict]:
    from jaxpar.observe.events import read_events
    return [e for e in read_events(run_dir / "rr") if e["source"] == "ray"]


def finalized(run_dir: Path) -> list[int]:
    from jaxpar.checkpoint.files import list_steps
    return [s for s, _, ok in list_steps(run_dir / "rr" / "checkpoints") if ok]


@pytest.mark.slow
@on_cluster
def test_sigterm_to_the_driver_stops_every_node_at_one_step_with_a_checkpoint(cluster, work, reference):
    run, sent = work / "sig", []

    def sigterm_after_step_3(line, proc):
        if not sent and line == "[0] finished step 3":
            sent.append(proc.send_signal(signal.SIGTERM))

    rc, lines = drive(cluster, work, run, on_line=sigterm_after_step_3)
    out = text(lines)
    assert rc == 0 and sent, out
    assert "[ray] attempt 0: 2 nodes x 4 CPU devices" in out
    assert "[0] jax.distributed: process 0 of 2, 4 local devices of 8" in out, out
    assert "[1] jax.distributed: process 1 of 2, 4 local devices of 8" in out, out
    assert "[ray] SIGTERM: forwarding SIGTERM to every process" in out
    stop = int(re.search(r"^\[0\] stopped by preemption notice after step (\d+)", out, re.M)[1])
    assert 3 <= stop < STEPS, out
    assert "[ray] group ended (signal): rank 0 exit code 0, rank 1 exit code 0" in out, out
    from jaxpar.checkpoint import read_meta
    meta = read_meta(run / "rr" / "checkpoints" / str(stop))  # both saved the step they stopped at
    assert meta["processes"] == 2 and meta["devices"] == 8
    got = losses(run)
    assert sorted(got) == list(range(1, stop + 1))
    close(got, reference, got)
    ev = launcher_events(run)
    assert [(e["event"], e.get("nprocs"), e.get("reason")) for e in ev] == [
        ("group_start", 2, None), ("group_end", None, "signal")], ev


@pytest.mark.slow
@on_cluster
def test_lost_node_shrinks_the_run_and_a_returning_node_grows_it_back(cluster, work, reference):
    """The node of rank 1 is removed after step 3 (once a checkpoint is whole): the run goes on on 1 node from the latest
    checkpoint, then a new node joins; after the next checkpoint the group stops (SIGTERM, save)
    and restarts on 2 nodes from the step it stopped at. Times printed for docs/benchmarks.md."""
    run = work / "elastic"
    nodes: dict[int, str] = {}
    t: dict[str, float] = {}
    at_loss: list[list[int]] = []

    def act(line, proc):
        m = re.match(r"\[ray\] rank (\d): node \S+ id (\w+) pid", line)
        if m:
            nodes[int(m[1])] = m[2]
        step = re.match(r"\[0\] finished step (\d+)$", line)
        if "removed" not in t and step and int(step[1]) >= 3 and finalized(run):  # a checkpoint to resume
            victim = next(n for n in cluster.worker_nodes if n.node_id == nodes[1])
            t["removed"] = time.monotonic()
            cluster.remove_node(victim)
        if line.startswith("[ray] group ended (node_lost)"):
            at_loss.append(finalized(run))  # nothing runs now: what the next attempt can resume
        if "shrunk" not in t and line.startswith("[0] finished step") and "[ray] attempt 1: 1 nodes" in seen:
            t["shrunk"] = time.monotonic()  # the first step on 1 node
            cluster.add_node(**NODE)
            t["added"] = time.monotonic()
        if "grown" not in t and line.startswith("[0] finished step") and "[ray] attempt 2: 2 nodes" in seen:
            t["grown"] = time.monotonic()
        seen.update([line[:len("[ray] attempt 1: 1 nodes")]])

    seen: set[str] = set()
    rc, lines = drive(cluster, work, run, "--min-nodes", "1", on_line=act)
    out = text(lines)
    assert rc == 0, out
    # the launcher learns of the loss from Ray (then kills rank 0), or rank 0 dies first when its
    # collective's peer vanishes (gloo aborts): either way rank 1's node is named lost
    assert ("[ray] node of rank 1 lost (Ray reports its actor dead); killing ranks 0" in out
            or re.search(r"^\[ray\] group ended \(node_lost\):.*rank 1 node lost", out, re.M)), out
    assert re.search(r"^\[ray\] group ended \(node_lost\)", out, re.M), out
    # shrunk: 1 node x 4 devices, from the latest checkpoint there was (no later step lost)
    resumed = [int(s) for s in re.findall(r"^\[0\]\s+resumed from\b.*checkpoints/\d+ \(step (\d+)", out, re.M)]
    assert len(resumed) == 2 and at_loss and resumed[0] == max(at_loss[0]), (resumed, at_loss, out)
    assert "[0] elastic resume: mesh" in out and "train.grad_accum 1 -> 2" in out, out
    # grown back: after a new checkpoint, stopped by SIGTERM at one step, resumed from exactly that
    assert "[ray] attempt 2: 2 nodes" in out and "growing after the next checkpoint" in out, out
    stop = int(re.search(r"^\[0\] stopped by SIGTERM after step (\d+)", out, re.M)[1])  # 1 process: no sync point
    assert resumed[1] == stop > resumed[0], out
    assert re.search(r"^\[ray\] group ended \(grow\): rank 0 exit code 0$", out, re.M), out
    assert "[ray] all 2 processes finished" in out
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    close(got, reference, range(1, STEPS + 1))  # global batch kept on 1 node
    ev = launcher_events(run)
    assert [(e["event"], e.get("nprocs"), e.get("reason")) for e in ev] == [
        ("group_start", 2, None), ("group_end", None, "node_lost"), ("group_start", 1, None),
        ("group_end", None, "grow"), ("group_start", 2, None), ("group_end", None, "done")], ev
    print(f"node loss -> next training step (1 node): {t['shrunk'] - t['removed']:.1f}s; "
          f"node added in {t['added'] - t['shrunk']:.1f}s; node return -> training on 2 nodes: "
          f"{t['grown'] - t['added']:.1f}s (includes waiting for the next checkpoint)")


# ---------------------------------------------------------------- bad input: no cluster needed


def _cli(*argv: str) -> tuple[int, str]:
    from jaxpar.cli import main
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, err.getvalue()


def test_min_nodes_above_nodes_names_the_flag(work):
    rc, err = _cli("launch", "--ray", "--nodes", "2", "--min-nodes", "3", "--", "train", str(work / "rr.yaml"))
    assert rc == 2 and "--min-nodes 3 must be in 1..2 (--nodes 2)" in err, err
    rc, err = _cli("launch", "--ray", "--", "train", str(work / "rr.yaml"))
    assert rc == 2 and "give --nodes N" in err, err
    rc, err = _cli("launch", "--ray", "--nodes", "2", "--nprocs", "2", "--", "train", str(work / "rr.yaml"))
    assert rc == 2 and "--nprocs 2 is for one machine" in err, err


def test_bad_launch_options_are_one_error_each(work):
    """Negative restarts / timeouts were accepted, Ray-only options were ignored without --ray, and
    a program not on PATH raised FileNotFoundError from the first rank's Popen: each is one error
    (exit 2) before any process starts."""
    train = ["--", "train", str(work / "rr.yaml")]
    for argv, msg in ((["--max-restarts", "-1"], "--max-restarts must be >= 0 (got -1)"),
                      (["--kill-timeout", "-5"], "--kill-timeout must be > 0 seconds (got -5)"),
                      (["--grace", "0"], "--grace must be > 0 seconds (got 0)"),
                      (["--nodes", "3"], "--nodes: --nodes/--min-nodes/--devices-per-node are for --ray"),
                      (["--devices-per-node", "2"], "--devices-per-node: --nodes/--min-nodes/--devices-per-node "
                                                    "are for --ray")):
        rc, err = _cli("launch", "--nprocs", "1", *argv, *train)
        assert rc == 2 and msg in err, (argv, err)
    rc, err = _cli("launch", "--ray", "--nodes", "1", "--grace", "-1", *train)
    assert rc == 2 and "--grace must be > 0 seconds" in err, err
    rc, err = _cli("launch", "--nprocs", "1", "--", "no_such_program_xyz", "arg")
    assert rc == 2 and "jaxpar launch: command 'no_such_program_xyz' not found" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_no_ray_installed_is_one_clear_error(work, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    rc, err = _cli("launch", "--ray", "--nodes", "1", "--", "train", str(work / "rr.yaml"))
    assert rc == 2 and "needs the `ray` package" in err and "jaxpar[ray]" in err, err


def test_unreachable_address_names_it(work):
    from jaxpar.launch import free_port
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    rc, err = _cli("launch", "--ray", addr, "--nodes", "1", "--", "train", str(work / "rr.yaml"))
    assert rc == 2 and f"--ray {addr}: the Ray cluster is not reachable" in err, err
    assert time.monotonic() - t0 < 30  # not Ray's minutes of retries


def test_ray_alone_finds_the_address_as_ray_does_and_names_it(work, monkeypatch):
    from jaxpar.launch import free_port
    addr = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", addr)  # e.g. a cluster that went away
    rc, err = _cli("launch", "--ray", "--nodes", "1", "--", "train", str(work / "rr.yaml"))
    port = addr.rpartition(":")[2]  # Ray resolves the loopback host to this machine's address
    assert rc == 2 and re.search(rf"--ray \(no ADDRESS: found [\d.]+:{port}\): the Ray cluster is not "
                                 rf"reachable", err), err


def test_run_dir_and_checkpoints_come_from_the_train_config(work, tmp_path):
    from jaxpar.launch_ray import run_paths
    run_dir, ckpt = run_paths(["train", str(work / "rr.yaml"), f"run_dir={tmp_path}", "name=x"], None)
    assert run_dir == tmp_path / "x" and ckpt == tmp_path / "x" / "checkpoints"
    assert run_paths(["python", "my.py"], None) == (None, None)
    with pytest.raises(ConfigError, match="train.stepz"):
        run_paths(["train", str(work / "rr.yaml"), "train.stepz=3"], None)


class _FakeRay:
    """What RayLauncher asks of `ray` before it places anything: the nodes, one list per call."""

    def __init__(self, counts):
        self.counts = list(counts)

    def nodes(self):
        n = self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]
        return ([{"Alive": True, "Resources": {"jaxpar_node": 1.0}}] * n
                + [{"Alive": False, "Resources": {}}, {"Alive": True, "Resources": {"CPU": 1.0}}])

    def shutdown(self):
        pass


def _events(run_dir: Path) -> list[tuple]:
    from jaxpar.observe.events import read_events
    return [(e["event"], e["source"], e.get("have"), e.get("want")) for e in read_events(run_dir)]


def test_too_few_nodes_waits_and_records_it(tmp_path):
    """Nodes without the resource, or dead, do not count; the wait goes into the event log."""
    import io
    from jaxpar.launch_ray import RayLauncher, RayOptions
    la = RayLauncher(RayOptions(2, ["python", "x.py"], run_dir=tmp_path), out=io.BytesIO())
    la.ray = _FakeRay([1, 1, 2])
    assert la.wait_nodes(2) == 2
    assert _events(tmp_path) == [("wait_nodes_start", "ray", 1, 2), ("wait_nodes_end", "ray", 2, None)]


def test_no_nodes_within_the_node_timeout_fails_the_run(tmp_path, monkeypatch):
    import io
    from jaxpar import launch_ray
    monkeypatch.setattr(launch_ray, "import_ray", lambda: _FakeRay([0]))
    monkeypatch.setattr(launch_ray, "connect", lambda ray, address: None)
    out = io.BytesIO()
    opts = launch_ray.RayOptions(2, ["python", "x.py"], min_nodes=1, run_dir=tmp_path, node_timeout=0.5)
    assert launch_ray.launch_ray(opts, out) == 1
    assert "[ray] fewer than 1 nodes for --node-timeout 0.5s; exit 1" in out.getvalue().decode()
    assert _events(tmp_path) == [("wait_nodes_start", "ray", 0, 1), ("wait_nodes_end", "ray", 0, None)]


def test_a_bundle_takes_all_gpus_of_the_smallest_node_unless_cpu_devices_are_forced():
    """So Ray makes a node's GPUs visible to its process (checked by hand on fake-GPU Ray nodes:
    CUDA_VISIBLE_DEVICES=0,1 in both processes for nodes of 2 and 3 GPUs)."""
    from jaxpar.launch_ray import RayLauncher, RayOptions
    node = lambda gpus: {"Alive": True, "Resources": {"jaxpar_node": 1.0, "GPU": float(gpus)}}
    fake = type("R", (), {"nodes": lambda self: [node(8), node(4), {"Alive": True, "Resources": {"GPU": 1.0}}]})()
    for k, want in ((None, {"jaxpar_node": 1, "GPU": 4}), (4, {"jaxpar_node": 1})):
        la = RayLauncher(RayOptions(2, ["python", "x.py"], devices_per_node=k))
        la.ray = fake
        assert la.bundle() == want, (k, la.bundle())


class _ActorGone(Exception):
    pass


class _Method:
    def __init__(self, fn):
        self.remote = fn  # the "object ref" is the value itself (or the error `get` raises)


class _FakeActor:
    """A node's actor as `watch` sees it: poll() -> (lines, code), send(sig); `code` after `exit_on`
    (a signal), or a dead actor when `gone`."""

    def __init__(self, code=None, exit_on=None, gone=False):
        self.code, self.exit_on, self.gone, self.got = code, exit_on, gone, []
        self.poll = _Method(lambda: _ActorGone() if self.gone else ([], self.code))
        self.send = _Method(self._signal)

    def _signal(self, sig):
        self.got.append(signal.Signals(sig).name)
        if self.exit_on is not None and sig in self.exit_on:
            self.code = -sig if sig == signal.SIGKILL else 0


def _watching(actors, nodes_up):
    import io
    from types import SimpleNamespace
    from jaxpar.launch_ray import RayLauncher, RayOptions
    la = RayLauncher(RayOptions(len(actors), ["python", "x.py"], kill_timeout=0.2, poll=0.01), out=io.BytesIO())

    def get(x, timeout=None):
        if isinstance(x, Exception):
            raise x
        return x
    la.ray = SimpleNamespace(get=get, nodes=_FakeRay([nodes_up]).nodes, exceptions=SimpleNamespace(
        RayActorError=_ActorGone, GetTimeoutError=TimeoutError, RayError=Exception))
    reason, codes = la.watch(actors, len(actors))
    return reason, codes, la.out.getvalue().decode()


def test_a_failed_rank_stops_the_others_with_sigterm_then_sigkill():
    ok, stubborn, bad = (_FakeActor(exit_on={signal.SIGTERM}), _FakeActor(exit_on={signal.SIGKILL}),
                         _FakeActor(code=1))
    reason, codes, out = _watching([ok, stubborn, bad], nodes_up=3)
    assert reason == "failed" and codes == [0, -9, 1], out
    assert ok.got == ["SIGTERM"] and stubborn.got[:2] == ["SIGTERM", "SIGKILL"], (ok.got, stubborn.got)
    assert "rank 2 failed (exit code 1); stopping the others" in out


def test_a_dead_actor_is_a_lost_node_and_the_others_are_killed_at_once():
    survivor, lost = _FakeActor(exit_on={signal.SIGKILL}), _FakeActor(gone=True)
    reason, codes, out = _watching([survivor, lost], nodes_up=1)
    assert reason == "node_lost" and survivor.got == ["SIGKILL"], (reason, survivor.got, out)
    assert "group ended (node_lost): rank 0 killed by SIGKILL, rank 1 node lost" in out
    # a process that failed before Ray reported its peer's node gone: still a lost node
    reason, _, out = _watching([_FakeActor(code=1), _FakeActor(exit_on={signal.SIGTERM})], nodes_up=1)
    assert reason == "node_lost", out


# ---------------------------------------------------------------- the driver (each process)


def _main(spec: dict) -> int:
    rank = int(os.environ.get("JAXPAR_PROCESS_ID", "0"))
    sleep = spec["sleep"].get(os.environ.get("JAXPAR_NUM_PROCESSES", "1"), 0.0)
    from jaxpar.cli import main
    from jaxpar.train import trainer as trainer_module
    from jaxpar.train.callbacks import Callback

    class Slow(Callback):
        def on_step_end(self, trainer, step, state, metrics):
            time.sleep(sleep)
            if rank == 0:
                print(f"finished step {step}", flush=True)

    build = trainer_module.build_callbacks
    trainer_module.build_callbacks = lambda *a, **kw: build(*a, **kw) + [Slow()]
    return main(spec["argv"])


if __name__ == "__main__":
    sys.exit(_main(json.loads(sys.argv[1])))
