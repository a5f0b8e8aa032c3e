"""Hugging Face checkpoints in and out (jaxpar/hf): logits against transformers' own, bit-exact
round trips, training from `train.init_from`, and one clear error per bad input.

The reference checkpoints live in ../shared/fixtures/hf (beside the clone; see its README).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.checkpoint import CheckpointError, read_config
from jaxpar.cli import main as cli_main
from jaxpar.config import ConfigError, ModelConfig, make_config
from jaxpar.hf.convert import load_checkpoint_params
from jaxpar.hf.hfconfig import HFError, hf_config, model_config, read_hf_config
from jaxpar.hf.init import checkpoint_step_dir, init_config
from jaxpar.hf.reading import load_params
from jaxpar.hf.writing import write_hf
from jaxpar.train.model import ModelDef
from jaxpar.train.builtin import llama_model_factory
from models.llama import llama3_frequencies
from tests.grad_util import run_steps

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "hf"
NAMES = ("llama_gqa", "mixtral")
pytestmark = [pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"no HF fixtures in {FIXTURES}"),
              pytest.mark.xdist_group("hf")]  # its module fixtures are built once, on one worker


def st():
    import safetensors.numpy as stn
    return stn


def leaves(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def imported():
    """name -> (model config, params) read from the fixture."""
    out = {}
    for name in NAMES:
        m = model_config(read_hf_config(FIXTURES / name))
        out[name] = (m, load_params(FIXTURES / name, m))
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The llama fixture converted by `jaxpar convert from-hf` (a checkpoints dir)."""
    out = tmp_path_factory.mktemp("hf") / "llama_ckpt"
    assert cli_main(["convert", "from-hf", str(FIXTURES / "llama_gqa"), str(out)]) == 0
    return out


def forward(m: ModelConfig, params, tokens) -> np.ndarray:
    md = ModelDef.from_factory(llama_model_factory(make_config({"model": m.model_dump(mode="json")})))
    return np.asarray(md.merge(md.state(params))(jnp.asarray(tokens, jnp.int32)))


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(imported, name):
    m, params = imported[name]
    ref = st().load_file(str(FIXTURES / name / "reference.safetensors"))
    logits = forward(m, params, ref["input_ids"])
    err = np.abs(logits - ref["logits"]).max()
    assert err < 1e-4, f"{name}: max |jaxpar - transformers| = {err:.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_cached_decode_matches_transformers(imported, name):
    """jaxpar generate's decode path (models' `decode`: a prefill, then one token per call with
    the KV cache; MoE dropless) fed the reference tokens gives transformers' logits."""
    from jaxpar.generate import Generator
    from jaxpar.train.builtin import init_cache
    m, params = imported[name]
    ref = st().load_file(str(FIXTURES / name / "reference.safetensors"))
    tokens, want = np.asarray(ref["input_ids"][0], np.int32), ref["logits"][0]
    gen = Generator(m, params, context=len(tokens))
    cache = init_cache(m, 1, len(tokens), jnp.float32)
    half = len(tokens) // 2
    logits, cache = gen._prefill(params, jnp.asarray(tokens[None, :half]), cache, jnp.int32(0))
    got = [np.asarray(logits[0])]
    key, zero = jax.random.key(0), jnp.float32(0)
    for pos in range(half, len(tokens)):  # teacher-forced: the reference's token at pos
        _, last, cache = gen._step(params, jnp.int32(tokens[pos]), cache, jnp.int32(pos), key, zero, zero + 1)
        got.append(np.asarray(last)[None])
    err = np.abs(np.concatenate(got) - want).max()
    assert err < 1e-4, f"{name}: cached decode max |jaxpar - transformers| = {err:.2e}"


def test_config_mapping():
    llama = model_config(read_hf_config(FIXTURES / "llama_gqa"))
    assert (llama.n_heads, llama.n_kv_heads, llama.resolved_head_dim, llama.tie_embeddings) == (4, 2, 16, False)
    mix = model_config(read_hf_config(FIXTURES / "mixtral"))
    assert (mix.moe.num_experts, mix.moe.top_k, mix.moe.dispatch, mix.rope_theta) == (4, 2, "dropless", 1e6)
    for m in (llama, mix):  # written back and read again: the same model
        assert model_config(hf_config(m)) == m
    # Llama 3.1's config styles: rope_theta / rope_scaling at the top level, and rope_parameters
    base = {k: v for k, v in read_hf_config(FIXTURES / "llama_gqa").items() if k != "rope_parameters"}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = model_config({**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling},
                        "tie_word_embeddings": True})
    new = model_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling},
                        "tie_word_embeddings": True})
    assert old == new and old.rope_theta == 500000.0 and old.rope_scaling.factor == 8.0 and old.tie_embeddings
    assert model_config(hf_config(old)) == old


def test_llama3_frequencies():
    s = ModelConfig.model_validate({"rope_scaling": {"type": "llama3"}}).rope_scaling
    inv = 1.0 / 500000.0 ** (jnp.arange(0, 128, 2, dtype=jnp.float32) / 128)
    out = np.asarray(llama3_frequencies(inv, s))
    wavelen = 2 * np.pi / np.asarray(inv)
    high = wavelen < 8192 / 4      # short wavelengths: kept
    low = wavelen > 8192 / 1       # long ones: stretched by the factor
    np.testing.assert_allclose(out[high], np.asarray(inv)[high], rtol=1e-6)
    np.testing.assert_allclose(out[low], np.asarray(inv)[low] / 8, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any() and np.all(out[mid] <= np.asarray(inv)[mid]) and np.all(out[mid] >= np.asarray(inv)[mid] / 8)


def test_export_reimport_bit_exact(imported, converted, tmp_path):
    """from-hf then to-hf writes the fixture's tensors exactly; re-importing gives the same params,
    from one file and from a sharded (index) checkpoint."""
    out = tmp_path / "exported"
    assert cli_main(["convert", "to-hf", str(converted), str(out)]) == 0
    mine, ref = (st().load_file(str(p / "model.safetensors")) for p in (out, FIXTURES / "llama_gqa"))
    assert sorted(mine) == sorted(ref)
    for k in ref:
        assert mine[k].dtype == ref[k].dtype and mine[k].shape == ref[k].shape, k
        assert mine[k].tobytes() == ref[k].tobytes(), k
    m, params = imported["llama_gqa"]
    assert model_config(read_hf_config(out)) == m
    want = leaves(params)
    for d in (out, tmp_path / "sharded"):
        if d.name == "sharded":
            write_hf(params, m, d, max_shard_bytes=40_000)
            assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 3
        again = leaves(load_params(d, m))
        assert sorted(again) == sorted(want)
        for k in want:
            assert again[k].tobytes() == want[k].tobytes(), k


def test_mixtral_round_trip(imported, tmp_path):
    m, params = imported["mixtral"]
    to = tmp_path / "mix"
    write_hf(params, m, to)
    mine, ref = (st().load_file(str(p / "model.safetensors")) for p in (to, FIXTURES / "mixtral"))
    assert sorted(mine) == sorted(ref) and all(mine[k].tobytes() == ref[k].tobytes() for k in ref)


def test_bfloat16_export(imported, tmp_path):
    m, params = imported["llama_gqa"]
    write_hf(params, m, tmp_path / "bf16", dtype="bfloat16")
    assert st().load_file(str(tmp_path / "bf16" / "model.safetensors"))["lm_head.weight"].dtype == jnp.bfloat16
    back = leaves(load_params(tmp_path / "bf16", m))
    for k, v in leaves(params).items():
        np.testing.assert_array_equal(back[k], v.astype(jnp.bfloat16).astype(np.float32), err_msg=k)


def train_cfg(init_from: str):
    return make_config({}, [
        f"train.init_from={init_from}", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
        "sharding.zero_stage=3", "train.global_batch=8", "train.seq_len=16", "train.compute_dtype=float32",
        "train.progress=false", "data.source=synthetic", "optimizer.warmup_steps=0", "train.steps=1"])


def test_train_step_from_hf_equals_converted_checkpoint(imported, converted, devices):
    """One step from hf:DIR (params read straight onto a data x fsdp x tensor ZeRO-3 layout) and
    one from the converted checkpoint: the same loss and gradients; the HF params are the start."""
    a = run_steps(train_cfg(f"hf:{FIXTURES / 'llama_gqa'}"), 1, devices)[0]
    b = run_steps(train_cfg(str(converted)), 1, devices)[0]
    assert np.isfinite(a["loss"]) and a["loss"] == b["loss"]
    ga, gb = leaves(a["grads"]), leaves(b["grads"])
    assert sorted(ga) == sorted(gb)
    for k in ga:
        np.testing.assert_array_equal(ga[k], gb[k], err_msg=k)
    params, model, _ = load_checkpoint_params(converted)
    assert model == imported["llama_gqa"][0]
    for k, v in leaves(imported["llama_gqa"][1]).items():
        assert leaves(params)[k].tobytes() == v.tobytes(), k


def test_init_from_fills_the_model_and_rejects_another_shape():
    spec = f"hf:{FIXTURES / 'mixtral'}"
    cfg = init_config(make_config({}, [f"train.init_from={spec}", "model.moe.capacity_factor=2.0"]))
    assert cfg.model.dim == 64 and cfg.model.moe.num_experts == 4 and cfg.model.moe.capacity_factor == 2.0
    with pytest.raises(ConfigError, match=r"model\.dim=128 \(the source has 64\)"):
        init_config(make_config({}, [f"train.init_from={spec}", "model.preset=tiny"]))


# ------------------------------------------------------------------ bad input: one clear error each


def copy_fixture(tmp_path, name="llama_gqa", config=None, drop=None, reshape=None, add=None) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copy(FIXTURES / name / "config.json", d / "config.json")
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    tensors = st().load_file(str(FIXTURES / name / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    for k, v in (add or {}).items():
        tensors[k] = v
    st().save_file(tensors, str(d / "model.safetensors"))
    return d


def expect_error(d: Path, match: str):
    with pytest.raises(HFError, match=match):
        m = model_config(read_hf_config(d))
        load_params(d, m)


def test_bad_config_json(tmp_path):
    d = copy_fixture(tmp_path)
    (d / "config.json").unlink()
    expect_error(d, "config.json not found")
    (d / "config.json").write_text("{not json")
    expect_error(d, "config.json is not valid JSON")
    (d / "config.json").write_text("[1, 2]")
    expect_error(d, "must hold a JSON object")
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    expect_error(d, r"vocab_size = None: a positive integer is required")


def test_bad_tensors(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    expect_error(copy_fixture(tmp_path / "a", drop=name), rf"missing tensor {re.escape(name)}")
    expect_error(copy_fixture(tmp_path / "b", reshape=name),
                 rf"tensor {re.escape(name)} has shape \[31, 64\], the config says \[32, 64\]")


@pytest.mark.parametrize("field, value, match", [
    ("attention_bias", True, "attention_bias = True is not supported"),
    ("hidden_act", "gelu", "hidden_act = 'gelu' is not supported"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
     "rope_parameters.rope_type = 'yarn' is not supported"),
    ("model_type", "gpt2", "model_type = 'gpt2' is not supported"),
    ("architectures", ["LlamaForSequenceClassification"],
     r"architectures = \['LlamaForSequenceClassification'\] is not supported .*\['LlamaForCausalLM'\]"),
    ("eos_token_id", "</s>", "eos_token_id = '</s>' is not a token id"),
    ("num_attention_heads", 0, "num_attention_heads = 0: a positive integer is required"),
    ("vocab_size", -320, "vocab_size = -320: a positive integer is required"),
    # the model's own checks: their message, not pydantic's help link
    ("num_key_value_heads", 3, r"cannot represent this model: n_heads=4 must be a multiple of n_kv_heads=3$"),
    ("head_dim", 15, r"cannot represent this model: the head dim \(head_dim=15 = 15\) must be even"),
    ("rms_norm_eps", -1.0, r"cannot represent this model: model.norm_eps = -1.0: Input should be greater than 0$"),
    ("rms_norm_eps", "x", r"cannot represent this model: model.norm_eps = 'x': Input should be a valid number"),
])
def test_unsupported_fields(tmp_path, field, value, match):
    hf = {**read_hf_config(FIXTURES / "llama_gqa"), field: value}
    expect_error(copy_fixture(tmp_path, config=hf), match)


def test_sliding_window_and_cli_message(tmp_path, capsys):
    hf = {**read_hf_config(FIXTURES / "mixtral"), "sliding_window": 4096}
    d = copy_fixture(tmp_path, "mixtral", config=hf)
    assert cli_main(["convert", "from-hf", str(d), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "sliding_window = 4096 is not supported" in err and "Traceback" not in err


@pytest.mark.parametrize("size", ["0", "-1", "nan", "inf", "big"])
def test_a_max_shard_size_that_is_no_size_is_one_error(tmp_path, capsys, size):
    """--max-shard-gb 0 or below wrote one file per tensor, NaN crashed after loading the run:
    refused by argparse, naming the option, before anything is read."""
    with pytest.raises(SystemExit) as stop:
        cli_main(["convert", "to-hf", str(tmp_path / "nothing"), str(tmp_path / "out"), "--max-shard-gb", size])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--max-shard-gb" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_tied_embeddings_and_index_that_leaves_the_dir(imported, tmp_path):
    m, params = imported["llama_gqa"]
    tied = m.model_copy(update={"tie_embeddings": True})
    write_hf({k: v for k, v in params.items() if k != "head"}, tied, tmp_path / "tied")
    assert "lm_head.weight" not in st().load_file(str(tmp_path / "tied" / "model.safetensors"))
    again = load_params(tmp_path / "tied", model_config(read_hf_config(tmp_path / "tied")))
    assert "head" not in again and np.array_equal(again["embed"], params["embed"])
    d = tmp_path / "tied"
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(HFError, match="leaves the checkpoint directory"):
        load_params(d, tied)


def test_bench_convert_smoke(devices):
    from jaxpar.bench import load
    mod, cfg = load("convert", None, ["model.vocab_size=512", "model.dim=64", "model.n_layers=1",
                                      "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128"])
    r = mod.run(cfg, repeats=1)
    assert r["import"]["mb_per_s"] > 0 and r["export"]["mb_per_s"] > 0 and r["zero_stage"] == 3
    assert "import" in mod.format_result(r)


def test_unexpected_tensors_are_an_error_unless_harmless(tmp_path):
    """A tensor no param reads (a layer the config lacks, a bias) is one error listing them; rotary
    inv_freq buffers and lm_head beside tied embeddings are what transformers itself ignores."""
    w = np.zeros((160, 64), np.float32)
    extra = {"model.layers.5.mlp.up_proj.weight": w, "model.layers.0.self_attn.q_proj.bias": w[0]}
    (tmp_path / "a").mkdir()
    expect_error(copy_fixture(tmp_path / "a", add=extra),
                 r"2 tensors that config.json does not account for: model.layers.0.self_attn.q_proj.bias, "
                 r"model.layers.5.mlp.up_proj.weight")
    harmless = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    tied = {**read_hf_config(FIXTURES / "llama_gqa"), "tie_word_embeddings": True}
    d = copy_fixture(tmp_path, config=tied, add=harmless)  # keeps its lm_head.weight
    assert "lm_head.weight" in st().load_file(str(d / "model.safetensors"))
    assert "head" not in load_params(d, model_config(read_hf_config(d)))


def test_export_writes_back_token_ids_and_context(converted, tmp_path):
    """Import then export keeps config.json's bos/eos ids and max_position_embeddings, and writes
    generation_config.json with the ids (transformers' generate reads them there)."""
    out = tmp_path / "exported"
    assert cli_main(["convert", "to-hf", str(converted), str(out)]) == 0
    for name, keys in (("config.json", ("bos_token_id", "eos_token_id", "max_position_embeddings")),
                       ("generation_config.json", ("bos_token_id", "eos_token_id"))):
        ref, mine = (json.loads((p / name).read_text()) for p in (FIXTURES / "llama_gqa", out))
        assert {k: mine[k] for k in keys} == {k: ref[k] for k in keys}, name


def test_from_hf_errors_name_the_dir_and_wrong_dirs_are_named(converted, tmp_path, capsys):
    assert cli_main(["convert", "from-hf", str(tmp_path / "nothing"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nothing'}: not a directory" in err and "train.init_from" not in err
    assert cli_main(["convert", "to-hf", str(FIXTURES / "llama_gqa"), str(tmp_path / "o")]) == 2
    assert "is a Hugging Face model dir" in capsys.readouterr().err
    # a run whose checkpoint.dir is not RUN/checkpoints: its config.yaml says where
    run = tmp_path / "run"
    shutil.copytree(converted, run / "ckpt")
    (run / "config.yaml").write_text("checkpoint:\n  dir: ckpt\n")
    assert checkpoint_step_dir(run, what="generate") == run / "ckpt" / "0"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no complete checkpoint step in .*checkpoint.dir"):
        checkpoint_step_dir(tmp_path / "empty", what="generate")


def test_init_from_vocab_is_fixed_and_text_takes_the_hf_tokenizer(tmp_path):
    from jaxpar.data.tokenizer import train_bpe
    d = copy_fixture(tmp_path)
    spec = f"train.init_from=hf:{d}"
    assert init_config(make_config({}, [spec, "data.source=text"])).data.tokenizer is None
    corpus = tmp_path / "a.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 50)
    train_bpe([corpus], 300, d / "tokenizer.json")
    assert init_config(make_config({}, [spec, "data.source=text"])).data.tokenizer == str(d / "tokenizer.json")
    (tmp_path / "d.bin").write_bytes(b"\0\0")
    (tmp_path / "d.bin.json").write_text(json.dumps({"vocab_size": 1000, "dtype": "uint16"}))
    with pytest.raises(ConfigError, match=r"vocabulary is fixed at 320, but data.bin_path=.* vocabulary of "
                                          r"1000; prepare the data with a tokenizer that fits"):
        init_config(make_config({}, [spec, "data.source=bin", f"data.bin_path={tmp_path / 'd.bin'}"]))


def test_from_hf_then_generate_uses_the_hf_tokenizer_eos_and_context(imported, tmp_path, capsys):
    """from-hf copies the HF dir's tokenizer (data.tokenizer names the copy); generate encodes with
    it, stops at generation_config.json's eos ids (which win over config.json's) and decodes within
    max_position_embeddings (256, not the default train.seq_len 128)."""
    from jaxpar.data.tokenizer import Tokenizer, train_bpe
    from jaxpar.generate import Generator
    d = copy_fixture(tmp_path)
    corpus = tmp_path / "a.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 50)
    tok = Tokenizer(train_bpe([corpus], 300, d / "tokenizer.json"))
    prompt = "def add(x, y):\n    return"
    m, params = imported["llama_gqa"]
    bos = 1  # generation_config.json's, which generate puts first (as transformers' tokenizer does)
    greedy, _ = Generator(m, params, context=256).generate([bos, *tok.encode(prompt)], 8, temperature=0.0)
    k = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])  # the first new token: eos
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": bos,
                                                          "eos_token_id": [319, int(greedy[k])]}))
    out = tmp_path / "ckpt"
    assert cli_main(["convert", "from-hf", str(d), str(out)]) == 0
    saved = read_config(out / "0")
    assert saved["data"]["tokenizer"] == str(out / "tokenizer.json") and (out / "generation_config.json").is_file()
    assert saved["model"]["max_positions"] == 256 and saved["model"]["eos_token_id"] == [319, int(greedy[k])]
    capsys.readouterr()
    assert cli_main(["generate", str(out), "--prompt", prompt, "--max-tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(greedy[:k]) + "\n"
    long = "a + b " * 50  # ~150 tokens: over train.seq_len (128), within max_position_embeddings
    assert 128 < len(tok.encode(long)) < 256
    assert cli_main(["generate", str(out), "--prompt", long, "--max-tokens", "1", "--temperature", "0"]) == 0
    capsys.readouterr()
    assert cli_main(["generate", str(out), "--prompt", long * 2, "--max-tokens", "1"]) == 2
    assert "longer than the model's context of 256 tokens (its model.max_positions)" in capsys.readouterr().err
    assert cli_main(["generate", str(out), "--prompt", "x", "--tokenizer", str(tmp_path / "none.json")]) == 2
    assert "--tokenizer=" in capsys.readouterr().err


@pytest.mark.parametrize("top_k, normalize", [(2, None), (1, None), (1, True)])
def test_an_exported_moe_reads_back_as_the_same_model_or_is_refused(tmp_path, top_k, normalize):
    """Read back as transformers reads it (Mixtral: the top-k gates always renormalised; the
    fixtures' logits pin that reading), an exported MoE computes the logits it computed in jaxpar;
    a model whose gates are not renormalised (top_k 1 by default) is refused instead."""
    m = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32, init_std=0.2,
                    moe=dict(num_experts=4, top_k=top_k, every_n=1, dispatch="dropless", normalize_gates=normalize))
    md = ModelDef.from_factory(llama_model_factory(make_config({"model": m.model_dump(mode="json")})))
    params = md.init(0)
    if top_k == 1 and normalize is None:
        with pytest.raises(HFError, match=r"model.moe.normalize_gates.*top_k=1.*renormalises"):
            write_hf(params, m, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        return
    write_hf(params, m, tmp_path)
    back = model_config(read_hf_config(tmp_path))
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) * 5 % 64
    np.testing.assert_allclose(forward(back, load_params(tmp_path, back), tokens), forward(m, params, tokens),
                               atol=1e-5, rtol=0)
