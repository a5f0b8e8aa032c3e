"""Shared pieces of the benchmarks: config assembly, per-device sizes, tables."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import jax

from jaxpar.config import Config, ConfigError, load_config, make_config

# Applied after the config file and before the user's overrides, for every benchmark:
# train.steps is the number of timed steps of `overhead` (and sizes nothing else).
COMMON_DEFAULTS: tuple[str, ...] = ("train.steps=20", "train.progress=false")


def default_config_path() -> Path:
    """configs/quickstart.yaml of the repository (or of the working directory)."""
    here = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    return here if here.is_file() else Path("configs") / "quickstart.yaml"


def mesh_overrides(**sizes: int) -> list[str]:
    """Overrides that set every mesh axis: the ones given, the rest 1."""
    axes = {"data": 1, "fsdp": 1, "pipeline": 1, "context": 1, "tensor": 1, "expert": 1, **sizes}
    return [f"mesh.{a}={n}" for a, n in axes.items()]


def build_config(config_path: str | Path | None, layout: Sequence[str], overrides: Sequence[str]) -> Config:
    """config file (quickstart when None) <- COMMON_DEFAULTS <- the benchmark's layout <- overrides."""
    path = default_config_path() if config_path is None else config_path
    return load_config(path, [*COMMON_DEFAULTS, *layout, *overrides])


def with_overrides(cfg: Config, overrides: Iterable[str]) -> Config:
    """A copy of `cfg` with more dotted overrides (validated like the CLI's)."""
    return make_config(cfg.model_dump(mode="json"), list(overrides))


def abstract_with(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree` that carry `shardings` (for jaxpar.sharding.per_device_bytes)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ratio(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3f}"


def ratio(measured: float, expected: float) -> float | None:
    if expected == 0:
        return None if measured else 1.0
    return measured / expected


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: first column left-aligned, the rest right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def describe_config(cfg: Config) -> dict:
    m, t = cfg.model, cfg.train
    return {
        "model": {"dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                  "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size, "tie_embeddings": m.tie_embeddings},
        "train": {"global_batch": t.global_batch, "seq_len": t.seq_len, "grad_accum": t.grad_accum,
                  "param_dtype": t.param_dtype, "compute_dtype": t.compute_dtype, "remat": t.remat},
    }


def check_name(name: str, valid: Iterable[str]) -> None:
    valid = sorted(valid)
    if name not in valid:
        raise ConfigError(f"unknown benchmark {name!r}; valid benchmarks: {', '.join(valid)}")
