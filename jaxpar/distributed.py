"""Several processes on JAX's own distributed runtime (jax.distributed), started once, first.

Where the settings come from, first match wins:
  1. the `distributed` config section (coordinator_address, num_processes, process_id);
  2. the environment: JAXPAR_COORDINATOR_ADDRESS, JAXPAR_NUM_PROCESSES, JAXPAR_PROCESS_ID (set by
     `jaxpar launch` and the deploy/ templates);
  3. the cluster, through jax's own detectors: a SLURM step (srun), an Open MPI job, or with
     `distributed.cluster_detection` any of slurm / ompi / mpi4py / k8s.
A single process (nothing found, or a count of 1) starts nothing.

`initialize()` must run before anything starts a JAX backend (jax.devices(), an array, a
jit); `jaxpar train` and `Trainer` call it first. A wrong setting never hangs: jax's client
aborts the process when it cannot join within its timeout, so a watchdog thread ends the
process a little before that with a message naming the settings and what to check.
"""
from __future__ import annotations

import ipaddress
import itertools
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from jaxpar.config import ConfigError, DistributedConfig

# jax is imported inside the functions that use it (heavy): resolving the settings from the
# config and the environment (`resolve`) loads nothing but this module.

ENV_COORDINATOR = "JAXPAR_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_BIND = "JAXPAR_COORDINATOR_BIND_ADDRESS"
EXIT_INIT_FAILED = 2  # like every other user error of the CLI


class DistributedError(ConfigError):
    """jax.distributed cannot start as configured: one message that names the setting."""


@dataclass(frozen=True)
class Settings:
    """Resolved settings. `method` is 'explicit' or the name of a jax cluster detector (then the
    address / count / id may be None until jax's detector fills them in)."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    method: str
    source: str  # where they came from, for messages
    local_device_ids: tuple[int, ...] | None = None
    bind_address: str | None = None
    timeout_s: int = 300
    heartbeat_s: int = 100
    shutdown_s: int = 300
    cpu_collectives: str = "gloo"

    def describe(self) -> str:
        who = (f"process {self.process_id} of {self.num_processes}"
               if self.process_id is not None and self.num_processes is not None else "this process")
        coordinator = self.coordinator_address or "(from " + self.method + ")"
        return f"{who}, coordinator {coordinator} ({self.source})"


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not an integer") from None


def _detected(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """(jax detector, process count) when this process runs in a SLURM step or Open MPI job."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in environ for v in slurm):
        return "slurm", _env_int(environ, "SLURM_NTASKS") or 1
    if "OMPI_COMM_WORLD_SIZE" in environ and ("OMPI_MCA_orte_hnp_uri" in environ or "OMPI_VERSION" in environ
                                              or "PMIX_NAMESPACE" in environ):
        return "ompi", _env_int(environ, "OMPI_COMM_WORLD_SIZE") or 1
    return None


def resolve(cfg: DistributedConfig, environ: Mapping[str, str] | None = None) -> Settings | None:
    """The settings `cfg` and the environment give, or None for a single process. Pure: starts
    nothing, so it can be called (and tested) anywhere."""
    env = os.environ if environ is None else environ
    if cfg.enabled is False:
        return None
    env_addr = env.get(ENV_COORDINATOR) or None
    env_n, env_id = _env_int(env, ENV_NUM_PROCESSES), _env_int(env, ENV_PROCESS_ID)
    addr = cfg.coordinator_address or env_addr
    n = cfg.num_processes if cfg.num_processes is not None else env_n
    pid = cfg.process_id if cfg.process_id is not None else env_id
    given = {"coordinator_address": addr, "num_processes": n, "process_id": pid}
    from_cfg = [k for k in given if getattr(cfg, k) is not None]
    from_env = [k for k, v in given.items() if v is not None and k not in from_cfg]
    source = " and ".join(filter(None, [
        "config distributed." + "/".join(from_cfg) if from_cfg else "",
        "environment " + "/".join(_env_name(k) for k in from_env) if from_env else ""]))
    common = dict(local_device_ids=tuple(cfg.local_device_ids) if cfg.local_device_ids is not None else None,
                  bind_address=cfg.coordinator_bind_address or env.get(ENV_BIND) or _loopback(addr),
                  timeout_s=cfg.initialization_timeout_s, heartbeat_s=cfg.heartbeat_timeout_s,
                  shutdown_s=cfg.shutdown_timeout_s, cpu_collectives=cfg.cpu_collectives)
    if addr is not None:
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise DistributedError(f"coordinator address {addr!r} ({source}) must be host:port of process 0")
    if n is not None and n < 1:
        raise DistributedError(f"the number of processes must be >= 1, got {n} ({source})")
    if n is not None and pid is not None and not 0 <= pid < n:
        raise DistributedError(f"process id {pid} is not in 0..{n - 1} for {n} processes ({source}); "
                               f"every process needs a distinct id from 0 to num_processes - 1")

    if cfg.cluster_detection is not None:  # jax's detector fills what is not given
        return Settings(addr, n, pid, cfg.cluster_detection, source or cfg.cluster_detection, **common)
    if n == 1:
        return None
    if all(v is not None for v in given.values()):
        return Settings(addr, n, pid, "explicit", source, **common)
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        raise DistributedError(
            f"incomplete jax.distributed settings: {source} given, but not "
            + " and ".join(f"distributed.{k} (or {_env_name(k)})" for k in missing)
            + "; give all three, or none to run a single process")
    found = _detected(env)
    if found is not None and found[1] > 1:
        return Settings(None, None, None, found[0], found[0].upper() if found[0] == "slurm" else "Open MPI",
                        **common)
    if cfg.enabled:
        raise DistributedError(
            "distributed.enabled=true, but nothing says how to reach the other processes: set "
            "distributed.coordinator_address/num_processes/process_id (or the JAXPAR_* environment), "
            "run under srun / mpirun, or set distributed.cluster_detection")
    return None


def _loopback(addr: str | None) -> str | None:
    """`addr` when its host is this machine's loopback, so process 0 listens there only: jax's
    default bind is every interface, which put the (unauthenticated) coordination service of a
    127.0.0.1 run on the network though no other machine could take part. Else None (jax's)."""
    if addr is None:
        return None
    host = addr.rpartition(":")[0].strip("[]")
    try:
        return addr if host == "localhost" or ipaddress.ip_address(host).is_loopback else None
    except ValueError:  # a host name: its machine's interfaces are unknown here
        return None


def _env_name(key: str) -> str:
    return {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES,
            "process_id": ENV_PROCESS_ID}[key]


def _fill_from_cluster(s: Settings) -> Settings:
    """Ask jax's cluster detector for what is missing, so the watchdog can name it and the
    process keeps all its devices (jax's SLURM / Open MPI default is one GPU per process)."""
    if None not in (s.coordinator_address, s.num_processes, s.process_id):
        return s
    try:
        from jax._src import clusters
        addr, n, pid, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            s.coordinator_address, s.num_processes, s.process_id, list(s.local_device_ids or [0]),
            s.method, s.timeout_s)
    except ImportError:  # jax moved its detectors: let jax.distributed.initialize detect
        return s
    if None in (addr, n, pid):
        raise DistributedError(f"jax's {s.method} cluster detection found no settings in this environment "
                               f"(distributed.cluster_detection={s.method}); set the coordinator, count and "
                               f"id explicitly")
    if n is not None and pid is not None and not 0 <= pid < n:
        raise DistributedError(f"{s.method}: process id {pid} is not in 0..{n - 1}")
    return Settings(addr, n, pid, s.method, s.source, s.local_device_ids, s.bind_address, s.timeout_s,
                    s.heartbeat_s, s.shutdown_s, s.cpu_collectives)


def _reachable(address: str, timeout: float = 2.0) -> str | None:
    """None when a TCP connection to host:port succeeds, else why not."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except socket.gaierror as e:
        return f"cannot resolve host {host!r} ({e.strerror or e})"
    except OSError as e:
        return f"no answer on {address} ({e.strerror or e})"


def _check_bind(address: str) -> None:
    """Process 0: fail early and clearly when the coordinator port is taken."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: only a listener conflicts
            sock.bind((host, int(port)))
    except OSError as e:
        if e.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise DistributedError(
                f"process 0 cannot start the coordinator on {address}: the port is in use "
                f"(another run?); choose another port in the coordinator address") from None
        # anything else (no IPv6, an address of another machine): let jax try and report


def _give_up(s: Settings, started: float) -> None:
    """The watchdog: runs when jax.distributed has not joined within the timeout."""
    why = _reachable(s.coordinator_address) if s.coordinator_address else "no coordinator address"
    if why is None:
        cause = (f"the coordinator at {s.coordinator_address} answers, but not all {s.num_processes} "
                 f"processes joined: check that every process was started with the same number of "
                 f"processes ({s.num_processes}) and a distinct process id in 0..{s.num_processes - 1}")
    else:
        cause = (f"{why}: check the coordinator address (host:port of process 0, reachable from "
                 f"every host; not 127.0.0.1 across machines), that process 0 is running, and firewalls")
    print(f"jaxpar: error: jax.distributed did not start within {time.monotonic() - started:.0f}s "
          f"(distributed.initialization_timeout_s={s.timeout_s}) for {s.describe()}: {cause}",
          file=sys.stderr, flush=True)
    os._exit(EXIT_INIT_FAILED)


def initialize(cfg: DistributedConfig | None = None, environ: Mapping[str, str] | None = None,
               log: Callable[[str], None] | None = None) -> Settings | None:
    """Start jax.distributed as `cfg` (a Config's `distributed` section, or a whole Config) and
    the environment say. Returns the settings, or None for a single process. Call it before any
    other JAX call; calling it again (or after jax.distributed was started otherwise) does nothing."""
    import jax

    if cfg is None:
        cfg = DistributedConfig()
    cfg = getattr(cfg, "distributed", cfg)
    if jax.distributed.is_initialized():
        same_program_on_every_process(log)
        return None
    s = resolve(cfg, environ)
    if s is None:
        return None
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise DistributedError(
            f"jax.distributed must start before any other JAX call, but a JAX backend is already "
            f"running ({s.describe()}): call jaxpar.distributed.initialize(cfg) first in the script, "
            f"before jax.devices(), arrays or jit")
    if s.cpu_collectives:
        try:
            jax.config.update("jax_cpu_collectives_implementation", s.cpu_collectives)
        except (AttributeError, ValueError):  # an older jax without the option
            pass
    s = _fill_from_cluster(s)
    bind = s.bind_address
    if s.process_id == 0 and s.coordinator_address:
        _check_bind(bind or "[::]:" + s.coordinator_address.rpartition(":")[2])
    started = time.monotonic()
    watchdog = threading.Timer(s.timeout_s, _give_up, args=(s, started))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=s.coordinator_address, num_processes=s.num_processes,
            process_id=s.process_id,
            local_device_ids=list(s.local_device_ids) if s.local_device_ids else None,
            cluster_detection_method=("deactivate" if None not in (s.coordinator_address, s.num_processes,
                                                                   s.process_id) else s.method),
            # jax aborts the process at its own timeout: the watchdog must come first
            initialization_timeout=s.timeout_s + 30, coordinator_bind_address=bind,
            heartbeat_timeout_seconds=s.heartbeat_s, shutdown_timeout_seconds=s.shutdown_s)
    except (RuntimeError, ValueError, TypeError) as e:
        raise DistributedError(f"jax.distributed.initialize failed for {s.describe()}: {e}") from None
    finally:
        watchdog.cancel()
    same_program_on_every_process(log)
    if log is not None:
        log(f"jax.distributed: process {jax.process_index()} of {jax.process_count()}, "
            f"{jax.local_device_count()} local devices of {jax.device_count()} "
            f"(coordinator {s.coordinator_address}; {s.source})")
    return s


def same_program_on_every_process(log: Callable[[str], None] | None = None) -> None:
    """Every process must launch each program under the same launch id: jaxlib (0.12.1 on)
    matches a launch's CPU collectives across processes by it, and seeds it from the executable's
    fingerprint. Launched under different ids, the collectives never meet and the first train
    step hangs. Two things gave processes different fingerprints for one program:
    - the Python call stack in the HLO's source metadata: a function traced from different lines
      on different processes (`if rank == 0: run(cfg) else: run(cfg, log=...)`). Locations keep
      only each op's own frame now.
    - on CPU, the persistent compilation cache: its key covers the process's own topology, so
      only process 0 ever finds its entries, and a step loaded from the cache has another
      fingerprint than the same step compiled. It is off for multi-process CPU runs; the other
      processes compile anyway, and every step waits for them."""
    import jax
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    cached = jax.config.jax_enable_compilation_cache
    if cached and jax.process_count() > 1 and jax.devices()[0].platform == "cpu":
        jax.config.update("jax_enable_compilation_cache", False)
        if log is not None and jax.config.jax_compilation_cache_dir:
            log("persistent compilation cache off: on CPU only process 0 can hit it, and a cached "
                "step launched beside a compiled one would hang (jaxpar.distributed)")


def is_main_process() -> bool:
    """True on process 0 (the one that writes logs, metrics and the progress bar)."""
    import jax
    return jax.process_index() == 0


_barrier_ids = itertools.count()


def barrier(name: str, timeout_s: float = 900.0) -> None:
    """Every process waits here, through the coordination service (not a collective: gloo gives
    a communicator 30 s to form, and processes may reach their first step minutes apart after
    compiling on a loaded host). Nothing to do for a single process."""
    import jax
    if jax.process_count() == 1:
        return
    from jax._src import distributed as dist
    client = dist.global_state.client
    if client is not None:
        client.wait_at_barrier(f"jaxpar:{name}:{next(_barrier_ids)}", timeout_in_ms=int(timeout_s * 1000))


def allgather_json(obj, name: str = "allgather"):
    """`obj` (anything JSON can hold) from every process, by process index, so that the
    processes decide together (e.g. which checkpoint step all of them can read). One process:
    `[obj]`, nothing sent. A barrier first, so the collective starts on every process at once."""
    import jax
    if jax.process_count() == 1:
        return [obj]
    import json

    import numpy as np
    from jax.experimental import multihost_utils
    barrier(name)
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8).astype(np.int32)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).ravel()
    width = 1 << int(sizes.max()).bit_length()  # few distinct shapes: few compiles
    buf = np.zeros(width, np.int32)
    buf[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(bytes(r[:n].astype(np.uint8)).decode()) for r, n in zip(rows, sizes)]


def same_config_on_every_process(cfg) -> None:
    """Every process must train one config (its `distributed` section aside): with another
    train.steps, mesh or run_dir on one process the processes compile different programs, whose
    collectives never meet, and the run hung at its first step. Compared through the coordination
    service (no collective, nothing compiled), so a mismatch is one error on every process."""
    import json

    import jax
    if jax.process_count() == 1:
        return
    from jax._src import distributed as dist

    from jaxpar.metrics.writers import flatten
    client = dist.global_state.client
    if client is None:
        return
    mine = {k: v for k, v in cfg.model_dump(mode="json").items() if k != "distributed"}
    prefix = f"jaxpar:config:{next(_barrier_ids)}/"
    client.key_value_set(prefix + str(jax.process_index()), json.dumps(mine, sort_keys=True))
    barrier("config")
    dotted = lambda v: {name.replace("/", "."): x for name, x in flatten(json.loads(v)).items()}
    configs = {int(k.rpartition("/")[2]): dotted(v) for k, v in client.key_value_dir_get(prefix)}
    ref = configs[0]
    differ = sorted({k for c in configs.values() for k in set(c) | set(ref) if c.get(k) != ref.get(k)})
    if differ:
        shown = "; ".join(f"{k}: " + ", ".join(f"{json.dumps(c.get(k))} on process {p}"
                                               for p, c in sorted(configs.items())) for k in differ[:5])
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        raise ConfigError(f"the processes were started with different configs: {shown}{more}; every process "
                          f"must get the same config and overrides (only `distributed` may differ)")

