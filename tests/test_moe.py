"""Mixture of experts: the layer on expert-parallel meshes vs a dense loop, the capacity rule
(padding of packed rows taking no capacity), the router losses, config errors, the Mixtral
counts, and training the small MoE preset."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar import nn
from jaxpar.config import ConfigError, make_config
from jaxpar.parallel.expert import capacity, capacity_slots, moe_apply
from jaxpar.train.model import ModelDef
from jaxpar.train.trainer import Trainer
from models.moe import MoE, MoELlama, active_param_count, load_balance_loss, param_count
from tests.conftest import tiny_config

pytestmark = pytest.mark.xdist_group("moe")  # its module fixtures are built once, on one worker

E, K, D, F, B, S = 8, 2, 16, 32, 8, 8


def layer_cfg(*overrides):
    return make_config({}, ["model.preset=moe_tiny", f"model.dim={D}", f"model.ffn_dim={F}",
                            f"model.moe.num_experts={E}", f"model.moe.top_k={K}", *overrides]).model


@pytest.fixture(scope="module")
def layer():
    """One MoE layer's graph and params (the `layers` dim dropped, as inside the layer scan)."""
    module = MoE(layer_cfg(), 1, nnx.Rngs(0))
    graphdef, state = nnx.split(module)
    params = {k: v[0] for k, v in nnx.to_pure_dict(state).items()}
    # Larger router weights than at init, so that routing is decisive and uneven.
    params["router"] = 0.5 * jax.random.normal(jax.random.key(1), params["router"].shape)
    x = jax.random.normal(jax.random.key(2), (B, S, D))
    r = jax.random.normal(jax.random.key(3), (B, S, D))
    return graphdef, state, params, x, r


def apply_layer(graphdef, state, cfg_moe, params, x):
    st = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(st, params)
    module = nnx.merge(graphdef, st)
    module.moe = cfg_moe
    return module(x)[0]


def dense_reference(params, x):
    """The MoE written as a loop over every expert on every token (no dispatch, nothing dropped)."""
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    top_p, idx = jax.lax.top_k(probs, K)
    gates = top_p / top_p.sum(-1, keepdims=True)
    y = jnp.zeros_like(x)
    for e in range(E):
        w = (gates * (idx == e)).sum(-1)[..., None]
        h = jax.nn.silu(x @ params["w_gate"][e]) * (x @ params["w_up"][e])
        y = y + w * (h @ params["w_down"][e])
    return y


def loss_and_grads(fn, params, x, r):
    """((loss, y), (param grads, x grad)) of loss = sum(fn(params, x) * r)."""
    def loss(p, x):
        y = fn(p, x)
        return (y * r).sum(), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


@pytest.fixture(scope="module")
def reference(layer):
    _, _, params, x, r = layer
    return loss_and_grads(dense_reference, params, x, r)


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
@pytest.mark.parametrize("data,expert", [(1, 4), (2, 4)])
def test_layer_matches_dense_loop(layer, reference, devices, dispatch, data, expert):
    graphdef, state, params, x, r = layer
    # capacity_factor E/K: every expert has a slot for every token of a sequence.
    moe_cfg = layer_cfg(f"model.moe.dispatch={dispatch}", f"model.moe.capacity_factor={E / K}").moe
    mesh = Mesh(np.array(devices[:data * expert]).reshape(data, expert), ("data", "expert"))
    specs = {k: P("expert") if k.startswith("w_") else P() for k in params}
    hook = lambda *a, **kw: moe_apply(*a, **kw, axis="expert", axis_size=expert)

    def local(p, xl):
        with nn.use_context(nn.Context(experts=hook)):
            return apply_layer(graphdef, state, moe_cfg, p, xl)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(("data", "expert"))),
                       out_specs=P(("data", "expert")))
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    (l_ref, y_ref), (g_ref, gx_ref) = reference
    (l, y), (g, gx) = loss_and_grads(fn, params, x, r)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-6)
    for k in g_ref:
        np.testing.assert_allclose(g[k], g_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_local_layer_matches_dense_loop(layer, reference):
    """Outside a step (no jaxpar context) the layer is a plain single-device computation."""
    graphdef, state, params, x, _ = layer
    for dispatch in ("capacity", "dropless"):
        moe_cfg = layer_cfg(f"model.moe.dispatch={dispatch}", f"model.moe.capacity_factor={E / K}").moe
        y = jax.jit(lambda p, x: apply_layer(graphdef, state, moe_cfg, p, x))(params, x)
        np.testing.assert_allclose(y, reference[0][1], rtol=1e-5, atol=1e-6)


def numpy_capacity_slots(idx: np.ndarray, num_experts: int, cap: int, valid: np.ndarray | None = None):
    """The capacity rule, one sequence at a time: (slot, keep) [G, S, k]. First choices in token
    order, then second choices, ...; an assignment takes its expert's next slot while the expert
    has fewer than `cap` tokens. With `valid` [G, S] the row is routed as if its invalid tokens
    were not there: they take nothing (slot E*cap, keep False)."""
    G, S_, k = idx.shape
    valid = np.ones((G, S_), bool) if valid is None else valid
    keep = np.zeros(idx.shape, bool)
    slot = np.full(idx.shape, num_experts * cap)
    for g in range(G):
        used = np.zeros(num_experts, int)
        tokens = np.flatnonzero(valid[g])  # the row with its invalid tokens removed
        for c in range(k):
            for s in tokens:
                e = idx[g, s, c]
                if used[e] < cap:
                    keep[g, s, c], slot[g, s, c] = True, e * cap + used[e]
                    used[e] += 1
    return slot, keep


def numpy_capacity_keep(idx: np.ndarray, num_experts: int, cap: int) -> np.ndarray:
    return numpy_capacity_slots(idx, num_experts, cap)[1]


def test_dropped_tokens_follow_capacity_rule():
    G, S_, k, n = 4, 16, 2, 4
    logits = jax.random.normal(jax.random.key(0), (G, S_, n)) + jnp.array([2.0, 0.5, 0, 0])  # skewed
    idx = np.asarray(jax.lax.top_k(logits, k)[1])
    cap = capacity(S_, k, n, 0.75)
    assert cap == 6
    slot, keep, _ = capacity_slots(jnp.asarray(idx), n, cap)
    expected = numpy_capacity_keep(idx, n, cap)
    assert 0 < (~expected).sum() < expected.size  # some, not all, dropped
    np.testing.assert_array_equal(np.asarray(keep), expected)
    slot = np.asarray(slot)
    for g in range(G):  # kept assignments get distinct slots in their expert's block
        kept = slot[g][expected[g]]
        assert len(set(kept.tolist())) == kept.size
        np.testing.assert_array_equal(kept // cap, idx[g][expected[g]])
    assert (slot[~expected] == n * cap).all()


def test_dropped_tokens_pass_through_the_residual(layer):
    """A dropped (token, choice) contributes nothing: the layer equals the dense loop restricted
    to the kept assignments, and reports the dropped fraction."""
    graphdef, state, params, x, _ = layer
    moe_cfg = layer_cfg("model.moe.capacity_factor=0.5").moe
    y, dropped = jax.jit(lambda p, x: moe_apply(
        x, *_route(p, x), lambda h: _experts(p, h), None, num_experts=E, capacity_factor=0.5))(params, x)
    idx, gates = _route(params, x)
    keep = numpy_capacity_keep(np.asarray(idx), E, capacity(S, K, E, 0.5))
    assert 0 < dropped == pytest.approx(1 - keep.mean())
    y_ref = jnp.zeros_like(x)
    for e in range(E):
        w = (gates * (idx == e) * keep).sum(-1)[..., None]
        h = jax.nn.silu(x @ params["w_gate"][e]) * (x @ params["w_up"][e])
        y_ref = y_ref + w * (h @ params["w_down"][e])
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    y_layer = jax.jit(lambda p, x: apply_layer(graphdef, state, moe_cfg, p, x))(params, x)
    np.testing.assert_allclose(y_layer, y_ref, rtol=1e-5, atol=1e-6)


def _route(p, x):
    top_p, idx = jax.lax.top_k(jax.nn.softmax(x @ p["router"], axis=-1), K)
    return idx, top_p / top_p.sum(-1, keepdims=True)


def _experts(p, h):
    a = jax.nn.silu(jnp.einsum("etd,edf->etf", h, p["w_gate"])) * jnp.einsum("etd,edf->etf", h, p["w_up"])
    return jnp.einsum("etf,efd->etd", a, p["w_down"])


def test_load_balance_loss_formula():
    # Two sequences of 4 tokens, 4 experts, top-1; hand-made router probabilities.
    probs = jnp.array([
        [[.7, .1, .1, .1], [.6, .2, .1, .1], [.1, .7, .1, .1], [.1, .1, .1, .7]],
        [[.25, .25, .25, .25]] * 4,
    ])
    idx = jnp.array([[[0], [0], [1], [3]], [[0], [1], [2], [3]]])
    f0, p0 = np.array([.5, .25, 0, .25]), np.array([1.5, 1.1, .4, 1.0]) / 4
    expected = (4 * (f0 * p0).sum() + 4 * (np.full(4, .25) * .25).sum()) / 2
    np.testing.assert_allclose(load_balance_loss(probs, idx, 4), expected, rtol=1e-6)


def test_load_balance_loss_minimal_for_uniform_load():
    """With router probabilities that agree with the routing (p = the token's expert), the loss is
    E * sum_e f_e^2 >= 1, with equality exactly at the uniform load."""
    n, S_ = 4, 64

    def loss_for(counts):
        idx = jnp.repeat(jnp.arange(n), jnp.array(counts), total_repeat_length=S_).reshape(1, S_, 1)
        return float(load_balance_loss(jax.nn.one_hot(idx[..., 0], n), idx, n))

    loads = {"uniform": [16, 16, 16, 16], "mild": [20, 16, 16, 12], "skewed": [40, 8, 8, 8],
             "two": [32, 32, 0, 0], "collapsed": [64, 0, 0, 0]}
    values = {k: loss_for(c) for k, c in loads.items()}
    assert values["uniform"] == pytest.approx(1.0)
    for k, c in loads.items():
        assert values[k] == pytest.approx(n * sum((x / S_) ** 2 for x in c))
    assert min(values, key=values.get) == "uniform"
    assert values["collapsed"] == pytest.approx(n)
    # Soft probabilities: uniform router probabilities give 1 for any routing.
    idx = jnp.repeat(jnp.arange(n), jnp.array(loads["skewed"]), total_repeat_length=S_).reshape(1, S_, 1)
    assert float(load_balance_loss(jnp.full((1, S_, n), 1 / n), idx, n)) == pytest.approx(1.0)


def router_losses_reference(h, router, w):
    """float64 numpy: (load-balance loss, z loss, load [E], d(lb + z)/dh) of a router over the
    tokens with weight w [G, S] > 0 only, per sequence then averaged over sequences."""
    h, router, w = (np.asarray(a, np.float64) for a in (h, router, w))
    G = h.shape[0]
    logits = h @ router
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    probs = np.exp(logits - lse[..., None])
    idx = np.argsort(-probs, axis=-1)[..., :K]
    chosen = (idx[..., None] == np.arange(E)).mean(axis=2)             # [G, S, E]
    share = w / w.sum(1, keepdims=True)                                 # each token's weight in its row
    f = np.einsum("gs,gse->ge", share, chosen)
    p = np.einsum("gs,gse->ge", share, probs)
    lb = (E * (f * p).sum(-1)).mean()
    z = (share * lse ** 2).sum(1).mean()
    d_probs = E * f[:, None, :] * share[..., None] / G                 # d lb / d probs
    d_logits = probs * (d_probs - (d_probs * probs).sum(-1, keepdims=True))
    d_logits += 2 * (share * lse)[..., None] * probs / G                # d z / d logits
    return lb, z, f.mean(0), d_logits @ router.T


def test_router_losses_count_only_weighted_tokens(layer):
    """Packed rows: the padding (token weight 0) takes no part in the router losses or the load:
    values and their gradient w.r.t. the layer's input equal a float64 numpy reference over the
    weighted tokens (and differ from the one over all tokens, so the check can fail)."""
    graphdef, state, params, x, _ = layer
    w = np.ones((B, S), np.float32)
    w[0, 5:] = 0.0  # padding at the end of rows, as the packer leaves it
    w[3, 2:] = 0.0
    w[5, ::3] = 0.0  # documents' closing EOS: not counted either

    def aux(x, w):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, params)
        a = nnx.merge(graphdef, st)(x, token_weights=w)[1]
        return a["lb"] + a["z"], a

    (_, got), dx = jax.jit(jax.value_and_grad(aux, has_aux=True))(x, jnp.asarray(w))
    lb, z, load, ref_dx = router_losses_reference(x, params["router"], w)
    assert float(got["lb"]) == pytest.approx(lb, rel=1e-5)
    assert float(got["z"]) == pytest.approx(z, rel=1e-5)
    np.testing.assert_allclose(got["load"], load, rtol=1e-5, atol=1e-7)
    dx = np.asarray(dx)
    assert np.abs(dx - ref_dx).max() <= 1e-5 * np.abs(ref_dx).max()
    assert not dx[w == 0].any()  # no router-loss gradient reaches the padding
    lb_all, z_all, _, _ = router_losses_reference(x, params["router"], np.ones_like(w))
    assert abs(lb_all - lb) > 1e-3 and abs(z_all - z) > 1e-3, (lb_all, lb, z_all, z)


def test_config_errors(devices):
    with pytest.raises(ConfigError, match=r"top_k=3 is above num_experts=2"):
        make_config({}, ["model.preset=moe_tiny", "model.moe.num_experts=2", "model.moe.top_k=3"])
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=6 is not divisible by mesh.expert=4"):
        Trainer(tiny_config("model.preset=moe_tiny", "model.moe.num_experts=6", "mesh.data=2",
                            "mesh.expert=4"), devices=devices)
    with pytest.raises(ConfigError, match=r"not divisible by mesh.expert=8"):  # expert filling the mesh
        Trainer(tiny_config("model.preset=moe_tiny", "model.moe.num_experts=6", "mesh.data=1",
                            "mesh.expert=-1"), devices=devices)
    with pytest.raises(ConfigError, match=r"multiple of moe.every_n=3"):
        make_config({}, ["model.preset=moe_tiny", "model.moe.every_n=3"])


def test_mixtral_8x7b_counts_match_published():
    cfg = make_config({}, ["model.preset=mixtral_8x7b"]).model
    assert param_count(cfg) == 46_702_792_704
    assert active_param_count(cfg) == 12_879_925_248
    assert ModelDef.from_factory(lambda r: MoELlama(cfg, r)).n_params == 46_702_792_704  # abstract
    # A preset's moe section merges with the one given beside it.
    cfg = make_config({}, ["model.preset=mixtral_8x7b", "model.moe.dispatch=dropless"]).model
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.dispatch) == (8, 2, "dropless")


@pytest.mark.parametrize("extra", [[], ["model.moe.every_n=2", "model.moe.shared_expert=true",
                                        "model.moe.shared_ffn_dim=48", "model.moe.expert_ffn_dim=24"]])
def test_model_param_count(extra):
    cfg = make_config({}, ["model.preset=moe_tiny", "model.n_layers=4", *extra]).model
    assert ModelDef.from_factory(lambda r: MoELlama(cfg, r)).n_params == param_count(cfg)


# --------------------------------------------------------------------------- training

TRAIN = ["model.preset=moe_tiny", "train.seq_len=32",
         "train.global_batch=16", "optimizer.lr=3e-3", "optimizer.decay_steps=25",
         "optimizer.warmup_steps=5", "model.moe.capacity_factor=1.25", "train.log_every=1"]


@pytest.fixture(scope="module")
def trained(devices, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_run")
    trainer = Trainer(tiny_config(*TRAIN, "train.steps=25", "mesh.data=2", "mesh.expert=4",
                                  "checkpoint.enabled=false"), devices=devices)  # reads metrics.jsonl only
    _, hist = trainer.fit(out_dir=out, progress=False)
    return hist, out


def test_training_lowers_loss_and_keeps_experts_loaded(trained):
    hist, out = trained
    first, last = hist[0], hist[-1]
    assert last["loss"] < first["loss"] - 0.5
    for rec in (first, last):
        load = np.array([rec[f"moe/load/{e}"] for e in range(8)])
        assert load.sum() == pytest.approx(1.0, abs=1e-4)
        assert load.max() < 0.25 and load.min() > 0.05, load  # far from collapsing onto one expert
        assert 0 <= rec["moe/dropped_fraction"] < 0.2
        assert rec["aux_loss"] == pytest.approx(0.01 * rec["moe/load_balance_loss"]
                                                + 0.001 * rec["moe/z_loss"], rel=1e-4)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"moe/load/0", "moe/dropped_fraction", "moe/load_balance_loss", "moe/z_loss",
            "aux_loss"} <= set(logged[-1])


@pytest.fixture(scope="module")
def one_device(devices):
    trainer = Trainer(tiny_config(*TRAIN, "train.steps=3", "mesh.data=1"), devices=devices[:1])
    return trainer.fit(progress=False)[1]


def assert_same_run(hist, ref):
    for a, b in zip(hist, ref):
        for key in ("loss", "aux_loss", "moe/dropped_fraction", "moe/load/0"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_expert_parallel_training_matches_one_device(trained, one_device):
    """data=2 x expert=4 (experts split, tokens all_to_all'd, capacity dropping some) trains
    exactly like one device: routing groups are sequences, and expert grads are not summed
    over `expert`."""
    hist, _ = trained
    assert hist[0]["moe/dropped_fraction"] > 0
    assert_same_run(hist[:3], one_device)


# fsdp x expert x tensor (ZeRO-3): tests/test_layout_grads.py compares its gradients.


# --------------------------------------------------------------------------- packed rows: padding

def packed_weights() -> np.ndarray:
    """Token weights [B, S] of packed rows: padding at the end of rows (after the documents, as the
    packer leaves it), documents' closing EOS inside rows, and one row all padding."""
    w = np.ones((B, S), np.float32)
    w[0, 5:] = 0.0
    w[3, 2:] = 0.0
    w[5, ::3] = 0.0
    w[6, 4:] = 0.0
    w[7, :] = 0.0
    return w


def numpy_moe(params, x, w, cap: int | None):
    """float64 numpy MoE layer over the tokens of weight > 0 only: (expert_idx, keep, y, dropped
    fraction). `cap` None: dropless. The router is the layer's (softmax, top-K, renormalized
    gates); capacity is assigned as if the weight-0 tokens were removed from their row (the
    capacity itself stays the row's); y is zero for them; the dropped fraction is per row over its
    valid assignments, averaged over rows (a row without any counts 0)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    valid = np.asarray(w) > 0
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    idx = np.argsort(-probs, axis=-1, kind="stable")[..., :K]
    top = np.take_along_axis(probs, idx, -1)
    gates = top / top.sum(-1, keepdims=True)
    if cap is None:
        keep = np.broadcast_to(valid[..., None], idx.shape).copy()
    else:
        keep = numpy_capacity_slots(idx, E, cap, valid)[1]
    silu = lambda a: a / (1 + np.exp(-a))
    y = np.zeros_like(x)
    for e in range(E):
        g = (gates * (idx == e) * keep).sum(-1)[..., None]
        y += g * ((silu(x @ p["w_gate"][e]) * (x @ p["w_up"][e])) @ p["w_down"][e])
    n = valid.sum(1) * K
    dropped = np.where(n > 0, 1 - keep.sum((1, 2)) / np.maximum(n, 1), 0.0).mean()
    return idx, keep, y, dropped


def test_padding_takes_no_capacity_slots():
    """(a) Only valid tokens take slots, in the priority order of the valid tokens alone: slots and
    keep equal a numpy loop over each row with its invalid tokens removed."""
    G, S_, k, n = 4, 16, 2, 4
    logits = jax.random.normal(jax.random.key(0), (G, S_, n)) + jnp.array([2.0, 0.5, 0, 0])  # skewed
    idx = np.asarray(jax.lax.top_k(logits, k)[1])
    cap = capacity(S_, k, n, 0.75)
    valid = np.ones((G, S_), bool)
    valid[0, 10:] = False  # padding at the end of a row
    valid[1, ::4] = False  # closing EOS inside a row
    valid[2, :] = False
    slots = jax.jit(capacity_slots, static_argnums=(1, 2))
    slot, keep, _ = slots(jnp.asarray(idx), n, cap, jnp.asarray(valid))
    ref_slot, ref_keep = numpy_capacity_slots(idx, n, cap, valid)
    np.testing.assert_array_equal(np.asarray(keep), ref_keep)
    np.testing.assert_array_equal(np.asarray(slot), ref_slot)
    assert not ref_keep[~valid].any() and (np.asarray(slot)[~valid] == n * cap).all()
    # the padding matters here: routed with it, valid tokens would lose (or gain) slots
    old_keep = numpy_capacity_keep(idx, n, cap)
    assert (old_keep[valid] != ref_keep[valid]).any()
    # unpacked (no mask) and an all-valid mask assign the same slots
    np.testing.assert_array_equal(np.asarray(capacity_slots(jnp.asarray(idx), n, cap)[0]),
                                  np.asarray(capacity_slots(jnp.asarray(idx), n, cap, jnp.ones((G, S_), bool))[0]))


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_padding_output_and_dropped_fraction_equal_numpy_without_it(layer, dispatch):
    """(b, c) The layer with token weights: its output on valid tokens equals a float64 numpy MoE
    that routes each row with the weight-0 tokens removed; weight-0 tokens get exactly 0 from the
    experts; moe/dropped_fraction is over valid assignments only."""
    graphdef, state, params, x, _ = layer
    cf = 1.0  # capacity 2 of 16 assignments per expert and row: drops, and padding would take slots
    moe_cfg = layer_cfg(f"model.moe.dispatch={dispatch}", f"model.moe.capacity_factor={cf}").moe
    w = packed_weights()

    @jax.jit
    def run(p, x, w):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, p)
        module = nnx.merge(graphdef, st)
        module.moe = moe_cfg
        return module(x, token_weights=w)

    y, aux = run(params, x, jnp.asarray(w))
    cap = capacity(S, K, E, cf) if dispatch == "capacity" else None
    idx, keep, y_ref, dropped_ref = numpy_moe(params, x, w, cap)
    np.testing.assert_array_equal(np.asarray(jax.lax.top_k(x @ params["router"], K)[1]), idx)
    y = np.asarray(y)
    assert not y[w == 0].any()
    assert np.abs(y - y_ref).max() <= 1e-5 * np.abs(y_ref).max()
    assert float(aux["dropped"]) == pytest.approx(dropped_ref, abs=1e-6)
    if dispatch == "capacity":
        assert 0 < dropped_ref
        # the check can fail: routing the padding too changes valid tokens' outputs and the fraction
        all_keep = numpy_capacity_keep(idx, E, cap)
        assert (all_keep[w > 0] != keep[w > 0]).any()
        assert abs((1 - all_keep.mean()) - dropped_ref) > 1e-3
    else:
        assert dropped_ref == 0


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_padding_under_expert_parallelism_matches_one_device(layer, devices, dispatch):
    """(d) data=2 x expert=4, tokens all_to_all'd: output and gradients (params, input) of the
    layer on packed, padded rows equal the one-device run; no gradient reaches a weight-0 token
    through the experts."""
    graphdef, state, params, x, r = layer
    moe_cfg = layer_cfg(f"model.moe.dispatch={dispatch}", "model.moe.capacity_factor=1.0").moe
    w = jnp.asarray(packed_weights())
    data, expert = 2, 4
    mesh = Mesh(np.array(devices[:data * expert]).reshape(data, expert), ("data", "expert"))
    specs = {k: P("expert") if k.startswith("w_") else P() for k in params}
    hook = lambda *a, **kw: moe_apply(*a, **kw, axis="expert", axis_size=expert)

    def layer_fn(p, x, w):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, p)
        module = nnx.merge(graphdef, st)
        module.moe = moe_cfg
        y, aux = module(x, token_weights=w)
        return y, aux["dropped"]

    def local(p, xl, wl):
        with nn.use_context(nn.Context(experts=hook)):
            y, dropped = layer_fn(p, xl, wl)
        return y, jax.lax.pmean(dropped, ("data", "expert"))

    rows = P(("data", "expert"))
    ep = jax.shard_map(local, mesh=mesh, in_specs=(specs, rows, rows), out_specs=(rows, P()))

    def grads(fn, p, x, w):
        def loss(p, x):
            y, dropped = fn(p, x, w)
            return (y * r).sum(), (y, dropped)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(p, x)

    (l_ref, (y_ref, d_ref)), (g_ref, gx_ref) = grads(layer_fn, params, x, w)
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
    (l, (y, d)), (g, gx) = grads(ep, {k: put(v, specs[k]) for k, v in params.items()}, put(x, rows), put(w, rows))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    assert float(d) == pytest.approx(float(d_ref), abs=1e-6)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-6)
    for k in g_ref:
        np.testing.assert_allclose(g[k], g_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert not np.asarray(gx)[np.asarray(w) == 0].any()
    assert np.asarray(gx)[np.asarray(w) > 0].any()
