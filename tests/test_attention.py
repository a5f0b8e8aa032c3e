"""Attention implementations (issue 14): blockwise against the xla reference (itself checked
against a float64 numpy attention), forward and gradients, causal, segment ids, GQA, ragged
blocks; the tiny llama with each; config errors; compiled memory of blockwise vs xla."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import nn
from jaxpar.attention import blockwise_attention, check, resolve, xla_attention
from jaxpar.attention import blockwise as bw
from jaxpar.bench import load
from jaxpar.config import ConfigError
from jaxpar.train.trainer import Trainer
from models.llama import Llama
from models.moe import MoELlama
from tests.conftest import tiny_config
from tests.grad_util import run_steps

B, S, D = 2, 48, 8
SEGMENTS = np.array([[0] * 20 + [1] * 13 + [2] * 15, [5] * 48], np.int32)  # ids need not start at 0


def inputs(heads: int, kv_heads: int, seq: int = S, dtype=jnp.float32, seed: int = 0):
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (B, seq, heads, D), dtype)
    k = jax.random.normal(kk, (B, seq, kv_heads, D), dtype)
    v = jax.random.normal(kv, (B, seq, kv_heads, D), dtype)
    return q, k, v, jax.random.normal(kd, (B, seq, heads, D), dtype)  # the last: output cotangent


def numpy_attention(q, k, v, segment_ids=None):
    """float64 softmax(q k^T / sqrt(d) + causal & segment mask) v, K/V heads repeated for GQA."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    n = q.shape[1]
    mask = np.tril(np.ones((n, n), bool))[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


@functools.lru_cache(maxsize=None)
def value_and_grads(impl: str, block: int = 0, segments: bool = False):
    """jit(q, k, v, do) -> (out, (dq, dk, dv)) of one implementation (compiled once per shape)."""
    seg = jnp.asarray(SEGMENTS) if segments else None
    fn = xla_attention if impl == "xla" else functools.partial(blockwise_attention, block=block)

    def run(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return out, vjp(do)
    return jax.jit(run)


def assert_close(got, ref, rtol=1e-5):
    """Relative to the reference's largest magnitude (elementwise ratios of values near 0 are noise)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err <= rtol, f"max error {err:.2e} of max |ref| {np.max(np.abs(ref)):.3g} (rtol {rtol})"


@pytest.mark.parametrize("segments", [False, True])
def test_xla_reference_is_causal_segmented_gqa_attention(segments):
    q, k, v, _ = inputs(4, 2)
    seg = SEGMENTS if segments else None
    out = xla_attention(q, k, v, None if seg is None else jnp.asarray(seg))
    assert_close(out, numpy_attention(q, k, v, seg), rtol=1e-6)


# block 16 divides seq 48, 20 does not (ragged: padded, padded keys masked), 64 is above it
@pytest.mark.parametrize("segments", [False, True], ids=["causal", "segments"])
@pytest.mark.parametrize("block", [16, 20, 64])
def test_blockwise_forward_and_grads_equal_xla(block, segments):
    q, k, v, do = inputs(4, 2)  # GQA: 2 query heads per kv head
    ref_out, ref_grads = value_and_grads("xla", segments=segments)(q, k, v, do)
    out, grads = value_and_grads("blockwise", block, segments)(q, k, v, do)
    assert_close(out, ref_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape, name
        assert_close(g, r)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_blockwise_equals_xla_for_mha_and_mqa(heads, kv_heads):
    q, k, v, do = inputs(heads, kv_heads, seed=1)
    (ref_out, ref_grads), (out, grads) = (value_and_grads(i, 16, True)(q, k, v, do) for i in ("xla", "blockwise"))
    for g, r in zip((out, *grads), (ref_out, *ref_grads)):
        assert_close(g, r)


def test_segments_change_the_answer():
    """The segment mask is not a no-op: without it the outputs differ (the test can fail)."""
    q, k, v, do = inputs(4, 2)
    with_seg, _ = value_and_grads("blockwise", 16, True)(q, k, v, do)
    without, _ = value_and_grads("blockwise", 16, False)(q, k, v, do)
    assert np.max(np.abs(np.asarray(with_seg) - np.asarray(without))) > 1e-2


def _scan_lengths(fn, *args) -> list[int]:
    """The trip counts of the loops in fn's jaxpr: scans, and blockwise.loop's while loops (whose
    condition is `counter < n` with n a literal)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    out = []

    def walk(jp):
        for e in jp.eqns:
            if e.primitive.name == "scan":
                out.append(e.params["length"])
            if e.primitive.name == "while":
                (lt,) = [c for c in e.params["cond_jaxpr"].jaxpr.eqns if c.primitive.name == "lt"]
                out.append(int(lt.invars[1].val))
            for p in e.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    if hasattr(sub, "jaxpr"):
                        walk(getattr(sub.jaxpr, "jaxpr", sub.jaxpr))
                    elif hasattr(sub, "eqns"):
                        walk(sub)
    walk(jaxpr.jaxpr)
    return out


def test_causal_tiles_above_the_diagonal_are_never_computed():
    """seq 48 in blocks of 8: 6 x 6 tiles, 21 of them on or below the diagonal; the forward and
    the backward each loop over exactly those (one tile's scores per step)."""
    q, k, v, do = inputs(4, 2)
    pairs = bw.visible_pairs(6, 6, 8, 8, 0, 0, causal=True)
    assert len(pairs) == 21 and all(j <= i for i, j in pairs)
    fwd_bwd = lambda q, k, v: jax.vjp(lambda *a: blockwise_attention(*a, block=8), q, k, v)[1](do)
    assert _scan_lengths(fwd_bwd, q, k, v) == [21, 21]
    assert len(bw.visible_pairs(6, 6, 8, 8, 0, 0, causal=False)) == 36
    # a query chunk after the key chunk (ring attention: an earlier chunk) sees every tile
    assert len(bw.visible_pairs(6, 6, 8, 8, 48, 0, causal=True)) == 36


# packed rows (ids non-decreasing, the same document boundaries in both rows): at block 8 the
# tiles hold documents {0}, {0,1}, {1}, {1}, {2}, {2}, so 10 of the 21 causal tiles share none
PACKED = np.array([[0] * 12 + [1] * 20 + [2] * 16, [3] * 12 + [4] * 20 + [5] * 16], np.int32)


def tiles_sharing_a_segment(seg: np.ndarray, block: int) -> int:
    """numpy: the causal (query tile, key tile) pairs holding some key k <= query q of the same
    segment in some row, the tiles cut from position 0 (the last one short)."""
    n = -(-seg.shape[1] // block)
    pos = np.arange(seg.shape[1])
    count = 0
    for i in range(n):
        for j in range(n):
            q, k = pos[i * block:(i + 1) * block], pos[j * block:(j + 1) * block]
            same = seg[:, q][:, :, None] == seg[:, k][:, None, :]
            count += bool((same & (k[None, :] <= q[:, None])).any())
    return count


@pytest.mark.parametrize("block", [8, 20])
def test_tiles_no_segment_shares_are_skipped_and_the_result_equals_xla(block):
    """The kernel visits only the tiles where a query and a key share a document (its count
    against a numpy one, below the causal count), and its output and gradients still equal xla's."""
    visited, causal = bw.visited_tiles(jnp.asarray(PACKED), S, block=block)
    assert int(visited) == tiles_sharing_a_segment(PACKED, block) < causal, (int(visited), causal)
    q, k, v, do = inputs(4, 2, seed=2)
    seg = jnp.asarray(PACKED)
    run = lambda fn: jax.jit(lambda *a: (lambda o, vjp: (o, *vjp(a[3])))(*jax.vjp(
        lambda q, k, v: fn(q, k, v, seg), *a[:3])))(q, k, v, do)
    got = run(functools.partial(blockwise_attention, block=block))
    for g, r in zip(got, run(xla_attention)):
        assert_close(g, r)


def test_a_skipped_tile_is_never_read():
    """NaN keys and values of the middle document (tiles 2 and 3 at block 8, no other document
    in them): the tiles of the other documents' queries against them are skipped, so those
    queries' outputs and every gradient outside the middle document stay finite and equal xla's
    on clean inputs. Visiting them would spread the NaN (0 * NaN in p @ v and in dq)."""
    seg = jnp.asarray(np.repeat([[0, 1, 2], [3, 4, 5]], 16, axis=1).astype(np.int32))
    q, k, v, do = inputs(4, 2, seed=3)
    bad = (jnp.arange(S) >= 16) & (jnp.arange(S) < 32)
    poison = lambda x: jnp.where(bad[None, :, None, None], jnp.nan, x)

    def run(fn, k, v):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return (out, *vjp(do))
    blockwise = functools.partial(blockwise_attention, block=8)
    got = jax.jit(lambda k, v: run(blockwise, k, v))(poison(k), poison(v))
    ref = jax.jit(lambda k, v: run(xla_attention, k, v))(k, v)
    keep = np.asarray(~bad)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        g = np.asarray(g)[:, keep]
        assert np.isfinite(g).all(), name
        assert_close(g, np.asarray(r)[:, keep])
    assert np.isnan(np.asarray(got[0])[:, ~keep]).all()  # the poison reached its own document


def test_block_step_composes_over_key_chunks_at_global_positions():
    """What ring attention will do: one query chunk, the keys arriving in two chunks with their
    global offsets, block_forward per chunk, then finish == attention of the whole sequence."""
    q, k, v, _ = inputs(4, 2)
    seg = jnp.asarray(SEGMENTS)
    grouped = q.reshape(B, S, 2, 2, D)[:, 24:]  # the second half's queries, [b, q, kv, g, d]
    q_pos = 24 + jnp.arange(24)
    state = bw.init_state(grouped)
    for lo in (0, 24):
        state = bw.block_forward(state, grouped, k[:, lo:lo + 24], v[:, lo:lo + 24], q_pos, lo + jnp.arange(24),
                                 seg[:, 24:], seg[:, lo:lo + 24], causal=True, scale=D ** -0.5)
    out, _ = bw.finish(state, q.dtype)
    assert_close(out.reshape(B, 24, 4, D), numpy_attention(q, k, v, SEGMENTS)[:, 24:])


def test_blockwise_in_bfloat16_is_close_to_xla():
    q, k, v, do = inputs(4, 2, dtype=jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, block=16))
    out = fn(q, k, v)
    assert out.dtype == jnp.bfloat16
    assert_close(out, numpy_attention(q, k, v), rtol=2e-2)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_float16_attention_compiles_and_is_close_to_numpy(impl):
    """jax's XLA attention asks for float16 dots with float32 accumulation by name, which XLA:CPU
    refused when the step lowered (train.compute_dtype=float16 ended in a traceback)."""
    q, k, v, do = inputs(4, 2, dtype=jnp.float16)
    fn = xla_attention if impl == "xla" else functools.partial(blockwise_attention, block=16)
    def run(q, k, v, do):  # jitted: eagerly, jax falls back to its default dots
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, jnp.asarray(SEGMENTS)), q, k, v)
        return out, vjp(do)
    out, (dq, _, _) = jax.jit(run)(q, k, v, do)
    assert out.dtype == dq.dtype == jnp.float16
    assert_close(out, numpy_attention(q, k, v, SEGMENTS), rtol=5e-3)
    _, (dq_ref, _, _) = value_and_grads("xla", segments=True)(*(x.astype(jnp.float32) for x in (q, k, v, do)))
    assert_close(dq, dq_ref, rtol=5e-3)


# --------------------------------------------------------------------------- choosing one

def test_auto_picks_cudnn_on_gpu_in_16_bit_else_blockwise_from_the_threshold():
    pick = lambda platform, dtype, seq, impl="auto", hd=64: resolve(
        impl, platform=platform, dtype=dtype, seq_len=seq, head_dim=hd, threshold=2048)
    assert pick("cpu", jnp.float32, 128) == "xla"
    assert pick("cpu", jnp.bfloat16, 2048) == "blockwise"
    assert pick("tpu", jnp.bfloat16, 8192) == "blockwise"
    assert pick("gpu", jnp.bfloat16, 128) == "cudnn"
    assert pick("gpu", jnp.float32, 128) == "xla" and pick("gpu", jnp.float32, 4096) == "blockwise"
    assert pick("gpu", jnp.bfloat16, 4096, hd=256) == "blockwise"  # beyond what auto trusts cuDNN with
    assert pick("cpu", jnp.float32, 8192, impl="xla") == "xla"


def test_cudnn_on_cpu_and_in_float32_are_clear_errors(devices):
    with pytest.raises(ConfigError, match=r"model.attention='cudnn': cuDNN flash attention needs a GPU, "
                                          r"and this run's devices are cpu; use model.attention=auto"):
        Trainer(tiny_config("model.attention=cudnn"), devices=devices, log=lambda s: None)
    with pytest.raises(ConfigError, match=r"runs in bfloat16 or float16, and attention computes in float32 "
                                          r"\(train.compute_dtype\); use train.compute_dtype=bfloat16"):
        check("cudnn", "gpu", "float32")
    check("cudnn", "gpu", "bfloat16")
    q, k, v, _ = inputs(4, 2)
    with pytest.raises(ConfigError, match="needs a GPU"):
        nn.attention(q, k, v, implementation="cudnn")


def test_bad_attention_settings_name_the_field():
    with pytest.raises(ConfigError, match=r"model.attention = 'flash': .*'auto', 'xla', 'blockwise' or 'cudnn'"):
        tiny_config("model.attention=flash")
    with pytest.raises(ConfigError, match=r"model.attention_block = 0"):
        tiny_config("model.attention_block=0")
    q, k, v, _ = inputs(4, 3)
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 kv heads"):
        blockwise_attention(q, k, v)


def test_the_model_calls_the_context_attention_hook():
    """A strategy (context parallelism) replaces attention through nn.Context.attention."""
    cfg = tiny_config("train.seq_len=8").model
    model = Llama(cfg, nnx.Rngs(0))
    seen = []

    def hook(q, k, v, segment_ids, **options):
        seen.append(options)
        return xla_attention(q, k, v, segment_ids)
    tokens = jnp.zeros((1, 8), jnp.int32)
    with nn.use_context(nn.Context(attention=hook)):
        out = model(tokens)
    assert len(seen) == 1 and seen[0]["implementation"] == "auto"  # one scanned layer body
    np.testing.assert_allclose(out, model(tokens), rtol=1e-6)


# --------------------------------------------------------------------------- the model

def test_tiny_llama_blockwise_loss_and_grads_equal_xla(devices):
    """Two train steps of the tiny llama, data x fsdp (ZeRO-3) x tensor (heads split over
    `tensor`): blockwise (tile 12: seq 32 is ragged over it; inside remat=full, so its forward
    also runs again in the backward) gives xla's losses and gradients."""
    layout = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=3", "train.steps=2"]
    ref = run_steps(tiny_config(*layout, "model.attention=xla"), 2, devices)
    got = run_steps(tiny_config(*layout, "model.attention=blockwise", "model.attention_block=12",
                                "train.remat=full"), 2, devices)
    for step, (r, g) in enumerate(zip(ref, got)):
        np.testing.assert_allclose(g["loss"], r["loss"], rtol=1e-5)
        for x, y in zip(jax.tree.leaves(g["grads"]), jax.tree.leaves(r["grads"])):
            # step 2 follows an AdamW update, which turns rounding into parameter differences of
            # ~lr: 2.5e-5 there on jax 0.10.2's XLA
            assert_close(x, y, rtol=1e-5 if step == 0 else 5e-5)


# --------------------------------------------------------------------------- memory

def test_blockwise_temp_memory_is_a_fraction_of_xla_at_2k():
    """Compile-only: forward + backward at seq 2048. xla holds [b, heads, seq, seq] scores (and
    their probabilities for the backward); blockwise one [256, 256] tile per head."""
    shape = lambda h: jax.ShapeDtypeStruct((1, 2048, h, 16), jnp.float32)

    def temp(fn):
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2)))
        return grad.lower(shape(4), shape(2), shape(2)).compile().memory_analysis().temp_size_in_bytes

    xla = temp(xla_attention)
    blockwise = temp(lambda q, k, v: blockwise_attention(q, k, v, block=256))
    scores = 4 * 2048 * 2048 * 4  # one float32 [heads, seq, seq]
    assert xla >= scores, (xla, scores)  # the reference really materialises the scores
    assert blockwise <= xla / 4, (blockwise, xla)
    assert blockwise < scores / 8, (blockwise, scores)


def test_bench_attention_rows_and_table():
    mod, cfg = load("attention", None, ["model.n_layers=1", "train.compute_dtype=float32",
                                        "model.attention_block=16"])
    res = mod.run(cfg, seqs=(64,), doc=16)
    assert [(r["kind"], r["impl"]) for r in res["rows"]] == [
        ("layer", "xla"), ("layer", "blockwise"), ("packed", "blockwise"), ("step", "xla"),
        ("step", "blockwise")]
    assert all(r["temp_bytes"] > 0 for r in res["rows"]) and res["rows"][0]["time_s"] > 0
    assert res["rows"][2]["tiles"] == [4, 10]  # documents of 16 in tiles of 16: the diagonal only
    assert set(res["ratios"]) == {"layer@64", "step@64"}
    text = mod.format_result({"benchmark": "attention", **res})
    assert "blockwise" in text and "ratio" in text


def test_bench_attention_cudnn_skipped_off_gpu_and_step_rows_timed():
    """--impls with cudnn on a CPU: cudnn skipped with the reason, the others measured; the step
    rows timed (as on a GPU) when asked, one state carried through them."""
    mod, cfg = load("attention", None, ["model.n_layers=1", "train.compute_dtype=float32",
                                        "model.attention_block=16"])
    res = mod.run(cfg, seqs=(32, 64), impls=("cudnn", "blockwise"), doc=16, time_steps=True)
    assert "needs a GPU" in res["skipped"]["cudnn"]
    assert [(r["kind"], r["seq"]) for r in res["rows"]] == [
        ("layer", 32), ("packed", 32), ("layer", 64), ("packed", 64), ("step", 32), ("step", 64)]
    assert not any(r.get("error") for r in res["rows"]) and all(r["impl"] == "blockwise" for r in res["rows"])
    steps = [r for r in res["rows"] if r["kind"] == "step"]
    assert all(r["time_s"] > 0 and r["host_call_s"] > 0 and r["temp_bytes"] > 0 for r in steps)
    text = mod.format_result({"benchmark": "attention", **res})
    assert "skipped cudnn: cuDNN flash attention needs a GPU" in text and "(timed)" in text


def test_bench_attention_options_one_clear_error(capsys):
    from jaxpar.bench.attention import check_options
    from jaxpar.cli import main
    with pytest.raises(ConfigError, match="valid are xla, blockwise, cudnn"):
        check_options([2048], ["flash"])
    with pytest.raises(ConfigError, match="positive integers"):
        check_options([0], ["xla"])
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--seqs", "4096,8k"])
    assert "--seqs: '4096,8k': expected positive integers" in capsys.readouterr().err
    assert main(["bench", "attention", "--impls", "xla,flash"]) == 2
    assert "implementations ['xla', 'flash']" in capsys.readouterr().err
    assert main(["bench", "memory", "--seqs", "64"]) == 2  # an option of another benchmark
    assert "--seqs is not an option of this benchmark" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["tiny", "moe_tiny"])
def test_models_with_segment_ids_blockwise_equals_xla(preset):
    """Both models pass segment ids down to attention: logits of packed sequences agree between
    blockwise and xla, and differ from the unpacked ones."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)), jnp.int32)
    seg = jnp.asarray(np.repeat([[0, 1, 2, 3], [7, 7, 8, 8]], 8, axis=1), jnp.int32)

    def logits(impl, segment_ids):
        cfg = tiny_config(f"model.preset={preset}", "model.n_layers=2", f"model.attention={impl}",
                          "model.attention_block=8").model
        graphdef, state = nnx.split(Llama(cfg, nnx.Rngs(0)) if preset == "tiny" else MoELlama(cfg, nnx.Rngs(0)))
        return jax.jit(lambda st, t, s: nnx.merge(graphdef, st)(t, s))(state, tokens, segment_ids)

    ref = logits("xla", seg)
    assert_close(logits("blockwise", seg), ref)
    assert np.max(np.abs(np.asarray(logits("xla", None)) - np.asarray(ref))) > 1e-3
