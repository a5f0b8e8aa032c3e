"""Stateless input: batch rows are a pure function of (seed, step, row index).

So resuming at step s needs no replay and no saved iterator state, every process computes only
the rows of its own shards, and the data does not change with the number of hosts or devices.
Randomness comes from a counter-based hash of (seed, step, row) (jaxpar/data/keys.py): computing
any subset of rows gives exactly the values those rows have in the full batch.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import jax
import numpy as np

from jaxpar.config import ConfigError, DataConfig
from jaxpar.data import binfile, packing, split as split_mod, synthetic, text, tokenizer
from jaxpar.data.keys import mix64, row_keys  # noqa: F401 (mix64: re-exported)


class TokenSource(Protocol):
    def rows(self, step: int, row_indices: np.ndarray, seq_len: int) -> np.ndarray:
        """int32 [len(row_indices), seq_len + 1]: inputs and, shifted by one, targets."""
        ...


@dataclass(frozen=True, eq=False)
class StreamSource:
    """Random windows of seq_len + 1 tokens from one long 1-D token stream (array or memmap).

    `vocab_size` set means ids are checked per batch (for files not fully validated upfront);
    `name` is the config field shown in errors."""

    tokens: np.ndarray = field(repr=False)
    seed: int
    name: str
    vocab_size: int | None = None

    def rows(self, step: int, row_indices: np.ndarray, seq_len: int) -> np.ndarray:
        return self.columns(step, row_indices, seq_len, np.arange(seq_len + 1))

    def check_length(self, seq_len: int) -> None:
        """A stream shorter than one window is a ConfigError (the loader asks when it is built,
        so a short held-out split fails before step 1, not at the first eval)."""
        n, length = int(self.tokens.shape[0]), seq_len + 1
        if n < length:
            raise ConfigError(
                f"{self.name} has {n} tokens, fewer than train.seq_len+1={length}; "
                "give a longer corpus or lower train.seq_len"
            )

    def columns(self, step: int, row_indices: np.ndarray, seq_len: int, cols: np.ndarray) -> np.ndarray:
        """rows(...)[:, cols], reading only those tokens of each window (a context device's share)."""
        self.check_length(seq_len)
        n, length = int(self.tokens.shape[0]), seq_len + 1
        offsets = row_keys(self.seed, step, row_indices) % np.uint64(n - length + 1)
        cuts = np.flatnonzero(np.diff(cols) != 1) + 1  # the contiguous runs of `cols`
        runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(cols, cuts)]
        out = np.empty((len(offsets), len(cols)), dtype=self.tokens.dtype)
        for i, o in enumerate(offsets.tolist()):  # contiguous reads: cheap on a memmap
            out[i] = np.concatenate([self.tokens[o + a : o + b] for a, b in runs])
        if self.vocab_size is not None:  # before the int32 cast, which could wrap huge ids
            binfile.check_ids(out, self.vocab_size, self.name)
        return out.astype(np.int32)


@dataclass(frozen=True)
class HeldOutSteps:
    """A stateless source's rows at steps no training run reaches: the held-out rows of a source
    without documents (synthetic)."""

    source: TokenSource
    offset: int = 1 << 48

    def rows(self, step: int, row_indices: np.ndarray, seq_len: int) -> np.ndarray:
        return self.source.rows(self.offset + step, row_indices, seq_len)


def build_source(cfg: DataConfig, vocab_size: int, seed: int, split: str = "train") -> TokenSource:
    """The token source `cfg` names, validated against the model's vocab_size. `split`: "train"
    (without the held-out documents, when data.eval_fraction / data.eval_paths is set) or "eval"
    (only those; a ConfigError when the config has no held-out split)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}; valid: train, eval")
    evaluating = split == "eval"
    if evaluating and not cfg.has_eval_split:
        raise ConfigError("evaluation needs a held-out split: set data.eval_fraction (e.g. 0.01) or "
                          "data.eval_paths")
    frac = cfg.eval_fraction
    if cfg.source == "text":
        paths = tuple(cfg.eval_paths) if evaluating and cfg.eval_paths else tuple(cfg.paths)
        exclude = () if evaluating else tuple(cfg.eval_paths)
        # data.eval_paths: all of those files (no fraction to split by)
        file_split = "train" if evaluating and cfg.eval_paths else split
        field_name = "data.eval_paths" if evaluating and cfg.eval_paths else "data.paths"
        name = f"{field_name}={list(paths)!r}" if paths else "the Python stdlib corpus"
        if frac:
            name += f" ({split} split, data.eval_fraction={frac})"
    if cfg.source == "text" and cfg.tokenizer:
        tokens = tokenizer.tokenized_corpus(paths, cfg.tokenizer, vocab_size, frac, file_split, exclude,
                                            field_name)
        name = f"{name} (data.tokenizer={cfg.tokenizer!r})"
        if cfg.packing:
            eos = tokenizer.Tokenizer(cfg.tokenizer).eos_id
            return packing.PackedSource(tokens, *packing.eos_boundaries(tokens, eos), eos, seed, name)
        return StreamSource(tokens, seed, name)
    if cfg.source == "text":
        if vocab_size < text.VOCAB_SIZE:
            raise ConfigError(
                f"model.vocab_size={vocab_size} is too small for data.source='text': byte tokens "
                f"need vocab_size >= {text.VOCAB_SIZE}"
            )
        return StreamSource(text.load_corpus(paths, None, frac, file_split, exclude, field_name), seed, name)
    if cfg.source == "bin":
        if not cfg.bin_path:
            raise ConfigError("data.source='bin' needs data.bin_path (a .bin file of tokens)")
        path, what = cfg.bin_path, "data.bin_path"
        if evaluating and cfg.eval_paths:
            path, what = cfg.eval_paths[0], "data.eval_paths"
        if what == "data.eval_paths":
            binfile.check_same_tokenizer(cfg.bin_path, path)
        binfile.check_meta(path, cfg.bin_dtype, vocab_size, what)
        tokens = binfile.open_bin(path, cfg.bin_dtype, what)
        binfile.check_head(tokens, vocab_size, f"{what}={path!r}")
        if "dtype" not in binfile.read_meta(path):
            binfile.check_width(tokens, cfg.bin_dtype, vocab_size, f"{what}={path!r}")
        name = f"{what}={path!r}"
        if frac:
            tokens = split_mod.bin_split(tokens, path, frac, split)
            name += f" ({split} split, data.eval_fraction={frac})"
        if cfg.packing:
            return _packed_bin(tokens, path, seed, name, vocab_size)
        return StreamSource(tokens, seed, name, vocab_size)
    if cfg.source == "synthetic":
        source = synthetic.SyntheticSource(vocab_size, seed)
        return HeldOutSteps(source) if evaluating else source
    raise ConfigError(f"data.source={cfg.source!r} is not valid; valid: text, bin, synthetic")


def _packed_bin(tokens, path: str, seed: int, name: str, vocab_size: int) -> packing.PackedSource:
    """data.packing over a `.bin`: its documents from the `.idx` (those of the split, when
    `tokens` is a split's Spans), the end-of-text id from the `.json`."""
    eos = binfile.eos_id(path)
    if isinstance(tokens, split_mod.Spans):
        starts, ends = tokens.starts, tokens.starts + np.diff(tokens.offsets)
        tokens = tokens.tokens
    else:
        idx = split_mod.read_index(tokens, path, "data.packing", "; or set data.packing=false")
        starts, ends = idx[:-1], idx[1:]
    return packing.PackedSource(tokens, starts, ends, eos, seed, name, vocab_size)


def global_batch(
    source: TokenSource, step: int, global_batch: int, seq_len: int, sharding: jax.sharding.Sharding,
    columns: np.ndarray | None = None,
) -> jax.Array:
    """The step's int32 [global_batch, seq_len + 1] batch as one global array with `sharding`;
    with `columns` (context parallelism: parallel/context.loader_columns), [global_batch,
    len(columns)]: those positions of each row, in that order, dim 1 split by the sharding.

    Each process computes only the rows of its addressable shards, and of those only the
    columns its shards hold when the source reads windows (`TokenSource.columns`); shards that
    repeat the same rows and columns (replicated over other axes) are computed once."""
    columns = np.arange(seq_len + 1) if columns is None else columns
    shape = (global_batch, len(columns))
    all_rows = np.arange(global_batch)
    done: dict[tuple, np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        rows_slice = index[0] if index else slice(None)
        cols = index[1] if len(index) > 1 else slice(None)
        key = (rows_slice.indices(global_batch), cols.indices(shape[1]))
        if key not in done:
            rows, want = all_rows[rows_slice], columns[cols]
            if hasattr(source, "columns"):
                done[key] = source.columns(step, rows, seq_len, want)
            else:  # sources that build a row as a whole (synthetic, packed): then cut
                done[key] = source.rows(step, rows, seq_len)[:, want]
        return done[key]

    return jax.make_array_from_callback(shape, sharding, shard)


class DataLoader:
    """Batches by step. There is no iterator state: the position is just the next step, so a
    checkpoint only needs `state_dict()` (or the train step) and resuming replays nothing."""

    def __init__(
        self, source: TokenSource, global_batch: int, seq_len: int, sharding: jax.sharding.Sharding,
        columns: np.ndarray | None = None,
    ) -> None:
        self.source = source
        if hasattr(source, "check_length"):
            source.check_length(seq_len)
        self.columns = columns  # context parallelism: each row's columns in its devices' order
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.sharding = sharding
        self.position = 0  # the step the next `next()` returns

    def batch(self, step: int) -> jax.Array:
        """The batch of `step` (pure: same step, same batch; does not move `position`)."""
        return global_batch(self.source, step, self.global_batch, self.seq_len, self.sharding, self.columns)

    def prefetch(self, steps: Iterable[int], depth: int) -> "Prefetcher":
        """The batches of `steps`, in order, built up to `depth` ahead by a background thread."""
        return Prefetcher(self.batch, steps, depth)

    def __iter__(self) -> "DataLoader":
        return self

    def __next__(self) -> jax.Array:
        out = self.batch(self.position)
        self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["step"])


class Prefetcher:
    """`make(s)` for each s of `steps`, in order. A daemon thread builds them (host rows, then the
    transfer to the devices) up to `depth` ahead of the consumer, so batch building overlaps the
    running step; depth 0 builds each in `next()`. An error building a batch is raised by the
    `next()` that would have returned it. `close()` stops the thread (a rollback, the loop's end)."""

    _END = object()

    def __init__(self, make, steps: Iterable[int], depth: int) -> None:
        self.make, self.depth = make, depth
        self._steps = iter(steps)
        self._stop = threading.Event()
        self._thread = None
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._fill, name="jaxpar-prefetch", daemon=True)
            self._thread.start()

    def _fill(self) -> None:
        try:
            for s in self._steps:
                if not self._put((s, self.make(s))):
                    return
            self._put(self._END)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer)
            self._put(e)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> tuple[int, jax.Array]:
        """(step, its batch)."""
        if self._thread is None:
            s = next(self._steps)
            return s, self.make(s)
        item = self._queue.get()
        if item is self._END:
            self._queue.put(self._END)  # StopIteration again on the next call
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
