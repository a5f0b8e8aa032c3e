"""`jaxpar data prepare`: tokenize a corpus into the memory-mapped `.bin` the `bin` source reads.

Inputs: text files (one document each), JSONL (one document per line, its `text_field`) or
parquet (one per row of that column; needs pyarrow). Chunks of documents are tokenized in
`workers` processes, written in input order, each document followed by the end-of-text token.
Beside `OUT.bin` (uint16, or uint32 when the vocabulary needs it):
  OUT.bin.idx   little-endian uint64 [documents + 1]: document i is tokens idx[i]:idx[i+1]
                (its EOS included), so packing can keep documents whole
  OUT.bin.keys  little-endian uint64 [documents]: each document's split key (data/split.doc_key
                of its text's bytes: a text file's raw bytes, as the `text` source hashes them), so
                data.eval_fraction holds out the same files whichever source reads them
  OUT.bin.json  dtype, vocab_size, eos_id, the tokenizer, counts (checked by the `bin` source)
All four are written under temporary names and renamed when whole.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data import split as split_mod
from jaxpar.data.binfile import DTYPES
from jaxpar.data.text import HEAD_BYTES, not_text
from jaxpar.data.tokenizer import Tokenizer, token_dtype

CHUNK_CHARS = 1 << 20  # text per worker task
FORMAT = "jaxpar-tokens/1"

_worker_tok: Tokenizer | None = None


def _init_worker(path: str, one_thread: bool = False) -> None:
    global _worker_tok
    if one_thread:  # a worker process per core: the tokenizer's own thread pool would oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tok = Tokenizer(path)


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of the chunk's documents, each followed by EOS; their lengths)."""
    tok = _worker_tok
    docs = tok.encode_batch(texts)
    lengths = np.array([len(d) + 1 for d in docs], np.uint64)
    eos = np.array([tok.eos_id], np.int64)
    return np.concatenate([x for d in docs for x in (d, eos)]), lengths


def documents(path: Path, text_field: str = "text") -> Iterator[tuple[str, bytes]]:
    """(text, the bytes its split key hashes) of each document of one input file (ConfigError
    naming the file and line on bad input)."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start}); JSON "
                                      f"lines must be UTF-8 text") from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{n}: not a JSON line ({e})") from None
                if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
                    raise ConfigError(f"{path}:{n}: no string field {text_field!r} "
                                      f"(set --text-field)")
                yield rec[text_field], rec[text_field].encode("utf-8", errors="replace")
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional: only parquet input needs it
        except ImportError:
            raise ConfigError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            names = ", ".join(pf.schema_arrow.names)
            raise ConfigError(f"{path}: no column {text_field!r}; columns: {names}")
        kind = pf.schema_arrow.field(text_field).type
        if str(kind) not in ("string", "large_string", "string_view"):
            raise ConfigError(f"{path}: column {text_field!r} holds {kind}, not text (set --text-field)")
        for batch in pf.iter_batches(columns=[text_field]):
            yield from ((t, t.encode("utf-8", errors="replace"))
                        for t in batch.column(0).to_pylist() if t is not None)
    else:
        check_text_file(path)
        raw = path.read_bytes()
        yield raw.decode("utf-8", errors="replace"), raw


def check_text_file(path: Path) -> None:
    """A ConfigError for a compressed or binary file given as a text document."""
    with open(path, "rb") as f:
        why = not_text(path, f.read(HEAD_BYTES))
    if why is not None:
        raise ConfigError(f"{path}: {why}, not a text document: read as text it would be tokenized as "
                          f"garbage; decompress it first (inputs: text files, .jsonl / .ndjson, .parquet)")


def _chunks(files: Sequence[Path], text_field: str, bar, keys: list) -> Iterator[list[str]]:
    """Lists of documents of about CHUNK_CHARS, in input order; their split keys appended to
    `keys` as they are read."""
    chunk, size = [], 0
    for f in files:
        for doc, raw in documents(f, text_field):
            chunk.append(doc)
            keys.append(split_mod.doc_key(raw))
            size += len(doc)
            if size >= CHUNK_CHARS:
                yield chunk
                chunk, size = [], 0
        bar.update(f.stat().st_size)
    if chunk:
        yield chunk


def _ordered(fn, items: Iterator, workers: int, tokenizer: str) -> Iterator:
    """fn(item) for each item, in order, at most 2 x workers tasks in flight."""
    if workers <= 1:
        _init_worker(tokenizer)
        yield from map(fn, items)
        return
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(tokenizer, True)) as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def prepare(tokenizer: str | Path, output: str | Path, inputs: Sequence[str | Path], workers: int = 1,
            text_field: str = "text", progress: bool | None = None) -> dict:
    """Tokenize `inputs` into `output` (+ .idx, .json); returns the counts and tokens/s."""
    from tqdm import tqdm
    tok = Tokenizer(tokenizer, what="--tokenizer")
    files = [Path(p) for p in inputs]
    for f in files:
        if not f.is_file():
            raise ConfigError(f"data prepare: input {str(f)!r} is not a file")
    if not files:
        raise ConfigError("data prepare: give the input files (text, .jsonl or .parquet)")
    if workers < 1:
        raise ConfigError(f"data prepare: --workers {workers} must be >= 1")
    out = Path(output)
    if out.is_dir():
        raise ConfigError(f"data prepare: --output {str(out)!r} is a directory; give a file name, "
                          f"e.g. {str(out / 'corpus.bin')!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    tmp = {k: out.with_name(out.name + k + ".tmp") for k in ("", ".idx", ".keys", ".json")}
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
               desc="tokenizing", disable=not show)
    t0 = time.perf_counter()
    n_tokens, n_docs = 0, 0
    try:
        with open(tmp[""], "wb") as fb, open(tmp[".idx"], "wb") as fi:
            fi.write(np.zeros(1, "<u8").tobytes())
            keys: list[int] = []
            chunks = _chunks(files, text_field, bar, keys)
            for ids, lengths in _ordered(_encode_chunk, chunks, workers, str(tok.path)):
                fb.write(ids.astype(DTYPES[dtype]).tobytes())
                fi.write((n_tokens + np.cumsum(lengths)).astype("<u8").tobytes())
                n_tokens += int(lengths.sum())
                n_docs += len(lengths)
        np.array(keys, dtype="<u8").tofile(tmp[".keys"])
        if n_docs == 0:
            raise ConfigError(f"data prepare: the inputs hold no documents ({', '.join(map(str, files))}); "
                              f"nothing to train on")
    except BaseException:
        for p in tmp.values():
            p.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    meta = {"format": FORMAT, "dtype": dtype, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "tokenizer": str(tok.path.absolute()), "documents": n_docs, "tokens": n_tokens,
            "inputs": [str(f) for f in files]}
    tmp[".json"].write_text(json.dumps(meta, indent=2) + "\n")
    for k, p in tmp.items():
        os.replace(p, out.with_name(out.name + k))
    rate = n_tokens / seconds if seconds else float("inf")
    return {**meta, "seconds": seconds, "tokens_per_s": rate,
            "tokens_per_s_per_worker": rate / max(1, workers), "workers": max(1, workers)}


def read_index(bin_path: str | Path) -> np.ndarray:
    """The document boundaries of a prepared .bin (uint64 [documents + 1])."""
    return np.fromfile(Path(str(bin_path) + ".idx"), dtype="<u8")


def read_meta(bin_path: str | Path) -> dict | None:
    """The .json beside a prepared .bin, or None (a .bin written another way)."""
    p = Path(str(bin_path) + ".json")
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
