"""Flat token files (nanoGPT-style `.bin`): little-endian uint16/uint32 ids, no header.

Memory-mapped, so a corpus larger than RAM costs nothing to open and each process reads only
the windows it samples.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxpar.config import ConfigError

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
CHECK_TOKENS = 1 << 20  # ids checked against vocab_size when the file is opened


def _dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise ConfigError(f"data.bin_dtype={name!r} is not valid; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def write_bin(path: str | Path, tokens: np.ndarray, dtype: str = "uint16") -> Path:
    """Write `tokens` as a flat .bin file (the format `open_bin` reads)."""
    dt = _dtype(dtype)
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dt).max):
        raise ValueError(
            f"token ids span [{tokens.min()}, {tokens.max()}], outside {dtype}'s "
            f"[0, {np.iinfo(dt).max}]; use bin_dtype='uint32'"
        )
    path = Path(path)
    tokens.astype(dt).tofile(path)
    return path


def open_bin(path: str | Path, dtype: str = "uint16", what: str = "data.bin_path") -> np.memmap:
    """Memory-map a .bin token file read-only, with clear errors for a missing or torn file
    (`what`: the config field that named it)."""
    dt = _dtype(dtype)
    p = Path(path).expanduser()
    if not p.is_file():
        why = "is a directory" if p.is_dir() else "does not exist"
        raise ConfigError(f"{what}={str(path)!r} {why}; give a .bin token file")
    size = p.stat().st_size
    if size == 0:
        raise ConfigError(f"{what}={str(path)!r} is empty")
    if size % dt.itemsize:
        raise ConfigError(
            f"{what}={str(path)!r} has {size} bytes, not a multiple of {dt.itemsize} "
            f"(data.bin_dtype={dtype!r}); the file is truncated or bin_dtype is wrong "
            f"(valid: {', '.join(DTYPES)})"
        )
    return np.memmap(p, dtype=dt, mode="r")


def check_ids(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Raise ConfigError if any id in `tokens` is >= vocab_size (cheap: call on a sample/batch)."""
    if tokens.size == 0:
        return
    top = int(tokens.max())
    if top >= vocab_size:
        raise ConfigError(
            f"{where} holds token id {top} >= model.vocab_size={vocab_size}; raise "
            "model.vocab_size or check data.bin_dtype (uint16 vs uint32)"
        )


def check_head(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Check the first CHECK_TOKENS ids at open time, so a wrong file fails before compiling
    (`where`: the config field and its value, e.g. "data.bin_path='x.bin'")."""
    check_ids(np.asarray(tokens[:CHECK_TOKENS]), vocab_size, where)


def check_width(tokens: np.ndarray, dtype: str, vocab_size: int, where: str) -> None:
    """A .bin has no header, so uint32 ids read as uint16 come out as valid ids with a 0 (the
    high half) after each: silently wrong training. Read as uint32, uint16 tokens a, b give the
    id a + 65536 b, above any vocabulary unless b is (nearly) always 0; so a uint16 head whose
    uint32 reading is all valid, nonzero ids is a uint32 file: a ConfigError. For files whose
    dtype is not recorded (a `.json` with "dtype", as `jaxpar data prepare` writes, says it)."""
    if dtype != "uint16":
        return
    head = np.asarray(tokens[:CHECK_TOKENS])
    wide = np.ascontiguousarray(head[:len(head) - len(head) % 2]).view("<u4")
    if wide.size >= 64 and wide.any() and int(wide.max()) < vocab_size:
        raise ConfigError(f"{where} looks like uint32 tokens read as data.bin_dtype='uint16' (read as "
                          f"uint32 its first {wide.size} ids are all below model.vocab_size={vocab_size}, "
                          f"which uint16 tokens never are); set data.bin_dtype=uint32 (valid: "
                          f"{', '.join(DTYPES)})")


def read_meta(path: str) -> dict:
    """`<path>.json` (written by `jaxpar data prepare`), or {} when there is none."""
    meta_path = Path(str(path) + ".json")
    if not meta_path.is_file():
        return {}
    try:
        return json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{meta_path} is not valid JSON: {e}") from None


def eos_id(path: str) -> int:
    """The end-of-text id that separates the documents of a prepared `.bin` (data.packing)."""
    eos = read_meta(path).get("eos_id")
    if eos is None:
        raise ConfigError(f"data.packing with data.bin_path={path!r} needs the end-of-text id in "
                          f"{path}.json (written by jaxpar data prepare); prepare the data again or set "
                          "data.packing=false")
    return int(eos)


def check_meta(path: str, dtype: str, vocab_size: int, what: str = "data.bin_path") -> None:
    """A .bin written by `jaxpar data prepare` names its dtype and vocabulary in `<path>.json`:
    a different data.bin_dtype, or a vocabulary above model.vocab_size, is a ConfigError."""
    meta = read_meta(path)
    meta_path = Path(str(path) + ".json")
    if not meta:
        return
    if meta.get("dtype") not in (None, dtype):
        raise ConfigError(f"data.bin_dtype={dtype!r} but {path} holds {meta['dtype']} tokens "
                          f"({meta_path}); set data.bin_dtype={meta['dtype']}")
    if int(meta.get("vocab_size", 0)) > vocab_size:
        raise ConfigError(f"{what}={path!r} was tokenized with a vocabulary of "
                          f"{meta['vocab_size']} ({meta.get('tokenizer')}), above model.vocab_size="
                          f"{vocab_size}; set model.vocab_size >= {meta['vocab_size']}")


def check_same_tokenizer(train_path: str, eval_path: str) -> None:
    """data.eval_paths prepared with another tokenizer than data.bin_path (both recorded in their
    .json by `jaxpar data prepare`): the eval loss would score other ids. A ConfigError."""
    a, b = read_meta(train_path) or {}, read_meta(eval_path) or {}
    ta, tb = a.get("tokenizer"), b.get("tokenizer")
    if ta and tb and ta != tb:
        raise ConfigError(f"data.eval_paths={eval_path!r} was prepared with the tokenizer {tb}, "
                          f"data.bin_path={train_path!r} with {ta}: the eval loss would score other "
                          f"ids; prepare both with the same tokenizer")
