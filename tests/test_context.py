"""Context parallelism (issue 14, deliverable 2): ring and all_to_all attention over `context`.

Against the `xla` attention on one device (tests/test_attention.py checks it against float64
numpy): forward and gradients of each strategy, causal, with and without segment ids, GQA,
context 2 / 4 / 8, zigzag and contiguous; the whole train step (gradients and losses) on
data x context x tensor, fsdp ZeRO-3 and context=8 against the one-device step; the ring's
collective-permute bytes in the compiled HLO against the analytic volume; compiled temp memory
falling with the context size; one clear error per bad config."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.attention import xla_attention
from jaxpar.config import ConfigError
from jaxpar.metrics.hlo import collective_bytes
from jaxpar.parallel.context import (ContextParallel, gathered_order, global_to_zigzag, ring_bytes,
                                     zigzag_to_global)
from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.grad_util import run_steps

pytestmark = pytest.mark.xdist_group("context")  # its module fixtures are built once, on one worker

B, S, D = 2, 64, 8
SEGMENTS = np.array([[0] * 23 + [1] * 18 + [2] * 23, [7] * 64], np.int32)


def inputs(heads, kv_heads):
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(0), 4)
    return (jax.random.normal(kq, (B, S, heads, D)), jax.random.normal(kk, (B, S, kv_heads, D)),
            jax.random.normal(kv, (B, S, kv_heads, D)), jax.random.normal(kd, (B, S, heads, D)))


def assert_close(got, ref, rtol=1e-5, what=""):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err <= rtol, f"{what}: max error {err:.2e} of max |ref| {np.max(np.abs(ref)):.3g}"


@jax.jit
def xla_reference(q, k, v, do, seg):
    """(out, dq, dk, dv) of the xla attention on one device; jitted: one compile per shape, not
    one per op."""
    out, vjp = jax.vjp(lambda q, k, v: xla_attention(q, k, v, seg), q, k, v)
    return (out, *vjp(do))


@functools.lru_cache(maxsize=None)
def reference(heads, kv_heads, segments):
    return xla_reference(*inputs(heads, kv_heads), jnp.asarray(SEGMENTS) if segments else None)


def sharded(cp: ContextParallel, devices, heads, kv_heads, segments, block=4, xs=None,
            implementation="blockwise", jaxpr=None):
    """(out, dq, dk, dv) of the strategy's hook in a shard_map over `context`, in global order;
    `segments` a bool (SEGMENTS or none) or an array of ids; `xs` (q, k, v, do) or `inputs`;
    `jaxpr` a list that receives the step's jaxpr."""
    return sharded_many(cp, devices, heads, kv_heads, [segments], block, xs, implementation, jaxpr)[0]


def sharded_many(cp: ContextParallel, devices, heads, kv_heads, segment_sets, block=4, xs=None,
                 implementation="blockwise", jaxpr=None):
    """`sharded` for each of `segment_sets` (bools or arrays of ids), all in one jitted program:
    one trace and one compile for the variants, each its own shard_map of the hook."""
    mesh = Mesh(np.array(devices[:cp.size]), ("context",))
    q, k, v, do = xs or inputs(heads, kv_heads)
    order = gathered_order(cp.layout, cp.size, q.shape[1])  # the devices' tokens, concatenated
    hook = cp.attention()

    def local(q, k, v, do, seg):
        fn = lambda q, k, v: hook(q, k, v, seg, implementation=implementation, block=block, threshold=0)
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do))

    spec = P(None, "context")
    one = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 4)
    run = jax.jit(lambda q, k, v, do, segs: [one(q, k, v, do, seg) for seg in segs])
    segs = []
    for segments in segment_sets:
        ids = SEGMENTS if segments is True else (segments if segments is not False else None)
        segs.append(None if ids is None else jnp.asarray(np.asarray(ids)[:, order]))
    args = (*(x[:, order] for x in (q, k, v, do)), segs)
    traced = run.trace(*args)  # one trace for the jaxpr and the compile
    if jaxpr is not None:
        jaxpr.append(traced.jaxpr)
    outs = traced.lower().compile()(*args)
    inv = np.argsort(order)
    return [[x[:, inv] for x in o] for o in outs]


@functools.lru_cache(maxsize=None)
def causal_and_segments(strategy, size, layout, heads, kv_heads):
    """The hook's (out, dq, dk, dv) causal (no segment ids) and with SEGMENTS, by segments."""
    devices = tuple(jax.devices())
    got = sharded_many(ContextParallel(size, strategy, layout), devices, heads, kv_heads, [False, True])
    return dict(zip((False, True), got))


@pytest.mark.parametrize("segments", [False, True], ids=["causal", "segments"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("strategy", ["ring", "all_to_all", "all_gather"])
def test_attention_forward_and_grads_equal_xla(strategy, size, layout, segments, devices):
    # GQA (2 query heads per kv head); all_to_all needs kv heads divisible by the context size
    heads, kv_heads = (16, 8) if strategy == "all_to_all" and size == 8 else (8, 4)
    # causal and segments are one compile (their own shard_maps in one jit), shared by the two tests
    got = causal_and_segments(strategy, size, layout, heads, kv_heads)[segments]
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, reference(heads, kv_heads, segments)):
        assert_close(g, r, what=f"{strategy} C={size} {layout} {name}")


def score_tiles(jaxpr) -> set[tuple[int, int]]:
    """The (key, query) tile extents of the score products in a jaxpr: the dots of a key block
    [b, tile, kv_heads, d] and a query block [b, tile, kv_heads, group, d] over head_dim alone."""
    found = set()

    def walk(jx):
        for eq in jx.eqns:
            if eq.primitive.name == "dot_general":
                (lc, rc), _ = eq.params["dimension_numbers"]
                a, b = (v.aval.shape for v in eq.invars)
                if a[-1] == b[-1] == D and tuple(lc) == (len(a) - 1,) and tuple(rc) == (len(b) - 1,):
                    found.add((a[1], b[1]))
            for p in eq.params.values():
                for x in (p if isinstance(p, (list, tuple)) else [p]):
                    inner = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)  # Jaxpr or Closed
                    if inner is not None:
                        walk(inner if hasattr(inner, "eqns") else inner.jaxpr)
    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("implementation, tile", [("xla", 8), ("blockwise", 4), ("auto", 4)])
def test_ring_tiles_follow_model_attention(implementation, tile, devices):
    """model.attention sets the ring's score tiles: xla a whole run (zigzag, C=4, S=64: runs of
    8), blockwise model.attention_block (4), auto (threshold 0: blockwise); each equal to xla."""
    seen = []
    got = sharded(ContextParallel(4, "ring", "zigzag"), devices, 8, 4, True, implementation=implementation,
                  jaxpr=seen)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, reference(8, 4, True)):
        assert_close(g, r, what=f"{implementation} {name}")
    assert score_tiles(seen[0]) == {(tile, tile)}, score_tiles(seen[0])


def test_zigzag_reorder_is_the_gathered_order():
    x = jnp.asarray(gathered_order("zigzag", 4, 32))[None]
    np.testing.assert_array_equal(zigzag_to_global(x, 4)[0], np.arange(32))
    np.testing.assert_array_equal(global_to_zigzag(jnp.arange(32)[None], 4), x)


def test_ring_tile_larger_than_a_run(devices):
    """A tile that does not divide the device's run of tokens falls back to one that does."""
    got = sharded(ContextParallel(4, "ring", "zigzag"), devices, 8, 4, True, block=5)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, reference(8, 4, True)):
        assert_close(g, r, what=name)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("layout, seq, block, tile", [("zigzag", 56, 3, 3), ("contiguous", 56, 4, 4)])
def test_ring_tile_when_no_divisor_of_the_run_is_near_the_block(strategy, layout, seq, block, tile, devices):
    """Runs of 7 (zigzag) or 14 (contiguous) tokens at context 4: the tile was the largest
    divisor of the run up to model.attention_block, 1 for 7 and 2 for 14 (a prime run of 1031
    at block 512: 1031^2 tiles of one token per chunk and layer). Now as few tiles <= block as
    cover the run, the run padded; outputs and gradients equal xla's on one device."""
    seen = []
    q, k, v, do = (jax.random.normal(key, (B, seq, h, D)) for key, h in
                   zip(jax.random.split(jax.random.PRNGKey(1), 4), (8, 4, 4, 8)))
    seg = np.array([[0] * 20 + [1] * 17 + [2] * 19, [5] * seq], np.int32)
    got = sharded(ContextParallel(4, strategy, layout), devices, 8, 4, seg, block=block, xs=(q, k, v, do),
                  jaxpr=seen)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, xla_reference(q, k, v, do, jnp.asarray(seg))):
        assert_close(g, r, what=f"{strategy} {layout} {name}")
    assert score_tiles(seen[0]) == {(tile, tile)}, score_tiles(seen[0])


def test_ring_never_reads_a_tile_no_segment_shares(devices):
    """Documents of 8 tokens, tiles of 4 (each inside one document), context 4 zigzag; NaN keys
    and values of document 3: every tile of another document's queries against them is skipped,
    so outside document 3 outputs and gradients stay finite and equal xla's on clean inputs (a
    visited tile spreads the NaN: 0 * NaN in p @ v and in dq)."""
    seg = np.repeat(np.arange(16).reshape(2, 8), 8, axis=1).astype(np.int32)
    q, k, v, do = inputs(8, 4)
    bad = (np.arange(S) >= 24) & (np.arange(S) < 32)
    poison = lambda x: jnp.where(jnp.asarray(bad)[None, :, None, None], jnp.nan, x)
    got = sharded(ContextParallel(4, "ring", "zigzag"), devices, 8, 4, seg, xs=(q, poison(k), poison(v), do))
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, xla_reference(q, k, v, do, jnp.asarray(seg))):
        g = np.asarray(g)[:, ~bad]
        assert np.isfinite(g).all(), name
        assert_close(g, np.asarray(r)[:, ~bad], what=name)


# ------------------------------------------------------------------ the train step

# 8 heads over 4 kv heads (GQA; all_to_all over context x tensor = 4 divides both)
MODEL = ["model.n_heads=8", "model.n_kv_heads=4", "train.global_batch=4", "model.attention=xla"]
STEPS = 3


@pytest.fixture(scope="module")
def one_device(devices):
    return run_steps(tiny_config(*MODEL, "mesh.data=1"), STEPS, devices[:1])


LAYOUTS = {
    "data2-context2-tensor2-ring": ["mesh.data=2", "mesh.context=2", "mesh.tensor=2"],
    "data2-context2-tensor2-a2a": ["mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                   "context.strategy=all_to_all"],
    "fsdp2-context4-zero3-ring-contiguous": ["mesh.data=1", "mesh.fsdp=2", "mesh.context=4",
                                             "sharding.zero_stage=3", "context.layout=contiguous"],
    "data2-context4-remat-full-loss-chunk": ["mesh.data=2", "mesh.context=4", "train.remat=full",
                                            "train.loss_chunk=4"],
    "fsdp2-context4-zero3-a2a": ["mesh.data=1", "mesh.fsdp=2", "mesh.context=4", "sharding.zero_stage=3",
                                 "context.strategy=all_to_all", "model.attention=blockwise",
                                 "model.attention_block=8"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_gradients_equal_one_device(layout, one_device, devices):
    got = run_steps(tiny_config(*MODEL, *LAYOUTS[layout]), 1, devices)[0]
    ref = one_device[0]
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    for path, g in jax.tree_util.tree_flatten_with_path(got["grads"])[0]:
        r = ref["grads"]
        for k in path:
            r = r[k.key]
        assert_close(g, r, what=f"{layout} {jax.tree_util.keystr(path)}")


def test_context8_losses_equal_one_device(one_device, devices):
    got = run_steps(tiny_config(*MODEL, "mesh.data=1", "mesh.context=8"), STEPS, devices)
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in one_device], rtol=1e-5)
    assert got[-1]["loss"] < got[0]["loss"]


# ------------------------------------------------------------------ the loader's share


class Spy:
    """A stream source (random access) that records which columns it was asked for."""

    def __init__(self, source):
        self.source, self.asked = source, []

    def rows(self, *a):
        raise AssertionError("a context run reads whole rows")

    def columns(self, step, rows, seq_len, cols):
        self.asked.append((tuple(rows.tolist()), tuple(cols.tolist())))
        return self.source.columns(step, rows, seq_len, cols)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_loader_gives_each_context_device_only_its_tokens(layout, devices):
    """data=2 x context=4: each device's shard of the batch is its own rows and, of each, its runs
    of tokens (with the target after each run); a random-access source is asked for nothing
    else; the step's whole_rows rebuilds the source's rows exactly."""
    from jaxpar.data.loader import StreamSource
    tr = Trainer(tiny_config(*MODEL, "mesh.data=2", "mesh.context=4", f"context.layout={layout}"),
                 devices=devices, log=lambda s: None)
    seq, batch, n = tr.cfg.train.seq_len, tr.cfg.train.global_batch, tr.mesh.shape["context"]
    stream = StreamSource(np.random.default_rng(0).integers(0, 256, 5000).astype(np.int32), 3, "test")
    spy = Spy(stream)
    tr.loader.source = spy
    got = tr.loader.batch(5)
    want = stream.rows(5, np.arange(batch), seq)
    runs = 2 if layout == "zigzag" else 1
    run = seq // (runs * n)
    coords = {d: c for c, d in np.ndenumerate(tr.mesh.devices)}
    names = tr.mesh.axis_names
    for shard in got.addressable_shards:
        at = dict(zip(names, coords[shard.device]))
        rows = np.arange(batch).reshape(2, -1)[at["data"]]
        starts = [at["context"] * run, (2 * n - 1 - at["context"]) * run][:runs]
        cols = np.concatenate([np.arange(a, a + run + 1) for a in starts])
        assert shard.data.shape == (len(rows), runs * (run + 1))
        np.testing.assert_array_equal(np.asarray(shard.data), want[rows][:, cols])
    # asked once per distinct (rows, columns) shard: 2 row blocks x 4 context devices
    assert len(spy.asked) == 8 and len(set(spy.asked)) == 8
    assert all(len(cols) == runs * (run + 1) for _, cols in spy.asked)
    rebuilt = jax.jit(tr.spec.batch_layout.whole_rows)(got)
    np.testing.assert_array_equal(np.asarray(rebuilt), want)
    np.testing.assert_array_equal(np.asarray(tr.put_batch(want)), np.asarray(got))


# ------------------------------------------------------------------ compiled structure

LONG = ["model.preset=tiny", "train.global_batch=1", "model.attention=blockwise", "model.attention_block=256"]


def compiled(overrides, devices):
    return Trainer(tiny_config(*LONG, *overrides), devices=devices, log=lambda s: None).compile()


@pytest.fixture(scope="module")
def ring8(devices):
    return compiled(["train.seq_len=8192", "mesh.data=1", "mesh.context=8"], devices)


def test_temp_memory_falls_with_context(ring8, devices):
    one = compiled(["train.seq_len=8192", "mesh.data=1"], devices[:1]).memory_analysis().temp_size_in_bytes
    eight = ring8.memory_analysis().temp_size_in_bytes
    assert eight <= 1.5 / 8 * one, (one, eight)


def test_ring_bytes_match_analytic(ring8):
    cfg = tiny_config(*LONG, "train.seq_len=8192", "mesh.data=1", "mesh.context=8")
    want = sum(ring_bytes(cfg, 8192, 1, 4).values())
    got = collective_bytes(ring8.as_text(), count_loops=True).get("collective-permute", 0)
    assert want <= got <= 1.05 * want, (got, want)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("overrides, words", [
    (["mesh.context=8", "train.seq_len=40"], ["train.seq_len=40", "16", "2 x mesh.context=8", "zigzag"]),
    (["mesh.context=8", "train.seq_len=36", "context.layout=contiguous"], ["train.seq_len=36", "by 8"]),
    (["mesh.context=4", "mesh.data=2", "context.strategy=all_to_all", "model.n_kv_heads=2"],
     ["model.n_kv_heads=2", "mesh.context=4", "context.strategy=ring"]),
    (["mesh.context=2", "mesh.tensor=2", "mesh.data=2", "context.strategy=all_to_all", "model.n_heads=4",
      "model.n_kv_heads=2"], ["model.n_kv_heads=2", "mesh.tensor=2", "by 4"]),
    (["mesh.context=4", "mesh.pipeline=2"], ["context.strategy=ring", "mesh.pipeline=2",
                                             "context.strategy=all_gather", "all_to_all"]),
])
def test_bad_layouts_raise_one_clear_error(overrides, words, devices):
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config("mesh.data=1", "train.global_batch=8", *overrides), devices=devices,
                log=lambda s: None)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_capacity_moe_splits_each_experts_slots_over_context(devices):
    """Beside context, capacity MoE's slots are the whole sequence's, split C ways over the
    devices (parallel/expert._capacity_moe) rather than every device running every expert on
    the whole sequence's capacity: the step at data 2 x context 4 costs no more FLOPs per device
    than data 8 does for the same tokens per device (2.43e8 against 1.48e8 with the slots
    unsplit, 9.85e7 split: 2026-12-07). Its gradients equal one device's in
    tests/test_layout_grads.py and tests/test_packing.py."""
    def flops(*overrides):
        cfg = tiny_config("model.preset=moe_tiny", "model.n_layers=2", "train.seq_len=256", *overrides)
        cost = Trainer(cfg, devices=devices, log=lambda s: None).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert flops("mesh.data=2", "mesh.context=4") <= flops("mesh.data=8")


def test_ring_refuses_cudnn():
    """On a GPU too (the layout check, before the device check that catches cudnn on CPU first)."""
    from jaxpar.parallel.context import check_layout
    cfg = tiny_config("mesh.data=1", "train.global_batch=8")
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"attention": "cudnn"})})
    with pytest.raises(ConfigError) as err:
        check_layout(cfg, {"context": 2, "data": 4})
    for w in ("model.attention=cudnn", "context.strategy=ring", "blockwise", "context.strategy=all_to_all"):
        assert w in str(err.value), (w, str(err.value))
    check_layout(cfg.model_copy(update={"context": cfg.context.model_copy(update={"strategy": "all_to_all"})}),
                 {"context": 2, "data": 4})


def test_context_config_is_validated():
    with pytest.raises(ConfigError, match="context.strategy"):
        tiny_config("context.strategy=ulysses")
    with pytest.raises(ConfigError, match="mesh.context"):
        tiny_config("mesh.context=0")


def test_bench_context_checks_every_length_before_compiling(monkeypatch):
    """--seqs 100: the blockwise row compiled and ran before ring's zigzag refused the length;
    every (strategy, length) is checked first, with the trainer's own error."""
    from jaxpar.bench import context as bench
    from jaxpar.bench import load
    _, cfg = load("context", None, ["model.n_layers=1"])
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("compiled before the check"))
    with pytest.raises(ConfigError, match=r"train.seq_len=100 must be divisible by 16"):
        bench.run(cfg, seqs=(100,), strategies=("blockwise", "ring"))


def test_bench_context_rows_and_table(devices):
    """`jaxpar bench context` at a tiny size: the ring's permute bytes are its analytic volume,
    the split sequence needs less temp memory per device, and the table prints."""
    from jaxpar.bench import context as bench
    from jaxpar.bench import load
    _, cfg = load("context", None, ["model.n_layers=1", "model.attention_block=64"])
    res = bench.run(cfg, seqs=(512,), strategies=("blockwise", "ring", "all_gather"), budget=2**40, max_seq=512)
    by = {r["strategy"]: r for r in res["rows"]}
    ring = by["ring"]
    assert 1.0 <= ring["collective_bytes"]["collective-permute"] / ring["analytic_ring_bytes"] <= 1.05
    assert ring["temp_bytes"] < by["blockwise"]["temp_bytes"] / 2
    # all_gather: the whole sequence's K and V (8 kv heads x 16, float32) gathered forward and
    # their gradients sent home backward, one layer; its temp between the ring's and one device's
    gathered = by["all_gather"]
    assert gathered["collective_bytes"]["all-to-all"] == 2 * 2 * 512 * 8 * 16 * 4
    assert ring["temp_bytes"] < gathered["temp_bytes"] < by["blockwise"]["temp_bytes"] / 2
    assert res["longest_fitting"] == {"blockwise": 512, "ring": 512, "all_gather": 512}
    assert "all_gather" in bench.format_result({"benchmark": "context", **res})


def test_attention_memory_check_counts_each_devices_share_of_the_scores(monkeypatch, devices):
    """The pre-flight check of the xla attention's scores took the whole sequence's [rows, heads,
    seq, seq] under context parallelism too, so it refused a ring run whose [run, run] tiles
    (zigzag: seq / 16 at context 8) fit with room to spare, advising the mesh.context it already
    had. Against the compiler's own figure: the compiled step fits in the budget it was refused."""
    from jaxpar.train import preflight
    seq = 4096
    tr = Trainer(tiny_config("mesh.data=1", "mesh.context=8", "train.global_batch=1", f"train.seq_len={seq}",
                             "model.attention=xla", "model.n_layers=1"), devices=devices, log=lambda s: None)
    mem = tr.compile().memory_analysis()
    need = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    heads = tr.cfg.model.n_heads
    assert heads * seq * seq * 4 > 2 * need  # the whole sequence's scores would not fit
    monkeypatch.setattr(preflight, "device_memory_bytes", lambda d: (2 * need, "a test device"))
    preflight.check_attention_fits(tr.cfg, tr.plan)
    tile = seq // 16
    monkeypatch.setattr(preflight, "device_memory_bytes", lambda d: (heads * tile * tile * 4 - 1, "a test device"))
    with pytest.raises(ConfigError, match=rf"ring attention's float32 score tiles \[1, {heads}, {tile}, {tile}\]"):
        preflight.check_attention_fits(tr.cfg, tr.plan)
