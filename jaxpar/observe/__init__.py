"""Observability as training-loop callbacks: Prometheus exporter, hang/straggler watchdog,
profiler window; and plots of finished runs (`jaxpar plot`).

`build_callbacks(cfg)` returns the callbacks a config asks for (`observe.*`, `profile.steps`);
`jaxpar train` attaches them, scripts pass them to `Trainer(cfg, callbacks=build_callbacks(cfg))`.
"""
from __future__ import annotations

from pathlib import Path

_LAZY = {"PrometheusExporter": "prometheus", "record_checkpoint_save": "prometheus",
         "ProfileWindow": "profiler", "Watchdog": "watchdog"}


def __getattr__(name: str):
    # The callbacks import jax; the event log and goodput (events.py, goodput.py) do not, and
    # `jaxpar launch` / `jaxpar goodput` load them without it: the package itself stays light.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"jaxpar.observe.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jaxpar.observe' has no attribute {name!r}")


def build_callbacks(cfg, out_dir: str | Path | None = None) -> list:
    """Callbacks for `cfg.observe` and `cfg.profile`, writing under `out_dir` (default: the run dir)."""
    from jaxpar.observe.prometheus import PrometheusExporter
    from jaxpar.observe.profiler import ProfileWindow
    from jaxpar.observe.watchdog import Watchdog

    out = Path(out_dir) if out_dir is not None else cfg.out_dir
    cbs: list = []
    prof = cfg.profile
    if prof.steps is not None:
        cbs.append(ProfileWindow(prof.steps[0], prof.steps[1], out / prof.dir, perfetto=prof.perfetto,
                                 run_dir=out))
    p = cfg.observe.prometheus
    if p.enabled:
        cbs.append(PrometheusExporter(p.host, p.port, p.all_processes, run=cfg.name))
    w = cfg.observe.watchdog
    if w.enabled:  # last: its step times include the other callbacks' work
        cbs.append(Watchdog(w.timeout_s, w.straggler_factor, w.window, w.min_steps,
                            w.abort, w.exit_code, log_dir=out))
    return cbs


__all__ = ["PrometheusExporter", "ProfileWindow", "Watchdog", "build_callbacks", "record_checkpoint_save"]
