"""Tests run on 8 forced CPU devices (set before jax is imported anywhere)."""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "--xla_backend_optimization_level" not in _flags:
    # Tests compile far more than they run: LLVM at -O0 compiles ~40% faster. HLO passes, buffer
    # assignment (memory_analysis) and the HLO the structure tests read are unchanged.
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for this run, shared by the xdist workers (they inherit the variable the
# controller sets here) and by the processes tests start (jaxpar train / launch children read
# JAX_COMPILATION_CACHE_DIR): tests build a fresh Trainer, so a fresh jit, for configs other tests
# compiled already (the one-device references above all), and a restarted process compiles what
# it compiled before it was killed; XLA's cache makes the repeat a load. Empty at the start of
# every run and removed at its end, so no test depends on an earlier run.
_CACHE_VAR = "JAXPAR_TEST_COMPILE_CACHE"
if _CACHE_VAR not in os.environ:
    import tempfile
    os.environ[_CACHE_VAR] = tempfile.mkdtemp(prefix="jaxpar-test-xla-cache-")
    _OWN_CACHE = True
else:
    _OWN_CACHE = False
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[_CACHE_VAR])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]

from jaxpar.config import make_config  # noqa: E402
import jaxpar.train.trainer  # noqa: E402,F401  (imported once, before the freeze below)
from tests.shared_init import REAL_INIT, shared_init_state  # noqa: E402

# one init program per model and optimizer, not one per layout (tests/shared_init.py)
jaxpar.train.trainer.Trainer.init_state = shared_init_state

# Tracing a step allocates millions of short-lived objects; with Python's default thresholds the
# cyclic collector runs full collections over a heap that module fixtures keep large (5-10% of a
# test's CPU time, measured with perf / cProfile). Imported modules are frozen out of it, and it
# runs less often; cyclic garbage still goes, only later.
gc.freeze()
gc.set_threshold(50_000, 20, 100)

TINY = [
    "model.preset=tiny", "model.n_layers=2", "train.global_batch=16", "train.seq_len=32",
    "train.compute_dtype=float32", "train.progress=false", "data.source=synthetic",
    "optimizer.warmup_steps=0", "train.steps=3",  # lr non-zero from step 1
    "train.log_every=1",  # tests read every step's record (the default logs every 10th)
]


def tiny_config(*overrides: str):
    return make_config({}, TINY + list(overrides))


@pytest.fixture(autouse=True)
def _real_init(request, monkeypatch):
    """A test marked `real_init` builds its train states with the layout's own init program."""
    if request.node.get_closest_marker("real_init") is not None:
        monkeypatch.setattr(jaxpar.train.trainer.Trainer, "init_state", REAL_INIT)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 forced CPU devices, got {len(devs)}"
    return devs


def pytest_sessionfinish(session):
    if _OWN_CACHE:  # the process that made the cache dir (the xdist controller, or a plain run)
        import shutil
        shutil.rmtree(os.environ[_CACHE_VAR], ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` a worker's grouped tests carry `@group` in their node ids (how
    pytest-xdist sends them to one worker); without it the groups are silently ignored and every
    module fixture is built on each worker (pytest-xdist 3.8 with pytest 9.2 did that)."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            raise pytest.UsageError(
                f"--dist loadgroup is not grouping {item.nodeid}: this pytest-xdist does not work with "
                f"pytest {pytest.__version__} (pyproject.toml pins the versions that do)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """JAXPAR_TEST_TIMELINE=FILE: each test's worker, start, end (setup and teardown included) and
    CPU seconds (the worker's threads and the child processes it waited for) appended to FILE, to
    see how busy the workers are and what costs CPU, which on 2 cores is what the run's length
    follows (scripts/test_timeline.py)."""
    path = os.environ.get("JAXPAR_TEST_TIMELINE")
    if not path:
        yield
        return
    import resource
    import time
    _listen_compile_events(path, item.nodeid)

    def cpu() -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + kids.ru_utime + kids.ru_stime
    t0, c0 = time.time(), cpu()
    _COMPILE_SECONDS.clear()
    yield
    spent = "\t".join(f"{_COMPILE_SECONDS.get(k, 0.0):.2f}" for k in _COMPILE_EVENTS)
    with open(path, "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'gw0')}\t{t0:.3f}\t{time.time():.3f}\t"
                f"{cpu() - c0:.2f}\t{spent}\t{item.nodeid}\n")


# seconds a test spent tracing to jaxprs, lowering to MLIR and in XLA's compile (jax's monitoring
# events, summed over its jits; a compile the persistent cache answers is not an XLA compile)
_COMPILE_EVENTS = {"trace": "/jax/core/compile/jaxpr_trace_duration",
                   "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "compile": "/jax/core/compile/backend_compile_duration"}
_COMPILE_SECONDS: dict[str, float] = {}


def _listen_compile_events(path: str, nodeid: str) -> None:
    """Also: each XLA compile (or persistent-cache load) with its program's name and seconds,
    one line per compile in FILE.compiles."""
    _listen_compile_events.nodeid = nodeid
    if getattr(_listen_compile_events, "done", False):
        return
    import logging

    class Compiles(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith(("Finished XLA compilation", "Persistent compilation cache hit")):
                with open(path + ".compiles", "a") as f:
                    f.write(f"{_listen_compile_events.nodeid}\t{msg[:160]}\n")
    for name in ("jax._src.dispatch", "jax._src.compiler"):
        logging.getLogger(name).setLevel(logging.DEBUG)
        logging.getLogger(name).addHandler(Compiles(logging.DEBUG))
    from jax._src import monitoring
    names = {v: k for k, v in _COMPILE_EVENTS.items()}

    def on_duration(event: str, seconds: float, **_) -> None:
        if event in names:
            _COMPILE_SECONDS[names[event]] = _COMPILE_SECONDS.get(names[event], 0.0) + seconds
    monitoring.register_event_duration_secs_listener(on_duration)
    _listen_compile_events.done = True
