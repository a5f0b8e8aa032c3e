"""The held-out split: a document is evaluation data when a hash of its content falls below
`data.eval_fraction`, so the split depends on nothing else (not the seed, the order, the other
documents or the device count) and a document is in exactly one of the two streams.

`Spans` is a token stream made of some documents of a memory-mapped `.bin` (its `.idx` gives the
boundaries), read in place: the training stream of a `.bin` without its held-out documents.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from jaxpar.config import ConfigError

SPLITS = ("train", "eval")


def doc_key(doc: bytes) -> int:
    """A document's split key: 8 bytes of blake2b of its content (the text's bytes as read: a
    text file's raw bytes, a JSON line's text in UTF-8)."""
    return int.from_bytes(hashlib.blake2b(doc, digest_size=8).digest(), "little")


def held_out(doc: bytes, fraction: float) -> bool:
    """Whether the document whose content is `doc` belongs to the eval split."""
    return doc_key(doc) < fraction * 2.0**64


def keys_held_out(keys: np.ndarray, fraction: float) -> np.ndarray:
    """held_out for stored uint64 keys, exactly (an int below the float bound fraction * 2**64 is
    one below its ceiling)."""
    bound = math.ceil(fraction * 2.0**64)
    if bound >= 2**64:
        return np.ones(keys.shape, bool)
    return keys < np.uint64(bound)


def select(docs: list, fraction: float, split: str, key=lambda d: d) -> list:
    """The documents of `split` ("train" or "eval"); `key(doc)` is the bytes that are hashed."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; valid: {', '.join(SPLITS)}")
    if not fraction:
        return list(docs) if split == "train" else []
    return [d for d in docs if held_out(key(d), fraction) == (split == "eval")]


def check_nonempty(kept: int, total: int, fraction: float, split: str, what: str) -> None:
    if kept == 0:
        fix = "raise it" if split == "eval" else "lower it"
        raise ConfigError(f"data.eval_fraction={fraction} leaves the {split} split of {what} empty "
                          f"({total} documents); {fix}, or give data.eval_paths")


class Spans:
    """The documents [starts[i], ends[i]) of `tokens`, joined end to end, as a read-only 1-D
    stream: `len`, `.shape`, `.dtype` and `[a:b]` slices (what StreamSource reads)."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        self.tokens, self.starts = tokens, np.asarray(starts, np.int64)
        lengths = np.asarray(ends, np.int64) - self.starts
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])  # stream position of each span
        self.shape, self.dtype = (int(self.offsets[-1]),), tokens.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, sl: slice) -> np.ndarray:
        a, b, step = sl.indices(self.shape[0])
        if step != 1:
            raise ValueError("Spans supports contiguous slices only")
        out, pos = [], a
        i = int(np.searchsorted(self.offsets, a, side="right")) - 1
        while pos < b:
            start = self.starts[i] + (pos - self.offsets[i])
            n = min(b, self.offsets[i + 1]) - pos
            out.append(np.asarray(self.tokens[start:start + n]))
            pos += n
            i += 1
        return np.concatenate(out) if out else np.empty(0, self.dtype)


def read_index(tokens: np.ndarray, path: str, why: str, fix: str = "") -> np.ndarray:
    """The document boundaries of a `.bin` (its `<path>.idx`, written by `jaxpar data prepare`):
    document i is tokens idx[i]:idx[i+1]. `why` names the setting that needs them."""
    idx_path = Path(str(path) + ".idx")
    if not idx_path.is_file():
        raise ConfigError(f"{why} with data.bin_path={path!r} needs its document "
                          f"index {idx_path} (written by jaxpar data prepare){fix}")
    idx = np.fromfile(idx_path, dtype="<u8").astype(np.int64)
    if idx.size < 2 or idx[0] != 0 or idx[-1] != tokens.shape[0] or np.any(np.diff(idx) < 0):
        raise ConfigError(f"{idx_path} does not match data.bin_path={path!r} ({tokens.shape[0]} tokens); "
                          "prepare the data again")
    return idx


def read_keys(path: str, documents: int) -> np.ndarray | None:
    """The split keys `jaxpar data prepare` stored per document (`<path>.keys`, uint64 doc_key of
    each document's text), or None for a .bin without them (then its token bytes are hashed)."""
    p = Path(str(path) + ".keys")
    if not p.is_file():
        return None
    keys = np.fromfile(p, dtype="<u8")
    if keys.size != documents:
        raise ConfigError(f"{p} holds {keys.size} keys for {documents} documents of data.bin_path="
                          f"{path!r}; prepare the data again")
    return keys


def bin_split(tokens: np.ndarray, path: str, fraction: float, split: str) -> Spans:
    """The documents of `split` in a `.bin` (boundaries from `<path>.idx`, `jaxpar data prepare`).
    By the keys prepare stored from each document's text, so a file is held out alike whether it
    is read through the `text` source or prepared (older .bin files: by their token bytes)."""
    idx = read_index(tokens, path, f"data.eval_fraction={fraction}", "; or give data.eval_paths")
    pairs = list(zip(idx[:-1].tolist(), idx[1:].tolist()))
    keys = read_keys(path, len(pairs))
    if keys is not None:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; valid: {', '.join(SPLITS)}")
        held = keys_held_out(keys, fraction) if fraction else np.zeros(len(pairs), bool)
        kept = [p for p, h in zip(pairs, held.tolist()) if h == (split == "eval")]
    else:
        kept = select(pairs, fraction, split, key=lambda p: np.asarray(tokens[p[0]:p[1]]).tobytes())
    check_nonempty(len(kept), len(pairs), fraction, split, f"data.bin_path={path!r}")
    arr = np.array(kept, np.int64).reshape(-1, 2)
    return Spans(tokens, arr[:, 0], arr[:, 1])
