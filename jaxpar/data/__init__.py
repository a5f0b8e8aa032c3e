"""Input data: token sources whose batches are a pure function of (seed, step, row).

`build_source(cfg.data, vocab_size, seed)` gives a source; `global_batch` / `DataLoader` turn
it into sharded global arrays of shape [global_batch, seq_len + 1].
"""
from jaxpar.data.binfile import open_bin, write_bin
from jaxpar.data.loader import DataLoader, Prefetcher, StreamSource, TokenSource, build_source, global_batch
from jaxpar.data.synthetic import SyntheticSource
from jaxpar.data.text import decode, encode, load_corpus

__all__ = [
    "DataLoader",
    "Prefetcher",
    "StreamSource",
    "SyntheticSource",
    "TokenSource",
    "build_source",
    "decode",
    "encode",
    "global_batch",
    "load_corpus",
    "open_bin",
    "write_bin",
]
