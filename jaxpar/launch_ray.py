"""`jaxpar launch --ray [ADDRESS] --nodes N`: one jaxpar process per node of a Ray cluster, elastic.

    jaxpar launch --ray --nodes 4 --min-nodes 2 -- train configs/big.yaml

Ray places the processes, jax.distributed connects them. A placement group of N bundles
({"jaxpar_node": 1} each, STRICT_SPREAD) takes N distinct nodes that offer that custom resource
(`ray start --resources '{"jaxpar_node": 1}'`); one small actor per bundle starts `jaxpar train`
there as its child, with the coordinator on the first bundle's node (its IP and a free port
there) and the JAXPAR_* environment `jaxpar launch` uses. The driver prints every child's output
prefixed with its rank, its own lines with `[ray]`.

- SIGTERM / SIGINT of the driver: forwarded to every process; jax's preemption sync point makes
  them all save at one step and exit 0 (killed after `--grace` s).
- A lost node (Ray reports its actor dead): the rest are killed (a save needs every process) and
  the group starts again on the nodes that remain, down to `--min-nodes` (default N: it waits up
  to `--node-timeout` s for nodes to come back); `train.resume=auto`
  resumes the latest checkpoint and elastic resume adapts mesh and grad_accum (global batch kept).
- More nodes than the group uses (a node came back): the driver waits for the run's next
  checkpoint (no run dir known: it does not wait), stops the group (SIGTERM: save, exit 0) and
  starts it on up to N nodes.
- Another failure restarts the group `--max-restarts` times; exit code 2 (a config error) never.

`--devices-per-node K` forces K CPU devices per process (tests, CPU clusters); without it each
process uses its node's accelerators (each bundle then takes the GPUs a node has). The launcher
writes `group_start`, `group_end`, `wait_nodes_start` and `wait_nodes_end` (source "ray") to the
run's event log. `ray` is imported
here only: the rest of jaxpar runs without it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from jaxpar.config import ConfigError
from jaxpar.launch import (USER_ERROR, _die_with_parent, _exit_status, child_command, child_env, free_port,
                           train_config_of)

NODE_RESOURCE = "jaxpar_node"
# What the driver hands on to the children from its own environment (the nodes' own is the base).
FORWARD_PREFIXES = ("JAX_", "XLA_", "PYTHONPATH", "PYTHONHASHSEED", "TF_CPP_")


@dataclass
class RayOptions:
    nodes: int
    command: list[str]
    address: str = "auto"
    min_nodes: int | None = None        # elastic floor; None: all N nodes or wait
    devices_per_node: int | None = None  # forced CPU devices; None: the node's accelerators
    node_resource: str = NODE_RESOURCE
    run_dir: Path | None = None         # events and checkpoints; None: from `train CONFIG ...`
    max_restarts: int = 3               # failures other than a lost node
    kill_timeout: float = 10.0
    grace: float = 180.0
    node_timeout: float = 600.0         # waiting for --min-nodes longer than this fails the run
    poll: float = 0.25


class NodeProcess:
    """The actor on one node: starts the jaxpar process there and hands its output to the driver."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lines: list[bytes] = []
        self.lock = threading.Lock()

    def info(self) -> tuple[str, int, str]:
        """(this node's IP, a free port on it for the coordinator, its Ray node id)."""
        import ray
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip), ray.get_runtime_context().get_node_id()

    def start(self, command: list[str], env: dict[str, str], cwd: str | None) -> int:
        full = {**os.environ, **env}
        self.proc = subprocess.Popen(
            child_command(command), env=full, cwd=cwd if cwd and os.path.isdir(cwd) else None,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent)  # dies with this actor
        threading.Thread(target=self._pump, daemon=True).start()
        return self.proc.pid

    def _pump(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            with self.lock:
                self.lines.append(line if line.endswith(b"\n") else line + b"\n")

    def poll(self) -> tuple[list[bytes], int | None]:
        """The output since the last call, and the exit code (None: running)."""
        code = self.proc.poll() if self.proc else None
        if code is not None:
            time.sleep(0.05)  # the pump's last lines
        with self.lock:
            lines, self.lines = self.lines, []
        return lines, code

    def send(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def run_paths(command: list[str], run_dir: Path | None) -> tuple[Path | None, Path | None]:
    """(run dir for events, checkpoints dir to watch) of the command: `train CONFIG [overrides]` is
    loaded as the trainer loads it; another program names its run dir with --run-dir."""
    if run_dir is not None:
        from jaxpar.checkpoint.files import DEFAULT_DIR
        return Path(run_dir), Path(run_dir) / DEFAULT_DIR
    cfg = train_config_of(command, strict=True)  # a bad config: one error before anything is placed
    if cfg is None:
        return None, None
    from jaxpar.checkpoint.files import checkpoint_dir
    return cfg.out_dir, checkpoint_dir(cfg)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("jaxpar launch --ray needs the `ray` package, which is not installed: "
                          "pip install 'jaxpar[ray]' (or 'ray>=2.9')") from None
    return ray


def _find_address(address: str) -> str:
    """`auto` as Ray resolves it (RAY_ADDRESS, the last `ray start` here, a local GCS), so that the
    reachability check below sees it; Ray's resolver is private, so anything but its own
    'no cluster' answer leaves `auto` to ray.init."""
    if address not in ("auto", ""):
        return address
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die  # optional: private API
        return canonicalize_bootstrap_address_or_die("auto")
    except ConnectionError as e:
        raise ConfigError(f"jaxpar launch --ray (no ADDRESS): no Ray cluster found ({e}); give the "
                          f"head node's address, --ray HOST:PORT, or set RAY_ADDRESS") from None
    except Exception:  # Ray moved or changed its resolver: ray.init resolves `auto` itself
        return "auto"


def connect(ray, address: str) -> None:
    """ray.init on an existing cluster; ConfigError naming --ray when it cannot be reached (Ray's
    own client retries for minutes on a wrong address, so a host:port is tried first)."""
    found = _find_address(address)
    if found != "auto" and not found.startswith("ray://"):
        from jaxpar.distributed import _reachable
        why = _reachable(found)
        if why is not None:
            given = address if found == address else f"(no ADDRESS: found {found})"
            raise ConfigError(f"jaxpar launch --ray {given}: the Ray cluster is not reachable ({why}); "
                              f"give the head node's GCS address host:port (ray start --head prints it), "
                              f"or --ray alone for RAY_ADDRESS / the cluster started on this machine")
    try:
        ray.init(address=found, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"jaxpar launch --ray {address}: cannot connect to a Ray cluster: {e}") from None


class RayLauncher:
    def __init__(self, opts: RayOptions, out: BinaryIO | None = None) -> None:
        if opts.nodes < 1:
            raise ConfigError(f"jaxpar launch --ray: --nodes {opts.nodes} must be >= 1")
        if opts.min_nodes is not None and not 1 <= opts.min_nodes <= opts.nodes:
            raise ConfigError(f"jaxpar launch --ray: --min-nodes {opts.min_nodes} must be in 1..{opts.nodes} "
                              f"(--nodes {opts.nodes})")
        if opts.devices_per_node is not None and opts.devices_per_node < 1:
            raise ConfigError(f"jaxpar launch --ray: --devices-per-node {opts.devices_per_node} must be >= 1")
        self.opts = opts
        self.out = out if out is not None else sys.stdout.buffer
        self.lock = threading.Lock()
        self.signal: str | None = None
        self.kill_now = False
        self.run_dir, self.ckpt_dir = run_paths(opts.command, opts.run_dir)
        self.ray = None

    # -- output and events
    def say(self, msg: str) -> None:
        self._write(b"[ray] " + msg.encode() + b"\n")

    def _write(self, data: bytes) -> None:
        with self.lock:
            self.out.write(data)
            self.out.flush()

    def event(self, name: str, **fields) -> None:
        if self.run_dir is not None:
            from jaxpar.observe.events import record
            record(self.run_dir, name, source="ray", **fields)

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
        else:
            self.kill_now = True

    # -- the cluster
    def _nodes(self) -> list[dict]:
        """The alive nodes that offer the node resource (used by us or not)."""
        return [n for n in self.ray.nodes()
                if n.get("Alive") and n.get("Resources", {}).get(self.opts.node_resource, 0) >= 1]

    def nodes_up(self) -> int:
        return len(self._nodes())

    def bundle(self) -> dict[str, float]:
        """One node's bundle: the node resource and, on accelerator nodes, all their GPUs (the
        fewest any node has), so that Ray makes them visible to the process (older Ray versions
        hide every GPU from an actor that asks for none)."""
        out = {self.opts.node_resource: 1}
        gpus = min((int(n["Resources"].get("GPU", 0)) for n in self._nodes()), default=0)
        if self.opts.devices_per_node is None and gpus > 0:
            out["GPU"] = gpus
        return out

    def latest_checkpoint(self) -> int | None:
        if self.ckpt_dir is None:
            return None
        from jaxpar.checkpoint.files import list_steps
        done = [s for s, _, ok in list_steps(self.ckpt_dir) if ok]
        return max(done) if done else None

    def wait_nodes(self, want: int) -> int | None:
        """Block until `want` nodes are up; their count, or None (a signal, or --node-timeout)."""
        have = self.nodes_up()
        if have >= want:
            return have
        self.say(f"waiting for nodes: {have} up with resource {self.opts.node_resource!r}, need {want}")
        self.event("wait_nodes_start", have=have, want=want)
        deadline = time.monotonic() + self.opts.node_timeout
        while have < want and not self.signal and time.monotonic() < deadline:
            time.sleep(1.0)
            have = self.nodes_up()
        self.event("wait_nodes_end", have=have)
        return have if have >= want else None

    # -- one start of the group
    def run_group(self, n: int, attempt: int) -> tuple[str, list[int | None]]:
        """Start the group on n nodes and watch it; (reason, exit codes). The reason is one of
        done / failed / node_lost / grow / signal (the event log's vocabulary)."""
        ray = self.ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        bundle = self.bundle()
        pg = placement_group([bundle] * n, strategy="STRICT_SPREAD")
        actors = []
        try:
            if not pg.wait(60):
                self.say(f"attempt {attempt}: {n} nodes could not be placed within 60s (nodes gone?)")
                return "node_lost", [None] * n
            remote = ray.remote(num_cpus=0, max_restarts=0)(NodeProcess)
            res = {k: v for k, v in bundle.items() if k != "GPU"}
            gpus = {"num_gpus": bundle["GPU"]} if "GPU" in bundle else {}
            place = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(n)]
            actors = [remote.options(resources=res, **gpus, scheduling_strategy=p).remote() for p in place]
            infos = ray.get([a.info.remote() for a in actors], timeout=120)
            host, port, _ = infos[0]
            ips = [ip for ip, _, _ in infos]
            self.say(f"attempt {attempt}: {n} nodes"
                     + (f" x {self.opts.devices_per_node} CPU devices" if self.opts.devices_per_node else "")
                     + f", coordinator {host}:{port}; latest checkpoint: step {self.latest_checkpoint()}")
            self.event("group_start", attempt=attempt, nprocs=n, nodes=ips)
            forward = {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES)}
            for rank, a in enumerate(actors):
                env = child_env(forward, rank, n, self.opts.devices_per_node, port, attempt, host=host)
                pid = ray.get(a.start.remote(self.opts.command, env, os.getcwd()), timeout=60)
                self.say(f"rank {rank}: node {ips[rank]} id {infos[rank][2]} pid {pid}")
            return self.watch(actors, n)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self.say(f"attempt {attempt}: the group could not start ({type(e).__name__}): a node went away")
            return "node_lost", [None] * n
        finally:
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)  # its child dies with it
                except ray.exceptions.RayError:
                    pass
            remove_placement_group(pg)

    def watch(self, actors, n: int) -> tuple[str, list[int | None]]:
        ray, opts = self.ray, self.opts
        codes: list[int | None] = [None] * n
        dead: set[int] = set()
        reason = None
        kill_at = None
        grow_after: int | None = None   # a node came back: stop after the checkpoint after this step
        next_look = 0.0
        while True:
            for rank, a in enumerate(actors):
                if rank in dead or codes[rank] is not None:
                    continue
                try:
                    lines, codes[rank] = ray.get(a.poll.remote(), timeout=30)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    dead.add(rank)
                    continue
                if lines:
                    self._write(b"".join(f"[{rank}] ".encode() + x for x in lines))
            now = time.monotonic()
            running = [r for r in range(n) if codes[r] is None and r not in dead]
            if not running:
                break
            if dead and reason != "node_lost":
                reason = "node_lost"
                self.say(f"node of rank {', '.join(map(str, sorted(dead)))} lost (Ray reports its actor "
                         f"dead); killing ranks {', '.join(map(str, running))}: a save needs every process")
                kill_at = now
            failed = [r for r in range(n) if codes[r] not in (None, 0)]
            if failed and reason is None:
                reason = "failed"
                self.say(f"rank {failed[0]} failed ({_exit_status(codes[failed[0]])}); stopping the others "
                         f"(SIGTERM, SIGKILL after {opts.kill_timeout:g}s)")
                self._send(actors, running, signal.SIGTERM)
                kill_at = now + opts.kill_timeout
            if self.signal and reason not in ("signal", "node_lost", "failed"):
                reason = "signal"
                self.say(f"{self.signal}: forwarding SIGTERM to every process (they save and exit; killed "
                         f"after {opts.grace:g}s)")
                self._send(actors, running, signal.SIGTERM)
                kill_at = now + opts.grace
            if self.kill_now:
                kill_at = now
            if reason is None and n < opts.nodes and now >= next_look:
                next_look = now + 1.0
                if grow_after is None and self.nodes_up() > n:
                    grow_after = self.latest_checkpoint() or 0
                    self.say(f"{self.nodes_up()} nodes up, the group has {n}: growing after the next "
                             f"checkpoint (after step {grow_after})")
                saved = self.ckpt_dir is None or (self.latest_checkpoint() or 0) > (grow_after or 0)
                if grow_after is not None and saved:
                    reason = "grow"
                    self.say(f"checkpoint of step {self.latest_checkpoint()} saved: stopping the group "
                             f"(SIGTERM) to restart it on more nodes")
                    self._send(actors, running, signal.SIGTERM)
                    kill_at = now + opts.grace
            if kill_at is not None and now >= kill_at:
                self._send(actors, running, signal.SIGKILL)
                kill_at = now + 5.0
            time.sleep(opts.poll)
        if reason is None:
            reason = "done" if all(c == 0 for c in codes) else "failed"
        if reason == "failed" and self.nodes_up() < n:
            reason = "node_lost"  # a process saw its peer go before Ray reported the node
        self.say("group ended (" + reason + "): " + ", ".join(
            f"rank {r} " + ("node lost" if r in dead else _exit_status(codes[r])) for r in range(n)))
        return reason, codes

    def _send(self, actors, ranks, sig) -> None:
        for r in ranks:
            try:
                actors[r].send.remote(sig)
            except self.ray.exceptions.RayActorError:
                pass

    # -- the whole run
    def run(self) -> int:
        opts = self.opts
        self.ray = import_ray()
        connect(self.ray, opts.address)
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                old[sig] = signal.signal(sig, self._on_signal)
        floor = opts.min_nodes if opts.min_nodes is not None else opts.nodes
        try:
            attempt, failures = 0, 0
            while True:
                have = self.wait_nodes(floor)
                if have is None:
                    if self.signal:
                        self.say(f"{self.signal} while waiting for {floor} nodes: nothing running; exit 0")
                        return 0
                    self.say(f"fewer than {floor} nodes for --node-timeout {opts.node_timeout:g}s; exit 1")
                    return 1
                n = min(opts.nodes, have)
                reason, codes = self.run_group(n, attempt)
                self.event("group_end", attempt=attempt, reason=reason)
                attempt += 1
                if reason == "done" or (reason == "signal" and all(c == 0 for c in codes)):
                    by = f" (stopped by {self.signal})" if self.signal else ""
                    self.say(f"all {n} processes finished{by}")
                    return 0
                code = next((c for c in codes if c not in (None, 0)), 1)
                status = code if code > 0 else 128 - code
                if self.signal:
                    self.say(f"stopped by {self.signal}; a process did not exit cleanly: exit {status}")
                    return status
                if reason == "failed":
                    if code == USER_ERROR:
                        self.say(f"failed with exit code {code}, a configuration error; exit {status}")
                        return status
                    failures += 1
                    if failures > opts.max_restarts:
                        self.say(f"failed ({_exit_status(code)}), no restarts left (--max-restarts "
                                 f"{opts.max_restarts}); exit {status}")
                        return status
                self.say(f"restarting ({reason}): the run resumes from its last checkpoint")
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
            self.ray.shutdown()


def launch_ray(opts: RayOptions, out: BinaryIO | None = None) -> int:
    """Run the group on the Ray cluster per `opts`; returns the exit status for the driver."""
    return RayLauncher(opts, out).run()
