"""Byte-level text: a tokenizer that needs no vocabulary file, and a corpus that needs no download.

Token = byte value (vocab 256), so any text trains out of the box. With no paths given the corpus
is the Python standard library's own sources, which every machine that runs us already has.
"""
from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data import split as split_mod

VOCAB_SIZE = 256
SEPARATOR = b"\n"
TEXT_SUFFIXES = (".py", ".txt", ".md")
DEFAULT_MAX_BYTES = 64 << 20  # the stdlib is ~30 MiB; the cap bounds memory and start-up time
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# compressed or binary files read as text would train on garbage: refused by name / magic
COMPRESSED = {".gz": b"\x1f\x8b", ".zst": b"\x28\xb5\x2f\xfd", ".bz2": b"BZh", ".xz": b"\xfd7zXZ",
              ".zip": b"PK\x03\x04"}
HEAD_BYTES = 4096  # what not_text looks at


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as int32 token ids in [0, 256)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(ids: Iterable[int] | np.ndarray) -> str:
    """Token ids back to text. Invalid UTF-8, and ids outside [0, 256) (a model with a padded
    vocab may sample them), come out as U+FFFD instead of raising."""
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    arr = np.where((arr >= 0) & (arr < VOCAB_SIZE), arr, 0xFF)  # 0xFF is never valid UTF-8
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def not_text(path: Path, head: bytes) -> str | None:
    """Why the file `path`, whose first bytes are `head`, is no text document (a compressed
    archive, by suffix or magic; binary data: NUL bytes), or None. The text source and `jaxpar
    data prepare` refuse the same files."""
    packed = next((s for s, magic in COMPRESSED.items()
                   if path.suffix.lower() == s or head[:HEAD_BYTES].startswith(magic)), None)
    if packed is not None:
        return f"a {packed} archive"
    if b"\0" in head[:HEAD_BYTES]:
        return "binary data (NUL bytes)"
    return None


def _walk(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under `root` with a wanted suffix, in a sorted (machine-independent) order."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(suffixes))
    return found


def stdlib_files() -> list[Path]:
    """The standard library's `.py` sources (site-packages skipped, so installs don't change it)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ConfigError(
            f"data.paths is empty and the Python standard library was not found at {root}; "
            "set data.paths to text files or directories"
        )
    return _walk(root, (".py",))


def corpus_files(paths: Sequence[str], what: str = "data.paths") -> list[Path]:
    """Expand `paths` (files, or directories searched for *.py, *.txt, *.md) in the given order;
    empty means the standard library. `what`: the config field that named them (in errors)."""
    if not paths:
        return stdlib_files()
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = _walk(path, TEXT_SUFFIXES)
            if not found:
                raise ConfigError(
                    f"{what} entry {p!r} is a directory with no "
                    f"{', '.join(TEXT_SUFFIXES)} files"
                )
            files.extend(found)
        else:
            raise ConfigError(
                f"{what} entry {p!r} does not exist; give text files or directories"
            )
    return files


@functools.lru_cache(maxsize=2)
def corpus_documents(paths: tuple[str, ...], max_bytes: int | None = None, exclude: tuple[str, ...] = (),
                     what: str = "data.paths") -> tuple[tuple[Path, bytes], ...]:
    """(file, its bytes) for the corpus of `paths` (named by the config field `what`), files in
    `exclude` (paths or dirs, expanded the same way: data.eval_paths) left out, stopping once
    `max_bytes` are read. Cached per process (the train and eval splits of one corpus read its
    files once). No file left after `exclude` is a ConfigError: nothing would be trained on."""
    skip = {f.resolve() for f in corpus_files(exclude, "data.eval_paths")} if exclude else set()
    files = corpus_files(paths, what)
    if skip and all(f.resolve() in skip for f in files):
        where = f"{what}={list(paths)!r}" if paths else "the stdlib corpus (data.paths empty)"
        raise ConfigError(f"data.eval_paths={list(exclude)!r} holds every file of {where}: nothing is "
                          f"left to train on; give data.paths other files than data.eval_paths")
    docs, total = [], 0
    for f in files:
        if f.resolve() in skip:
            continue
        docs.append((f, f.read_bytes()))
        why = not_text(f, docs[-1][1])
        if why is not None:
            raise ConfigError(f"{what} entry {str(f)!r} is {why}, not text: read as text the run would "
                              f"train on its raw bytes; decompress it, or give tokens as data.source=bin")
        total += len(docs[-1][1]) + len(SEPARATOR)
        if max_bytes is not None and total >= max_bytes:
            break
    return tuple(docs)


@functools.lru_cache(maxsize=4)
def load_corpus(paths: tuple[str, ...] = (), max_bytes: int | None = None, eval_fraction: float = 0.0,
                split: str = "train", exclude: tuple[str, ...] = (), what: str = "data.paths") -> np.ndarray:
    """All files' bytes joined by b"\n" into one read-only uint8 array, cached per process.

    `max_bytes` truncates the result (default: DEFAULT_MAX_BYTES for the stdlib corpus, no cap
    for user paths; corpora too big for memory belong in a .bin file). With `eval_fraction`, only
    the files of `split` (jaxpar/data/split.py: by a hash of each file's bytes); `exclude`: files
    never read (the held-out data.eval_paths); `what`: the config field naming `paths`."""
    if max_bytes is None and not paths:
        max_bytes = DEFAULT_MAX_BYTES
    docs = corpus_documents(paths, max_bytes, exclude, what)
    kept = split_mod.select(docs, eval_fraction, split, key=lambda d: d[1])
    if eval_fraction:
        split_mod.check_nonempty(len(kept), len(docs), eval_fraction, split,
                                 f"{what}={list(paths)!r}" if paths else "the stdlib corpus")
    blob = SEPARATOR.join(d for _, d in kept)
    if max_bytes is not None:
        blob = blob[:max_bytes]
    arr = np.frombuffer(blob, dtype=np.uint8)  # bytes-backed, hence read-only: safe to share
    if arr.size == 0:
        raise ConfigError(f"{what}={list(paths)!r} gives an empty corpus; give non-empty files")
    return arr
