"""Packed documents (issue 14, deliverable 3): the packer on a known stream (documents whole,
padding, every target once, exact resume, each host its rows), the segment ids / positions /
weights the step derives from the tokens vs a hand-written numpy version, every attention
implementation on packed segments vs float64 numpy (forward and gradients), and a packed train
step's loss and gradients vs a one-device reference that runs each document alone."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import nn
from jaxpar.attention import attention, blockwise_attention, cudnn_attention, xla_attention
from jaxpar.config import ConfigError
from jaxpar.data import DataLoader, build_source, write_bin
from jaxpar.data.packing import PackedSource, eos_boundaries
from jaxpar.train.batch import Batch, document_batch
from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.grad_util import place_batch, to_numpy

pytestmark = pytest.mark.xdist_group("packing")  # its module fixtures are built once, on one worker

EOS, SEQ, VOCAB = 0, 32, 256
QUIET = lambda s: None


def make_docs(n=60, seed=0):
    """Documents of random non-EOS tokens, each ending with EOS; some longer than a row."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([3, 5, 9, 14, 20, 33, 40, 75], size=n)
    return [np.append(rng.integers(1, VOCAB, L - 1), EOS) for L in lengths]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared .bin (tokens, .idx, .json), as `jaxpar data prepare` writes one."""
    docs = make_docs()
    path = tmp_path_factory.mktemp("packed") / "docs.bin"
    write_bin(path, np.concatenate(docs))
    np.cumsum([0] + [len(d) for d in docs]).astype("<u8").tofile(str(path) + ".idx")
    (path.parent / "docs.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": VOCAB,
                                                           "eos_id": EOS}))
    return path, docs


def packed_cfg(path, *extra):
    return tiny_config("data.source=bin", f"data.bin_path={path}", "data.packing=true", "model.init_std=0.2",
                       *extra)


# ---------------------------------------------------------------- the packer


def plan_rows(source: PackedSource, seq_len: int) -> list[np.ndarray]:
    """Every row of the source's plan, in plan order (what the random draws pick from)."""
    plan = source.plan(seq_len)
    return [source.row(plan, r, seq_len) for r in range(plan.rows)]


def test_rows_hold_whole_documents_padding_after_and_every_target_once():
    docs = make_docs()
    stream = np.concatenate(docs)
    source = PackedSource(stream, *eos_boundaries(stream, EOS), EOS, seed=3, name="test")
    rows = plan_rows(source, SEQ)
    assert all(r.shape == (SEQ + 1,) for r in rows)
    pieces = [tuple(x.tolist()) for r in rows for x in np.split(r, np.flatnonzero(r == EOS) + 1) if x.size]
    short = [tuple(d.tolist()) for d in docs if len(d) <= SEQ + 1]
    for d in short:  # a short document sits whole in exactly one row (as often as the corpus has it)
        assert pieces.count(d) == short.count(d), d
    for r in rows:  # padding: only EOS after the last document
        last = np.flatnonzero(r != EOS)
        if last.size and last[-1] + 1 < len(r):
            assert np.all(r[last[-1] + 1:] == EOS)
    # every transition inside a document is a counted target exactly once (long documents split
    # into row-sized pieces that overlap by one token); nothing else counts
    want = sorted((int(d[i]), int(d[i + 1])) for d in docs for i in range(len(d) - 1))
    got = sorted((int(r[i]), int(r[i + 1])) for r in rows for i in range(SEQ) if r[i] != EOS)
    assert got == want
    pad = 1 - sum(len(d) for d in docs) / (len(rows) * (SEQ + 1))
    assert 0 < pad < 0.35, pad


def test_batches_resume_exactly_and_each_host_builds_only_its_rows(corpus, devices):
    path, _ = corpus
    cfg = packed_cfg(path).data
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(8), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    a = DataLoader(build_source(cfg, VOCAB, seed=1), 16, SEQ, sharding)
    b = DataLoader(build_source(cfg, VOCAB, seed=1), 16, SEQ, sharding)
    first = [np.asarray(next(a)) for _ in range(3)]
    b.load_state_dict(a.state_dict())  # resumed at step 3 by a fresh process
    assert np.array_equal(np.asarray(next(a)), np.asarray(next(b)))
    assert np.array_equal(np.asarray(b.batch(1)), first[1])
    src = build_source(cfg, VOCAB, seed=1)
    assert np.array_equal(src.rows(2, np.arange(8, 12), SEQ), first[2][8:12])  # rows alone = in the batch
    assert not np.array_equal(first[0], first[1])
    other = build_source(cfg, VOCAB, seed=2).rows(0, np.arange(16), SEQ)
    assert not np.array_equal(other, first[0])


def test_text_with_a_tokenizer_packs_one_document_per_file(tmp_path):
    from jaxpar.data.tokenizer import Tokenizer, train_bpe
    files = []
    for i, n in enumerate((40, 300, 1200)):
        files.append(tmp_path / f"f{i}.txt")
        files[-1].write_text(f"file {i}: " + " ".join(f"w{j % 17}" for j in range(n // 4)))
    tok = Tokenizer(train_bpe(files, 300, tmp_path / "tok.json"))
    cfg = tiny_config("data.source=text", f"data.paths=[{tmp_path}]", f"data.tokenizer={tmp_path / 'tok.json'}",
                      "data.packing=true", "model.vocab_size=300").data
    src = build_source(cfg, 300, seed=0)
    assert isinstance(src, PackedSource) and src.eos_id == tok.eos_id and len(src.starts) == 3
    texts = sorted(tok.decode(src.tokens[a:b - 1]) for a, b in zip(src.starts, src.ends))
    assert texts == sorted(f.read_text() for f in files)
    rows = src.rows(0, np.arange(4), 64)
    assert rows.shape == (4, 65)
    whole = [f.read_text() for f in files]
    for r in rows:  # every piece of a row is text of one file (no piece spans two)
        for piece in np.split(r, np.flatnonzero(r == tok.eos_id) + 1):
            body = piece[piece != tok.eos_id]
            assert body.size == 0 or any(tok.decode(body) in w for w in whole)


# ---------------------------------------------------------------- documents from the tokens


def numpy_documents(tokens: np.ndarray):
    """Loop by loop: segment id, position in the document, and whether the target counts."""
    b, n = tokens.shape[0], tokens.shape[1] - 1
    seg, pos, w = (np.zeros((b, n), t) for t in (np.int32, np.int32, np.float32))
    for i in range(b):
        s = p = 0
        for t in range(n):
            if t and tokens[i, t - 1] == EOS:
                s, p = s + 1, 0
            seg[i, t], pos[i, t], w[i, t] = s, p, float(tokens[i, t] != EOS)
            p += 1
    return seg, pos, w


def test_segment_ids_positions_and_weights_equal_a_numpy_loop():
    stream = np.concatenate(make_docs(seed=4))
    rows = PackedSource(stream, *eos_boundaries(stream, EOS), EOS, seed=0, name="t").rows(0, np.arange(6), SEQ)
    rows[0, :5] = [7, 8, EOS, EOS, 9]  # an empty document, and a row that starts mid-document
    got = jax.jit(lambda t: document_batch(t, EOS, reset_positions=True))(jnp.asarray(rows))
    seg, pos, w = numpy_documents(rows)
    np.testing.assert_array_equal(np.asarray(got.segment_ids), seg)
    np.testing.assert_array_equal(np.asarray(got.positions), pos)
    np.testing.assert_array_equal(np.asarray(got.weights), w)
    assert seg.max() > 2 and np.any(pos != np.arange(SEQ))  # several documents a row: the check can fail
    assert document_batch(jnp.asarray(rows), EOS).positions is None  # reset_positions off: 0..seq-1


# ---------------------------------------------------------------- attention on packed segments


def numpy_attention_and_grads(q, k, v, do, seg):
    """float64 causal, segment-masked attention (GQA by repeating K/V) and its analytic backward."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scale = q.shape[-1] ** -0.5
    n = q.shape[1]
    mask = np.tril(np.ones((n, n), bool))[None, None] & (seg[:, :, None] == seg[:, None, :])[:, None]
    s = np.where(mask, np.einsum("bqhd,bkhd->bhqk", q, kr) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, vr)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
    ds = p * (dp - np.einsum("bqhd,bqhd->bhq", do, o)[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], g, x.shape[-1]).sum(3)
    dk = fold(np.einsum("bhqk,bqhd->bkhd", ds, q) * scale)
    dv = fold(np.einsum("bhqk,bqhd->bkhd", p, do))
    return o, (dq, dk, dv)


IMPLEMENTATIONS = {
    "xla": xla_attention,
    "blockwise-8": lambda *a, **kw: blockwise_attention(*a, block=8, **kw),
    "blockwise-12": lambda *a, **kw: blockwise_attention(*a, block=12, **kw),  # ragged: 32 = 2*12 + 8
    "cudnn": cudnn_attention,
    # auto: cudnn on a GPU in 16 bits, else blockwise from the threshold on (here), else xla
    "auto": lambda *a, **kw: attention(*a, implementation="auto", block=8, threshold=16, **kw),
}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_every_attention_honours_packed_segments_forward_and_gradients(impl):
    if impl == "cudnn" and jax.default_backend() != "gpu":
        pytest.skip("cuDNN attention needs a GPU (scripts/gpu_check.sh)")
    dtype = jnp.bfloat16 if impl == "cudnn" else jnp.float32
    stream = np.concatenate(make_docs(seed=5))
    rows = PackedSource(stream, *eos_boundaries(stream, EOS), EOS, seed=0, name="t").rows(0, np.arange(2), SEQ)
    seg = document_batch(jnp.asarray(rows), EOS).segment_ids
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, SEQ, 4, 8), dtype)
    k, v = (jax.random.normal(kk, (2, SEQ, 2, 8), dtype) for kk in keys[1:3])
    do = jax.random.normal(keys[3], (2, SEQ, 4, 8), dtype)
    fn = IMPLEMENTATIONS[impl]

    def run(q, k, v, do):  # jitted, as the step runs it: one compile, not one per op
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return out, vjp(do)
    out, grads = jax.jit(run)(q, k, v, do)
    ref_out, ref_grads = numpy_attention_and_grads(q, k, v, do, np.asarray(seg))
    rtol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    for got, ref in zip((out, *grads), (ref_out, *ref_grads)):
        err = np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max()
        assert err < rtol, (impl, err)
    unmasked = numpy_attention_and_grads(q, k, v, do, np.zeros_like(np.asarray(seg)))[0]
    assert np.abs(unmasked - ref_out).max() > 0.1  # the segments matter: the check can fail


# ---------------------------------------------------------------- the packed train step


def documents(rows: np.ndarray) -> list[np.ndarray]:
    """Every document of every row (a document ends at an EOS input), padding dropped."""
    docs = []
    for r in rows:
        cut = np.flatnonzero(r[:-1] == EOS) + 1
        for piece in np.split(r, cut):
            if piece.size >= 2 and not np.all(piece == EOS):
                docs.append(piece)
    return docs


# id(model) -> (the model, kept alive so that its id stays its own; its jitted loss and grad)
_LOSS_AND_GRAD: dict[int, tuple] = {}


def document_loss_and_grad(model):
    """jit((params, tokens, weights) -> (loss, grads)): the mean NLL over the weighted targets of
    `model` run on each row alone, by jax.grad; one compile per shape, shared by the references."""
    if id(model) not in _LOSS_AND_GRAD:
        def loss(p, toks, w):
            logits = model.merge(model.state(p))(toks[:, :-1]).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1)[..., 0]
            return (nll * w).sum() / w.sum()
        _LOSS_AND_GRAD[id(model)] = (model, jax.jit(jax.value_and_grad(loss)))
    return _LOSS_AND_GRAD[id(model)][1]


def per_document_reference(trainer: Trainer, params, rows: np.ndarray, pad_to: int = 0):
    """(loss, grads) on one device, no packing: every document of every row run alone as its own
    sequence (positions from 0, padded after its end), the mean NLL over the targets inside the
    documents, the gradient by jax.grad. Shares nothing with the step but the model. `pad_to`:
    that many sequences at least, the extra ones all padding with no target counted (so that
    references of batches with other document counts share one compile)."""
    docs = documents(rows)
    width = SEQ + 1
    toks = np.full((max(len(docs), pad_to), width), EOS, np.int32)
    w = np.zeros((len(toks), SEQ), np.float32)
    for i, d in enumerate(docs):
        toks[i, :len(d)] = d
        w[i, :len(d) - 1] = 1.0
    cpu = jax.devices()[0]
    p = jax.device_put(jax.device_get(params), cpu)
    value, grads = document_loss_and_grad(trainer.model)(p, jnp.asarray(toks), jnp.asarray(w))
    return float(value), to_numpy(grads)


LAYOUTS = {
    "one-device": ("mesh.data=1",),
    "data2-fsdp4-zero3-accum2": ("mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=3", "train.grad_accum=2"),
    "data4-pipeline2": ("mesh.data=4", "mesh.pipeline=2", "train.grad_accum=2"),
    # per-row positions in a pipeline that stashes its stages' residuals (zb_h1: the whole
    # stage's vjp on the last stage, each layer's halves on the others)
    "data4-pipeline2-reset-zb": ("mesh.data=4", "mesh.pipeline=2", "train.grad_accum=2",
                                 "data.reset_positions=true", "pipeline.schedule=zb_h1"),
    "data2-fsdp2-tensor2-reset-chunked": ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "data.reset_positions=true",
                                          "train.loss_chunk=8", "model.attention=blockwise",
                                          "model.attention_block=8"),
    # context parallelism cuts every document field of the rows alike (parallel/context.split)
    "data2-context2-tensor2-ring-zigzag-reset": ("mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                                 "data.reset_positions=true"),
    "data2-context2-all_to_all": ("mesh.data=2", "mesh.context=2", "context.strategy=all_to_all"),
}


@pytest.fixture(scope="module")
def reference(corpus, devices):
    """The one-device per-document reference for batch 0 of the packed source (shared)."""
    path, _ = corpus
    trainer = Trainer(packed_cfg(path, "mesh.data=1"), devices=devices[:1], log=QUIET)
    rows = np.asarray(trainer.loader.batch(0))
    params = trainer.init_state()["params"]
    return rows, params, per_document_reference(trainer, params, rows), trainer


def test_per_document_reference_ignores_padding_sequences(reference):
    """Padding sequences (no target counted) change neither the reference's loss nor its grads
    (the local SGD test pads its halves' references to the whole batch's document count)."""
    rows, params, (loss, grads), trainer = reference
    more_loss, more_grads = per_document_reference(trainer, params, rows, pad_to=len(documents(rows)) + 5)
    assert abs(more_loss - loss) < 1e-6 * loss
    errs = jax.tree.map(lambda g, r: float(np.abs(g - r).max() / (np.abs(r).max() + 1e-12)), more_grads, grads)
    assert max(jax.tree.leaves(errs)) < 1e-6, errs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_step_loss_and_gradients_equal_the_per_document_reference(layout, corpus, devices, reference):
    path, _ = corpus
    rows, params0, (ref_loss, ref_grads), ref_trainer = reference
    opts = LAYOUTS[layout]
    n = int(np.prod([int(o.split("=")[1]) for o in opts if o.startswith("mesh.")]))
    # one-device: the reference's own trainer (its config), whose step the reference never ran
    trainer = ref_trainer if layout == "one-device" else Trainer(packed_cfg(path, *opts), devices=devices[:n],
                                                                   log=QUIET)
    state = trainer.init_state()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 jax.device_get(state["params"]), jax.device_get(params0))
    _, metrics = trainer.make_step(return_grads=True)(state, place_batch(trainer, rows))
    metrics = to_numpy(metrics)
    assert abs(float(metrics["loss"]) - ref_loss) < 1e-5 * ref_loss, (metrics["loss"], ref_loss)
    errs = jax.tree.map(lambda g, r: float(np.abs(g - r).max() / (np.abs(r).max() + 1e-12)),
                        metrics["grads"], ref_grads)
    assert max(jax.tree.leaves(errs)) < 2e-5, errs


def test_packed_moe_router_counts_only_real_tokens_and_equals_one_device(corpus, devices):
    """The target weights reach the MoE router and dispatch through the step (Rows.apply ->
    token_weights): the step's router losses and dropped fraction are the model's own over the
    packed rows with their weights (not over every token: padding takes no expert capacity), and
    data=2 x expert=4 gives the one-device loss, router losses, dropped fraction and gradients
    (these statistics are per sequence, and a sequence is a whole row everywhere); so does data=2
    x context=2 x expert=2 at capacity factor 0.5, where each device holds two runs of every row
    and which assignments drop is decided in the whole row's order (parallel/expert.py)."""
    path, _ = corpus
    moe = ("model.preset=moe_tiny", "model.n_layers=2")
    one = Trainer(packed_cfg(path, *moe, "mesh.data=1"), devices=devices[:1], log=QUIET)
    rows = np.asarray(one.loader.batch(0))
    state = one.init_state()
    params = jax.device_get(state["params"])
    _, ref = one.make_step(return_grads=True)(state, place_batch(one, rows))
    ref = to_numpy(ref)

    batch = document_batch(jnp.asarray(rows), EOS)
    model = one.model.merge(one.model.state(jax.device_put(params, devices[0])))

    @jax.jit
    def sown(weights):
        with nn.collect_aux() as out:
            model(batch.inputs, batch.segment_ids, token_weights=weights)
        return {k: v for k, (v, _) in out.items()}
    counted, every = sown(batch.weights), sown(jnp.ones_like(batch.weights))
    for key in ("moe/load_balance_loss", "moe/z_loss", "moe/dropped_fraction"):
        assert float(ref[key]) == pytest.approx(float(counted[key]), rel=1e-5), key
        assert abs(float(every[key]) - float(counted[key])) > 1e-5 * float(counted[key]), key

    ep = Trainer(packed_cfg(path, *moe, "mesh.data=2", "mesh.expert=4"), devices=devices, log=QUIET)
    _, got = ep.make_step(return_grads=True)(ep.init_state(), place_batch(ep, rows))
    _assert_same_moe_step(to_numpy(got), ref)

    half = ("model.moe.capacity_factor=0.5",)
    one = Trainer(packed_cfg(path, *moe, *half, "mesh.data=1"), devices=devices[:1], log=QUIET)
    _, ref = one.make_step(return_grads=True)(one.init_state(), place_batch(one, rows))
    ref = to_numpy(ref)
    assert float(ref["moe/dropped_fraction"]) > 0.3
    split = ("mesh.data=2", "mesh.context=2", "mesh.expert=2")
    cp = Trainer(packed_cfg(path, *moe, *half, *split), devices=devices, log=QUIET)
    _, got = cp.make_step(return_grads=True)(cp.init_state(), place_batch(cp, rows))
    _assert_same_moe_step(to_numpy(got), ref)


def _assert_same_moe_step(got: dict, ref: dict) -> None:
    for key in ("loss", "aux_loss", "moe/load_balance_loss", "moe/z_loss", "moe/load/0", "moe/dropped_fraction"):
        assert float(got[key]) == pytest.approx(float(ref[key]), rel=1e-5), key
    errs = jax.tree.map(lambda g, r: float(np.abs(g - r).max() / (np.abs(r).max() + 1e-12)),
                        got["grads"], ref["grads"])
    assert max(jax.tree.leaves(errs)) < 2e-5, errs


def test_packed_dropless_moe_beside_context_equals_one_device(corpus, devices):
    """Packed rows split over context=2 (all_to_all) beside data=2 x expert=2, dropless MoE: each
    device routes its half of every row, the router's weighted per-sequence statistics are summed
    over context before they are divided (nn.sequence_sum), so the loss, router losses, load and
    gradients are the one-device run's (the router losses weighted up so that their gradients
    show beside the LM loss's)."""
    path, _ = corpus
    moe = ("model.preset=moe_tiny", "model.n_layers=2", "model.moe.dispatch=dropless",
           "model.moe.load_balance_coef=1.0", "model.moe.z_loss_coef=0.1")
    one = Trainer(packed_cfg(path, *moe, "mesh.data=1"), devices=devices[:1], log=QUIET)
    rows = np.asarray(one.loader.batch(0))
    _, ref = one.make_step(return_grads=True)(one.init_state(), place_batch(one, rows))
    ref = to_numpy(ref)
    cp = Trainer(packed_cfg(path, *moe, "mesh.data=2", "mesh.context=2", "mesh.expert=2",
                            "context.strategy=all_to_all"), devices=devices, log=QUIET)
    _, got = cp.make_step(return_grads=True)(cp.init_state(), place_batch(cp, rows))
    got = to_numpy(got)
    for key in ("loss", "aux_loss", "moe/load_balance_loss", "moe/z_loss", "moe/load/0"):
        assert float(got[key]) == pytest.approx(float(ref[key]), rel=1e-5), key
    errs = jax.tree.map(lambda g, r: float(np.abs(g - r).max() / (np.abs(r).max() + 1e-12)),
                        got["grads"], ref["grads"])
    assert max(jax.tree.leaves(errs)) < 2e-5, errs


def test_local_sgd_replicas_each_get_the_mean_over_their_own_documents(corpus, devices, reference):
    """Under local SGD each replica's gradient is the mean over the targets of its own rows (its
    count psum'd within the replica only)."""
    path, _ = corpus
    rows, _, _, ref_trainer = reference
    trainer = Trainer(packed_cfg(path, "mesh.data=2", "local_sgd.sync_every=2"), devices=devices[:2], log=QUIET)
    state = trainer.init_state()
    params = jax.device_get(state["params"])  # every replica starts from them (the step donates them)
    _, metrics = trainer.make_step(return_grads=True)(state, place_batch(trainer, rows))
    grads = to_numpy(metrics["grads"])
    for r, part in enumerate(np.split(rows, 2)):  # replica r holds rows of its data index
        # the reference's model (this config's: local SGD changes the step, not the model), padded
        # to the whole batch's document count: the fixture's program, compiled once for all three
        _, ref = per_document_reference(ref_trainer, params, part, pad_to=len(documents(rows)))
        errs = jax.tree.map(lambda g, x: float(np.abs(g[r] - x).max() / (np.abs(x).max() + 1e-12)), grads, ref)
        assert max(jax.tree.leaves(errs)) < 2e-5, (r, errs)


def test_packing_changes_the_loss_the_reference_can_tell(reference, corpus, devices):
    """The same rows unpacked (attention across documents, every target counted) give another
    loss, so the comparison above can fail."""
    path, _ = corpus
    rows, params, (ref_loss, _), trainer = reference
    model = trainer.model

    @jax.jit  # one compile, not one per op
    def unpacked_loss(p, rows):
        logits = model.merge(model.state(p))(rows[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1).mean()
    unpacked = float(unpacked_loss(jax.device_get(params), jnp.asarray(rows)))
    assert abs(unpacked - ref_loss) > 1e-2, (unpacked, ref_loss)


def test_packed_eval_loss_equals_the_per_document_reference(corpus, devices, reference):
    path, _ = corpus
    rows, params0, (ref_loss, _), _ = reference
    trainer = Trainer(packed_cfg(path, "mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=3",
                                 "data.eval_fraction=0.2"), devices=devices, log=QUIET)
    eval_step = trainer.make_evaluator().eval_step
    total, count = eval_step(trainer.init_state()["params"], place_batch(trainer, rows))
    assert abs(float(total) / float(count) - ref_loss) < 1e-5 * ref_loss
    assert float(count) == float((rows[:, :-1] != EOS).sum())


def test_the_evaluator_weighs_batches_by_their_counted_targets():
    from jaxpar.train.evaluate import Evaluator

    class Loader:
        def batch(self, i):
            return i
    sums = {0: (10.0, 5.0), 1: (3.0, 1.0)}  # batch means 2 and 3: per target 13 / 6, not 2.5
    out = Evaluator(lambda params, b: sums[b], Loader(), 2)(None)
    assert abs(out["eval_loss"] - 13 / 6) < 1e-12


# ---------------------------------------------------------------- bad input


def test_packing_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="data.packing=true needs documents; data.source 'synthetic'"):
        tiny_config("data.packing=true")
    with pytest.raises(ConfigError, match="byte-level text .* has none: set data.tokenizer"):
        tiny_config("data.source=text", "data.packing=true")
    with pytest.raises(ConfigError, match="data.reset_positions=true .* needs data.packing=true"):
        tiny_config("data.reset_positions=true")
    path = tmp_path / "bare.bin"
    write_bin(path, np.arange(1, 100) % 7)
    with pytest.raises(ConfigError, match=r"data.packing with data.bin_path=.* needs the end-of-text id in"):
        build_source(packed_cfg(path).data, VOCAB, 0)
    (tmp_path / "bare.bin.json").write_text(json.dumps({"eos_id": 0}))
    with pytest.raises(ConfigError, match=r"data.packing with data.bin_path=.* needs its document index"):
        build_source(packed_cfg(path).data, VOCAB, 0)


def test_rows_apply_passes_only_what_they_have():
    seen = {}
    Batch(jnp.zeros((1, 5), jnp.int32)).rows().apply(lambda x, **kw: seen.update(kw))
    assert seen == {}
    seg = jnp.ones((1, 4), jnp.int32)
    Batch(jnp.zeros((1, 5), jnp.int32), segment_ids=seg).rows().apply(lambda x, **kw: seen.update(kw))
    assert list(seen) == ["segment_ids"]
    document_batch(jnp.zeros((1, 5), jnp.int32), EOS).rows().apply(lambda x, **kw: seen.update(kw))
    assert list(seen) == ["segment_ids", "token_weights"]  # the target weights, as the model's
    # a model that does not name token_weights (a user's) still runs packed rows
    got = document_batch(jnp.zeros((1, 5), jnp.int32), EOS).rows().apply(lambda x, segment_ids=None: segment_ids)
    assert got is not None and got.shape == (1, 4)


# ---------------------------------------------------------------- a sequence too long for the devices


def test_a_too_long_sequence_is_one_clear_error_before_compiling(tmp_path):
    """The quickstart at 262144 tokens with the xla attention (1 TiB of scores per device): exit 2
    and one message naming train.seq_len, the per-device figure and the fixes; no traceback, no
    signal (a subprocess, in case it would crash)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", str(root / "configs/quickstart.yaml"),
           "train.seq_len=262144", "train.global_batch=8", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1",
           "model.attention=xla", "data.source=synthetic", "data.eval_fraction=0", "eval.every=0",
           f"run_dir={tmp_path}", "checkpoint.enabled=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert ("train.seq_len=262144 does not fit: the xla attention's float32 scores [1, 4, 262144, 262144] "
            "take 1024.0 GiB per device") in out.stderr, out.stderr[-2000:]
    assert "model.attention=blockwise" in out.stderr and "mesh.context" in out.stderr


def test_blockwise_in_a_layer_scan_keeps_no_mask_per_tile():
    """What made the quickstart need 144 GiB per device at 256K tokens with the blockwise
    attention: inside the layer scan JAX hoisted each tile's mask (it depends on constants and
    on the layer-invariant segment ids) as a residual stacked over all tiles, a seq^2 buffer.
    Compiled temporaries of a 2-layer scan stay within 4x those of one call outside a scan
    (before the fix: 23x)."""
    seq = 8192
    x = jax.ShapeDtypeStruct((1, seq, 4, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((2, 16, 16), jnp.float32)
    seg = jnp.zeros((1, seq), jnp.int32)

    def layer(h, wl):
        y = jnp.einsum("bshd,de->bshe", h, wl)
        return blockwise_attention(y, y[:, :, :2], y[:, :, :2], seg, block=256), None

    def temp(f):
        return jax.jit(jax.grad(f, argnums=1)).lower(x, w).compile().memory_analysis().temp_size_in_bytes

    one = temp(lambda h, w: layer(h, w[0])[0].sum())
    scanned = temp(lambda h, w: jax.lax.scan(layer, h, w)[0].sum())
    assert scanned < 4 * one, (scanned, one)


def test_a_sequence_far_beyond_memory_stops_before_the_step_is_traced(monkeypatch, tmp_path):
    """train.seq_len=100000000 on the quickstart with the blockwise attention ended in a host
    MemoryError while tracing (its tile table: 195313^2 blocks). The layers' inputs, which every
    remat policy keeps, are a bound from the shapes alone: one message, nothing traced."""
    from jaxpar.train import preflight, trainer as trainer_mod
    monkeypatch.setattr(preflight, "device_memory_bytes", lambda device: (1 << 30, "a 1 GiB test device"))
    monkeypatch.setattr(trainer_mod.Trainer, "compile", lambda self: pytest.fail("step traced"))
    cfg = tiny_config("mesh.data=8", "train.global_batch=8", "train.seq_len=100000000", f"run_dir={tmp_path}",
                      "checkpoint.enabled=false", "model.attention=blockwise", "eval.every=0")
    dim = cfg.model.dim
    with pytest.raises(ConfigError, match=(
            rf"train.seq_len=100000000 does not fit: the inputs of the 2 layer\(s\) a device runs, kept for the "
            rf"backward whatever train.remat is \(\[1, 100000000, {dim}\] each, float32\), take "
            rf"{2 * 10**8 * dim * 4 / 2**30:.1f} GiB per device, above the 1.0 GiB a device has \(a 1 GiB test "
            rf"device\); use a shorter train.seq_len, or the sequence split over more devices \(context "
            rf"parallelism: mesh.context, now 1\)")):
        trainer_mod.run(cfg, log=QUIET)


def test_a_compiled_step_above_the_device_memory_stops_before_the_state_exists(monkeypatch, tmp_path):
    from jaxpar.train import preflight, trainer as trainer_mod
    monkeypatch.setattr(preflight, "device_memory_bytes", lambda device: (1 << 20, "a 1 MiB test device"))
    monkeypatch.setattr(trainer_mod.Trainer, "init_state", lambda self: pytest.fail("state allocated"))
    cfg = tiny_config("mesh.data=8", f"run_dir={tmp_path}", "checkpoint.enabled=false", "model.attention=blockwise")
    with pytest.raises(ConfigError, match=r"train.seq_len=32 x 2 sequence\(s\) per device does not fit: the "
                                          r"compiled step needs .* GiB per device .* above the 0.0 GiB a device "
                                          r"has \(a 1 MiB test device\); use fewer sequences per device at once"):
        trainer_mod.run(cfg, log=QUIET)
