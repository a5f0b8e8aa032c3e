"""Subword data: `jaxpar data train-tokenizer` (byte-level BPE on local files), `data prepare`
(parallel tokenization into a .bin + document index), `data.tokenizer` for the text source, and
one clear error per vocabulary mismatch or bad input."""
from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.cli import main as cli_main
from jaxpar.config import ConfigError, DataConfig
from jaxpar.data import DataLoader, build_source, open_bin
from jaxpar.data.prepare import prepare, read_index, read_meta
from jaxpar.data.tokenizer import Tokenizer

pytestmark = pytest.mark.xdist_group("tokenizer")  # its module fixtures are built once, on one worker

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = sorted(str(p) for p in (STDLIB / "json").glob("*.py")) + [str(STDLIB / "textwrap.py")]
VOCAB = 512


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(tokenizer.json, data.bin) made through the CLI: train-tokenizer then prepare, 2 workers."""
    d = tmp_path_factory.mktemp("tok")
    tok, out = d / "tokenizer.json", d / "data.bin"
    assert cli_main(["data", "train-tokenizer", "--vocab-size", str(VOCAB), "--output", str(tok), *FILES]) == 0
    assert cli_main(["data", "prepare", "--tokenizer", str(tok), "--output", str(out), "--workers", "2",
                     *FILES]) == 0
    return tok, out


def test_bin_decodes_back_with_whole_documents(prepared):
    tok_path, out = prepared
    tok = Tokenizer(tok_path)
    assert tok.vocab_size == VOCAB
    meta = read_meta(out)
    assert meta["dtype"] == "uint16" and meta["documents"] == len(FILES) and meta["vocab_size"] == VOCAB
    tokens, idx = open_bin(out, "uint16"), read_index(out)
    assert len(idx) == len(FILES) + 1 and idx[0] == 0 and idx[-1] == len(tokens) == meta["tokens"]
    for i, f in enumerate(FILES):
        doc = np.asarray(tokens[idx[i]:idx[i + 1]])
        assert doc[-1] == tok.eos_id and tok.eos_id not in doc[:-1], f  # one document, whole
        assert tok.decode(doc[:-1]) == Path(f).read_text(), f
    assert len(tokens) < 0.6 * sum(len(Path(f).read_bytes()) for f in FILES)  # BPE compresses


def test_workers_do_not_change_the_output(prepared, tmp_path):
    tok, out = prepared
    one = tmp_path / "one.bin"
    prepare(tok, one, FILES, workers=1, progress=False)
    for suffix in ("", ".idx"):
        assert Path(str(one) + suffix).read_bytes() == Path(str(out) + suffix).read_bytes()


def test_training_data_resumes_at_the_same_position(prepared):
    _, out = prepared
    cfg = DataConfig(source="bin", bin_path=str(out), bin_dtype="uint16")
    sharding = jax.sharding.make_single_device_sharding(jax.devices()[0])
    a = DataLoader(build_source(cfg, VOCAB, 7), 4, 16, sharding)
    [next(a) for _ in range(3)]
    b = DataLoader(build_source(cfg, VOCAB, 7), 4, 16, sharding)
    b.load_state_dict(a.state_dict())
    first, again = np.asarray(next(a)), np.asarray(next(b))
    assert np.array_equal(first, again) and first.max() < VOCAB


def test_text_source_with_tokenizer(prepared):
    tok_path, _ = prepared
    src = build_source(DataConfig(source="text", paths=FILES, tokenizer=str(tok_path)), VOCAB, 0)
    rows = src.rows(0, np.arange(4), 32)
    assert rows.shape == (4, 33) and rows.max() < VOCAB
    corpus = "".join(Path(f).read_text() for f in FILES)
    tok = Tokenizer(tok_path)
    for r in rows:
        if tok.eos_id not in r:
            assert tok.decode(r) in corpus


def test_a_special_tokens_text_inside_a_document_is_text(prepared):
    """A document that quotes the end-of-text token's string keeps it as text: encoded as the
    token it would end the document there (a packed row's boundary, the loss's mask); the
    reference is the document itself, which its ids must decode back to."""
    tok = Tokenizer(prepared[0])
    name = tok.tok.id_to_token(tok.eos_id)
    doc = f"x = 1\nprint('{name}')\n"
    (ids,) = tok.encode_batch([doc])
    assert tok.eos_id not in ids.tolist()
    assert tok.decode(ids) == doc
    assert tok.eos_id in tok.encode(doc).tolist()  # a prompt's special tokens are still parsed


def test_vocab_mismatch_is_one_clear_error(prepared):
    tok, out = prepared
    with pytest.raises(ConfigError, match=rf"vocab_size {VOCAB}, above model.vocab_size=256"):
        build_source(DataConfig(source="text", paths=FILES, tokenizer=str(tok)), 256, 0)
    with pytest.raises(ConfigError, match=rf"vocabulary of {VOCAB} .* above model.vocab_size=256"):
        build_source(DataConfig(source="bin", bin_path=str(out)), 256, 0)
    with pytest.raises(ConfigError, match="set data.bin_dtype=uint16"):
        build_source(DataConfig(source="bin", bin_path=str(out), bin_dtype="uint32"), VOCAB, 0)


def test_jsonl_input_and_bad_inputs(prepared, tmp_path, capsys):
    tok, _ = prepared
    docs = ["first document", "zweites Dokument \u00e4\u00f6\u00fc", "third\nwith a newline"]
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    r = prepare(tok, tmp_path / "j.bin", [jl], text_field="body", progress=False)
    t, idx = open_bin(tmp_path / "j.bin"), read_index(tmp_path / "j.bin")
    assert r["documents"] == 3
    assert [Tokenizer(tok).decode(t[idx[i]:idx[i + 1] - 1]) for i in range(3)] == docs
    with pytest.raises(ConfigError, match=r"c.jsonl:1: no string field 'text'"):
        prepare(tok, tmp_path / "k.bin", [jl], progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{nope\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not a JSON line"):
        prepare(tok, tmp_path / "k.bin", [tmp_path / "bad.jsonl"], progress=False)
    assert not list(tmp_path.glob("k.bin*"))  # nothing half-written left behind
    assert cli_main(["data", "prepare", "--tokenizer", str(tmp_path / "none.json"), "--output",
                     str(tmp_path / "x.bin"), str(jl)]) == 2
    assert "--tokenizer=" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a readable tokenizer.json"):
        Tokenizer(tmp_path / "broken.json")


def test_parquet_input(prepared, tmp_path):
    import pyarrow as pa  # in the test extra: the parquet path is tested, never skipped
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["a parquet row", "another"]}), tmp_path / "p.parquet")
    assert prepare(prepared[0], tmp_path / "p.bin", [tmp_path / "p.parquet"], progress=False)["documents"] == 2


def test_train_tokenizer_reports_the_vocab_it_got(tmp_path, capsys):
    """Too little text for the merges asked: the printed vocab is the file's, and says why."""
    (tmp_path / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 20)
    out = tmp_path / "tok.json"
    assert cli_main(["data", "train-tokenizer", "--vocab-size", "100000", "--output", str(out),
                     str(tmp_path / "a.txt")]) == 0
    got = Tokenizer(out).vocab_size
    merges = len(json.loads(out.read_text())["model"]["merges"])
    assert got < 100000 and merges == got - 257
    assert f"vocab {got} (asked 100000: the text gave only {merges} merges)" in capsys.readouterr().out


def test_prepare_refuses_what_it_would_tokenize_as_garbage(prepared, tmp_path, capsys):
    """Each was a traceback, or garbage tokens with exit 0, or leftovers: one error each now."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    tok, _ = prepared
    bad = {"u.jsonl": b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "empty.jsonl": b"",
           "c.txt.gz": gzip.compress(b"some text"), "blob.txt": b"\x00\x01\x02binary"}
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
    pq.write_table(pa.table({"n": [1, 2]}), tmp_path / "n.parquet")
    cases = [("u.jsonl", r"u.jsonl:2: not UTF-8"), ("empty.jsonl", "the inputs hold no documents"),
             ("c.txt.gz", r"a .gz archive"), ("blob.txt", "binary data"),
             ("n.parquet", r"column 'n' holds int64, not text")]
    for name, match in cases:
        field = ["--text-field", "n"] if name.endswith("parquet") else []
        assert cli_main(["data", "prepare", "--tokenizer", str(tok), "--output", str(tmp_path / "o.bin"),
                         *field, str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert re.search(match, err) and "Traceback" not in err, (name, err)
        assert not list(tmp_path.glob("o.bin*")), name  # nothing half-written left behind
    (tmp_path / "outdir").mkdir()
    assert cli_main(["data", "prepare", "--tokenizer", str(tok), "--output", str(tmp_path / "outdir"),
                     FILES[0]]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err
    assert not list(tmp_path.glob("outdir.*"))
    assert cli_main(["data", "prepare", "--tokenizer", str(tok), "--output", str(tmp_path / "w.bin"),
                     "--workers", "0", FILES[0]]) == 2
    assert "--workers 0 must be >= 1" in capsys.readouterr().err


def test_a_short_or_foreign_eval_split_fails_before_training(prepared, tmp_path):
    """A held-out .bin shorter than a row failed at the first eval (mid-run); one prepared with
    another tokenizer of the same size scored other ids, silently."""
    tok, out = prepared
    (tmp_path / "short.txt").write_text("tiny")
    short = tmp_path / "short.bin"
    prepare(tok, short, [tmp_path / "short.txt"], progress=False)
    cfg = DataConfig(source="bin", bin_path=str(out), eval_paths=[str(short)])
    with pytest.raises(ConfigError, match=r"data.eval_paths=.*short.bin.* fewer than train.seq_len\+1=65"):
        DataLoader(build_source(cfg, VOCAB, 0, split="eval"), 8, 64, None)
    other = tmp_path / "other.json"
    assert cli_main(["data", "train-tokenizer", "--vocab-size", str(VOCAB), "--output", str(other),
                     FILES[-1]]) == 0
    foreign = tmp_path / "foreign.bin"
    prepare(other, foreign, FILES[:2], progress=False)
    cfg = DataConfig(source="bin", bin_path=str(out), eval_paths=[str(foreign)])
    with pytest.raises(ConfigError, match=r"data.eval_paths=.*foreign.bin.* prepared with the tokenizer"):
        build_source(cfg, VOCAB, 0, split="eval")
    missing = DataConfig(source="bin", bin_path=str(out), eval_paths=[str(tmp_path / "none.bin")])
    with pytest.raises(ConfigError, match=r"data.eval_paths=.*none.bin' does not exist"):
        build_source(missing, VOCAB, 0, split="eval")


def test_eval_paths_holding_every_file_is_one_clear_error(prepared, tmp_path):
    """data.tokenizer with data.eval_paths covering all of data.paths: a numpy "need at least one
    array to concatenate" from deep in the corpus; now a ConfigError naming data.eval_paths."""
    tok, _ = prepared
    cfg = DataConfig(source="text", tokenizer=str(tok), paths=FILES[:2], eval_paths=FILES[:2])
    with pytest.raises(ConfigError, match=r"^data\.eval_paths=.* holds every file of data\.paths="):
        build_source(cfg, VOCAB, 0)
