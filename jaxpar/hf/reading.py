"""Read a Hugging Face safetensors checkpoint into jaxpar params, each placed on its sharding.

A sharded checkpoint (`model.safetensors.index.json`: tensor name -> file) is opened file by
file, memory-mapped; every param is built with `jax.make_array_from_callback`, whose callback
reads only the rows and columns of the HF tensors that one device's shard covers. So a host
reads just what its own devices hold, and no host ever holds the whole model at once.
Every tensor's presence, shape and dtype is checked before anything is loaded, and a tensor the
config does not account for (more layers, biases) is an error too, never silently dropped.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar.hf.hfconfig import HFError
from jaxpar.hf.layout import Entry, entries, to_ours
from jaxpar.train.model import nest

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def _inside(root: Path, name: str, where: str) -> Path:
    """`root / name` for a file name read from an index, which may not leave `root`."""
    p = (root / name).resolve()
    if Path(name).is_absolute() or root.resolve() not in p.parents:
        raise HFError(f"{where}: file name {name!r} leaves the checkpoint directory")
    return p


class SafetensorsDir:
    """The tensors of an HF model dir: name -> (file, shape, dtype), files opened lazily."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open  # optional: only conversion needs it
        self._open_fn = safe_open
        self.root = Path(hf_dir)
        index = self.root / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (json.JSONDecodeError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
                raise HFError(f"{index}: not a safetensors index (a JSON object with a "
                              f"'weight_map' of tensor name -> file)") from None
            files = sorted(set(weight_map.values()))
            paths = {f: _inside(self.root, f, str(index)) for f in files}
        elif (self.root / SINGLE).is_file():
            paths = {SINGLE: self.root / SINGLE}
            weight_map = None
        else:
            raise HFError(f"{self.root}: no {SINGLE} and no {INDEX} (only safetensors checkpoints "
                          f"are read, never pickled .bin files)")
        self._handles: dict[Path, Any] = {}
        self.tensors: dict[str, tuple[Path, tuple[int, ...], str]] = {}
        for f, path in paths.items():
            if not path.is_file():
                raise HFError(f"{index}: names {f}, which is missing from {self.root}")
            h = self._handle(path)
            for name in h.keys():
                if weight_map is None or weight_map.get(name) == f:
                    sl = h.get_slice(name)
                    self.tensors[name] = (path, tuple(sl.get_shape()), sl.get_dtype())

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = self._open_fn(str(path), framework="np")
            except Exception as e:  # the safetensors error (a bad header) names no file
                raise HFError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[path]

    def unexpected(self, table: list[Entry], tie_embeddings: bool = False) -> list[str]:
        """The tensors no param reads, less the harmless ones: rotary `inv_freq` buffers (older
        transformers saved them) and `lm_head.weight` beside tied embeddings (transformers
        ignores it then)."""
        used = {n for e in table for n in e.names}
        return sorted(n for n in self.tensors if n not in used and not n.endswith(".inv_freq")
                      and not (tie_embeddings and n == "lm_head.weight"))

    def check(self, table: list[Entry], tie_embeddings: bool = False) -> None:
        """One HFError naming the first missing or mis-shaped tensors (all checked at once), else
        one naming the tensors the config does not account for."""
        problems = []
        for e in table:
            for name in e.names:
                if name not in self.tensors:
                    problems.append(f"missing tensor {name} (for {'/'.join(e.path)})")
                    continue
                _, shape, dtype = self.tensors[name]
                if shape != e.hf_shape:
                    problems.append(f"tensor {name} has shape {list(shape)}, the config says "
                                    f"{list(e.hf_shape)}")
                elif dtype not in FLOAT_DTYPES:
                    problems.append(f"tensor {name} has dtype {dtype}; expected a float")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise HFError(f"{self.root}: " + "; ".join(problems[:5]) + more)
        extra = self.unexpected(table, tie_embeddings)
        if extra:
            more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
            raise HFError(f"{self.root}: {len(extra)} tensors that config.json does not account for: "
                          f"{', '.join(extra[:5])}{more}; its config (num_hidden_layers, "
                          f"attention_bias, mlp_bias, ...) does not describe these weights")

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        path = self.tensors[name][0]
        return self._handle(path).get_slice(name)[index]


def _part(src: SafetensorsDir, e: Entry, index: tuple[slice, ...], dtype) -> np.ndarray:
    """The block `index` of param `e`: its HF tensors' needed parts, transformed and stacked."""
    ns = len(e.stack)
    stack_idx, slab_idx = index[:ns], index[ns:]
    ranges = [range(*s.indices(n)) for s, n in zip(stack_idx, e.stack)]
    strides = [int(np.prod(e.stack[i + 1:])) for i in range(ns)]
    slabs = []
    for pos in itertools.product(*ranges):
        name = e.names[sum(p * s for p, s in zip(pos, strides))]
        slabs.append(to_ours(e.kind, e.shape, lambda ix: src.read(name, ix), slab_idx).astype(dtype))
    if not ns:
        return slabs[0]
    return np.stack(slabs).reshape(*map(len, ranges), *slabs[0].shape)


def load_params(hf_dir: str | Path, model_cfg, shardings: dict | None = None,
                dtype=np.float32) -> dict:
    """jaxpar params (a pure nested dict of jax arrays) from the safetensors in `hf_dir`, for
    the model `model_cfg`. `shardings`: a nested dict like the params of jax.sharding.Sharding
    (default: every param on the first local device)."""
    src = SafetensorsDir(hf_dir)
    table = entries(model_cfg)
    src.check(table, model_cfg.tie_embeddings)
    flat = {}
    for e in table:
        sh = shardings
        for k in e.path:
            sh = sh[k] if sh is not None else None
        sh = sh or jax.sharding.make_single_device_sharding(jax.local_devices()[0])
        flat[e.path] = jax.make_array_from_callback(
            e.full_shape, sh, lambda index, e=e: _part(src, e, index, dtype))
    return nest(flat)
