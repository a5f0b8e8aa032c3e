"""A one-node SLURM on 127.0.0.1 for tests: munged with a generated key, slurmctld and slurmd,
a short slurm.conf, every state file in one temporary directory. Needs root (slurmd starts
tasks as the submitting user) and the Debian packages slurm-wlm and munge.

    with one_node_slurm(tmp_dir) as env:       # env: os.environ plus SLURM_CONF
        subprocess.run(["sbatch", "job.sbatch"], env=env)

`python tests/slurm_cluster.py DIR` brings one up and keeps it until Ctrl-C (to try sbatch by hand)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
NODE = "localhost"  # jax's SLURM detection takes the first node's name as the coordinator's host


def missing() -> list[str]:
    """What is not installed (Debian package names), or why it cannot run here."""
    out = [pkg for prog, pkg in (("munged", "munge"), ("slurmctld", "slurm-wlm"), ("slurmd", "slurm-wlm"),
                                 ("sbatch", "slurm-client")) if shutil.which(prog) is None]
    out = sorted(set(out))
    if not out and os.geteuid() != 0:
        out.append("root (slurmd runs as root)")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MAX_DIR = 60  # + "/slurmd/localhost_<job>.<step>" (about 40) stays under 108


@contextlib.contextmanager
def short_dir():
    """A fresh directory with a short path under /tmp, removed afterwards."""
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="jaxpar-slurm-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _conf(d: Path, cpus: int) -> str:
    ctld, slurmd = _free_port(), _free_port()
    return f"""\
ClusterName=jaxpar-check
SlurmctldHost={NODE}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/slurmd
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=check Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


def _wait(pred, timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            tail = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                             for p in logs if p.exists())
            raise RuntimeError(f"one-node SLURM: {what} not within {timeout:.0f}s\n{tail}")
        time.sleep(0.2)


def _cancel_all(env: dict) -> None:
    """End every job left (a failed test's), so no job step outlives the daemons."""
    subprocess.run(["scancel", "--partition=check", "--full"], env=env, capture_output=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True)
        if r.returncode != 0 or not r.stdout.strip():
            return
        time.sleep(0.5)


@contextlib.contextmanager
def one_node_slurm(d: Path, cpus: int | None = None):
    """Bring the cluster up in `d`, yield the environment its clients need, tear it down. `d`
    must be a short path: munged's and slurmstepd's Unix sockets live in it, and a socket path
    has at most 108 bytes (pytest's tmp_path under xdist is too long: use short_dir())."""
    d = Path(d).resolve()
    if len(str(d)) > MAX_DIR:
        raise ValueError(f"one-node SLURM: {d} is {len(str(d))} characters, over {MAX_DIR}: the "
                         f"Unix sockets in it would pass the 108-byte limit; use short_dir()")
    for sub in ("ctld", "slurmd", "munge"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    conf = d / "slurm.conf"
    conf.write_text(_conf(d, cpus or os.cpu_count() or 1))
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs: list[subprocess.Popen] = []
    logs = [d / "munged.log", d / "slurmctld.log", d / "slurmd.log"]
    try:
        procs.append(subprocess.Popen(
            ["munged", "-F", "-f", f"--socket={d}/munge.socket", f"--key-file={key}",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munge/seed"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(d / "munged.err", "w")))
        _wait(lambda: (d / "munge.socket").exists(), 20, "munged", logs + [d / "munged.err"])
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen(["slurmd", "-D", "-N", NODE, "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))

        def node_idle() -> bool:
            for p in procs:
                if p.poll() is not None:
                    tails = "\n".join(x.read_text(errors="replace")[-2000:] for x in logs if x.exists())
                    raise RuntimeError(f"one-node SLURM: {p.args[0]} exited with {p.returncode}: {tails}")
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True)
            return r.returncode == 0 and r.stdout.strip() == "idle"

        _wait(node_idle, 60, "the node idle (sinfo)", logs)
        yield env
    finally:
        if len(procs) == len(DAEMONS) and all(p.poll() is None for p in procs):
            _cancel_all(env)
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


if __name__ == "__main__":
    if missing():
        sys.exit(f"needs: {', '.join(missing())}")
    with one_node_slurm(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/slurm-check")) as e:
        print(f"up: export SLURM_CONF={e['SLURM_CONF']}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
