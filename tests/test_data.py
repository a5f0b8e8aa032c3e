"""Data sources: deterministic by (seed, step, row), subset-consistent, correctly sharded."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxpar.config import ConfigError, DataConfig  # noqa: E402
from jaxpar.data import (  # noqa: E402
    DataLoader,
    SyntheticSource,
    build_source,
    decode,
    encode,
    global_batch,
    load_corpus,
    open_bin,
    write_bin,
)
from jaxpar.data.text import stdlib_files  # noqa: E402

SEQ = 16


@pytest.fixture
def text_dir(tmp_path):
    (tmp_path / "b.txt").write_text("hello world, " * 40)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.py").write_text("print('jaxpar')\n" * 30)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 100)  # not a text suffix: ignored in dirs
    return tmp_path


def _sources(tmp_path, text_dir):
    bin_path = write_bin(tmp_path / "toks.bin", np.arange(5000) % 1000, "uint16")
    return [
        build_source(DataConfig(source="text", paths=[str(text_dir)]), 256, seed=3),
        build_source(DataConfig(source="bin", bin_path=str(bin_path)), 1000, seed=3),
        build_source(DataConfig(source="synthetic"), 97, seed=3),
    ]


def test_deterministic_and_subset_consistent(tmp_path, text_dir):
    rows = np.arange(32)
    for src in _sources(tmp_path, text_dir):
        full = src.rows(7, rows, SEQ)
        assert full.shape == (32, SEQ + 1) and full.dtype == np.int32
        np.testing.assert_array_equal(full, src.rows(7, rows, SEQ))
        assert not np.array_equal(full, src.rows(8, rows, SEQ))
        subset = np.array([31, 0, 5, 17])
        np.testing.assert_array_equal(src.rows(7, subset, SEQ), full[subset])
        assert src.rows(7, np.arange(0), SEQ).shape == (0, SEQ + 1)


def test_seed_changes_data(text_dir):
    cfg = DataConfig(source="text", paths=[str(text_dir)])
    a = build_source(cfg, 256, seed=0).rows(0, np.arange(8), SEQ)
    b = build_source(cfg, 256, seed=1).rows(0, np.arange(8), SEQ)
    assert not np.array_equal(a, b)


def test_global_batch_sharded_matches_numpy(text_dir):
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = Mesh(np.array(devices[:8]).reshape(8), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    src = build_source(DataConfig(source="text", paths=[str(text_dir)]), 256, seed=0)
    arr = global_batch(src, 5, 16, SEQ, sharding)
    assert arr.shape == (16, SEQ + 1) and arr.dtype == np.int32
    assert arr.sharding == sharding
    assert {s.data.shape for s in arr.addressable_shards} == {(2, SEQ + 1)}
    np.testing.assert_array_equal(np.asarray(arr), src.rows(5, np.arange(16), SEQ))

    loader = DataLoader(src, 16, SEQ, sharding)
    np.testing.assert_array_equal(np.asarray(loader.batch(5)), np.asarray(arr))
    loader.load_state_dict({"step": 5})
    np.testing.assert_array_equal(np.asarray(next(loader)), np.asarray(arr))
    assert loader.state_dict() == {"step": 6}


def test_byte_tokenizer_round_trip():
    s = "héllo, wörld ✓\n"
    ids = encode(s)
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < 256
    assert decode(ids) == s
    assert decode([104, 105, 300]) == "hi\ufffd"  # out-of-vocab ids do not raise


def test_text_rejects_small_vocab_and_missing_path(tmp_path, text_dir):
    with pytest.raises(ConfigError, match="vocab_size=100"):
        build_source(DataConfig(source="text", paths=[str(text_dir)]), 100, seed=0)
    with pytest.raises(ConfigError, match="does not exist"):
        build_source(DataConfig(source="text", paths=[str(tmp_path / "nope")]), 256, seed=0)
    short = tmp_path / "short.txt"
    short.write_text("abc")
    src = build_source(DataConfig(source="text", paths=[str(short)]), 256, seed=0)
    with pytest.raises(ConfigError, match="seq_len"):
        src.rows(0, np.arange(2), SEQ)


def test_corpus_order_and_contents(text_dir):
    corpus = load_corpus((str(text_dir),))
    assert corpus.dtype == np.uint8
    assert bytes(corpus) == (b"hello world, " * 40) + b"\n" + b"print('jaxpar')\n" * 30


def test_bin_round_trip(tmp_path):
    toks = np.random.default_rng(0).integers(0, 70000, size=3000)
    path = write_bin(tmp_path / "t.bin", toks, "uint32")
    np.testing.assert_array_equal(open_bin(path, "uint32"), toks)
    src = build_source(DataConfig(source="bin", bin_path=str(path), bin_dtype="uint32"), 70000, 0)
    rows = src.rows(2, np.arange(4), SEQ)
    for row in rows:  # each row is a contiguous window of the file
        start = np.flatnonzero(toks == row[0])
        assert any(np.array_equal(toks[s : s + SEQ + 1], row) for s in start)


def test_bin_errors(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="not a multiple of 2"):
        build_source(DataConfig(source="bin", bin_path=str(bad)), 256, 0)
    with pytest.raises(ConfigError, match="does not exist"):
        build_source(DataConfig(source="bin", bin_path=str(tmp_path / "missing.bin")), 256, 0)
    big = write_bin(tmp_path / "big.bin", np.full(100, 500), "uint16")
    with pytest.raises(ConfigError, match="500 >= model.vocab_size=256"):
        build_source(DataConfig(source="bin", bin_path=str(big)), 256, 0)
    with pytest.raises(ValueError):
        write_bin(tmp_path / "x.bin", np.array([70000]), "uint16")


def test_stdlib_corpus_nonempty_and_deterministic():
    files = stdlib_files()
    assert files and files == stdlib_files()
    assert not any("site-packages" in f.parts for f in files)
    corpus = load_corpus()
    assert corpus.size > 1_000_000 and corpus is load_corpus()
    src = build_source(DataConfig(), 256, seed=0)
    np.testing.assert_array_equal(src.rows(1, np.arange(4), 64), src.rows(1, np.arange(4), 64))


def test_synthetic_in_range_and_learnable():
    src = SyntheticSource(vocab_size=97, seed=1, noise=0.1)
    rows = src.rows(0, np.arange(64), 128)
    assert rows.min() >= 0 and rows.max() < 97
    follows = (src.a * rows[:, :-1] + src.b) % 97 == rows[:, 1:]
    assert 0.85 < follows.mean() < 0.95  # the rule holds except for ~10% noise
    with pytest.raises(ConfigError):
        SyntheticSource(vocab_size=1, seed=0)


def test_errors_about_eval_paths_name_data_eval_paths(tmp_path, text_dir):
    """A bad data.eval_paths entry was reported as data.paths (or data.bin_path), and eval_paths
    holding every file of data.paths said "give non-empty files" (with a tokenizer: a numpy
    ValueError): each is now one ConfigError naming data.eval_paths."""
    nope = str(tmp_path / "nope")
    cfg = DataConfig(source="text", paths=[str(text_dir)], eval_paths=[nope])
    for split in ("train", "eval"):
        with pytest.raises(ConfigError, match=r"^data\.eval_paths entry '.*nope' does not exist"):
            build_source(cfg, 256, 0, split=split)
    every = DataConfig(source="text", paths=[str(text_dir)],
                       eval_paths=[str(text_dir / "sub"), str(text_dir)])
    with pytest.raises(ConfigError, match=r"^data\.eval_paths=.* holds every file of data\.paths="):
        build_source(every, 256, 0)
    train = write_bin(tmp_path / "train.bin", np.arange(100) % 50, "uint16")
    held = write_bin(tmp_path / "held.bin", np.full(100, 300), "uint16")
    cfg = DataConfig(source="bin", bin_path=str(train), eval_paths=[str(held)])
    with pytest.raises(ConfigError, match=r"^data\.eval_paths='.*held.bin' holds token id 300 >= model"):
        build_source(cfg, 256, 0, split="eval")
    with pytest.raises(ConfigError, match=r"data\.bin_path='.*' is a directory"):
        build_source(DataConfig(source="bin", bin_path=str(tmp_path)), 256, 0)


def test_a_uint32_file_read_as_uint16_is_one_clear_error(tmp_path):
    """uint32 ids below 65536 read as uint16 are valid ids with a 0 after each: the run trained on
    that silently. Without a .json naming the dtype, it is now a ConfigError naming bin_dtype;
    uint16 files of the same ids (and a .json that says uint16) still open and read back."""
    ids = np.random.default_rng(1).integers(1, 5000, size=2000)
    wide = write_bin(tmp_path / "wide.bin", ids, "uint32")
    assert np.array_equal(np.fromfile(wide, "<u2")[1::2], np.zeros(2000))  # what uint16 would train on
    with pytest.raises(ConfigError, match=r"data\.bin_path='.*wide.bin' looks like uint32.*bin_dtype=uint32"):
        build_source(DataConfig(source="bin", bin_path=str(wide)), 8192, 0)
    src = build_source(DataConfig(source="bin", bin_path=str(wide), bin_dtype="uint32"), 8192, 0)
    np.testing.assert_array_equal(src.tokens, ids)
    narrow = write_bin(tmp_path / "narrow.bin", ids, "uint16")
    src = build_source(DataConfig(source="bin", bin_path=str(narrow)), 8192, 0)
    np.testing.assert_array_equal(src.tokens, ids)
    (tmp_path / "wide.bin.json").write_text('{"dtype": "uint16"}')  # the user says so: taken as given
    build_source(DataConfig(source="bin", bin_path=str(wide)), 8192, 0)


def test_the_text_source_refuses_compressed_or_binary_files(tmp_path, text_dir):
    """data.paths naming a .gz (or a binary file) trained on its raw bytes, silently, where `jaxpar
    data prepare` refused the same file: now one ConfigError naming the field and the file."""
    import gzip
    body = (text_dir / "b.txt").read_bytes()
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(body))
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02" * 100)
    for name, why in [("c.txt.gz", "a .gz archive"), ("blob.txt", r"binary data \(NUL bytes\)")]:
        good, bad = str(text_dir / "b.txt"), str(tmp_path / name)
        for split, cfg in [("train", DataConfig(source="text", paths=[good, bad])),
                           ("eval", DataConfig(source="text", paths=[good], eval_paths=[bad]))]:
            field = "data.paths" if split == "train" else "data.eval_paths"
            with pytest.raises(ConfigError, match=rf"^{field} entry '.*{name}' is {why}"):
                build_source(cfg, 256, 0, split=split)
    # the same text uncompressed is the corpus it was meant to be
    (tmp_path / "c.txt").write_bytes(body)
    assert bytes(load_corpus((str(tmp_path / "c.txt"),))) == body
