"""The Llama model against published parameter counts and a float64 numpy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import make_config
from jaxpar.train.model import ModelDef, pure_dict
from models.llama import Llama, param_count

PUBLISHED = {"1b": 1_235_814_400, "8b": 8_030_261_248, "70b": 70_553_706_496}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_parameter_counts(preset):
    cfg = make_config({}, [f"model.preset={preset}"]).model
    assert param_count(cfg) == PUBLISHED[preset]
    built = ModelDef.from_factory(lambda rngs: Llama(cfg, rngs))  # abstract: nothing allocated
    assert built.n_params == PUBLISHED[preset]


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, theta, positions=None):
    b, s, hd = x.shape[0], x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    pos = np.broadcast_to(np.arange(s), (b, s)) if positions is None else positions
    ang = pos[..., None] * inv
    c, sn = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], -1)


def numpy_llama(p, tokens, cfg, positions=None):
    """Independent float64 forward: explicit loops over layers and kv groups."""
    x = p["embed"][tokens]
    H, K = cfg.n_heads, cfg.n_kv_heads
    S = tokens.shape[1]
    mask = np.tril(np.ones((S, S), bool))
    L = p["layers"]
    for i in range(cfg.n_layers):
        h = _rms(x, L["attn_norm"][i], cfg.norm_eps)
        q = _rope(np.einsum("bsd,dhk->bshk", h, L["wq"][i]), cfg.rope_theta, positions)
        k = _rope(np.einsum("bsd,dhk->bshk", h, L["wk"][i]), cfg.rope_theta, positions)
        v = np.einsum("bsd,dhk->bshk", h, L["wv"][i])
        out = np.zeros_like(q)
        for head in range(H):
            g = head // (H // K)
            sc = np.einsum("bsk,btk->bst", q[:, :, head], k[:, :, g]) / np.sqrt(q.shape[-1])
            sc = np.where(mask, sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out[:, :, head] = np.einsum("bst,btk->bsk", pr, v[:, :, g])
        x = x + np.einsum("bshk,hkd->bsd", out, L["wo"][i])
        h = _rms(x, L["mlp_norm"][i], cfg.norm_eps)
        gte, up = h @ L["w_gate"][i], h @ L["w_up"][i]
        x = x + (gte / (1 + np.exp(-gte)) * up) @ L["w_down"][i]
    x = _rms(x, p["norm"], cfg.norm_eps)
    return x @ (p["embed"].T if cfg.tie_embeddings else p["head"])


@pytest.mark.parametrize("tie", [False, True])
def test_forward_matches_numpy_float64(tie):
    cfg = make_config({}, ["model.preset=tiny", f"model.tie_embeddings={tie}"]).model
    model = Llama(cfg, nnx.Rngs(1))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    got = np.asarray(model(jnp.asarray(tokens)), np.float64)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), pure_dict(nnx.state(model, nnx.Param)))
    want = numpy_llama(params, tokens, cfg)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_forward_at_given_positions_matches_numpy_float64():
    """Each row's own RoPE positions (a context shard's global ones, or restarted per document)."""
    cfg = make_config({}, ["model.preset=tiny"]).model
    model = Llama(cfg, nnx.Rngs(2))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
    positions = np.stack([np.arange(12) + 100, np.r_[np.arange(5), np.arange(7)]])
    got = np.asarray(model(jnp.asarray(tokens), positions=jnp.asarray(positions)), np.float64)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), pure_dict(nnx.state(model, nnx.Param)))
    np.testing.assert_allclose(got, numpy_llama(params, tokens, cfg, positions), rtol=2e-4, atol=2e-5)
    assert not np.allclose(got, numpy_llama(params, tokens, cfg), rtol=2e-4, atol=2e-5)


def test_layers_are_stacked_and_scanned():
    cfg = make_config({}, ["model.preset=tiny", "model.n_layers=3"]).model
    md = ModelDef.from_factory(lambda rngs: Llama(cfg, rngs))
    assert md.axes["layers"]["wq"] == ("layers", "embed", "heads", "head_dim")
    assert md.shapes["layers"]["wq"].shape[0] == 3
    model = Llama(cfg, nnx.Rngs(0))
    hlo = jax.jit(lambda t: model(t)).lower(jnp.zeros((1, 8), jnp.int32)).as_text()
    assert "while" in hlo  # one scanned body, not 3 unrolled layers
