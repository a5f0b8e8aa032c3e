"""Held-out evaluation: the split never overlaps training, and the eval loss is the same on one
device and on data=2 x fsdp=2 x tensor=2, and equal to a plain numpy reference."""
import json
import math
import time

import jax
import numpy as np
import pytest

from conftest import tiny_config
from jaxpar.config import ConfigError, DataConfig
from jaxpar.data import build_source, write_bin
from jaxpar.data.split import Spans, bin_split
from jaxpar.train.callbacks import Callback
from jaxpar.train.trainer import Trainer

QUIET = lambda s: None


def make_corpus(root, n=40, size=600, seed=0):
    """n files of distinct random printable text (no two share a 24-byte substring)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    docs = {}
    for i in range(n):
        body = bytes(rng.integers(97, 123, size, dtype=np.uint8)) + f"\n# doc {i}\n".encode()
        path = root / f"doc{i:03d}.txt"
        path.write_bytes(body)
        docs[path] = body
    return docs


def text_cfg(corpus, *extra):
    return tiny_config("data.source=text", f"data.paths=[{corpus}]", "model.init_std=0.2", *extra)


def reference_loss(trainer, params, batches):
    """Mean token NLL over `batches` (each batch's mean, averaged) from a plain forward (no mesh,
    no shard_map) and a numpy log-softmax."""
    params = jax.device_get(params)
    model = trainer.model
    forward = jax.jit(lambda p, t: model.merge(model.state(p))(t))
    losses = []
    for tokens in batches:
        logits = np.asarray(forward(params, tokens[:, :-1]), np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        losses.append(float(-np.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()))
    return float(np.mean(losses))


def test_eval_loss_same_on_one_device_and_2x2x2(tmp_path, devices):
    corpus = tmp_path / "corpus"
    make_corpus(corpus)
    common = ("data.eval_fraction=0.3", "eval.every=1", "eval.batches=2")
    one = Trainer(text_cfg(corpus, *common, "mesh.data=1"), devices=devices[:1], log=QUIET)
    many = Trainer(text_cfg(corpus, *common, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                            "sharding.zero_stage=3"), devices=devices, log=QUIET)
    p1, p8 = one.init_state()["params"], many.init_state()["params"]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p1, p8)
    got1, got8 = one.evaluator(p1), many.evaluator(p8)
    ref = reference_loss(one, p1, [np.asarray(one.evaluator.loader.batch(i)) for i in range(2)])
    assert abs(got1["eval_loss"] - got8["eval_loss"]) < 1e-5, (got1, got8)
    assert abs(got1["eval_loss"] - ref) < 1e-5, (got1, ref)
    assert abs(got8["eval_ppl"] - math.exp(got8["eval_loss"])) < 1e-6 * got8["eval_ppl"]
    assert abs(ref - math.log(256)) > 0.05  # the params are far from uniform: the check can fail
    # the eval batches are held-out batches, not the training ones
    assert not np.array_equal(np.asarray(one.evaluator.loader.batch(0)), np.asarray(one.loader.batch(0)))


@pytest.mark.parametrize("layout", [("mesh.data=2", "mesh.expert=2", "mesh.tensor=2"),
                                    ("mesh.data=4", "mesh.pipeline=2", "train.grad_accum=2",
                                     "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
                                     "model.n_layers=4"),
                                    ("mesh.data=2", "mesh.context=4")],
                         ids=["moe-expert", "pipeline-interleaved", "context-ring"])
def test_eval_loss_other_layouts(tmp_path, devices, layout):
    """Expert parallel (the all_to_all dispatch), a pipeline mesh (its axis left to the compiler;
    interleaved: the layers stored out of the model's order, sharding.Plan.layer_order, which the
    eval step reads them back in) and context parallelism (each device evaluates its part of each sequence: the ring's K/V
    ppermutes are in the compiled eval step)."""
    corpus = tmp_path / "corpus"
    make_corpus(corpus)
    common = ("data.eval_fraction=0.3", "eval.every=1", "eval.batches=1")
    if layout[1] == "mesh.expert=2":
        common += ("model.preset=moe_tiny",)
    model = tuple(o for o in layout if o.startswith("model."))
    one = Trainer(text_cfg(corpus, *common, *model, "mesh.data=1"), devices=devices[:1], log=QUIET)
    many = Trainer(text_cfg(corpus, *common, *layout), devices=devices, log=QUIET)
    assert many.plan.interleaves_layers == ("pipeline.virtual_stages=2" in layout)
    got1 = one.evaluator(one.init_state()["params"])["eval_loss"]
    state = many.init_state()
    got8 = many.evaluator(state["params"])["eval_loss"]
    assert abs(got1 - got8) < 1e-5, (got1, got8)
    if "mesh.context=4" in layout:
        hlo = many.evaluator.eval_step.lower(state["params"], many.evaluator.loader.batch(0)).as_text()
        assert "collective_permute" in hlo or "collective-permute" in hlo


def _stream(cfg: DataConfig, split: str) -> bytes:
    return np.asarray(build_source(cfg, 256, 0, split).tokens).astype(np.uint8).tobytes()


def test_eval_never_sees_a_training_document(tmp_path):
    docs = make_corpus(tmp_path / "corpus", n=60)
    cfg = DataConfig(source="text", paths=[str(tmp_path / "corpus")], eval_fraction=0.25)
    train, held = _stream(cfg, "train"), _stream(cfg, "eval")
    in_eval = {p for p, body in docs.items() if body in held}
    in_train = {p for p, body in docs.items() if body in train}
    assert in_eval and in_train
    assert not in_eval & in_train and in_eval | in_train == set(docs)
    assert 0.1 < len(in_eval) / len(docs) < 0.45
    # a document's side depends on its content only: the same with half the other files gone
    half = tmp_path / "half"
    half.mkdir()
    kept = list(docs)[1::2]
    for p in kept:
        (half / p.name).write_bytes(docs[p])
    held2 = _stream(DataConfig(source="text", paths=[str(half)], eval_fraction=0.25), "eval")
    assert {p for p in kept if docs[p] in held2} == {p for p in in_eval if p in kept}
    # every window of the eval batches comes from held-out documents only
    cfg_full = text_cfg(tmp_path / "corpus", "data.eval_fraction=0.25", "eval.every=1")
    source = build_source(cfg_full.data, 256, 0, "eval")
    rows = source.rows(0, np.arange(16), 32).astype(np.uint8)
    train2 = _stream(cfg_full.data, "train")
    for row in rows:
        piece = row.tobytes()
        assert piece in _stream(cfg_full.data, "eval") and piece not in train2


def test_eval_paths_are_left_out_of_training(tmp_path):
    docs = make_corpus(tmp_path / "corpus", n=10)
    held_files = sorted(docs)[:3]
    cfg = DataConfig(source="text", paths=[str(tmp_path / "corpus")], eval_paths=[str(p) for p in held_files])
    train, held = _stream(cfg, "train"), _stream(cfg, "eval")
    for p, body in docs.items():
        assert (body in held) == (p in held_files) and (body in train) == (p not in held_files)


def test_bin_split_by_document_index(tmp_path):
    rng = np.random.default_rng(1)
    lengths = rng.integers(5, 40, 50)
    docs = [rng.integers(1, 1000, n).astype(np.int64) for n in lengths]
    path = tmp_path / "data.bin"
    write_bin(path, np.concatenate(docs))
    np.concatenate([[0], np.cumsum(lengths)]).astype("<u8").tofile(str(path) + ".idx")
    tokens = np.memmap(path, dtype="<u2", mode="r")
    parts = {s: bin_split(tokens, str(path), 0.3, s) for s in ("train", "eval")}
    got = {s: np.asarray(sp[0:len(sp)]) for s, sp in parts.items()}
    sides = []
    for d in docs:
        sides.append([s for s in got if any(np.array_equal(got[s][i:i + len(d)], d)
                                            for i in range(len(got[s]) - len(d) + 1))])
    assert all(len(s) == 1 for s in sides), sides
    assert {s[0] for s in sides} == {"train", "eval"}
    assert len(got["train"]) + len(got["eval"]) == sum(lengths)
    # Spans slices against a plain concatenation
    sp = parts["train"]
    ref = got["train"]
    for a, b in rng.integers(0, len(ref), (30, 2)):
        a, b = sorted((int(a), int(b)))
        np.testing.assert_array_equal(sp[a:b], ref[a:b])
    with pytest.raises(ConfigError, match="needs its document index"):
        bin_split(tokens, str(tmp_path / "other.bin"), 0.3, "train")


def test_eval_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="eval.every=5 needs a held-out split"):
        tiny_config("eval.every=5")
    with pytest.raises(ConfigError, match="synthetic' reads no files"):
        tiny_config("data.eval_paths=[x.txt]")
    # synthetic data evaluates on rows at steps training never reaches
    cfg = tiny_config("data.eval_fraction=0.1", "eval.every=1").data
    train, held = build_source(cfg, 256, 0), build_source(cfg, 256, 0, "eval")
    assert not np.array_equal(train.rows(0, np.arange(4), 32), held.rows(0, np.arange(4), 32))
    np.testing.assert_array_equal(held.rows(3, np.arange(4), 32), train.rows((1 << 48) + 3, np.arange(4), 32))
    make_corpus(tmp_path / "c", n=3)
    cfg = DataConfig(source="text", paths=[str(tmp_path / "c")], eval_fraction=1e-9)
    with pytest.raises(ConfigError, match=r"eval_fraction=1e-09 leaves the eval split .* empty"):
        build_source(cfg, 256, 0, "eval")


def test_fit_logs_eval_metrics(tmp_path, devices):
    corpus = tmp_path / "corpus"
    make_corpus(corpus)
    cfg = text_cfg(corpus, "data.eval_fraction=0.3", "eval.every=2", "eval.batches=1", "train.steps=3",
                   "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "checkpoint.enabled=false")
    lines, seen = [], []

    class Seen(Callback):  # what Prometheus and the other callbacks receive
        def on_log(self, trainer, record):
            seen.append(record)

    trainer = Trainer(cfg, devices=devices, log=lines.append, callbacks=[Seen()])
    evaluate, took = trainer.evaluator, []

    def slow_eval(params):  # compiles on its first call, and sleeps: seconds that are no step's
        t0 = time.perf_counter()
        out = evaluate(params)
        time.sleep(2.0)
        took.append(time.perf_counter() - t0)
        return out

    trainer.evaluator = slow_eval
    trainer.fit(out_dir=tmp_path / "run")
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in recs if "eval_loss" in r}
    assert sorted(evals) == [2, 3]  # every 2 steps and at the last
    # a step's time leaves its evaluation out (it used to hold it: the last step of every run read
    # as the slowest, and benchmark means over a window ending there were 10-30% high)
    for step, t in zip((2, 3), took):
        assert evals[step]["step_time_s"] < t - 1.0, (evals[step], took)
    for r in evals.values():
        assert abs(r["eval_ppl"] - math.exp(r["eval_loss"])) < 1e-6 * r["eval_ppl"]
    assert any(line.startswith("step 2: eval_loss") for line in lines)
    assert [r["eval_loss"] for r in seen if "eval_loss" in r] == [evals[2]["eval_loss"], evals[3]["eval_loss"]]
    from jaxpar.observe.prometheus import _RECORD_GAUGES
    assert {"eval_loss", "eval_ppl"} <= set(_RECORD_GAUGES)
    pytest.importorskip("matplotlib")
    from jaxpar.observe.plots import plot_runs
    written = plot_runs([tmp_path / "run"])
    assert any(p.endswith("eval_loss.png") for p in written)


def test_a_file_is_held_out_alike_by_the_text_source_and_its_prepared_bin(tmp_path):
    """The .bin's split hashed each document's token bytes, the text source each file's bytes:
    a run moved from text to the prepared .bin was evaluated on files it had trained on. prepare
    now stores each document's key from its text (`.keys`)."""
    from jaxpar.data.prepare import prepare
    from jaxpar.data.split import held_out
    from jaxpar.data.tokenizer import Tokenizer, train_bpe
    docs = make_corpus(tmp_path / "corpus", n=40)
    tok = train_bpe(list(docs), 300, tmp_path / "tok.json")
    files = sorted(docs)
    prepare(tok, tmp_path / "c.bin", files, progress=False)
    tokens = np.memmap(tmp_path / "c.bin", dtype="<u2", mode="r")
    decode = Tokenizer(tok).decode
    for frac in (0.2, 0.5):
        want = {docs[f] for f in files if held_out(docs[f], frac)}  # the text source's rule
        assert 0 < len(want) < len(files)
        spans = bin_split(tokens, str(tmp_path / "c.bin"), frac, "eval")
        ends = spans.starts + np.diff(spans.offsets)
        got = {decode(tokens[a:b - 1]).encode() for a, b in zip(spans.starts, ends)}
        assert got == want
