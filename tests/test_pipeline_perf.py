"""Pipeline performance, read off the compiled step: without recompute a backward no longer runs
its stage's forward again (XLA's cost_analysis FLOPs); zb_h1's backward splits into an input half
without the weight gradients and a weight half with only them; the gradients of both still equal
the one-device step's."""
import functools

import numpy as np
import pytest

from jaxpar.parallel.pipeline import build_timetable
from jaxpar.parallel.pipeline.schedule import B_FIRST, B_LAST, B_MID, BX_FIRST, W
from tests.pipeline_util import branch_flops, loss_and_grads, temp_bytes
from tests.test_pipeline import assert_matches

pytestmark = pytest.mark.xdist_group("pipeline_perf")  # its module fixtures are built once, on one worker

P4 = ["model.n_layers=4", "mesh.data=1", "mesh.pipeline=4", "train.grad_accum=4"]
CODES = (B_FIRST, B_MID, B_LAST)


def weight_matmul_flops() -> float:
    """The FLOPs of one tiny-model layer's (one stage here) weight matmuls on one microbatch: 4
    sequences of 32 tokens, dim 128, 4 query and 2 kv heads of 32, SwiGLU 384 (models/llama.py)."""
    tokens, d, hd, f = 4 * 32, 128, 32, 384
    weights = d * 4 * hd * 2 + d * 2 * hd * 2 + 3 * d * f
    return 2 * tokens * weights


# the stage's last projection (w_down, 2 x 128 tokens x 128 x 384): a recomputing backward does
# not run it again (its output feeds no gradient: XLA removes it as dead code)
LAST_PROJECTION = 2 * 128 * 128 * 384


def stage_forward_flops() -> float:
    """The matmul FLOPs of that layer's forward: its weight matmuls, the attention scores and
    the weighted values."""
    b, s, h, hd = 4, 32, 4, 32
    return weight_matmul_flops() + 2 * 2 * b * h * s * s * hd


@pytest.fixture(scope="module")
def flops(devices):
    return {r: branch_flops(P4 + [f"pipeline.recompute={str(r).lower()}"], devices[:4], CODES)
            for r in (True, False)}


def test_no_recompute_drops_one_stage_forward_per_backward(flops):
    """A recomputing backward runs the stage's forward again, all but what no gradient needs (the
    last projection's output: XLA removes it as dead code), so the saving lies between a
    forward without its last projection (w_down, 2 x 128 x 128 x 384) and a whole one."""
    again, stash, fwd = flops[True], flops[False], stage_forward_flops()
    last = LAST_PROJECTION
    for code in (B_MID, B_FIRST):
        assert fwd - last - 0.05 * fwd <= again[code] - stash[code] <= 1.05 * fwd, code
        # what is left is the backward: twice the forward's matmuls
        assert stash[code] == pytest.approx(2 * fwd, rel=0.1), code
    # recomputing, the last stage's forward is folded into its backward; without, it runs on its
    # own tick (F last, keeping its output) and the last backward holds none of it: the whole
    # stage forward leaves B last (its last projection too: its output feeds the head)
    assert 0.95 * fwd <= again[B_LAST] - stash[B_LAST] <= 1.05 * fwd


def test_step_flops_drop_by_one_stage_forward_per_microbatch(flops):
    """Summed over the timetable's backward ticks and devices: the step saves p - 1 stage
    forwards per microbatch (every stage but the last), and the last stage's forward moves out of
    its backward to its own F last tick (which this one-tick harness cannot cost: a forward's
    outputs only fill buffers nobody reads, so XLA removes it)."""
    p, m = 4, 4

    def step(recompute):
        tt = build_timetable("1f1b", p, m, recompute=recompute)
        return sum(flops[recompute].get(int(c), 0.0) for c in tt.code.ravel())

    saved = m * (p - 1) * (flops[True][B_MID] - flops[False][B_MID])
    moved = m * (flops[True][B_LAST] - flops[False][B_LAST])
    assert step(True) - step(False) == pytest.approx(saved + moved, rel=0.02)
    assert saved >= 0.95 * m * (p - 1) * (stage_forward_flops() - LAST_PROJECTION)


@pytest.mark.parametrize("remat", ["none", "full", "dots_saveable"])
def test_zb_h1_splits_the_backward_into_halves(remat, flops, devices):
    """Bx of the first stage (its layers' input cotangent, then the embedding's gradient) skips
    the weight-gradient matmuls: a forward's worth below the whole backward. W runs only those:
    each layer's weight gradients from what Bx kept (the weight matmuls' output cotangents) and
    the forward's residuals (their inputs), with no activation-gradient chain, so Bx + W is one
    whole backward and W about half of it (W applying the stage's whole vjp again, as before,
    cost 0.9-1.0 of a whole backward: the chain through the stage's layers ran twice). The
    same under a train.remat policy, whose layer backward is one remat2 equation: Bx recomputes
    the forward and keeps what W reads of it (left uninlined, W ran 0.4 MFLOP and Bx the
    weight matmuls: no zero-bubble advantage)."""
    layout = P4 + [f"train.remat={remat}"]
    zb = branch_flops(layout + ["pipeline.schedule=zb_h1"], devices[:4], (BX_FIRST, W))
    one = flops[False] if remat == "none" else branch_flops(layout, devices[:4], (B_FIRST, B_MID))
    whole, fwd = one[B_FIRST], stage_forward_flops()
    assert whole - zb[BX_FIRST] == pytest.approx(fwd, rel=0.1)
    assert zb[BX_FIRST] + zb[W] == pytest.approx(whole, rel=0.1)
    assert zb[W] <= 0.6 * one[B_MID]
    # the weight matmuls (x^T dz, one per weight) and the norm scales' sums, nothing else
    assert zb[W] == pytest.approx(weight_matmul_flops(), rel=0.05)


# pipeline alone (every schedule, zb_h1 too, p = 2 and 4, without recompute: the default) is
# tests/test_pipeline.py's full matrix, 1f1b with data and tensor its dp2-pp2-tp2 case; here zb_h1
# (without and with a remat policy) and ZeRO-3 composed
@pytest.mark.parametrize("overrides", [
    ["mesh.data=2", "mesh.pipeline=2", "mesh.tensor=2", "train.grad_accum=4", "pipeline.schedule=zb_h1"],
    # zb_h1 under remat: the split inlines the layer backward's remat2 equation
    ["mesh.pipeline=4", "train.grad_accum=4", "pipeline.schedule=zb_h1", "train.remat=full"],
    ["mesh.data=2", "mesh.pipeline=2", "mesh.tensor=2", "train.grad_accum=4", "pipeline.schedule=zb_h1",
     "train.remat=dots_saveable"],
    # Bx computes W's attention output from the probabilities (split.pull_into_bx), 1f1b_split
    ["mesh.data=2", "mesh.pipeline=4", "train.grad_accum=4", "pipeline.schedule=1f1b_split",
     "train.remat=dots_with_no_batch_dims_saveable"],
    ["mesh.fsdp=2", "mesh.pipeline=2", "sharding.zero_stage=3", "train.grad_accum=2", "mesh.tensor=2"],
])
def test_no_recompute_grads_match_one_device(overrides, reference, devices):
    n = int(np.prod([int(o.split("=")[1]) for o in overrides if o.startswith("mesh.")]))
    layout = [] if any(o.startswith("mesh.data=") for o in overrides) else ["mesh.data=1"]
    assert_matches(loss_and_grads(["model.n_layers=4", "pipeline.recompute=false"] + layout + overrides,
                                  devices[:n]), reference)


@pytest.fixture(scope="module")
def reference(devices):
    return loss_and_grads(["model.n_layers=4", "mesh.data=1"], devices[:1])


def test_ppermutes_send_only_real_values(devices):
    """The compiled step's collective-permutes are the timetable's send patterns: no pair on a
    tick whose source has nothing to send (1f1b p=4 m=4: 5 forward and 5 backward patterns from
    the fill and the drain; the old runner's two full ppermutes per tick sent zeros on the idle
    ones). One switch sends both directions (one conditional a tick, not two): each of its
    branches is a move, a forward and a backward pattern, each permute once in it."""
    import re

    from jaxpar.parallel.pipeline.runner import send_patterns, tick_plan
    from jaxpar.train.trainer import Trainer
    from tests.conftest import tiny_config
    trainer = Trainer(tiny_config(*P4), devices=devices[:4], log=lambda s: None)
    hlo = trainer.compile().as_text()
    found = [tuple(tuple(map(int, pair.split(","))) for pair in re.findall(r"\{(\d+,\d+)\}", pairs))
             for pairs in re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", hlo)]
    tt = build_timetable("1f1b", 4, 4)
    fwd, fwd_idx = send_patterns(tt.recv_x, [(0, 1), (1, 2), (2, 3)])
    bwd, bwd_idx = send_patterns(tt.recv_g, [(1, 0), (2, 1), (3, 2)])
    assert len(fwd) == len(bwd) == 5 and set(found) == set(fwd + bwd)
    _, (moves, index) = tick_plan(tt)
    assert sorted(found) == sorted(pattern for move in moves for pattern in move if pattern)
    for t in range(tt.ticks):  # the tick's move is its two directions' patterns
        want = (fwd[fwd_idx[t] - 1] if fwd_idx[t] else (), bwd[bwd_idx[t] - 1] if bwd_idx[t] else ())
        assert (moves[index[t] - 1] if index[t] else ((), ())) == want


def test_interleaved_step_moves_no_weights(devices):
    """interleaved_1f1b (data 2 x pipeline 4, v = 2, 8 layers): the plan stores each device's
    layers in the order the schedule runs them, so the compiled step's only collective-permutes
    are the timetable's activation sends (one per send pattern, activation-shaped), and a layer
    weight or gradient is in no collective but the gradient's all-reduce over `data`. (Permuting
    the contiguous stack every step, as before, added 72 permutes of layer-shaped arrays:
    docs/benchmarks.md.)"""
    import re

    from jaxpar.metrics.hlo import collective_ops
    from jaxpar.parallel.pipeline import stacked_paths
    from jaxpar.parallel.pipeline.runner import flatten, send_patterns
    from jaxpar.train.trainer import Trainer
    from tests.conftest import tiny_config
    p, v, m = 4, 2, 4
    trainer = Trainer(tiny_config("model.n_layers=8", "mesh.data=2", f"mesh.pipeline={p}",
                                  "pipeline.schedule=interleaved_1f1b", f"pipeline.virtual_stages={v}",
                                  f"train.grad_accum={m}"), devices=devices, log=lambda s: None)
    ops = collective_ops(trainer.compile().as_text())
    shapes = flatten(trainer.model.shapes)
    layer_shapes = {(s.shape[0] // p, *s.shape[1:]) for k, s in shapes.items() if k in stacked_paths(trainer.model)}
    rows = 16 // 2 // m  # a microbatch's rows on one data-parallel device
    activation = (rows, 32, 128)
    stage = lambda i: np.unravel_index(i, trainer.mesh.devices.shape)[trainer.mesh.axis_names.index("pipeline")]
    # the groups over `data` (older XLAs print them as explicit device lists, newer by mesh axis)
    ids = np.vectorize(lambda d: d.id)(trainer.mesh.devices)
    ids = np.moveaxis(ids, trainer.mesh.axis_names.index("data"), -1).reshape(-1, trainer.mesh.shape["data"])
    data_groups = {frozenset(int(i) for i in g) for g in ids}
    groups = lambda op: {frozenset(int(i) for i in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", op.replica_groups)}
    permutes = set()
    for op in ops:
        assert op.kind in ("all-reduce", "collective-permute"), op
        if op.kind == "collective-permute":
            assert op.shape == activation, op
            pairs = re.findall(r"\{(\d+),(\d+)\}", op.replica_groups)
            permutes.add(tuple(sorted({(int(stage(int(a))), int(stage(int(b)))) for a, b in pairs})))
        elif op.shape in layer_shapes:  # the layer gradients' data-parallel reduction
            assert op.replica_groups.endswith("{'data'}") or groups(op) == data_groups, op
    tt = build_timetable("interleaved_1f1b", p, m, v)
    fwd, _ = send_patterns(tt.recv_x, [(d, (d + 1) % p) for d in range(p)])
    bwd, _ = send_patterns(tt.recv_g, [((d + 1) % p, d) for d in range(p)])
    assert permutes == {tuple(sorted(x)) for x in fwd + bwd}
    assert any(op.shape in layer_shapes for op in ops)  # the check above saw the layer gradients


def test_stash_references_params_not_copies():
    """A stage's vjp splits into what a tick stashes and references to the params the backward
    has anyway (no copy of the weights per microbatch in flight); joined again in another trace,
    it gives the same gradients as the vjp itself (float64 numpy reference)."""
    import jax
    import jax.numpy as jnp

    from jaxpar.parallel.pipeline.residuals import StashPlan
    rng = np.random.default_rng(0)
    w, x, ct = (rng.standard_normal(s) for s in ((3, 4), (2, 3), (2, 4)))
    f = lambda w, x: jnp.tanh(x @ w)
    plan = StashPlan()

    @jax.jit
    def forward(w, x):
        _, fn = jax.vjp(f, w, x)
        return plan.split(fn, {"lay": {"w": w}})

    kept = forward(w, x)
    assert plan.refs.count(("lay", "w")) == 1 and len(kept) == len(plan.refs) - 1
    assert all(a.shape != w.shape for a in kept)
    dw, dx = jax.jit(lambda kept, w, ct: plan.join(kept, {"lay": {"w": w}})(ct))(kept, w, ct)
    y = np.tanh(x @ w)
    g = ct * (1 - y ** 2)
    np.testing.assert_allclose(dw, x.T @ g, rtol=1e-5)
    np.testing.assert_allclose(dx, g @ w.T, rtol=1e-5)


# a model whose weights outweigh a microbatch's activations (dim 256, ffn 1024, 16 tokens a row),
# data 4 x pipeline 2, m 4: the bf16 stash test compiles it in float32 and bfloat16, and the
# residual ring test reads the float32 program's HLO (the same layout and schedule it needs)
STASH_LAYOUT = ["mesh.data=4", "mesh.pipeline=2", "train.grad_accum=4", "model.dim=256", "model.ffn_dim=1024",
                "model.n_layers=4", "train.seq_len=16"]


@functools.cache
def _stash_programs(schedule: str, devices: tuple) -> dict:
    """{dtype: (the compiled step's temp bytes, its HLO text, the shapes StashPlan.split kept,
    the layer params its vjps referenced)} of STASH_LAYOUT with `schedule`, float32 and bf16
    compute (computed once per process: two tests read them; treat the result as read-only)."""
    from unittest import mock

    from jaxpar.parallel.pipeline.residuals import StashPlan
    from jaxpar.train.trainer import Trainer
    from tests.conftest import tiny_config
    split, out = StashPlan.split, {}
    for dtype in ("float32", "bfloat16"):
        shapes, refs = set(), set()

        def recording(plan, fn, known):
            kept = split(plan, fn, known)
            shapes.update(tuple(a.shape) for a in kept)
            refs.add(tuple(sorted(r[1] for r in plan.refs if r and r[0] == "lay")))
            return kept
        with mock.patch.object(StashPlan, "split", recording):
            cfg = tiny_config(*STASH_LAYOUT, f"pipeline.schedule={schedule}", f"train.compute_dtype={dtype}")
            compiled = Trainer(cfg, devices=list(devices), log=lambda s: None).compile()
        out[dtype] = (compiled.memory_analysis().temp_size_in_bytes, compiled.as_text(), shapes, refs)
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_bf16_stage_stashes_no_copy_of_its_weights(schedule, devices):
    """bf16 compute of float32 params: the layer stacks are cast once for the step, outside every
    tick and vjp, so a stage's vjp references the cast weights as it references float32 ones,
    and a microbatch in flight stashes activations only. Cast inside (per layer, in the layer
    scan), every cast was a residual: a bf16 copy of the stage's weights per microbatch in
    flight, compiled temp 49.3 MiB here against float32's 27.4 (2026-12-07; 24.2 since). A
    model whose weights outweigh a microbatch's activations (STASH_LAYOUT)."""
    programs = _stash_programs(schedule, tuple(devices))
    temp = {dtype: programs[dtype][0] for dtype in programs}
    refs = {dtype: programs[dtype][3] for dtype in programs}
    # the matmul weights: referenced in float32, and in bf16 the same
    (f32,) = refs["float32"]
    assert {n for _, n in f32} >= {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}, f32
    assert refs["bfloat16"] == {f32}, refs
    assert temp["bfloat16"] <= temp["float32"], temp


def test_split_cuts_a_layer_backward_at_the_weight_matmuls():
    """split.py's cut of a layer's backward (two matmuls around a silu, each matmul in a `jit`):
    Bx runs the two input-gradient matmuls, W only the two weight-gradient ones (the jits are
    inlined first: a jit's transpose is one equation yielding both cotangents), and together
    they give the layer's gradients (float64 numpy reference)."""
    import jax

    from jaxpar.parallel.pipeline.split import _Cut
    rng = np.random.default_rng(0)
    w1, w2, x, ct = (rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (8, 4), (2, 4), (2, 4)))
    mm = jax.jit(lambda a, b: a @ b)
    _, fn = jax.vjp(lambda w, x: x + mm(jax.nn.silu(mm(x, w[0])), w[1]), (w1, w2), x)
    leaves, treedef = jax.tree.flatten(fn)
    cut = _Cut.of(jax.make_jaxpr(lambda l, g: jax.tree.unflatten(treedef, l)(g))(leaves, ct), 2, len(leaves))
    dots = lambda nodes: sum(cut.nodes[i][0].primitive.name == "dot_general" for i in nodes)
    assert dots(cut.x_nodes) == dots(cut.w_nodes) == 2
    dx, *kept = cut.run(cut.x_nodes, dict(zip(cut.in_keys, [*leaves, ct])), cut.dx_out + cut.w_in)
    dw1, dw2 = cut.run(cut.w_nodes, dict(zip(cut.w_in, kept)), cut.dw_out)
    x, w1, w2, ct = (a.astype(np.float64) for a in (x, w1, w2, ct))
    h = x @ w1
    sig = 1 / (1 + np.exp(-h))
    dh = (ct @ w2.T) * sig * (1 + h * (1 - sig))
    for got, want in ((dw2, (h * sig).T @ ct), (dw1, x.T @ dh), (dx, ct + dh @ w1.T)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_split_w_recomputes_the_swiglu_cotangents_from_the_one_at_its_output():
    """A SwiGLU's gate and up cotangents are elementwise in the cotangent at its output and the
    forward's gate and up values (residuals, which W has anyway): W computes them again, so Bx
    keeps one F-sized value for W where it kept two (and W's gradients stay the float64
    reference's)."""
    import jax

    from jaxpar.parallel.pipeline.split import _Cut
    rng = np.random.default_rng(1)
    b, d, f = 3, 4, 16
    wg, wu, wd = (rng.standard_normal(s).astype(np.float32) for s in ((d, f), (d, f), (f, d)))
    x, ct = (rng.standard_normal((b, d)).astype(np.float32) for _ in range(2))
    mm = jax.jit(lambda a, w: a @ w)
    _, fn = jax.vjp(lambda w, x: x + mm(jax.nn.silu(mm(x, w[0])) * mm(x, w[1]), w[2]), (wg, wu, wd), x)
    leaves, treedef = jax.tree.flatten(fn)
    closed = jax.make_jaxpr(lambda l, g: jax.tree.unflatten(treedef, l)(g))(leaves, ct)
    cut = _Cut.of(closed, 3, len(leaves))
    have = set(cut.in_keys[:len(leaves)])
    kept = sorted(cut.nbytes[k] for k in cut.w_in if k not in have)
    # the output cotangent (w_down's: [b, d]) and the SwiGLU's ([b, f]); not its gate and up ones
    assert kept == [b * d * 4, b * f * 4], kept
    dx, *w_kept = cut.run(cut.x_nodes, dict(zip(cut.in_keys, [*leaves, ct])), cut.dx_out + cut.w_in)
    dwg, dwu, dwd = cut.run(cut.w_nodes, dict(zip(cut.w_in, w_kept)), cut.dw_out)
    x, wg, wu, wd, ct = (a.astype(np.float64) for a in (x, wg, wu, wd, ct))
    g, u = x @ wg, x @ wu
    sig = 1 / (1 + np.exp(-g))
    dh = ct @ wd.T
    dg, du = dh * u * sig * (1 + g * (1 - sig)), dh * g * sig
    for got, want in ((dwd, (g * sig * u).T @ ct), (dwg, x.T @ dg), (dwu, x.T @ du),
                      (dx, ct + dg @ wg.T + du @ wu.T)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_the_residual_ring_holds_only_the_timetables_slots(schedule, devices):
    """Only a forward tick stashes residuals, and it files them under a cond: the runner's ring
    holds the timetable's slots, each residual leaf [slots, layers, ...] with slots =
    n_r_slots. Until 2026-12-07 every tick filed its branch's residuals (the other branches'
    zeros) into a spare slot: a whole stage's residuals more on every device (XLA:CPU, data 2 x
    pipeline 4, m 8, 1f1b: 25.85 -> 23.51 MiB compiled temp). The tick files every ring it
    writes in one switch. Read off the float32 program the bf16 stash test compiles (data 4 x
    pipeline 2, m 4: the layout this check needs; its wider model changes no ring's slots)."""
    from jaxpar.parallel.pipeline.schedule import build_timetable
    from tests.conftest import tiny_config
    _, hlo, shapes, _ = _stash_programs(schedule, tuple(devices))["float32"]
    cfg = tiny_config(*STASH_LAYOUT, f"pipeline.schedule={schedule}")
    p, m = cfg.mesh.pipeline, cfg.train.grad_accum
    n_r = build_timetable(schedule, p, m).n_r_slots
    assert shapes and n_r == (3 if schedule == "1f1b" else 2)
    # the split records one layer's leaves (its layer scan stacks them); the plain vjp a stage's
    layers = cfg.model.n_layers // p
    found = 0
    for shape in (s for s in shapes if len(s) >= 2):  # activations (a scalar's ring is ambiguous)
        whole = shape if schedule == "1f1b" else (layers, *shape)
        ring = lambda n: "[" + ",".join(map(str, (n, *whole))) + "]"
        assert ring(n_r + 1) not in hlo, (shape, n_r)
        found += ring(n_r) in hlo
    assert found, shapes
    # ... and one switch files all of a tick's rings (a cond per ring and a send switch per
    # direction were 7 conditionals a tick with 1f1b, 8 with zb_h1; XLA:GPU reads every
    # conditional's index back to the host): the tick's op switch, its send switch and the
    # filing switch
    body = max(_conditionals_per_computation(hlo).values())
    assert body == 3, body


def _conditionals_per_computation(hlo: str) -> dict[str, int]:
    counts, name = {}, None
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            name = line.split(" ")[1] if line.startswith("ENTRY") else line.split(" ")[0]
            counts[name] = 0
        elif name is not None and " conditional(" in line:
            counts[name] += 1
    return counts


def test_the_stage_input_ring_holds_only_the_timetables_slots(devices):
    """The x ring (stage inputs, the last stage's kept outputs) is filed under a cond too: a
    [n_x_slots, rows, seq, D] buffer. Until 2026-12-07 every tick wrote what arrived for nobody
    into a spare slot, and the g ring had one too: two stage-boundary activations more on every
    device (XLA:CPU, tests/test_planner.py's fifteen pipeline layouts: 0.19-0.75 MiB less temp).
    gpipe at p 2, m 4 has 4 x slots, so the spare one's [5, ...] is no other buffer's shape."""
    from jaxpar.parallel.pipeline.schedule import build_timetable
    from jaxpar.train.trainer import Trainer
    from tests.conftest import tiny_config
    p, m = 2, 4
    cfg = tiny_config("mesh.data=4", f"mesh.pipeline={p}", f"train.grad_accum={m}", "model.n_layers=4",
                      "pipeline.schedule=gpipe")
    hlo = Trainer(cfg, devices=devices, log=lambda s: None).compile().as_text()
    n_x = build_timetable("gpipe", p, m).n_x_slots
    rows = cfg.train.global_batch // (cfg.mesh.data * m)
    ring = lambda n: f"f32[{n},{rows},{cfg.train.seq_len},{cfg.model.dim}]"
    assert n_x == 4 and ring(n_x) in hlo
    assert ring(n_x + 1) not in hlo


def test_split_bx_computes_a_w_value_smaller_than_its_inputs():
    """Under a remat policy that does not save batched dots, W's weight gradient of an attention
    output projection reads the output recomputed from the probabilities: [b, b] a sequence
    where the output is [b, d]. Bx computes that dot (its inputs are Bx's anyway) and keeps the
    output for W; each equation still runs once, and W's gradient is the float64 reference's."""
    import jax

    from jaxpar.parallel.pipeline.split import _Cut
    rng = np.random.default_rng(2)
    b, d = 16, 4
    w = rng.standard_normal((d, d)).astype(np.float32)
    x, ct = (rng.standard_normal((b, d)).astype(np.float32) for _ in range(2))

    def layer(w, x):
        p = jax.nn.softmax(x @ x.T, axis=-1)
        return x + (p @ x) @ w
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
    _, fn = jax.vjp(layer, w, x)
    leaves, treedef = jax.tree.flatten(fn)
    closed = jax.make_jaxpr(lambda l, g: jax.tree.unflatten(treedef, l)(g))(leaves, ct)
    cut = _Cut.of(closed, 1, len(leaves))
    have = set(cut.in_keys[:len(leaves)])
    kept = sorted(cut.nbytes[k] for k in cut.w_in if k not in have)
    assert kept == [b * d * 4, b * d * 4], kept  # the output's cotangent and the output, no [b, b]
    dots = lambda nodes: sum(cut.nodes[i][0].primitive.name == "dot_general" for i in nodes)
    assert dots(cut.w_nodes) == 1  # the weight gradient only
    _, *w_kept = cut.run(cut.x_nodes, dict(zip(cut.in_keys, [*leaves, ct])), cut.dx_out + cut.w_in)
    (dw,) = cut.run(cut.w_nodes, dict(zip(cut.w_in, w_kept)), cut.dw_out)
    x64 = x.astype(np.float64)
    s = x64 @ x64.T
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(dw, (p @ x64).T @ ct.astype(np.float64), rtol=1e-5, atol=1e-6)
