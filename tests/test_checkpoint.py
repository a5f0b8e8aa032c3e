"""Checkpoint format, keep policy, integrity checks and fall back, inspect, elastic layout
planning, metrics truncation, the non-finite guard. In process (the subprocess tests that kill
runs are in test_checkpoint_resume.py)."""
import json
import math
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar import checkpoint as ck
from jaxpar.cli import main as cli_main
from tests.poison_util import PoisonSource, poisoned_factory
from tests.conftest import tiny_config

pytestmark = pytest.mark.xdist_group("checkpoint")  # the poisoned trainer is built once


def _state(devices, n=8, seed=0):
    mesh = Mesh(np.array(devices[:n]).reshape(n), ("x",))
    rng = np.random.default_rng(seed)
    host = {"step": np.int32(7), "params": {"w": rng.standard_normal((64, 32)).astype(np.float32),
                                            "b": rng.standard_normal((32,)).astype(np.float32)},
            "opt_state": {"count": np.int32(3), "mu": rng.standard_normal((64, 32)).astype(np.float32)}}
    shard = {"step": P(), "params": {"w": P("x"), "b": P()}, "opt_state": {"count": P(), "mu": P("x")}}
    state = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), host, shard)
    return host, state


def _target(devices, n, host):
    """The same tree as ShapeDtypeStructs on an n-device mesh with other shardings."""
    mesh = Mesh(np.array(devices[:n]).reshape(n), ("y",))
    shard = {"step": P(), "params": {"w": P(None, "y"), "b": P("y")}, "opt_state": {"count": P(), "mu": P()}}
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                        host, shard)


def _save_steps(root, devices, steps, **kw):
    mgr = ck.Checkpointer(root, **kw)
    host, state = _state(devices)
    for s in steps:
        mgr.save(s, state, {"devices": 8, "mesh": {"data": 8}}, {"model": {"dim": 4}})
    mgr.close()
    return host


def _biggest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def test_save_restore_other_mesh_and_keep_policy(tmp_path, devices):
    host = _save_steps(tmp_path / "c", devices, range(1, 7), keep_last=2, keep_every=3)
    mgr = ck.Checkpointer(tmp_path / "c")
    assert mgr.all_steps() == [3, 5, 6]  # latest 2 plus every 3rd
    state, meta, step = mgr.restore(_target(devices, 2, host))
    assert step == 6 and meta["step"] == 6 and meta["format"] == ck.FORMAT
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(host)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert state["params"]["w"].sharding.spec == P(None, "y")
    assert len(state["params"]["w"].sharding.mesh.devices.ravel()) == 2
    # no pickle anywhere in the format
    for p in (tmp_path / "c").rglob("*"):
        if p.is_file():
            assert not p.read_bytes().startswith(b"\x80"), p
    mgr.close()


def test_checksum_is_layout_independent_and_catches_one_bit(devices):
    host, state = _state(devices)
    moved = jax.device_put(host, jax.sharding.make_single_device_sharding(devices[3]))
    assert ck.fingerprint(state) == ck.fingerprint(moved) == ck.fingerprint(host)
    flipped = jax.tree.map(np.copy, host)
    flipped["params"]["w"].view(np.uint32)[5, 7] ^= 1 << 3
    bad = [k for k, v in ck.fingerprint(flipped).items() if v != ck.fingerprint(host)[k]]
    assert bad == ["params/w"]


def test_corrupted_latest_falls_back_then_clear_error(tmp_path, devices):
    root = tmp_path / "c"
    host = _save_steps(root, devices, [1, 2, 3])
    # step 3: arrays that read fine but are not what was saved (as after a silent bit flip)
    meta_file = root / "3" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["checksums"]["params/w"] = "00000000"
    meta_file.write_text(json.dumps(meta))
    # step 2: truncated
    f2 = _biggest_data_file(root / "2")
    f2.write_bytes(f2.read_bytes()[: f2.stat().st_size // 3])
    warnings = []
    mgr = ck.Checkpointer(root)
    state, meta, step = mgr.restore(_target(devices, 4, host), warn=warnings.append)
    assert step == 1
    assert len(warnings) == 2
    assert str(root.absolute() / "3") in warnings[0] and "checksum mismatch" in warnings[0]
    assert "falling back to step 2" in warnings[0]
    assert str(root.absolute() / "2") in warnings[1] and "falling back to step 1" in warnings[1]
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), host["params"]["w"])
    # nothing good left: one clear error
    shutil.rmtree(root / "1" / "state")
    with pytest.raises(ck.CheckpointError, match="no good checkpoint"):
        mgr.restore(_target(devices, 4, host), warn=lambda m: None)
    mgr.close()


def test_inspect_cli(tmp_path, devices, capsys, monkeypatch):
    root = tmp_path / "run" / "checkpoints"
    _save_steps(root, devices, [2, 4])
    (root / "6.orbax-checkpoint-tmp-1234").mkdir()  # a save that was killed
    f = _biggest_data_file(root / "4")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    # orbax's record of the saved shardings, truncated: a resume does not read it, nor does verify
    sharding = root / "2" / "state" / "_sharding"
    assert sharding.is_file()
    sharding.write_bytes(sharding.read_bytes()[:10])
    monkeypatch.chdir(tmp_path)  # a relative path (orbax wants absolute ones)
    assert cli_main(["checkpoint", "inspect", "run", "--verify"]) == 1  # step 4 is corrupted
    out = capsys.readouterr().out
    assert "step        2  complete, checksums ok (warning: " in out
    assert "_sharding is unreadable" in out and "the data is intact" in out
    assert "step        4  CORRUPTED: " in out
    assert "step        6  INCOMPLETE: interrupted save" in out
    assert "mesh data=8 on 8 devices" in out
    assert "params/w" in out and "64x32" in out and "float32" in out
    assert "config:" in out and "dim: 4" in out
    assert cli_main(["checkpoint", "inspect", str(tmp_path / "nowhere")]) == 2
    shutil.rmtree(root / "4")
    assert cli_main(["checkpoint", "inspect", "run", "--verify"]) == 0  # only usable steps (and a tmp dir)
    # a truncated _sharding does not keep a resume from the step (so verify does not call it corrupted)
    host = _state(devices)[0]
    mgr = ck.Checkpointer(root)
    _, _, step = mgr.restore(_target(devices, 4, host), warn=pytest.fail)
    mgr.close()
    assert step == 2


def test_resume_and_inspect_read_a_named_path_alike(tmp_path):
    """A run dir, its checkpoints dir and one step dir name the same root for train.resume and
    for inspect; a dir with steps of its own is the root even beside a `checkpoints/`."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    (root / "5" / "state").mkdir(parents=True)
    for named, step in ((run, None), (root, None), (root / "5", 5)):
        assert ck.locate(named) == ck.resolve_source(str(named), tmp_path / "own") == (root, step)
        assert ck.inspect(named).startswith(f"checkpoints in {root}:\n  step        5  INCOMPLETE: ")
    (run / "7" / "state").mkdir(parents=True)
    assert ck.locate(run) == (run, None)
    assert ck.checkpoint_dir(tiny_config(f"run_dir={tmp_path}", "name=run")) == root  # where it saves


def test_a_home_relative_checkpoint_dir_is_where_the_readers_look(tmp_path, monkeypatch):
    """checkpoint.dir=~/ck: the run saved into a literal `~` dir inside the run dir while
    `generate`, `convert` and `train.init_from` (hf.init.run_checkpoint_dir, from the saved
    config) looked in the home dir. Both are the home dir's now, the path os.path gives."""
    from jaxpar.hf.init import run_checkpoint_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = tiny_config(f"run_dir={tmp_path}", "name=run", "checkpoint.dir=~/ck")
    want = Path(os.path.expanduser("~/ck"))
    assert want.is_absolute() and ck.checkpoint_dir(cfg) == want
    cfg.out_dir.mkdir(parents=True)
    (cfg.out_dir / "config.yaml").write_text(cfg.to_yaml())
    assert run_checkpoint_dir(cfg.out_dir) == ck.checkpoint_dir(cfg)


def test_adapt_layout_keeps_global_batch():
    cfg = tiny_config("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    meta = ck.layout_meta(cfg, type("M", (), {"shape": {"data": 2, "fsdp": 2, "pipeline": 1, "tensor": 2,
                                                        "expert": 1}, "axis_names": ("data", "fsdp", "pipeline",
                                                                                     "tensor", "expert"),
                                              "devices": np.zeros(8)})())
    assert meta["batch_parallel"] == 4 and meta["devices"] == 8
    # same command on 4 devices: the mesh shrinks (tensor kept), grad_accum doubles
    new, changes = ck.adapt_layout(cfg, meta, 4)
    assert (new.mesh.data, new.mesh.fsdp, new.mesh.tensor, new.train.grad_accum) == (1, 2, 2, 2)
    assert any("mesh" in c for c in changes) and any("grad_accum 1 -> 2" in c for c in changes)
    # 2 devices, explicit data=2: per-device batch would double, so accumulate 2
    new, changes = ck.adapt_layout(tiny_config("mesh.data=2"), meta, 2)
    assert new.train.grad_accum == 2 and len(changes) == 1
    # 1 device: accumulate 4
    assert ck.adapt_layout(cfg, meta, 1)[0].train.grad_accum == 4
    # back to 8 after 2 devices with accum 2: accum 1 again (from the config)
    meta2 = {**meta, "devices": 2, "batch_parallel": 2, "grad_accum": 2}
    new, changes = ck.adapt_layout(cfg, meta2, 8)
    assert new.train.grad_accum == 1 and not changes
    # no layout keeps a global batch of 12 on 8-way data parallelism
    with pytest.raises(ck.CheckpointError, match="cannot keep the global batch"):
        ck.adapt_layout(tiny_config("mesh.data=-1", "train.global_batch=12"),
                        {**meta, "global_batch": 12, "devices": 4, "batch_parallel": 4}, 8)


def test_plan_resume_errors(tmp_path, devices):
    cfg = tiny_config(f"run_dir={tmp_path}", "name=r")
    assert not ck.plan_resume(cfg, 8).resuming
    root = ck.checkpoint_dir(cfg)
    mgr = ck.Checkpointer(root)
    _, state = _state(devices)
    mgr.save(3, state, {"devices": 8, "batch_parallel": 8, "grad_accum": 1, "global_batch": 16},
             {"model": {**cfg.model.model_dump(mode="json"), "dim": 256}})
    mgr.close()
    with pytest.raises(ck.CheckpointError, match="another model"):
        ck.plan_resume(cfg, 8)
    with pytest.raises(ck.CheckpointError, match="train.resume=never"):
        ck.plan_resume(tiny_config(f"run_dir={tmp_path}", "name=r", "train.resume=never"), 8)
    with pytest.raises(ck.CheckpointError, match="no such directory"):
        ck.plan_resume(tiny_config(f"run_dir={tmp_path}", "name=r", f"train.resume={tmp_path}/x"), 8)
    other = tiny_config(f"run_dir={tmp_path}", "name=other", "model.dim=256", f"train.resume={root / '3'}")
    plan = ck.plan_resume(other, 8)
    assert plan.resuming and plan.step == 3 and plan.root == root
    # restarted with the same command after saving its own checkpoints: continues from those
    mgr = ck.Checkpointer(ck.checkpoint_dir(other))
    mgr.save(5, state, {"devices": 8}, {"model": other.model.model_dump(mode="json")})
    mgr.close()
    plan = ck.plan_resume(other, 8)
    assert plan.root == ck.checkpoint_dir(other) and plan.step is None
    assert "not used: this run already has its own checkpoints" in plan.changes[0]


def test_truncate_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    with open(path, "a") as writer:  # an appending writer survives the in-place truncation
        assert ck.truncate_metrics(path, 4) == 4
        writer.write(json.dumps({"step": 5}) + "\n")
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert ck.truncate_metrics(tmp_path / "missing.jsonl", 3) == 0


# ---------------------------------------------------------------- the non-finite guard


@pytest.fixture(scope="module")
def poisoned_trainer(devices):
    from jaxpar.train.trainer import Trainer


    cfg = tiny_config("mesh.data=4", "mesh.tensor=2", "train.steps=5", "train.max_nonfinite=2")
    trainer = Trainer(cfg, model_factory=poisoned_factory(cfg), devices=devices)
    base = trainer.loader.source
    trainer.poison = lambda bad: setattr(trainer.loader, "source", PoisonSource(base, bad))
    return trainer


def test_nan_batch_is_skipped_and_counted(poisoned_trainer):
    tr = poisoned_trainer
    tr.poison({1})
    step = tr.compiled or tr.compile()
    s0 = tr.init_state()
    s1, m1 = step(s0, tr.loader.batch(0))
    p1 = jax.tree.map(np.asarray, jax.device_get(s1["params"]))
    s2, m2 = step(s1, tr.loader.batch(1))
    assert int(m1["nonfinite"]) == 0 and int(m2["nonfinite"]) == 1 and not np.isfinite(float(m2["loss"]))
    assert int(s2["step"]) == 2  # the step counter (and so the data position) moves on
    for a, b in zip(jax.tree.leaves(jax.device_get(s2["params"])), jax.tree.leaves(p1)):
        np.testing.assert_array_equal(a, b)  # ... the update does not
    _, hist = tr.fit(progress=False)
    assert [h["skipped_steps"] for h in hist] == [0, 1, 1, 1, 1]
    assert np.isnan(hist[1]["loss"])
    assert all(np.isfinite(h["loss"]) for i, h in enumerate(hist) if i != 1)


def test_nonfinite_streak_stops_the_run(poisoned_trainer):
    from jaxpar.train.trainer import TrainingStopped
    tr = poisoned_trainer
    tr.poison({1, 2})
    with pytest.raises(TrainingStopped, match=r"2 non-finite steps in a row \(steps 2..3"):
        tr.fit(progress=False)


def test_bench_checkpoint_small():
    from jaxpar.bench import run_bench
    lines = []
    assert run_bench("checkpoint", None, ["model.dim=64", "model.n_layers=1", "model.ffn_dim=128",
                                          "model.n_heads=2", "model.n_kv_heads=1", "train.steps=2"],
                     as_json=True, out=lines.append, options={"repeats": 1}) == 0
    r = json.loads(lines[0])
    assert r["benchmark"] == "checkpoint" and r["state_bytes"] > 0
    assert r["save"]["mb_per_s"] > 0 and r["restore"]["mb_per_s"] > 0
    assert 0 < r["async_save"]["blocking_s"] <= r["async_save"]["total_s"]
    assert r["overlap"]["step_s_no_save"] > 0


@pytest.mark.parametrize("bad, steps", [({2, 3}, 5), ({3, 4}, 7)])
def test_nonfinite_streak_rolls_back_and_skips_the_batch(poisoned_trainer, tmp_path, bad, steps):
    """{2, 3}: steps 3 and 4 (data steps 2, 3) are bad, 2 in a row = max_nonfinite, found at step
    4's checkpoint. {3, 4}: steps 4 and 5, found at step 5's log, which is read once step 6 is
    dispatched: that step is dropped with the rollback."""
    tr = poisoned_trainer
    tr.poison(bad)
    first = min(bad)
    logs = []
    old_log, tr.log = tr.log, logs.append
    tr.cfg.train.nonfinite_rollback, tr.cfg.checkpoint.every, tr.cfg.train.steps = True, 2, steps
    try:
        _, hist = tr.fit(out_dir=tmp_path, progress=False)
    finally:
        tr.cfg.train.nonfinite_rollback, tr.cfg.checkpoint.every, tr.log = False, 100, old_log
        tr.cfg.train.steps = 5
    assert any(f"rolled back to step 2 and skipping data step {first}" in m for m in logs), logs
    # after the roll back, step 3 trains on data step 2 or 3, and the other bad data step is
    # skipped once more: 3 skipped in all
    assert [h["step"] for h in hist] == list(range(1, steps + 1))
    skipped = [0, 0, 3, 3, 3] if first == 2 else [0, 0, 2, 3, 3, 3, 3]
    assert [h["skipped_steps"] for h in hist] == skipped
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    meta = ck.read_meta(tmp_path / "checkpoints" / str(steps))
    assert meta["data"]["skipped_batches"] == [first] and meta["data"]["position"] == steps + 1
    assert meta["nonfinite"]["skipped"] == 3
    # step 4's checkpoint, taken inside the streak, is set aside, not resumed from, and saved again
    aside = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if "rolled_back" in p.name)
    assert aside == ([] if first == 2 else ["4.rolled_back"])


def test_a_rollback_onto_a_damaged_step_falls_back_to_the_one_before(poisoned_trainer, tmp_path, monkeypatch):
    """Steps 3 and 4 bad (data steps 2, 3), a checkpoint every step: the streak rolls back to the
    latest step before it, 2. With step 2 damaged (its arrays fail to load) the rollback stopped
    the run ("no good checkpoint") though step 1 was good; it falls back to step 1, as a resume
    does, and the run completes every step."""
    from jaxpar.checkpoint.store import Checkpointer
    tr = poisoned_trainer
    tr.poison({2, 3})
    load = Checkpointer._load

    def damaged(self, abstract, s, config=None):
        if s == 2 and self.root == tmp_path / "checkpoints":
            raise ck.CheckpointError("arrays unreadable (test)")
        return load(self, abstract, s, config)
    monkeypatch.setattr(Checkpointer, "_load", damaged)
    logs = []
    old_log, tr.log = tr.log, logs.append
    tr.cfg.train.nonfinite_rollback, tr.cfg.checkpoint.every = True, 1
    try:
        _, hist = tr.fit(out_dir=tmp_path, progress=False)
    finally:
        tr.cfg.train.nonfinite_rollback, tr.cfg.checkpoint.every, tr.log = False, 100, old_log
    assert any("rolled back to step 1 and skipping data step 2" in m for m in logs), logs
    assert [h["step"] for h in hist] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(h["loss"]) for h in hist[-2:])


def test_sigint_is_caught_then_handlers_restored():
    import signal
    import time
    before = signal.getsignal(signal.SIGINT)
    with ck.Preemption(grace_s=30) as p:
        assert not p.should_stop(1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert p.should_stop(2) and p.requested == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


def test_preemption_grace_period_ends_the_process():
    import subprocess
    import sys
    code = ("import os, signal, time\nfrom jaxpar.checkpoint import Preemption\n"
            "Preemption(0.5).__enter__()\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(60)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 1 and "grace period (0.5s) ran out" in r.stderr, r.stderr


# ZeRO-1: data 4 x fsdp 2 and data 2 x fsdp 4 give the residuals the same shapes (at ZeRO-2 the
# shapes differ, and the shape check alone drops them)
INT8 = ["gradient_compression.method=int8", "gradient_compression.warmup_steps=0", "checkpoint.every=1",
        "sharding.zero_stage=1"]


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory, devices):
    """A run with int8 compression (error-feedback residuals in state["comm"]) on data 4 x fsdp 2
    that saved steps 1 and 2: (its final params and residuals on the host, its run dir). Tests
    resume from a copy."""
    from jaxpar.train.trainer import Trainer
    out = tmp_path_factory.mktemp("int8_run")
    first = Trainer(tiny_config("mesh.data=4", "mesh.fsdp=2", "train.steps=2", *INT8), devices=devices,
                    log=lambda s: None)
    assert "comm" in first.spec.state_shardings
    s2, _ = first.fit(out_dir=out, progress=False)
    return jax.tree.map(np.asarray, jax.device_get({k: s2[k] for k in ("params", "comm")})), out


def test_compression_residuals_carry_over_on_the_same_mesh_only(int8_run, tmp_path, devices):
    """data 4 x fsdp 2 and data 2 x fsdp 4 give the residuals the same shapes with each gradient
    element in another slot (collectives/reducer.py): they were restored silently, each added
    back to another element's gradient. On the saved mesh they are restored as saved."""
    from jaxpar.train.trainer import Trainer
    saved, out = int8_run
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    for resumed, kept in ((("mesh.data=4", "mesh.fsdp=2"), True), (("mesh.data=2", "mesh.fsdp=4"), False)):
        again = Trainer(tiny_config(*resumed, "train.steps=3", *INT8), devices=devices, log=lambda s: None)
        shapes = jax.tree.map(lambda x: x.shape, again.abstract_state()["comm"])
        assert shapes == jax.tree.map(np.shape, saved["comm"])  # only the mesh tells them apart
        state, start, msg = again.restore(out_dir=tmp_path)
        assert start == 2 and ("started afresh: comm" in msg) != kept, msg
        same = [np.array_equal(np.asarray(a), b)
                for a, b in zip(jax.tree.leaves(state["comm"]), jax.tree.leaves(saved["comm"]))]
        assert all(same) if kept else not all(same)


def test_resume_on_fewer_devices_restarts_compression_residuals(int8_run, tmp_path, devices):
    """Error-feedback residuals have one row per batch device: they cannot carry over to another
    device count (saved on 8, resumed on 4), so they start afresh (and are named); everything
    else is restored."""
    from jaxpar.train.trainer import Trainer
    saved, out = int8_run
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    tr4 = Trainer(tiny_config("mesh.data=2", "mesh.fsdp=2", "train.steps=3", *INT8), devices=devices[:4])
    state, start, msg = tr4.restore(out_dir=tmp_path)
    assert start == 2 and "started afresh: comm" in msg, msg
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(saved["params"])):
        np.testing.assert_array_equal(np.asarray(a), b)
    shapes = jax.tree.map(lambda x: x.shape, tr4.abstract_state()["comm"])
    assert jax.tree.map(lambda x: x.shape, state["comm"]) == shapes != jax.tree.map(np.shape, saved["comm"])
    _, hist = tr4.fit(state, start, progress=False)  # and trains on
    assert [h["step"] for h in hist] == [3] and np.isfinite(hist[0]["loss"])


def test_interleaved_run_saves_canonical_layer_order_and_resumes_bit_exact(tmp_path, devices):
    """interleaved_1f1b stores each device's layers in the order it runs them (sharding.Plan.
    layer_order; here [0, 2, 1, 3]). Its init is the one-device init reordered; its checkpoints
    hold the model's order, so a plain data-parallel layout restores its params and optimizer
    moments with each layer where the model has it; and its own layout resumes bit for bit."""
    import optax

    from jaxpar.train.trainer import Trainer
    model = ["model.n_layers=4"]
    tr = Trainer(tiny_config(*model, "mesh.data=1", "mesh.pipeline=2", "pipeline.schedule=interleaved_1f1b",
                             "pipeline.virtual_stages=2", "train.grad_accum=2", "train.steps=2",
                             "checkpoint.every=1"), devices=devices[:2], log=lambda s: None)
    plain = Trainer(tiny_config(*model, "mesh.data=2"), devices=devices[:2], log=lambda s: None)
    order = tr.plan.layer_order(4)
    assert order.tolist() == [0, 2, 1, 3]
    host = lambda tree: jax.tree.map(np.asarray, jax.device_get(tree))
    canonical = lambda x, axes: x[np.argsort(order)] if axes[:1] == ("layers",) else x
    canonical_params = lambda p: jax.tree.map(canonical, host(p), tr.model.axes)
    # init: the one-device params (the plain layout's random init does not depend on the layout)
    for a, b in zip(jax.tree.leaves(canonical_params(tr.init_state()["params"])),
                    jax.tree.leaves(host(plain.init_state()["params"]))):
        np.testing.assert_array_equal(a, b)
    s2, hist = tr.fit(out_dir=tmp_path, progress=False)
    s2 = host({"params": s2["params"], "opt_state": s2["opt_state"]})
    # resume from step 1 on the same layout: bit for bit
    s1, _, _ = tr.restore_step(tr.checkpointer, 1)
    again, hist_again = tr.fit(s1, 1, progress=False)
    assert hist_again[-1]["loss"] == hist[-1]["loss"]
    for a, b in zip(jax.tree.leaves(host({"params": again["params"], "opt_state": again["opt_state"]})),
                    jax.tree.leaves(s2)):
        np.testing.assert_array_equal(a, b)
    # step 2 onto a plain layout: the model's layer order, in the params and the Adam moments
    src = ck.Checkpointer(tmp_path / "checkpoints", async_save=False, read_only=True)
    restored, _, step = plain.restore_step(src, 2)
    src.close()
    want = {"params": canonical_params(s2["params"]),
            "opt_state": optax.tree_map_params(tr.tx, canonical, s2["opt_state"], tr.model.axes)}
    assert step == 2
    for a, b in zip(jax.tree.leaves(host({k: restored[k] for k in want})), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_processes_fall_back_together_and_a_bug_is_not_damage(tmp_path, devices, monkeypatch):
    """A second process (simulated in the gather) cannot read step 2: this process, which can,
    falls back to step 1 with it, the warning naming process 1 and its file. A programming error
    during restore propagates instead of being taken for a damaged step."""
    import jaxpar.distributed as dist
    root = tmp_path / "c"
    host = _save_steps(root, devices, [1, 2])
    other = {"checkpoint verdict": [f"OUT_OF_RANGE: {root}/2/state/ocdbt.process_1/d/x truncated"]}
    monkeypatch.setattr(dist, "allgather_json",
                        lambda obj, name="": [obj, (other.get(name) or [obj]).pop(0)])
    warnings = []
    mgr = ck.Checkpointer(root)
    state, _, step = mgr.restore(_target(devices, 4, host), warn=warnings.append)
    assert step == 1 and warnings[0] == (
        f"checkpoint {root.absolute() / '2'} is unusable (on process 1: OUT_OF_RANGE: {root}/2/state/"
        f"ocdbt.process_1/d/x truncated); falling back to step 1")
    assert mgr.all_steps() == [1] and (root / "2.unusable" / "state").is_dir()  # step 2 can be saved again
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), host["params"]["w"])
    monkeypatch.setattr(ck.store, "verify", lambda state, meta: 1 / 0)  # what restore calls
    with pytest.raises(ZeroDivisionError):
        mgr.restore(_target(devices, 4, host), warn=warnings.append)
    mgr.close()
    wrapped = Exception("Encountered error while reading array index")
    wrapped.__cause__ = ValueError('OUT_OF_RANGE: Error reading "w/0.0" of local file "/c/2/state/d/x"')
    assert ck.damage(wrapped) is wrapped.__cause__ and ck.damage(KeyError("w")) is None


# ---------------------------------------------------------------- config changes on resume


def test_other_dtype_is_one_error_not_damage(tmp_path, devices):
    """A target with another dtype (as after optimizer.mu_dtype=bfloat16) is not damage: one
    error naming the path, no fall back, no step set aside (checksums never compared)."""
    root = tmp_path / "c"
    host = _save_steps(root, devices, [1, 2])
    target = _target(devices, 4, host)
    mu = target["opt_state"]["mu"]
    target["opt_state"]["mu"] = jax.ShapeDtypeStruct(mu.shape, jax.numpy.bfloat16, sharding=mu.sharding)
    warnings = []
    mgr = ck.Checkpointer(root)
    with pytest.raises(ck.CheckpointError, match="holds another train state") as e:
        mgr.restore(target, warn=warnings.append)
    assert "opt_state/mu: checkpoint float32[64x32], config bfloat16[64x32]" in str(e.value)
    assert "checksum" not in str(e.value) and warnings == []
    assert mgr.all_steps() == [1, 2]
    del target["opt_state"]["count"]  # another structure: named too, still no fall back
    with pytest.raises(ck.CheckpointError, match="opt_state/count: only in the checkpoint"):
        mgr.restore(target, warn=warnings.append)
    assert warnings == [] and sorted(p.name for p in root.iterdir()) == ["1", "2"]
    mgr.close()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, devices):
    """A tiny trainer that saved steps 1 and 2 (a module's fits share its compiled step)."""
    from jaxpar.train.trainer import Trainer
    out = tmp_path_factory.mktemp("saved_run")
    logs = []
    tr = Trainer(tiny_config("mesh.data=8", "train.steps=2", "checkpoint.every=1"), devices=devices,
                 log=logs.append)
    tr.fit(out_dir=out, progress=False)
    return tr, out, logs


@pytest.mark.parametrize("change, field, back", [
    ("optimizer.mu_dtype=bfloat16", "optimizer.mu_dtype: checkpoint 'float32', config 'bfloat16'",
     "optimizer.mu_dtype=float32"),
    ("optimizer.clip_norm=null", "optimizer.clip_norm: checkpoint 1.0, config None", "optimizer.clip_norm=1.0"),
])
def test_resume_with_another_optimizer_state_names_the_settings(saved_run, tmp_path, devices,
                                                                change, field, back):
    from jaxpar.train.trainer import Trainer
    _, out, _ = saved_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    tr = Trainer(tiny_config("mesh.data=8", "train.steps=4", "checkpoint.every=1", change), devices=devices,
                 log=lambda m: None)
    with pytest.raises(ck.CheckpointError, match="holds another train state") as e:
        tr.restore(out_dir=run)
    msg = str(e.value)
    assert field in msg and f"resume with the checkpoint's values ({back})" in msg, msg
    assert "train.init_from=" in msg and "opt_state/" in msg
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2"]  # nothing moved


def test_resume_from_an_older_step_of_the_run_supersedes_later_ones(saved_run, tmp_path):
    """train.resume=<own checkpoints>/1 with step 2 there: step 2 is moved aside before training,
    so the run saves its own step 2; a changed seed and batch are named on resume."""
    tr, out, logs = saved_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    cfg = tr.cfg
    saved = (cfg.train.resume, cfg.train.seed)
    cfg.train.resume, cfg.train.seed = str(run / "checkpoints" / "1"), 7
    logs.clear()
    try:
        state, start, _ = tr.restore(out_dir=run)
        assert start == 1
        _, hist = tr.fit(state, start, out_dir=run, progress=False)
    finally:
        cfg.train.resume, cfg.train.seed = saved
    assert [h["step"] for h in hist] == [2]
    notice = [m for m in logs if m.startswith("resume: changed since the checkpoint")]
    assert notice == ["resume: changed since the checkpoint: train.seed 0 -> 7 (the data order will "
                      "differ from the original run's)"], logs
    assert any("its later checkpoints (2) are moved aside" in m for m in logs), logs
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["1", "2", "2.superseded"]


def test_resume_notices_name_batch_seed_and_seq_len(tmp_path, devices):
    cfg = tiny_config(f"run_dir={tmp_path}", "name=r")
    mgr = ck.Checkpointer(ck.checkpoint_dir(cfg))
    _, state = _state(devices)
    mgr.save(3, state, {"devices": 8}, cfg.model_dump(mode="json"))
    mgr.close()
    assert ck.plan_resume(cfg, 8).notices == []
    plan = ck.plan_resume(tiny_config(f"run_dir={tmp_path}", "name=r", "train.global_batch=32",
                                      "train.seq_len=64"), 8)
    assert plan.notices == ["train.global_batch 16 -> 32", "train.seq_len 32 -> 64"]


def test_second_signal_waits_for_the_save(saved_run, tmp_path, monkeypatch):
    """SIGINT at step 1, again while its save is in flight: the save completes, the run stops
    cleanly, and only then is the checkpoint reported as saved."""
    import signal
    from jaxpar.train.callbacks import Callback
    tr, _, logs = saved_run

    class First(Callback):
        def on_step_end(self, trainer, step, state, metrics):
            if step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    save = ck.Checkpointer.save

    def save_then_signal(self, step, *a, **kw):
        save(self, step, *a, **kw)  # async: the files are still being written
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ck.Checkpointer, "save", save_then_signal)
    monkeypatch.setattr(tr, "callbacks", [First()])
    logs.clear()
    tr.fit(out_dir=tmp_path, progress=False)
    assert tr.preempted == "SIGINT"
    assert logs[-1] == f"stopped by SIGINT after step 1: checkpoint saved in {tr.checkpointer.root / '1'}; " \
                       f"metrics flushed"
    assert ck.check_complete(tmp_path / "checkpoints" / "1") == []
    # a stop whose save did not land says so
    assert "the save of step 5 did not complete; the latest complete checkpoint is" in \
        tr._stop_message(tr.checkpointer, False, 5)


def test_third_signal_exits_without_a_traceback():
    import subprocess
    import sys
    code = ("import os, signal, time\nfrom jaxpar.checkpoint import Preemption\n"
            "Preemption(30).__enter__()\n"
            "for _ in range(3):\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(0.2)\n"
            "time.sleep(60)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 128 + 15 and "Traceback" not in r.stderr, r.stderr
    assert "SIGTERM again: still finishing" in r.stderr and "SIGTERM a third time" in r.stderr, r.stderr


def test_resume_notices_a_changed_learning_rate_schedule(tmp_path, devices):
    """A resume with a longer train.steps (decay_steps null) stretches the cosine: the next step's
    lr jumps from the end of the old schedule back up, silently. Named with the lr of the next
    step from the analytic warmup + cosine; train.steps with decay_steps fixed changes nothing."""
    lr, steps, step = 1e-2, 3, 3

    def cosine(s, total):  # warmup 0 (tiny_config), min_lr_ratio 0.1
        return 0.1 * lr + 0.45 * lr * (1 + math.cos(math.pi * min(s / total, 1)))

    cfg = tiny_config(f"run_dir={tmp_path}", "name=r", f"optimizer.lr={lr}", f"train.steps={steps}")
    mgr = ck.Checkpointer(ck.checkpoint_dir(cfg))
    _, state = _state(devices)
    mgr.save(step, state, {"devices": 8}, cfg.model_dump(mode="json"))
    mgr.close()
    plan = ck.plan_resume(tiny_config(f"run_dir={tmp_path}", "name=r", f"optimizer.lr={lr}", "train.steps=10"), 8)
    assert len(plan.notices) == 1, plan.notices
    got = re.fullmatch(r"the learning-rate schedule \(train.steps 3 -> 10\): lr of step 4 (\S+) -> (\S+)",
                       plan.notices[0])
    assert got, plan.notices
    assert float(got[1]) == pytest.approx(cosine(step, steps), rel=1e-3)
    assert float(got[2]) == pytest.approx(cosine(step, 10), rel=1e-3)
    assert ck.plan_resume(cfg, 8).notices == []
    fixed = [f"run_dir={tmp_path}", "name=r2", f"optimizer.lr={lr}", "optimizer.decay_steps=20"]
    mgr = ck.Checkpointer(ck.checkpoint_dir(tiny_config(*fixed)))
    mgr.save(step, state, {"devices": 8}, tiny_config(*fixed, "train.steps=3").model_dump(mode="json"))
    mgr.close()
    assert ck.plan_resume(tiny_config(*fixed, "train.steps=10"), 8).notices == []


def test_schedule_notice_reads_each_schedule_once_over_every_step_to_run(monkeypatch):
    """The lrs of the steps still to run are compared in one call per schedule over all their
    optimizer counts (one by one, a resume with 200k steps ahead evaluated them for minutes)."""
    from jaxpar.checkpoint import compat
    from jaxpar.train import decay
    calls, real = [], decay.schedule

    def recording(cfg, total):
        lr = real(cfg, total)
        return lambda count: calls.append(np.array(count)) or lr(count)
    monkeypatch.setattr(decay, "schedule", recording)
    same = ["optimizer.warmup_steps=10", "optimizer.decay_steps=50000"]
    saved = tiny_config(*same, "train.steps=100000").model_dump(mode="json")
    assert compat.schedule_notices(saved, tiny_config(*same, "train.steps=200000"), 5000) == []
    assert len(calls) == 2 and all(np.array_equal(c, np.arange(5000, 200000)) for c in calls)
    # a schedule stretched from 100k to 200k steps differs: named
    saved = tiny_config("optimizer.warmup_steps=10", "train.steps=100000").model_dump(mode="json")
    assert compat.schedule_notices(saved, tiny_config("optimizer.warmup_steps=10", "train.steps=200000"),
                                   5000) != []


LOCAL_SGD = ["local_sgd.sync_every=2", "mesh.tensor=2", "train.global_batch=8", "checkpoint.every=2",
             "sharding.zero_stage=1"]


def test_local_sgd_elastic_resume_keeps_the_replicas(tmp_path, devices):
    """Local SGD holds one optimizer state and params copy per data replica: an elastic resume
    onto 4 devices gave it data=2 and stopped with a state mismatch naming no setting. The mesh
    keeps data=4 and the next steps are the uninterrupted 8-device run's (tensor=2 -> 1 changes
    only the order of float32 sums: 1e-5); a device count data=4 does not divide is one error."""
    from jaxpar.train.trainer import Trainer
    cfg = tiny_config("mesh.data=4", "train.steps=4", *LOCAL_SGD)
    _, ref = Trainer(cfg, devices=devices, log=lambda s: None).fit(out_dir=tmp_path / "ref", progress=False)
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")  # as if stopped after step 2
    plan = ck.plan_resume(cfg, 4, own_root=tmp_path / "run" / "checkpoints")
    assert plan.cfg.mesh.data == 4 and plan.cfg.train.grad_accum == 1, plan.changes
    tr4 = Trainer(plan.cfg, devices=devices[:4], log=lambda s: None)
    state, start, msg = tr4.restore(plan, out_dir=tmp_path / "run")
    assert start == 2 and "afresh" not in msg, msg
    _, hist = tr4.fit(state, start, progress=False)
    got, want = {h["step"]: h for h in hist}, {h["step"]: h for h in ref}
    assert sorted(got) == [3, 4]
    for s in got:
        np.testing.assert_allclose([got[s]["loss"], got[s]["grad_norm"]],
                                   [want[s]["loss"], want[s]["grad_norm"]], rtol=1e-5)
    with pytest.raises(ck.CheckpointError, match="local SGD run on 6 devices.*mesh.data=4"):
        ck.adapt_layout(cfg, plan.meta, 6)


def test_elastic_resume_adapts_pipeline_microbatches():
    """With pipeline.microbatches set (grad_accum 1), the saved layout recorded grad_accum 1: a
    resume on 4 devices set grad_accum 2 beside microbatches 4 and stopped with "set only one of
    them". The microbatches are the accumulation: they are what adapts, keeping the saved run's
    rows per microbatch."""
    cfg = tiny_config("mesh.data=2", "mesh.pipeline=2", "mesh.tensor=2", "pipeline.microbatches=4",
                      "train.global_batch=16")
    axes = ("data", "fsdp", "pipeline", "tensor", "expert")
    mesh8 = type("M", (), {"shape": {"data": 2, "fsdp": 1, "pipeline": 2, "tensor": 2, "expert": 1},
                           "axis_names": axes, "devices": np.zeros(8)})()
    meta = ck.layout_meta(cfg, mesh8)
    rows = lambda c, n: c.train.global_batch // (ck.batch_parallel(c, n)
                                                 * c.pipeline.resolved_microbatches(c.train.grad_accum))
    new, changes = ck.adapt_layout(cfg, meta, 4)
    assert new.mesh.pipeline == 2 and rows(new, 4) == rows(cfg, 8), changes
    assert any("pipeline.microbatches 4 -> 8" in c for c in changes), changes
