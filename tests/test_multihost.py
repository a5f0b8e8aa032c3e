"""Multi-host pieces that need no training: where jax.distributed settings come from, clear
errors (never a hang) for wrong ones, the local launcher's process handling (with small Python
children). The training runs are in test_multihost_train.py, the deploy/ templates in
test_deploy.py."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxpar.config import ConfigError, DistributedConfig, make_config
from jaxpar.distributed import DistributedError, initialize, resolve
from jaxpar.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
ADDR = "10.0.0.1:1234"


# ---------------------------------------------------------------- settings


def test_settings_from_config_env_and_cluster():
    env = {"JAXPAR_COORDINATOR_ADDRESS": "127.0.0.1:999", "JAXPAR_NUM_PROCESSES": "4", "JAXPAR_PROCESS_ID": "3"}
    s = resolve(DistributedConfig(), env)
    assert (s.coordinator_address, s.num_processes, s.process_id, s.method) == ("127.0.0.1:999", 4, 3, "explicit")
    assert "JAXPAR_PROCESS_ID" in s.source
    # the config wins over the environment, field by field
    s = resolve(DistributedConfig(coordinator_address=ADDR, process_id=1), env)
    assert (s.coordinator_address, s.num_processes, s.process_id) == (ADDR, 4, 1)
    assert "distributed.coordinator_address/process_id" in s.source
    # nothing: one process, nothing to start; a count of 1 is one process too
    assert resolve(DistributedConfig(), {}) is None
    assert resolve(DistributedConfig(), {**env, "JAXPAR_NUM_PROCESSES": "1", "JAXPAR_PROCESS_ID": "0"}) is None
    assert resolve(DistributedConfig(enabled=False), env) is None
    # a SLURM step with several tasks, an Open MPI job: jax's detectors fill the rest
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[01-04]", "SLURM_NTASKS": "4",
             "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}
    assert resolve(DistributedConfig(), slurm).method == "slurm"
    assert resolve(DistributedConfig(), {**slurm, "SLURM_NTASKS": "1"}) is None
    assert resolve(DistributedConfig(), {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_VERSION": "4.1"}).method == "ompi"
    assert resolve(DistributedConfig(cluster_detection="k8s"), {}).method == "k8s"
    # dotted overrides reach the section
    cfg = make_config({}, ["distributed.coordinator_address=h:1", "distributed.num_processes=2",
                           "distributed.process_id=0", "distributed.initialization_timeout_s=5"])
    assert resolve(cfg.distributed, {}).timeout_s == 5


def test_slurm_detection_fills_coordinator_count_and_id(monkeypatch):
    """jax's SLURM detector, asked by jaxpar: the first node of the step, the port from
    JAX_COORDINATOR_PORT, and all local devices kept (no one-GPU-per-process restriction)."""
    from jaxpar.distributed import _fill_from_cluster
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[07-10]", "SLURM_NTASKS": "4",
           "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "JAX_COORDINATOR_PORT": "12355"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = _fill_from_cluster(resolve(DistributedConfig(cluster_detection="slurm"), env))
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("gpu07:12355", 4, 2)
    assert s.local_device_ids is None


@pytest.mark.parametrize("cfg, env, message", [
    ({}, {"JAXPAR_COORDINATOR_ADDRESS": ADDR, "JAXPAR_NUM_PROCESSES": "2"},
     "not distributed.process_id (or JAXPAR_PROCESS_ID)"),
    ({"num_processes": 2, "process_id": 1}, {}, "not distributed.coordinator_address"),
    ({}, {"JAXPAR_COORDINATOR_ADDRESS": ADDR, "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "2"},
     "process id 2 is not in 0..1"),
    ({}, {"JAXPAR_COORDINATOR_ADDRESS": "10.0.0.1", "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "0"},
     "must be host:port"),
    ({}, {"JAXPAR_NUM_PROCESSES": "two"}, "JAXPAR_NUM_PROCESSES='two' is not an integer"),
    ({"enabled": True}, {}, "nothing says how to reach the other processes"),
])
def test_wrong_settings_name_the_setting(cfg, env, message):
    with pytest.raises(DistributedError, match=re.escape(message)):
        resolve(DistributedConfig(**cfg), env)


def test_config_section_checks():
    with pytest.raises(ConfigError, match="must be host:port"):
        make_config({}, ["distributed.coordinator_address=nohost"])
    with pytest.raises(ConfigError, match=r"process_id=3 is not in 0..1"):
        make_config({}, ["distributed.num_processes=2", "distributed.process_id=3"])
    with pytest.raises(ConfigError, match="did you mean 'num_processes'"):
        make_config({}, ["distributed.num_process=2"])


def test_initialize_after_jax_started_is_a_clear_error(devices):
    """The test process already runs a backend: initialize refuses (and starts nothing)."""
    cfg = DistributedConfig(coordinator_address=f"127.0.0.1:{free_port()}", num_processes=2, process_id=1)
    with pytest.raises(DistributedError, match="must start before any other JAX call"):
        initialize(cfg)
    assert initialize(DistributedConfig()) is None  # a single process: nothing to do



def test_every_process_compiles_the_same_program_whatever_the_call_site(devices):
    """jaxlib seeds an executable's launch ids from its fingerprint, and with full tracebacks in
    the HLO's source metadata the fingerprint depends on where the step was traced from: the
    rank-0 and other-rank branches of a script gave two processes different launch ids, and on
    jaxlib 0.12.1 their gloo collectives never met (the first step hung). Once jax.distributed
    is up, the same function traced from two places compiles to one program."""
    import jax
    import jax.numpy as jnp

    from jaxpar.distributed import same_program_on_every_process

    def fresh():  # a new function object each time: traced anew, never a cache hit
        return lambda x: jnp.sin(x) * 2

    x = jnp.ones(3)

    def here():
        return jax.jit(fresh()).lower(x).compile()

    def there():
        return jax.jit(fresh()).lower(x).compile()

    def fingerprint(compiled):
        return compiled.runtime_executable().fingerprint, compiled.as_text()

    before = jax.config.jax_include_full_tracebacks_in_locations
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        # both compiled here, not one loaded from the test run's compilation cache (its key
        # leaves the source locations out: `there` would load `here`'s executable): no entry
        # written (whether the cache is used at all is decided once a process)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
        jax.config.update("jax_include_full_tracebacks_in_locations", True)
        assert fingerprint(here()) != fingerprint(there())  # the hazard is real here
        same_program_on_every_process()
        assert fingerprint(here()) == fingerprint(there())
    finally:
        jax.config.update("jax_include_full_tracebacks_in_locations", before)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)

def _env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
    env.update(extra)
    return env


INIT = ("import sys; from jaxpar.distributed import initialize; from jaxpar.config import make_config; "
        "initialize(make_config({}, sys.argv[1:]).distributed); import jax; print('devices', jax.device_count())")


@pytest.mark.parametrize("who, expect", [
    ("unreachable", "no answer on 127.0.0.1:"),      # process 1, nobody listens at the coordinator address
    ("missing", "answers, but not all 2 processes joined"),  # process 0 alone: the other never comes
])
def test_wrong_coordinator_fails_fast_with_a_message(who, expect):
    port = free_port()
    pid = 1 if who == "unreachable" else 0
    args = [f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
            f"distributed.process_id={pid}", f"distributed.coordinator_bind_address=127.0.0.1:{port}",
            "distributed.initialization_timeout_s=4"]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", INIT, *args], env=_env(), capture_output=True, text=True,
                       timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    assert "jaxpar: error: jax.distributed did not start within 4s" in r.stderr, r.stderr
    assert expect in r.stderr and f"process {pid} of 2" in r.stderr, r.stderr
    assert "Check failure" not in r.stderr and "devices" not in r.stdout
    assert took < 60, took


def test_coordinator_port_in_use_is_a_clear_error():
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = [f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                "distributed.process_id=0", f"distributed.coordinator_bind_address=127.0.0.1:{port}"]
        r = subprocess.run([sys.executable, "-c", INIT, *args], env=_env(), capture_output=True, text=True,
                           timeout=60)
    assert r.returncode != 0 and "the port is in use" in r.stderr and "Check failure" not in r.stderr, r.stderr


def _listening(port: int) -> list:
    """The addresses a TCP listener on `port` is bound to (Linux /proc/net)."""
    import ipaddress
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                found.append(getattr(ip, "ipv4_mapped", None) or ip)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net")
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_loopback_coordinator_listens_on_loopback_only(host):
    """distributed.coordinator_address=127.0.0.1:PORT without a bind address: jax's default
    bind ([::]:PORT, every interface) put the coordination service on the network, though only
    this machine's processes can reach 127.0.0.1. Process 0 now listens where the address says,
    as `jaxpar launch` does; the processes still join."""
    port = free_port()
    args = [f"distributed.coordinator_address={host}:{port}", "distributed.num_processes=2",
            "distributed.initialization_timeout_s=60"]
    first = subprocess.Popen([sys.executable, "-c", INIT, *args, "distributed.process_id=0"], env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)
        bound = _listening(port)
        assert bound and all(ip.is_loopback for ip in bound), bound
        second = subprocess.run([sys.executable, "-c", INIT, *args, "distributed.process_id=1"], env=_env(),
                                capture_output=True, text=True, timeout=90)
        out = first.communicate(timeout=60)[0]
    finally:
        first.kill()
    assert second.returncode == 0 and first.returncode == 0, second.stdout + second.stderr + out
    assert "devices 4" in out and "devices 4" in second.stdout


# ---------------------------------------------------------------- the launcher (small children)

CHILD = textwrap.dedent("""\
    import os, signal, sys, time
    rank, attempt = int(os.environ["JAXPAR_PROCESS_ID"]), int(os.environ["JAXPAR_RESTART_COUNT"])
    n = os.environ["JAXPAR_NUM_PROCESSES"]
    mode = sys.argv[1]
    print(f"hello from {rank}/{n} attempt {attempt} at {os.environ['JAXPAR_COORDINATOR_ADDRESS']} "
          f"{os.environ['XLA_FLAGS']}", flush=True)
    if mode == "ok":
        print(f"hash seed {os.environ.get('PYTHONHASHSEED')}", flush=True)
        sys.exit(0)
    if mode == "term":  # save-and-exit on SIGTERM, like jaxpar train
        signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(0)))
        print("ready", flush=True)
        time.sleep(120)
        sys.exit(1)
    if mode == "fail1":  # rank 1 fails, the others would run forever and ignore SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rank == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    if mode == "config":  # a configuration error (exit 2): restarting would repeat it
        sys.exit(2 if rank == 0 else 0)
    if mode == "flaky":  # rank 1 dies in attempt 0 and cannot come back; fewer processes finish
        if rank == 1:
            sys.exit(3)
        if attempt < 2:
            time.sleep(120)
        print(f"finished on {n}", flush=True)
        sys.exit(0)
""")


def _launch(tmp_path, mode, *opts, nprocs=2, timeout=60, wait=True):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nprocs", str(nprocs), "--devices-per-proc", "3",
           *opts, "--", "python", str(script), mode]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return p
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def test_launch_prefixes_ranks_and_sets_the_environment(tmp_path):
    rc, out = _launch(tmp_path, "ok", nprocs=3)
    assert rc == 0, out
    for r in range(3):
        line = next(x for x in out.splitlines() if x.startswith(f"[{r}] hello"))
        assert f"hello from {r}/3 attempt 0 at 127.0.0.1:" in line, out
        assert line.endswith("--xla_force_host_platform_device_count=3"), line  # replaces the caller's 2
    assert "[launch] all 3 processes finished" in out
    seeds = set(re.findall(r"^\[\d\] hash seed (\S+)$", out, re.M))
    assert len(seeds) == 1 and seeds != {"None"}, out  # one seed: every process traces the same program


def test_launch_ends_the_others_when_one_dies(tmp_path):
    t0 = time.monotonic()
    rc, out = _launch(tmp_path, "fail1", "--kill-timeout", "2")
    assert time.monotonic() - t0 < 60
    assert rc == 128 + signal.SIGKILL, out
    assert "[launch] rank 1 failed (killed by SIGKILL); stopping ranks 0" in out, out
    assert "rank 0 killed by SIGKILL" in out  # it ignored SIGTERM: killed after --kill-timeout


def test_launch_forwards_sigterm_and_sigint(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGINT):
        p = _launch(tmp_path, "term", wait=False)
        lines = []
        while sum("ready" in x for x in lines) < 2:
            lines.append(p.stdout.readline())
            assert lines[-1], "".join(lines)
        p.send_signal(sig)
        out = "".join(lines) + p.communicate(timeout=60)[0]
        assert p.returncode == 0, out
        assert f"[launch] {signal.Signals(sig).name}: forwarding SIGTERM" in out
        assert "[0] got SIGTERM" in out and "[1] got SIGTERM" in out, out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state  # a zombie has exited


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_children_die_with_a_killed_launcher(tmp_path):
    p = _launch(tmp_path, "term", wait=False)
    lines, pids = [], []
    while sum("ready" in x for x in lines) < 2:
        lines.append(p.stdout.readline())
        assert lines[-1], "".join(lines)
        m = re.match(r"\[launch\] rank \d: pid (\d+)", lines[-1])
        if m:
            pids.append(int(m[1]))
    p.kill()  # SIGKILL: no handler runs in the launcher
    p.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), pids


def test_launch_restarts_and_shrinks_when_a_rank_cannot_come_back(tmp_path):
    rc, out = _launch(tmp_path, "flaky", "--max-restarts", "2", "--min-nprocs", "1", "--kill-timeout", "2",
                      timeout=90)
    assert rc == 0, out
    assert "restart 1 of 2" in out and "rank 1 failed twice in a row: it cannot come back" in out, out
    assert "[0] hello from 0/1 attempt 2" in out and "[0] finished on 1" in out
    # without restarts the launcher exits with the failing rank's code
    rc, out = _launch(tmp_path, "flaky", "--kill-timeout", "2")
    assert rc == 3 and "no --max-restarts" in out, out
    rc, out = _launch(tmp_path, "config", "--max-restarts", "2")
    assert rc == 2 and "a configuration error" in out and "attempt 1" not in out, out


DIFFERENT_STEPS = textwrap.dedent("""\
    import os, sys
    from jaxpar.cli import main
    rank = int(os.environ["JAXPAR_PROCESS_ID"])
    sys.exit(main(["train", sys.argv[1], f"run_dir={sys.argv[2]}", f"train.steps={3 + rank}"]))
""")


def test_processes_with_different_configs_fail_at_once_naming_the_difference(tmp_path):
    """train.steps=3 on process 0 and 4 on process 1 (a per-host override gone wrong): they
    compiled different programs and the run hung at its first step; now every process exits with
    code 2 naming the setting, before anything compiles, and the launcher does not restart."""
    from tests.run_configs import layout_run_yaml
    (tmp_path / "run.yaml").write_text(layout_run_yaml("mismatch", 4, "every: 100"))
    (tmp_path / "child.py").write_text(DIFFERENT_STEPS)
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nprocs", "2", "--devices-per-proc", "4",
           "--max-restarts", "1", "--kill-timeout", "2", "--", "python", str(tmp_path / "child.py"),
           str(tmp_path / "run.yaml"), str(tmp_path / "runs")]
    try:
        r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"a run with different configs hung: {e.stdout}") from None
    assert r.returncode == 2, r.stdout + r.stderr
    for rank in (0, 1):
        assert (f"[{rank}] jaxpar: error: the processes were started with different configs: "
                f"train.steps: 3 on process 0, 4 on process 1;") in r.stdout, r.stdout
    assert "a configuration error (restarting would repeat it)" in r.stdout and "attempt 1" not in r.stdout
    assert not (tmp_path / "runs" / "mismatch" / "metrics.jsonl").exists()
