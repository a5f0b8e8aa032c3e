"""`jaxpar launch`: a multi-process jax.distributed run on one machine, on CPU devices.

    jaxpar launch --nprocs 2 --devices-per-proc 4 -- train configs/quickstart.yaml train.steps=20

starts N processes (`jaxpar train ...`, or any program: `-- python my_script.py`) that find each
other through JAX's coordination service on 127.0.0.1 (a free port) and reduce with JAX's CPU
collectives (gloo), each with K forced CPU devices. It is the multi-host code path (per-process
data, process-0 logging, checkpoints written by all) on one machine; real clusters start
`jaxpar train` with SLURM or Kubernetes (deploy/).

- Every line of output is prefixed with its rank (`[1] ...`); the launcher's own with `[launch]`.
- SIGTERM and SIGINT (Ctrl-C) are forwarded to every process as SIGTERM, so jax's preemption
  sync point makes all of them stop, save and exit at the same step; after `--grace` seconds
  the rest are killed. A second signal kills them at once.
- When a process fails (non-zero exit or a signal), the others get SIGTERM, then SIGKILL after
  `--kill-timeout` seconds; the launcher exits non-zero. It never waits on a broken group.
- `--max-restarts R` starts the group again (R times at most; not after exit code 2, a
  configuration error); `jaxpar train` resumes from the latest checkpoint (train.resume=auto).
  A rank that fails twice in a row cannot come back: with `--min-nprocs M` below N the group
  restarts without it (down to M processes), and the run's elastic resume adapts the mesh and
  grad_accum to the smaller device count.

With a run dir (`--run-dir`, by default the `<run_dir>/<name>` of a `train CONFIG` command) the
launcher writes `group_start` / `group_end` (reason done, failed or signal) into its event log
(observe/events.py, source "launch"), which `jaxpar goodput` reads.

The children see JAXPAR_COORDINATOR_ADDRESS / JAXPAR_NUM_PROCESSES / JAXPAR_PROCESS_ID (read by
`jaxpar.distributed.initialize`), JAXPAR_RESTART_COUNT (the attempt, from 0), XLA_FLAGS
with --xla_force_host_platform_device_count=K, and one PYTHONHASHSEED for all (yours, or 0).
The coordinator listens on 127.0.0.1 only.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from jaxpar.observe.events import RunEvents

# `jaxpar launch -- train ...` runs these through the jaxpar CLI; anything else runs as given.
JAXPAR_COMMANDS = ("train", "bench", "checkpoint", "plot", "profile")
HOST = "127.0.0.1"
USER_ERROR = 2  # jaxpar's exit code for a bad config or jax.distributed setting: never restarted


@dataclass
class LaunchOptions:
    nprocs: int
    devices_per_proc: int
    command: list[str]
    max_restarts: int = 0
    min_nprocs: int | None = None   # elastic floor; None: never shrink
    kill_timeout: float = 10.0      # after a failure: SIGTERM, then SIGKILL this much later
    grace: float = 180.0            # after a forwarded SIGTERM/SIGINT: then SIGKILL
    restart_delay: float = 1.0
    run_dir: str | None = None      # where group_start / group_end go (the run's event log)


@dataclass
class Attempt:
    """How one start of the group ended."""

    nprocs: int
    codes: list[int | None]
    first_failure: int | None = None   # the rank that failed first (by exit time), if any
    signalled: str | None = None       # the signal the launcher forwarded, if any
    exit_times: dict[int, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.codes)


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on now (bound to `host`, port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_command(command: list[str]) -> list[str]:
    if not command:
        raise ValueError("no command to launch: jaxpar launch ... -- train CONFIG [overrides]")
    if command[0] in JAXPAR_COMMANDS:
        return [sys.executable, "-m", "jaxpar.cli", *command]
    if command[0] in ("python", "python3"):  # this interpreter (the venv's)
        return [sys.executable, *command[1:]]
    return list(command)


def missing_program(command: list[str]) -> str | None:
    """The program of `command` when it cannot be started (checked before any process starts, so a
    typo is one error, not a FileNotFoundError per rank); None when it can (a jaxpar subcommand,
    python, or an executable on PATH / at the given path)."""
    import shutil
    program = child_command(command)[0]
    if command[0] in JAXPAR_COMMANDS or command[0] in ("python", "python3"):
        return None
    return None if shutil.which(program) is not None else program


def forced_device_flags(xla_flags: str, devices: int) -> str:
    """`xla_flags` with its forced CPU device count, if any, replaced by `devices`."""
    flags = [f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def child_env(base: dict[str, str], rank: int, nprocs: int, devices: int | None, port: int, attempt: int,
              hash_seed: str = "0", host: str = HOST) -> dict:
    """The environment of rank `rank`: the coordinator at host:port, and `devices` forced CPU
    devices (None: the machine's own accelerators, as found)."""
    env = dict(base)
    # Every process must trace the same program: one Python hash seed for all (set iteration
    # order must not differ between them). A seed the caller set is kept.
    env.setdefault("PYTHONHASHSEED", hash_seed)
    if devices is not None:
        env["XLA_FLAGS"] = forced_device_flags(env.get("XLA_FLAGS", ""), devices)
        env["JAX_PLATFORMS"] = "cpu"
    env.update({
        "JAXPAR_COORDINATOR_ADDRESS": f"{host}:{port}",
        "JAXPAR_COORDINATOR_BIND_ADDRESS": f"{host}:{port}",
        "JAXPAR_NUM_PROCESSES": str(nprocs),
        "JAXPAR_PROCESS_ID": str(rank),
        "JAXPAR_RESTART_COUNT": str(attempt),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _exit_status(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _libc():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux: the launcher's own handlers still clean up
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies, so nothing is orphaned. Only a
    call into libc loaded beforehand (no imports, no locks between fork and exec)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Launcher:
    def __init__(self, opts: LaunchOptions, out: BinaryIO | None = None) -> None:
        if opts.nprocs < 1 or opts.devices_per_proc < 1:
            raise ValueError("--nprocs and --devices-per-proc must be >= 1")
        self.opts = opts
        self.out = out if out is not None else sys.stdout.buffer
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.signal: str | None = None
        self.kill_now = False
        self.attempts: list[Attempt] = []
        self.events = RunEvents(opts.run_dir, source="launch")

    # -- output
    def say(self, msg: str) -> None:
        self._write(b"[launch] " + msg.encode() + b"\n")

    def _write(self, data: bytes) -> None:
        with self.lock:
            self.out.write(data)
            self.out.flush()

    def _pump(self, rank: int, stream) -> None:
        prefix = f"[{rank}] ".encode()
        for line in iter(stream.readline, b""):
            self._write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
        stream.close()

    # -- signals
    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
        else:
            self.kill_now = True

    def _send(self, proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)  # the child leads its own process group
            except (ProcessLookupError, PermissionError):
                pass

    # -- one start of the group
    def _start(self, nprocs: int, attempt: int) -> list[threading.Thread]:
        port = free_port()
        cmd = child_command(self.opts.command)
        self.say(f"attempt {attempt}: {nprocs} processes x {self.opts.devices_per_proc} CPU devices, "
                 f"coordinator {HOST}:{port}: {' '.join(cmd)}")
        threads = []
        self.procs = []
        self.exit_times: dict[int, float] = {}
        self.events("group_start", attempt=attempt, nprocs=nprocs)
        for rank in range(nprocs):
            p = subprocess.Popen(
                cmd, env=child_env(dict(os.environ), rank, nprocs, self.opts.devices_per_proc, port, attempt),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent)
            self.procs.append(p)
            self.say(f"rank {rank}: pid {p.pid}")
            threads.append(threading.Thread(target=self._pump, args=(rank, p.stdout), daemon=True))
            threads.append(threading.Thread(target=self._reap, args=(rank, p), daemon=True))
        for t in threads:
            t.start()
        return threads

    def _reap(self, rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        self.exit_times[rank] = time.monotonic()

    def _run_once(self, nprocs: int, attempt: int) -> Attempt:
        threads = self._start(nprocs, attempt)
        kill_at: float | None = None
        failed_seen = False
        forwarded = False
        while True:
            codes = [p.poll() for p in self.procs]
            now = time.monotonic()
            if self.signal and not forwarded:
                forwarded = True
                self.say(f"{self.signal}: forwarding SIGTERM to every process (they save and exit; "
                         f"killed after {self.opts.grace:g}s)")
                for p in self.procs:
                    self._send(p, signal.SIGTERM)
                kill_at = now + self.opts.grace if kill_at is None else min(kill_at, now + self.opts.grace)
            if self.kill_now:
                kill_at = now
            failures = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failures and not failed_seen:
                failed_seen = True
                first = min(failures, key=lambda r: self.exit_times.get(r, now))
                rest = [r for r, c in enumerate(codes) if c is None]
                self.say(f"rank {first} failed ({_exit_status(codes[first])})"
                         + (f"; stopping ranks {', '.join(map(str, rest))} (SIGTERM, SIGKILL after "
                            f"{self.opts.kill_timeout:g}s)" if rest else ""))
                for r in rest:
                    self._send(self.procs[r], signal.SIGTERM)
                kill_deadline = now + self.opts.kill_timeout
                kill_at = kill_deadline if kill_at is None else min(kill_at, kill_deadline)
            if all(c is not None for c in codes):
                break
            if kill_at is not None and now >= kill_at:
                for p in self.procs:
                    self._send(p, signal.SIGKILL)
                kill_at = now + 5.0  # SIGKILL cannot be ignored; re-send until they are gone
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=5.0)
        codes = [p.returncode for p in self.procs]
        failed = [r for r, c in enumerate(codes) if c != 0]
        first = min(failed, key=lambda r: self.exit_times.get(r, float("inf"))) if failed else None
        result = Attempt(nprocs, codes, first, self.signal, dict(self.exit_times))
        self.events("group_end", attempt=attempt,
                    reason="signal" if self.signal else "done" if result.ok else "failed")
        self.say(f"attempt {attempt} ended: " + ", ".join(
            f"rank {r} {_exit_status(c)}" for r, c in enumerate(codes)))
        return result

    # -- the whole run
    def run(self) -> int:
        opts = self.opts
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                old[sig] = signal.signal(sig, self._on_signal)
        try:
            nprocs = opts.nprocs
            attempt = 0
            while True:
                res = self._run_once(nprocs, attempt)
                self.attempts.append(res)
                if res.ok:
                    self.say(f"all {nprocs} processes finished" + (f" (stopped by {res.signalled})"
                                                                   if res.signalled else ""))
                    return 0
                code = res.codes[res.first_failure]
                status = code if code and code > 0 else 128 + (-code if code else 1)
                if res.signalled:
                    self.say(f"stopped by {res.signalled}; a process did not exit cleanly: exit {status}")
                    return status
                if code == USER_ERROR:
                    self.say(f"failed: rank {res.first_failure} exit code {code}, a configuration error "
                             f"(restarting would repeat it); exit {status}")
                    return status
                if attempt >= opts.max_restarts:
                    why = "no restarts left" if opts.max_restarts else "no --max-restarts"
                    self.say(f"failed: rank {res.first_failure} {_exit_status(code)} ({why}); exit {status}")
                    return status
                attempt += 1
                prev = self.attempts[-2] if len(self.attempts) > 1 else None
                floor = opts.min_nprocs if opts.min_nprocs is not None else nprocs
                if (prev is not None and prev.first_failure == res.first_failure
                        and prev.nprocs == res.nprocs and nprocs - 1 >= max(floor, 1)):
                    nprocs -= 1
                    self.say(f"rank {res.first_failure} failed twice in a row: it cannot come back; "
                             f"restarting on {nprocs} processes (elastic resume from the last checkpoint)")
                else:
                    self.say(f"restart {attempt} of {opts.max_restarts}: the run resumes from its last "
                             f"checkpoint")
                time.sleep(opts.restart_delay)
                if self.signal:
                    self.say(f"{self.signal} during the restart: not starting again; exit {status}")
                    return status
        finally:
            for p in self.procs:
                self._send(p, signal.SIGKILL)
            for sig, h in old.items():
                signal.signal(sig, h)


def train_config_of(command: list[str], strict: bool = False):
    """The config of a `train CONFIG [overrides]` command, loaded as the trainer loads it; else
    None. A config that does not load is None too (the child reports it) unless `strict`."""
    if len(command) < 2 or command[0] != "train":
        return None
    from jaxpar.config import ConfigError, load_config
    try:
        return load_config(command[1], [a for a in command[2:] if not a.startswith("-")])
    except (ConfigError, OSError, ValueError):
        if strict:
            raise
        return None


def run_dir_of(command: list[str]) -> Path | None:
    """The run dir (<run_dir>/<name>) of a `train CONFIG [overrides]` command, else None."""
    cfg = train_config_of(command)
    return None if cfg is None else cfg.out_dir


def launch(opts: LaunchOptions, out: BinaryIO | None = None) -> int:
    """Run the group per `opts`; returns the exit status for the launcher."""
    return Launcher(opts, out).run()
