"""Subword tokenizers: a Hugging Face `tokenizer.json` (through the `tokenizers` package), and
training a byte-level BPE on local files (so tests and the quickstart need no download).

Documents are separated by one end-of-text token (`eos_id`): the first of EOS_NAMES the
vocabulary has. A tokenizer whose vocabulary is larger than `model.vocab_size` is a ConfigError.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data import split as split_mod, text

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
TRAINED_EOS = "<|endoftext|>"


class Tokenizer:
    """A loaded tokenizer.json: encode / decode, vocab_size, eos_id (None only with
    need_eos=False: generating for a model that names its own eos token id)."""

    def __init__(self, path: str | Path, what: str = "data.tokenizer", need_eos: bool = True):
        from tokenizers import Tokenizer as HFTokenizer  # optional: only subword data needs it
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ConfigError(f"{what}={str(path)!r} does not exist; give a tokenizer.json "
                              f"(or train one: jaxpar data train-tokenizer)")
        try:
            self.tok = HFTokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 (the tokenizers error is one line, without the file)
            raise ConfigError(f"{what}={str(path)!r} is not a readable tokenizer.json: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = [self.tok.token_to_id(n) for n in EOS_NAMES]
        found = [i for i in ids if i is not None]
        if not found and need_eos:
            raise ConfigError(f"{what}={str(path)!r} has no end-of-text token (one of "
                              f"{', '.join(EOS_NAMES)}) to separate documents")
        self.eos_id = found[0] if found else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """A corpus's documents: a special token's text inside one (a file quoting
        "<|endoftext|>") is encoded as the text it is, not as the token, or it would end the
        document there (packing's boundaries and loss mask follow the end-of-text ids)."""
        previous = getattr(self.tok, "encode_special_tokens", None)
        if previous is not None:
            self.tok.encode_special_tokens = True
        try:
            out = self.tok.encode_batch(list(texts), add_special_tokens=False)
        finally:
            if previous is not None:
                self.tok.encode_special_tokens = previous
        return [np.asarray(e.ids, dtype=np.int64) for e in out]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def check_vocab(self, model_vocab: int, what: str = "data.tokenizer") -> None:
        if self.vocab_size > model_vocab:
            raise ConfigError(f"{what}={str(self.path)!r} has vocab_size {self.vocab_size}, above "
                              f"model.vocab_size={model_vocab}: its ids would be out of range; set "
                              f"model.vocab_size >= {self.vocab_size} (a multiple of 128 is fastest)")


def run_tokenizer(data_cfg) -> str | None:
    """The tokenizer.json a run's text went through: data.tokenizer, or the one `jaxpar data
    prepare` recorded beside data.bin_path (None: bytes, or synthetic data)."""
    if data_cfg.tokenizer:
        return str(data_cfg.tokenizer)
    if data_cfg.source == "bin" and data_cfg.bin_path:
        meta = Path(str(data_cfg.bin_path) + ".json")  # written by jaxpar data prepare
        if meta.is_file():
            return json.loads(meta.read_text()).get("tokenizer")
    return None


def token_dtype(vocab_size: int) -> str:
    """The .bin dtype of a vocabulary: uint16 while every id fits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def train_bpe(files: Sequence[str | Path], vocab_size: int, output: str | Path,
              min_frequency: int = 2) -> Path:
    """Train a byte-level BPE (every byte is a token, so no text is out of vocabulary) on `files`
    and save it as tokenizer.json; TRAINED_EOS is its id 0."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < 257 + 1:
        raise ConfigError(f"--vocab-size {vocab_size}: a byte-level BPE needs more than 257 "
                          f"(256 bytes + end-of-text + merges)")
    paths = [str(Path(f)) for f in files]
    missing = [p for p in paths if not Path(p).is_file()]
    if missing or not paths:
        raise ConfigError(f"train-tokenizer: no such file: {missing[0]}" if missing else
                          "train-tokenizer: give at least one text file")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[TRAINED_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train(paths, trainer)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    json.loads(out.read_text())  # written whole
    return out


def trained_size(path: str | Path, asked: int) -> str:
    """`vocab N` of a trained tokenizer.json, saying why when the text gave fewer than `asked`
    (BPE stops when no pair is frequent enough to merge)."""
    saved = json.loads(Path(path).read_text())
    got = Tokenizer(path, what="--output").vocab_size
    if got >= asked:
        return f"vocab {got}"
    merges = len(saved.get("model", {}).get("merges", []))
    return f"vocab {got} (asked {asked}: the text gave only {merges} merges)"


@functools.lru_cache(maxsize=4)
def tokenized_corpus(paths: tuple[str, ...], tokenizer: str, model_vocab: int, eval_fraction: float = 0.0,
                     split: str = "train", exclude: tuple[str, ...] = (),
                     what: str = "data.paths") -> np.ndarray:
    """data.tokenizer for the text source: the files of data.paths (default: the stdlib, capped
    as for bytes) tokenized in this process, one document per file, EOS after each; with
    `eval_fraction` only the files of `split`, `exclude`d files never read (as text.load_corpus).
    For big corpora, `jaxpar data prepare` once and the `bin` source."""
    tok = Tokenizer(tokenizer)
    tok.check_vocab(model_vocab)
    budget = text.DEFAULT_MAX_BYTES if not paths else None
    files = text.corpus_documents(paths, budget, exclude, what)
    kept = split_mod.select(files, eval_fraction, split, key=lambda d: d[1])
    if eval_fraction:
        split_mod.check_nonempty(len(kept), len(files), eval_fraction, split,
                                 f"{what}={list(paths)!r}" if paths else "the stdlib corpus")
    docs = [data.decode("utf-8", errors="replace") for _, data in kept]
    eos = np.array([tok.eos_id], np.int64)
    ids = np.concatenate([x for d in tok.encode_batch(docs) for x in (d, eos)])
    out = ids.astype(np.int32)
    out.flags.writeable = False  # shared by every caller (cached)
    return out
