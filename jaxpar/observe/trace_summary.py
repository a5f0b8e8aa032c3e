"""A profile window's figures from its Perfetto trace (`perfetto_trace.json.gz`, written by a
`profile.steps` run): how busy the devices were, how long they idled between their programs
(the loop's host gap: the host dispatching, building batches or reading metrics while the device
waits), which device ops took the time, how much of the collectives' time ran under compute, and
the host's dispatch calls. The raw trace answers these only in a viewer; `jaxpar profile RUN_DIR
--summary` prints them.

Reading: a trace event of phase "X" has `ts` and `dur` in microseconds; processes named
"/device:..." are the accelerators (their threads: CUDA streams "Stream #N(...)", and lines that
XLA derives from them, "XLA Modules" and "XLA Ops"); "/host:..." the host threads. Device busy
time is the union of the stream events (else of "XLA Ops", else of every device line but the
derived module / step lines), so concurrent streams are counted once. A CPU run has no device
process (XLA:CPU runs the program on host threads): its device figures are None.
"""
from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

COLLECTIVE_WORDS = ("all-reduce", "all_reduce", "allreduce", "all-gather", "all_gather", "allgather",
                    "reduce-scatter", "reduce_scatter", "reducescatter", "all-to-all", "all_to_all",
                    "alltoall", "collective-permute", "collective_permute", "nccl", "ncclkernel")
DERIVED_LINES = ("xla modules", "steps", "framework", "source code", "launch stats", "tensorflow")


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_us(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Length of (union of a) ∩ (union of b)."""
    a, b = _merged(a), _merged(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def load_trace(path: str | Path) -> list[dict]:
    """The events of a Chrome / Perfetto JSON trace (gzipped or not)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome/Perfetto JSON trace (no traceEvents list)")
    return events


def _is_collective(name: str) -> bool:
    low = name.lower()
    return any(w in low for w in COLLECTIVE_WORDS)


def summarize(events: list[dict], steps: int | None = None, top: int = 10) -> dict:
    """The window's figures (times in milliseconds; per step where `steps` is given)."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e]
    if not spans:
        raise ValueError("the trace holds no timed events")
    iv = lambda e: (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))  # noqa: E731
    window = (min(iv(e)[0] for e in spans), max(iv(e)[1] for e in spans))
    lines: dict[tuple, list[dict]] = defaultdict(list)
    for e in spans:
        lines[(e.get("pid"), e.get("tid"))].append(e)
    device = {k: v for k, v in lines.items() if procs.get(k[0], "").startswith("/device")}
    host = {k: v for k, v in lines.items() if k not in device}
    name = lambda k: threads.get(k, str(k[1]))  # noqa: E731

    def pick(pred):
        return {k: v for k, v in device.items() if pred(name(k).lower())}
    chosen, basis = pick(lambda n: "stream" in n), "CUDA streams"
    if not chosen:
        chosen, basis = pick(lambda n: n == "xla ops"), "XLA Ops lines"
    if not chosen:
        chosen, basis = pick(lambda n: not any(n.startswith(d) for d in DERIVED_LINES)), "device lines"
    ops = [e for v in chosen.values() for e in v]
    ms = lambda us: us / 1e3  # noqa: E731
    per = (lambda x: None if x is None else x / steps) if steps else (lambda x: None)
    out: dict[str, Any] = {"window_ms": ms(window[1] - window[0]), "steps": steps,
                           "devices": sorted({procs[k[0]] for k in device}), "basis": basis if ops else None}
    if ops:
        busy = ms(union_us(iv(e) for e in ops))
        coll = [iv(e) for e in ops if _is_collective(str(e.get("name", "")))]
        comp = [iv(e) for e in ops if not _is_collective(str(e.get("name", "")))]
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in ops:
            by_name[str(e.get("name", "?"))][0] += 1
            by_name[str(e.get("name", "?"))][1] += float(e.get("dur", 0.0))
        out.update({
            "device_busy_ms": busy, "device_idle_ms": out["window_ms"] - busy,
            "device_busy_fraction": busy / out["window_ms"] if out["window_ms"] else None,
            "collective_ms": ms(union_us(coll)), "collective_hidden_ms": ms(overlap_us(coll, comp)),
            "top_ops": [{"name": n, "count": c, "ms": ms(d)} for n, (c, d) in
                        sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
            "lines": [{"name": name(k), "events": len(v), "busy_ms": ms(union_us(iv(e) for e in v))}
                      for k, v in sorted(device.items(), key=lambda kv: name(kv[0]))],
        })
        modules = sorted((iv(e) for k, v in device.items() if name(k).lower() == "xla modules" for e in v))
        if modules:
            gaps = [b[0] - a[1] for a, b in zip(modules, modules[1:]) if b[0] > a[1]]
            out["modules"] = {"count": len(modules), "ms": ms(union_us(modules)), "gaps_ms": ms(sum(gaps)),
                              "max_gap_ms": ms(max(gaps, default=0.0))}
    dispatch: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for v in host.values():
        outer: dict[str, float] = {}  # a call shows as nested events of one name: count the outermost
        for e in sorted(v, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0)))):
            n = str(e.get("name", ""))
            if n.startswith("PjitFunction(") and iv(e)[1] > outer.get(n, float("-inf")):
                outer[n] = iv(e)[1]
                dispatch[n][0] += 1
                dispatch[n][1] += float(e.get("dur", 0.0))
    out["dispatch"] = [{"name": n, "count": c, "mean_ms": ms(d / c)} for n, (c, d) in
                       sorted(dispatch.items(), key=lambda kv: -kv[1][1])[:5]]
    for key in ("window_ms", "device_busy_ms", "device_idle_ms"):
        out[key.replace("_ms", "_per_step_ms")] = per(out.get(key))
    return out


def format_summary(s: dict, records: list[dict] | None = None) -> str:
    """The summary as text; `records` (metrics.jsonl) add the logged throughput and MFU."""
    f = lambda x, unit=" ms": "-" if x is None else f"{x:.2f}{unit}"  # noqa: E731
    steps = s.get("steps")
    lines = [f"profile window: {f(s['window_ms'])}" + (f" over {steps} steps, {f(s['window_per_step_ms'])} "
                                                      f"per step" if steps else "")]
    if s.get("basis") is None:
        lines.append("device: no device lines in the trace (a CPU run: XLA:CPU runs the program on host "
                     "threads; or the GPU tracer, CUPTI, recorded nothing), so no busy / idle split")
    else:
        idle_pct = 100 * (1 - (s['device_busy_fraction'] or 0))
        lines += [
            f"device ({', '.join(s['devices'])}; busy = union of {s['basis']}): "
            f"busy {f(s['device_busy_ms'])}, idle {f(s['device_idle_ms'])} ({idle_pct:.1f}% of the window)",
        ]
        if steps:
            lines.append(f"per step: device busy {f(s['device_busy_per_step_ms'])}, device idle (the loop's "
                         f"host gap) {f(s['device_idle_per_step_ms'])}")
        if s.get("modules"):
            m = s["modules"]
            lines.append(f"XLA modules: {m['count']} executions, {f(m['ms'])}; device idle between them "
                         f"{f(m['gaps_ms'])} in all, longest gap {f(m['max_gap_ms'])}")
        if s["collective_ms"]:
            hidden = 100 * s['collective_hidden_ms'] / s['collective_ms']
            lines.append(f"collectives: {f(s['collective_ms'])}, of which {f(s['collective_hidden_ms'])} ran "
                         f"under compute ({hidden:.0f}% overlapped)")
        else:
            lines.append("collectives: none in the trace (one device, or none issued in the window)")
        lines.append("device lines: " + "; ".join(
            f"{ln['name']} {ln['events']} events, busy {f(ln['busy_ms'])}" for ln in s["lines"]))
        lines.append("top device ops by time:")
        lines += [f"  {o['ms']:9.2f} ms  {o['count']:6d}x  {o['name'][:100]}" for o in s["top_ops"]]
    if s.get("dispatch"):
        lines.append("host dispatch (PjitFunction calls in the window):")
        lines += [f"  {d['count']:4d}x  mean {d['mean_ms']:.3f} ms  {d['name'][:100]}" for d in s["dispatch"]]
    for r in records or []:
        mfu = f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ", MFU unknown (no peak)"
        lines.append(f"logged step {r['step']}: {r['tokens_per_s']:.0f} tokens/s, "
                     f"step {1e3 * r['step_time_s']:.1f} ms{mfu}")
    return "\n".join(lines)


def perfetto_trace(run_dir: str | Path, sub: str = "profile") -> Path | None:
    """The newest perfetto_trace.json.gz of a run's profile directory (None: none yet)."""
    found = sorted((Path(run_dir) / sub).rglob("perfetto_trace.json.gz"))
    return found[-1] if found else None


__all__ = ["format_summary", "load_trace", "overlap_us", "perfetto_trace", "summarize", "union_us"]
