"""Prometheus exporter: training metrics on an HTTP `/metrics` endpoint (prometheus_client).

Off by default (`observe.prometheus.enabled`). Binds 127.0.0.1 unless `host` says otherwise, so
nothing is exposed to other machines by accident. Only process 0 serves unless `all_processes`
(each process then serves on `port + process index`). Every series carries `run` (config name) and
`process` labels.

Values are a snapshot the training loop updates (step on every step, the rest on every logged
record); the HTTP thread only reads it. Checkpoint code reports save times with
`record_checkpoint_save(seconds)`, exported as `jaxpar_checkpoint_save_seconds`. The run's goodput
(observe/goodput.py, from the event log the trainer writes) is recomputed at logged steps, at most
every `goodput_every_s` seconds: `jaxpar_goodput_ratio`, `jaxpar_goodput_{wall,productive}_seconds`
and `jaxpar_goodput_lost_seconds{cause}`.
"""
from __future__ import annotations

import errno
import socket
import threading
import time
from typing import Any, Iterable

import jax
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from jaxpar.config import ConfigError
from jaxpar.metrics import COLLECTIVE_KINDS, collective_bytes, compiled_memory, device_memory_stats
from jaxpar.observe import watchdog
from jaxpar.observe.events import read_events
from jaxpar.observe.goodput import CAUSES, account
from jaxpar.observe.watchdog import exempt_current_step
from jaxpar.train.callbacks import Callback

# ------------------------------------------------------------------ checkpoint save times

_lock = threading.Lock()
_checkpoint = {"last_s": None, "count": 0, "total_s": 0.0}


def record_checkpoint_save(seconds: float) -> None:
    """Report one checkpoint save's wall time (any thread). Exported as
    `jaxpar_checkpoint_save_seconds` (last save) and `jaxpar_checkpoint_saves_total`; the
    watchdog also exempts the step that saved from its straggler check."""
    with _lock:
        _checkpoint["last_s"] = float(seconds)
        _checkpoint["count"] += 1
        _checkpoint["total_s"] += float(seconds)
    exempt_current_step()


# ------------------------------------------------------------------ what is exported

# record key -> (metric name, help)
_RECORD_GAUGES: dict[str, tuple[str, str]] = {
    "loss": ("jaxpar_loss", "Training loss of the last logged step"),
    "grad_norm": ("jaxpar_grad_norm", "Global gradient norm (before clipping) of the last logged step"),
    "eval_loss": ("jaxpar_eval_loss", "Held-out loss of the last evaluation (eval.every)"),
    "eval_ppl": ("jaxpar_eval_perplexity", "Held-out perplexity (exp of eval_loss) of the last evaluation"),
    "lr": ("jaxpar_learning_rate", "Learning rate of the last logged step"),
    "step_time_s": ("jaxpar_step_time_seconds", "Mean wall time per step since the previous log"),
    "tokens_per_s": ("jaxpar_tokens_per_second", "Training tokens per second, all devices"),
    "mfu": ("jaxpar_mfu_ratio", "Model FLOPs utilisation (0-1); absent when the device peak is unknown"),
    "skipped_steps": ("jaxpar_skipped_steps", "Steps skipped so far (e.g. non-finite gradients)"),
}


def memory_snapshot(compiled: Any = None, devices: Iterable | None = None) -> list[dict]:
    """Per local device: `bytes_in_use`, `peak_bytes` (and `bytes_limit`) with `source`
    `allocator` where the backend reports memory stats, else `compiled_estimate` from the compiled
    step's memory analysis (in use: arguments + outputs - aliased; peak: XLA's peak or total)."""
    est = compiled_memory(compiled) if compiled is not None else {}
    out = []
    for d in devices if devices is not None else jax.local_devices():
        stats = device_memory_stats(d)
        if stats and "bytes_in_use" in stats:
            row = {"device": str(d.id), "source": "allocator", "bytes_in_use": stats["bytes_in_use"],
                   "peak_bytes": stats.get("peak_bytes_in_use", stats["bytes_in_use"])}
            if "bytes_limit" in stats:
                row["bytes_limit"] = stats["bytes_limit"]
        elif est:
            resident = est.get("argument_bytes", 0) + est.get("output_bytes", 0) - est.get("alias_bytes", 0)
            row = {"device": str(d.id), "source": "compiled_estimate", "bytes_in_use": resident,
                   "peak_bytes": est.get("peak_bytes") or est.get("total_bytes", resident)}
        else:
            continue
        out.append(row)
    return out


class _Collector:
    """Turns the exporter's snapshot into metric families at scrape time."""

    def __init__(self, exporter: "PrometheusExporter") -> None:
        self.exporter = exporter

    def describe(self):  # no eager collect at registration
        return []

    def collect(self):
        ex = self.exporter
        base = {"run": ex.run, "process": str(ex.process)}
        names, values = list(base), list(base.values())

        def gauge(name: str, doc: str, value: float | None, unit: str = ""):
            if value is None:
                return None
            g = GaugeMetricFamily(name, doc, labels=names, unit=unit)
            g.add_metric(values, float(value))
            return g

        snap = ex.snapshot()
        info = InfoMetricFamily("jaxpar_run", "The run's layout", labels=names)
        info.add_metric(values, ex.info)
        yield info
        yield gauge("jaxpar_step", "Optimizer steps completed (resumed runs count from the resume step)",
                    snap["step"])
        c = CounterMetricFamily("jaxpar_steps", "Optimizer steps completed by this process", labels=names)
        c.add_metric(values, snap["steps_done"])
        yield c
        g = gauge("jaxpar_last_step_timestamp_seconds",
                  "Unix time the loop last finished a step on the host (its device work may still run; "
                  "hang alerts)", snap["last_step_time"])
        if g is not None:
            yield g
        rec = snap["record"]
        for key, (name, doc) in _RECORD_GAUGES.items():
            if key in rec:
                yield gauge(name, doc, rec[key])
        ck = dict(_checkpoint)
        if ck["last_s"] is not None:
            yield gauge("jaxpar_checkpoint_save_seconds", "Wall time of the last checkpoint save",
                        ck["last_s"])
        c = CounterMetricFamily("jaxpar_checkpoint_saves", "Checkpoint saves recorded", labels=names)
        c.add_metric(values, ck["count"])
        yield c
        c = CounterMetricFamily("jaxpar_watchdog_reports", "Watchdog reports (kind: straggler, hang)",
                                labels=names + ["kind"])
        g = GaugeMetricFamily("jaxpar_watchdog_last_report_step", "Step of the last watchdog report",
                              labels=names + ["kind"])
        for kind, n in list(watchdog.report_counts.items()):
            c.add_metric(values + [kind], n)
            if kind in watchdog.last_report_step:
                g.add_metric(values + [kind], watchdog.last_report_step[kind])
        yield c
        if g.samples:
            yield g
        gp = snap["goodput"]
        if gp is not None:
            yield gauge("jaxpar_goodput_ratio", "Productive training time / wall time of the run, "
                        "across restarts (jaxpar goodput)", gp["goodput"])
            yield gauge("jaxpar_goodput_wall_seconds", "Wall time of the run: first event to last",
                        gp["wall_s"])
            yield gauge("jaxpar_goodput_productive_seconds", "Productive training time of the run",
                        gp["productive_s"])
            g = GaugeMetricFamily("jaxpar_goodput_lost_seconds", "Wall time lost, by cause (startup, "
                                  "checkpoint_save, checkpoint_restore, redone, wait_nodes, other)",
                                  labels=names + ["cause"])
            for cause in CAUSES:
                g.add_metric(values + [cause], float(gp["lost_s"][cause]))
            yield g
        if snap["collectives"] is not None:
            g = GaugeMetricFamily("jaxpar_collective_bytes_per_step",
                                  "Per-device result bytes of each collective type in one compiled step "
                                  "(from its HLO, loops counted by trip count)",
                                  labels=names + ["collective"])
            for kind in COLLECTIVE_KINDS:
                g.add_metric(values + [kind], float(snap["collectives"].get(kind, 0)))
            yield g
        mem = snap["memory"]
        if mem:
            fams = {
                "bytes_in_use": GaugeMetricFamily("jaxpar_device_memory_in_use_bytes",
                                                  "Device memory in use",
                                                  labels=names + ["device", "source"]),
                "peak_bytes": GaugeMetricFamily("jaxpar_device_memory_peak_bytes",
                                                "Peak device memory", labels=names + ["device", "source"]),
                "bytes_limit": GaugeMetricFamily("jaxpar_device_memory_limit_bytes",
                                                 "Device memory the allocator may use",
                                                 labels=names + ["device", "source"]),
            }
            for row in mem:
                for key, fam in fams.items():
                    if key in row:
                        fam.add_metric(values + [row["device"], row["source"]], float(row[key]))
            yield from (f for f in fams.values() if f.samples)


class PrometheusExporter(Callback):
    """Serves `/metrics` from `on_start` to `on_end`. `port=0` picks a free port (see `.port`)."""

    goodput_every_s = 10.0  # the event log is re-read at most this often (at logged steps)

    def __init__(self, host: str = "127.0.0.1", port: int = 9400, all_processes: bool = False,
                 run: str = "run") -> None:
        self.host, self.requested_port, self.all_processes, self.run = host, port, all_processes, run
        self.process = jax.process_index()
        self.port: int | None = None
        self.info: dict[str, str] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._server = None
        self._snap: dict = {"step": None, "steps_done": 0, "last_step_time": None, "record": {},
                            "collectives": None, "memory": [], "goodput": None}
        self._compiled = None
        self._goodput_at: float | None = None
        if self.active:  # a taken port is one clear error before the step compiles, not after
            probe_port(self.host, self._listen_port(), self.requested_port)

    def _listen_port(self) -> int:
        return self.requested_port + (self.process if self.all_processes and self.requested_port else 0)

    @property
    def active(self) -> bool:
        return self.all_processes or self.process == 0

    def snapshot(self) -> dict:
        return self._snap

    def _update(self, **kw) -> None:
        self._snap = {**self._snap, **kw}  # swap, so a scrape sees one consistent snapshot

    # -------------------------------------------------------------- callback hooks

    def on_start(self, trainer: Any, step: int, state: Any) -> None:
        if not self.active:
            return
        self._compiled = getattr(trainer, "compiled", None)
        collectives = None
        if self._compiled is not None:
            try:
                collectives = collective_bytes(self._compiled.as_text(), count_loops=True)
            except Exception:  # a backend without HLO text: no collective series
                collectives = None
        mesh = getattr(trainer, "mesh", None)
        self.info = {"mesh": " ".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1) or "1 device"
                     if mesh is not None else "",
                     "devices": str(jax.device_count()), "backend": jax.default_backend()}
        plan = getattr(trainer, "plan", None)
        if plan is not None:
            self.info["zero_stage"] = str(plan.zero_stage)
        self._update(step=step, collectives=collectives, memory=memory_snapshot(self._compiled))
        if self._server is None:
            from prometheus_client import start_http_server  # optional: only an enabled exporter
            port = self._listen_port()
            try:
                self._server, _ = start_http_server(port, addr=self.host, registry=self.registry)
            except OSError as e:  # taken since the check at construction
                raise ConfigError(_listen_error(self.host, port, self.requested_port, e)) from None
            self.port = self._server.server_address[1]
            log = getattr(trainer, "log", print)
            log(f"prometheus metrics on http://{self.host}:{self.port}/metrics")

    def on_step_end(self, trainer: Any, step: int, state: Any, metrics: Any) -> None:
        if self.active:
            self._update(step=step, steps_done=self._snap["steps_done"] + 1, last_step_time=time.time())

    def on_log(self, trainer: Any, record: dict) -> None:
        if not self.active:
            return
        rec = {k: float(v) for k, v in record.items() if k in _RECORD_GAUGES and _number(v)}
        self._update(record={**self._snap["record"], **rec}, memory=memory_snapshot(self._compiled))
        self._update_goodput(getattr(getattr(trainer, "events", None), "run_dir", None))

    def _update_goodput(self, run_dir) -> None:
        """The goodput of the trainer's event log (process 0 writes it; elsewhere there is none)."""
        now = time.monotonic()
        recent = self._goodput_at is not None and now - self._goodput_at < self.goodput_every_s
        if run_dir is None or recent:
            return
        self._goodput_at = now
        try:
            events = list(read_events(run_dir))
            if events:
                self._update(goodput=account(events).to_dict())
        except (OSError, ValueError, KeyError, TypeError):  # a metric never stops the run
            pass

    def on_end(self, trainer: Any, step: int, state: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _listen_error(host: str, port: int, requested: int, e: OSError) -> str:
    field = f"observe.prometheus.port={requested}"
    if port != requested:
        field += f" (+ process index {port - requested}: observe.prometheus.all_processes)"
    if e.errno == errno.EADDRINUSE:
        return f"{field}: {host}:{port} is in use; use another port or port: 0 (a free one)"
    return (f"{field}, observe.prometheus.host={host!r}: cannot listen on {host}:{port} "
            f"({e.strerror or e}); use another host/port or port: 0")


def probe_port(host: str, port: int, requested: int | None = None) -> None:
    """ConfigError when nothing can listen on host:port now (port 0 binds a free port: the host is
    still checked). The probe binds as the HTTP server will (SO_REUSEADDR), so a port in TIME_WAIT
    passes."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            s.listen(1)
    except socket.gaierror as e:
        raise ConfigError(f"observe.prometheus.host={host!r}: not an address of this machine ({e.strerror}); "
                          f"use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    except OSError as e:
        raise ConfigError(_listen_error(host, port, port if requested is None else requested, e)) from None


def _number(v: Any) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False
