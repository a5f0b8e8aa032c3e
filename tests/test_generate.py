"""Sampling: KV-cached decoding gives the full forward's logits at every position, greedy decoding
is the argmax of the full forward, `jaxpar generate` reads a checkpoint saved in any layout, and
bad input is one clear error."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.data import decode, encode
from jaxpar.generate import Generator, model_def, sample
from jaxpar.train.trainer import Trainer

QUIET = lambda s: None


def full_forward(model_cfg):
    """(params, ids) -> the training forward's logits (no cache) on the whole sequence, float64
    on the host; one jit, compiled once per length."""
    model = model_def(model_cfg)
    forward = jax.jit(lambda params, ids: model.merge(model.state(params))(ids[None])[0])
    return lambda params, ids: np.asarray(forward(params, jnp.asarray(ids)), np.float64)


# MoE: a dense layer then an MoE one per group (every_n=2), dropless in training too (with a
# capacity, the full forward would drop what decoding, one token at a time, never drops)
MOE = ("model.n_layers=4", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.every_n=2",
       "model.moe.dispatch=dropless")


@pytest.mark.parametrize("extra", [(), ("model.tie_embeddings=true", "model.n_kv_heads=1"), MOE],
                         ids=["llama", "tied-mqa", "moe"])
def test_cached_decode_equals_full_forward(extra):
    cfg = tiny_config("model.init_std=0.1", *extra)
    model = model_def(cfg.model)
    params = jax.jit(model.init, static_argnums=0)(3)
    gen = Generator(cfg.model, params, context=32)
    prompt = np.array([5, 17, 200, 3, 99, 42, 7], np.int32)
    # 25 new tokens fill the context: every generate below has a cache of 32 (one compile of the
    # prefill and the step for all of them)
    ids, logits = gen.generate(prompt, max_tokens=25, temperature=0.0)
    assert len(ids) == 25
    seq = np.concatenate([prompt, ids])
    ref = full_forward(cfg.model)(params, seq[:-1])
    assert logits.shape == ref.shape == (len(seq) - 1, cfg.model.vocab_size)
    np.testing.assert_allclose(logits, ref, atol=1e-5, rtol=0)
    # greedy: each new token is the full forward's argmax at the position before it
    np.testing.assert_array_equal(ids, ref[len(prompt) - 1:].argmax(-1))
    assert len(set(ids.tolist())) > 1  # not a degenerate model that repeats one token
    # the context bounds the generation; a longer prompt is an error
    ids, _ = gen.generate(prompt, max_tokens=100, temperature=0.0)
    assert len(prompt) + len(ids) == 32
    with pytest.raises(ConfigError, match="prompt is 33 tokens, longer than the model's context of 32"):
        gen.generate(np.zeros(33, np.int32), 4)
    # sampling (temperature > 0) is reproducible per seed
    a, _ = gen.generate(prompt, 25, temperature=1.0, top_p=0.9, seed=1)
    b, _ = gen.generate(prompt, 25, temperature=1.0, top_p=0.9, seed=1)
    np.testing.assert_array_equal(a, b)


def test_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    keys = jax.random.split(jax.random.key(0), 4000)
    draw = jax.jit(jax.vmap(lambda k, p: sample(logits, k, jnp.float32(1.0), p), in_axes=(0, None)))
    got = np.asarray(draw(keys, jnp.float32(0.7)))  # 0.5 + 0.3 reaches 0.7: tokens 0 and 1 only
    assert set(got.tolist()) == {0, 1}
    assert abs((got == 0).mean() - 0.5 / 0.8) < 0.03
    assert set(np.asarray(draw(keys, jnp.float32(1.0))).tolist()) == {0, 1, 2, 3}
    assert int(sample(logits, keys[0], jnp.float32(0.0), jnp.float32(0.5))) == 0


def save_initial_state(cfg, devices, run_dir):
    """A run dir holding a checkpoint of `cfg`'s initial state, laid out and written as `fit`
    writes its checkpoints (Trainer.save: the trainer's sharding, its saved config), without
    compiling a train step (what these tests read does not depend on training); its params."""
    trainer = Trainer(cfg, devices=devices, log=QUIET)
    state = trainer.init_state()
    ckpt = trainer.make_checkpointer(run_dir)
    trainer.save(ckpt, cfg.train.steps, state)
    ckpt.close()
    return state["params"]


def test_generate_cli_reads_a_sharded_checkpoint(tmp_path, devices, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n" * 20)
    cfg = tiny_config("data.source=text", f"data.paths=[{corpus}]", "train.steps=2", "mesh.data=2",
                      "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=3", "model.init_std=0.1",
                      "checkpoint.async_save=false")
    params = save_initial_state(cfg, devices, tmp_path / "run")  # saved sharded over data x fsdp x tensor
    assert params["layers"]["wq"].sharding.spec[1:3] == ("fsdp", "tensor")
    params = jax.device_get(params)
    prompt = "def add("
    ids = list(encode(prompt))
    forward, padded = full_forward(cfg.model), np.zeros(cfg.train.seq_len, np.int32)
    for _ in range(6):  # greedy continuation from full forwards (no cache) of the saved params,
        padded[:len(ids)] = ids  # all of one length (causal: the padding changes no logit before it)
        ids.append(int(forward(params, padded)[len(ids) - 1].argmax()))
    want = prompt + decode(ids[len(encode(prompt)):])
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--max-tokens", "6",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == want + "\n"
    # tensor parallel over 2 local devices: the same tokens; 3 does not divide the heads
    assert main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--max-tokens", "6",
                 "--temperature", "0", "--devices", "2"]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--devices", "3"]) == 2
    err = capsys.readouterr().err
    assert "--devices 3 cannot split this model" in err and "valid: [1, 2]" in err
    assert main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--devices", "99"]) == 2
    assert "--devices 99 must be between 1 and the 8 local devices" in capsys.readouterr().err
    # a prompt longer than the context (train.seq_len=32), a missing checkpoint: one clear error
    assert main(["generate", str(tmp_path / "run"), "--prompt", "x" * 40]) == 2
    assert "prompt is 40 tokens, longer than the model's context of 32" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "no such file or directory" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main(["generate", str(tmp_path / "empty"), "--prompt", "x"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    # exported, a jaxpar-trained model's context is its train.seq_len; no token ids are known
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 32 and "eos_token_id" not in exported
    assert not (tmp_path / "hf" / "generation_config.json").exists()


@pytest.mark.parametrize("option, value, match", [
    ("--temperature", "nan", "--temperature nan must be a finite number >= 0"),
    ("--temperature", "-1", "--temperature -1.0 must be a finite number >= 0"),
    ("--top-p", "0", r"--top-p 0.0 must be in \(0, 1\]"),
    ("--top-p", "nan", r"--top-p nan must be in \(0, 1\]"),
    ("--max-tokens", "-3", "--max-tokens -3 must be >= 0"),
    ("--seed", "99999999999999999999", r"--seed 99999999999999999999 must be in \[0, 4294967295\]"),
    ("--seed", "-1", r"--seed -1 must be in \[0, 4294967295\]"),
])
def test_bad_sampling_option_is_named_alone(tmp_path, capsys, option, value, match):
    """Checked before any checkpoint is read; the message names only the bad option."""
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x", option, value]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err
    assert not [o for o in ("--temperature", "--top-p", "--max-tokens", "--seed") if o != option and o in err]


def test_generate_uses_the_runs_tokenizer(tmp_path):
    from jaxpar.data.tokenizer import train_bpe
    from jaxpar.generate import codec_for
    corpus = tmp_path / "a.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 50)
    tok = train_bpe([corpus], 300, tmp_path / "tok.json")
    codec = codec_for(tiny_config("model.vocab_size=384", f"data.tokenizer={tok}"))
    ids = codec.encode("def add(x, y):")
    assert codec.name == str(tok) and codec.eos_id == 0 and len(ids) < len("def add(x, y):")
    assert codec.decode(ids) == "def add(x, y):"
    # a .bin prepared with it names it in its .json
    (tmp_path / "d.bin").write_bytes(b"\0\0")
    (tmp_path / "d.bin.json").write_text(f'{{"tokenizer": "{tok}"}}')
    cfg = tiny_config("model.vocab_size=384", "data.source=bin", f"data.bin_path={tmp_path / 'd.bin'}")
    assert codec_for(cfg).name == str(tok)
    assert codec_for(tiny_config()).name == "bytes"
    with pytest.raises(ConfigError, match=r"has vocab_size \d+, above model.vocab_size=256"):
        codec_for(tiny_config(f"data.tokenizer={tok}"))


def test_export_carries_the_runs_tokenizer(tmp_path, devices, capsys):
    """A run on a tokenizer (its checkpoint's saved config names it) exports it beside the
    weights, with its end-of-text id as the model's eos (what transformers' generate stops at)."""
    from jaxpar.data.tokenizer import Tokenizer, train_bpe
    corpus = tmp_path / "a.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 50)
    tok = train_bpe([corpus], 300, tmp_path / "tok.json")
    cfg = tiny_config("model.vocab_size=384", "data.source=text", f"data.paths=[{corpus}]",
                      f"data.tokenizer={tok}", "train.steps=1", "checkpoint.async_save=false", "mesh.data=1")
    save_initial_state(cfg, devices[:1], tmp_path / "run")
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    eos = Tokenizer(tok).eos_id
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and tc["eos_token"] == "<|endoftext|>"


def test_the_prompt_starts_with_the_models_bos():
    from jaxpar.config import ModelConfig
    from jaxpar.generate import Codec, prompt_ids
    codec = Codec(encode, decode)
    plain, with_bos = ModelConfig(), ModelConfig(bos_token_id=1)
    assert list(prompt_ids(codec, plain, "ab")) == list(encode("ab"))
    assert list(prompt_ids(codec, with_bos, "ab")) == [1, *encode("ab")]
    assert list(prompt_ids(codec, with_bos, "\x01b")) == list(encode("\x01b"))  # already first
    assert len(prompt_ids(codec, with_bos, "")) == 0  # empty stays empty: its own error


def sentencepiece_like(path):
    """A tokenizer.json decoding as Llama 2's and Mixtral's do: each word a '▁word' token, the
    decoder fusing them and stripping the one space a text starts with. Vocab 256."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"▁w{i}": 3 + i for i in range(253)}}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.save(str(path))
    return path


def test_the_continuation_is_decoded_after_the_prompt(tmp_path, devices, capsys):
    """What generate prints is the whole sequence as the tokenizer decodes it (as transformers
    shows a generation): with a SentencePiece-style decoder the continuation's first word keeps
    the space before it."""
    from jaxpar.data.tokenizer import Tokenizer
    cfg = tiny_config("train.steps=1", "checkpoint.async_save=false", "mesh.data=1", "model.init_std=0.1")
    params = save_initial_state(cfg, devices[:1], tmp_path / "run")
    tok = Tokenizer(sentencepiece_like(tmp_path / "tokenizer.json"))
    prompt = "w1 w2 w30"
    ids = tok.encode(prompt)
    new, _ = Generator(cfg.model, params, context=32).generate(ids, 6, temperature=0.0, eos_id=tok.eos_id)
    new = new[:-1] if len(new) and new[-1] == tok.eos_id else new
    assert len(new) > 1 and tok.decode(ids) == prompt
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--max-tokens", "6",
                 "--temperature", "0", "--tokenizer", str(tmp_path / "tokenizer.json")]) == 0
    assert capsys.readouterr().out == tok.decode([*ids, *new]) + "\n"
