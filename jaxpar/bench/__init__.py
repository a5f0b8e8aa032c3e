"""`jaxpar bench NAME [CONFIG] [overrides...] [--json]`: benchmarks that print figures.

  overhead  jaxpar's step vs a hand-written `jax.jit` step: compute dtype x remat x layout matrix
  overhead-point  one cell of it: jaxpar's compiled step vs the hand-written step, this layout
  memory    per-device params / grads / optimizer state / temp bytes per ZeRO stage vs the paper
  comm      bytes per collective kind per step (from the compiled HLO) vs the analytic minimum
  moe       expert all-to-all bytes (compiled HLO vs analytic) and step time, capacity vs dropless
  checkpoint  save / restore MB/s of a ~300 MB state; slowdown of steps overlapping an async save
  compression  gradient-reduction bytes per step per compression method (HLO) and loss beside none
  convert   Hugging Face import / export MB/s of a ~300 MB checkpoint (safetensors <-> sharded params)
  attention  temp memory per device and time of xla vs blockwise (vs cudnn on a GPU) attention at
            2K / 8K tokens (--seqs, --impls), per call and per train step
  planner   predicted vs measured step time over 11 layouts (Spearman), time to plan 70B on 1024 GPUs
  packing   data.packing on the stdlib tokenized by a BPE: padding per seq_len, packed step's cost
  context   xla / blockwise (a sequence per device) vs ring / all_to_all / all_gather (a sequence over
            mesh.context):
            temp memory, collective bytes vs the analytic ring volume, step time, longest fitting seq
  step      per layout, the config's model and the 1B shape (compiled only): model vs compiled FLOPs,
            collectives inside vs outside the loops, temp memory; the config's: step and host time

The config is CONFIG (default configs/quickstart.yaml), then `train.steps=20`, then the
benchmark's layout (e.g. a data-parallel mesh for `overhead`), then the overrides. Each
benchmark module has `LAYOUT` (its default overrides), `run(cfg) -> dict` (JSON-able) and
`format_result(result) -> str` (the table).
"""
from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from jaxpar.bench.common import build_config, check_name
from jaxpar.config import ConfigError
from jaxpar.xla import apply_xla_flags

BENCHMARKS: dict[str, str] = {
    "overhead": "jaxpar.bench.overhead_matrix",
    "overhead-point": "jaxpar.bench.overhead",
    "memory": "jaxpar.bench.memory",
    "comm": "jaxpar.bench.comm",
    "moe": "jaxpar.bench.moe",
    "checkpoint": "jaxpar.bench.checkpoint",
    "compression": "jaxpar.bench.compression",
    "pipeline": "jaxpar.bench.pipeline",
    "convert": "jaxpar.bench.convert",
    "attention": "jaxpar.bench.attention",
    "planner": "jaxpar.bench.planner",
    "packing": "jaxpar.bench.packing",
    "context": "jaxpar.bench.context",
    "step": "jaxpar.bench.step",
}


def get(name: str):
    """The benchmark module called `name` (ConfigError listing the valid names otherwise)."""
    check_name(name, BENCHMARKS)
    return importlib.import_module(BENCHMARKS[name])


def load(name: str, config_path: str | Path | None = None, overrides: Sequence[str] = ()):
    """(module, resolved config) for benchmark `name`."""
    mod = get(name)
    return mod, build_config(config_path, mod.LAYOUT, overrides)


def split_args(config_path: str | None, overrides: Sequence[str]) -> tuple[str | None, list[str]]:
    """`jaxpar bench comm model.n_layers=2`: argparse takes the first override for CONFIG."""
    overrides = list(overrides)
    if config_path is not None and "=" in config_path and not Path(config_path).is_file():
        return None, [config_path, *overrides]
    return config_path, overrides


def check_options(name: str, mod, options: dict) -> None:
    """A benchmark's own options (--plot, --seqs, --impls) go to its `run`; one that this
    benchmark does not take is an error, not silently ignored."""
    params = inspect.signature(mod.run).parameters
    bad = [k for k in options if k == "log" or k not in params]
    if bad:
        raise ConfigError(f"jaxpar bench {name}: {', '.join('--' + k for k in bad)} is not an option of "
                          f"this benchmark")


def run_bench(name: str, config_path: str | None, overrides: Sequence[str], as_json: bool = False,
              out: Callable[[str], None] | None = None, plot: str | None = None,
              options: dict | None = None) -> int:
    """What the CLI runs. Prints the table, or with `as_json` one JSON document, on stdout."""
    config_path, overrides = split_args(config_path, overrides)
    options = {**({"plot": plot} if plot else {}), **(options or {})}  # --plot: pipeline
    check_options(name, get(name), options)
    mod, cfg = load(name, config_path, overrides)
    apply_xla_flags(cfg)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # progress; stdout holds only the result
    result = mod.run(cfg, log=log, **options)
    result = {"benchmark": name, **result}
    out = out or print
    if as_json:
        out(json.dumps(result, indent=2, sort_keys=False))
    else:
        out(mod.format_result(result))
    return 0


__all__ = ["BENCHMARKS", "get", "load", "run_bench", "split_args"]
