"""Where the test suite's CPU goes: a pytest plugin and its report.

    JAXPAR_SUITE_PROFILE=/tmp/prof PYTHONPATH=scripts .venv/bin/python -m pytest -q -n 3 \\
        --dist loadgroup -p suite_profile
    .venv/bin/python scripts/suite_profile.py /tmp/prof

Per test, the plugin records its wall time, the CPU time of the worker and of its reaped child
processes (rusage), and from jax's compile log (`jax_log_compiles`) the seconds spent tracing,
lowering and compiling per jitted function and the persistent-cache hits; one JSON line per test
in DIR/<worker>.jsonl. The report sums them by program and by file. Why: the suite is bound by
CPU on CI's 2 cores, and most of it is XLA compiling step programs (docs/benchmarks.md, session
24); wall times under 3 workers do not say which test costs what.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import resource
import sys
import time
from pathlib import Path

import pytest

_LOG = re.compile(r"Finished (XLA compilation of|tracing|jaxpr to MLIR module conversion) (\S+) .*?in "
                  r"([0-9.e-]+) sec")
_HIT = re.compile(r"[Cc]ache hit for '(\S+)'")
_KIND = {"XLA compilation of": "compile", "tracing": "trace", "jaxpr to MLIR module conversion": "lower"}
_current: collections.Counter = collections.Counter()
_out = None


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if m := _LOG.search(msg):
            kind, name = _KIND[m[1]], m[2].removeprefix("jit(").removesuffix(")")
            _current[f"{kind}:{name}"] += float(m[3])
            _current[f"n_{kind}:{name}"] += 1
        elif h := _HIT.search(msg):
            _current[f"n_hit:{h[1].removeprefix('jit_')}"] += 1


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def pytest_configure(config) -> None:
    import jax
    jax.config.update("jax_log_compiles", True)  # jax then logs these at WARNING, the default level
    logging.getLogger("jax").addHandler(_Handler())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001  (pytest's hook signature)
    global _out
    if _out is None:
        d = Path(os.environ.get("JAXPAR_SUITE_PROFILE", "suite_profile"))
        d.mkdir(parents=True, exist_ok=True)
        _out = open(d / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a")
    _current.clear()
    t0, (own0, kids0) = time.perf_counter(), _cpu()
    yield
    own1, kids1 = _cpu()
    _out.write(json.dumps({"test": item.nodeid, "wall": time.perf_counter() - t0, "cpu": own1 - own0,
                           "child_cpu": kids1 - kids0, "jax": dict(_current)}) + "\n")
    _out.flush()



def report(directory: Path, top: int = 25) -> str:
    rows = [json.loads(line) for f in sorted(directory.glob("*.jsonl")) for line in f.open()]
    programs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        f = files[r["test"].split("::")[0]]
        f.update(tests=1, cpu=r["cpu"], child_cpu=r["child_cpu"], wall=r["wall"])
        for key, v in r["jax"].items():
            kind, name = key.split(":", 1)
            programs[name][kind] += v
            if kind in ("compile", "trace", "lower"):
                f["jax"] += v
    total = {k: sum(r[k] for r in rows) for k in ("cpu", "child_cpu", "wall")}
    lines = [f"{len(rows)} tests: {total['cpu']:.0f} CPU s in the workers, {total['child_cpu']:.0f} in "
             f"child processes, {total['wall']:.0f} s of test wall time", "",
             f"{'program':<28}{'compiles':>9}{'hits':>6}{'compile s':>11}{'trace s':>9}{'lower s':>9}"]
    for name, c in sorted(programs.items(), key=lambda kv: -kv[1]["compile"])[:top]:
        lines.append(f"{name[:27]:<28}{c['n_compile']:>9.0f}{c['n_hit']:>6.0f}{c['compile']:>11.1f}"
                     f"{c['trace']:>9.1f}{c['lower']:>9.1f}")
    lines += ["", f"{'file':<44}{'tests':>6}{'CPU s':>8}{'child':>7}{'wall s':>8}{'jax s':>7}"]
    for name, c in sorted(files.items(), key=lambda kv: -(kv[1]["cpu"] + kv[1]["child_cpu"]))[:top]:
        lines.append(f"{name[:43]:<44}{c['tests']:>6.0f}{c['cpu']:>8.1f}{c['child_cpu']:>7.1f}"
                     f"{c['wall']:>8.1f}{c['jax']:>7.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: suite_profile.py DIR  (the JAXPAR_SUITE_PROFILE directory of a profiled run)")
    print(report(Path(sys.argv[1])))
