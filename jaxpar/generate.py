"""`jaxpar generate RUN_OR_CKPT --prompt TEXT`: sample from a checkpoint with a KV cache.

The params are restored onto the local devices asked for (`--devices N`, default 1), whatever
layout they were saved in (orbax reshards), in the run's train.param_dtype: on N devices they and
the KV cache are split over heads (tensor parallel, by the run's own sharding rules) and the
compiler partitions the decode. Dense Llama and MoE models alike (an MoE layer decodes dropless:
a token's output never depends on which tokens share its step). Decoding is the model's `decode` path
(models/llama.py): the prompt in one jitted call (prefill), then one jitted call per token, each
writing its keys and values into the cache. Temperature 0 is greedy (argmax); otherwise the
logits are divided by the temperature and sampled from the smallest set of tokens whose
probability reaches `top_p` (nucleus sampling). Text goes through `--tokenizer`, else the run's
tokenizer (data.tokenizer, or the one that prepared data.bin_path) or, without one, bytes.
The context is model.max_positions (an imported model's max_position_embeddings) or else
train.seq_len; decoding stops at model.eos_token_id (any of a list) when set, else at the
tokenizer's end-of-text token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import make_single_device_sharding

from jaxpar.checkpoint import CheckpointError, read_config, restore_params
from jaxpar.config import Config, ConfigError
from jaxpar.data import text
from jaxpar.data.tokenizer import Tokenizer, run_tokenizer
from jaxpar.config import MeshConfig
from jaxpar.hf.init import checkpoint_step_dir
from jaxpar.mesh import build_mesh
from jaxpar.parallel import expert  # noqa: F401 (the local MoE dispatch the decode uses)
from jaxpar.sharding import Plan
from jaxpar.train.builtin import init_cache, model_class
from jaxpar.train.model import ModelDef
from jaxpar.train.precision import DTYPES


@dataclass(frozen=True)
class Codec:
    """Text <-> ids: a tokenizer.json, or bytes."""

    encode: Callable[[str], np.ndarray]
    decode: Callable[[Any], str]
    eos_id: int | None = None
    name: str = "bytes"


def codec_for(cfg: Config, tokenizer: str | Path | None = None) -> Codec:
    """The run's text <-> ids (`tokenizer`, a tokenizer.json, overrides the run's)."""
    path = tokenizer or run_tokenizer(cfg.data)
    if path:
        what = "--tokenizer" if tokenizer else "data.tokenizer"
        tok = Tokenizer(path, what, need_eos=cfg.model.eos_token_id is None)
        tok.check_vocab(cfg.model.vocab_size, what)
        return Codec(tok.encode, tok.decode, tok.eos_id, str(path))
    if cfg.model.vocab_size < text.VOCAB_SIZE:
        raise ConfigError(f"generate: the run has no data.tokenizer and model.vocab_size="
                          f"{cfg.model.vocab_size} is too small for bytes ({text.VOCAB_SIZE})")
    return Codec(text.encode, text.decode)


def context_of(model_cfg, seq_len: int) -> tuple[int, str]:
    """(the decode context, where it comes from): model.max_positions, else train.seq_len."""
    if model_cfg.max_positions:
        return model_cfg.max_positions, "model.max_positions"
    return seq_len, "train.seq_len"


def stop_ids(model_cfg, codec: Codec) -> tuple[int, ...]:
    """The ids that end a generation: model.eos_token_id (int or list) when set, else the codec's."""
    eos = model_cfg.eos_token_id
    if eos is None:
        return () if codec.eos_id is None else (codec.eos_id,)
    return tuple(eos) if isinstance(eos, list) else (eos,)


def prompt_ids(codec: Codec, model_cfg, prompt: str) -> np.ndarray:
    """The prompt's ids, after model.bos_token_id when the model has one (an imported Llama was
    trained with it first, as transformers' tokenizer adds it; jaxpar's encode adds nothing)."""
    ids = np.asarray(codec.encode(prompt))
    bos = model_cfg.bos_token_id
    if bos is not None and prompt and (len(ids) == 0 or int(ids[0]) != bos):
        ids = np.concatenate([np.array([bos], ids.dtype if ids.size else np.int64), ids])
    return ids


SEEDS = 2**32  # jax.random.key keeps a seed's low 32 bits (without x64): larger ones repeat smaller ones


def check_options(max_tokens: int, temperature: float, top_p: float, seed: int = 0) -> None:
    """A ConfigError naming the one bad sampling option (NaN fails every check)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"generate: --temperature {temperature} must be a finite number >= 0 "
                          f"(0: greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"generate: --top-p {top_p} must be in (0, 1] (1: the whole distribution)")
    if not max_tokens >= 0:
        raise ConfigError(f"generate: --max-tokens {max_tokens} must be >= 0")
    if not 0 <= seed < SEEDS:
        raise ConfigError(f"generate: --seed {seed} must be in [0, {SEEDS - 1}]")


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """One token id from float32 logits [vocab]: argmax at temperature <= 0, else nucleus sampling."""
    greedy = jnp.argmax(logits)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    probs = jax.nn.softmax(scaled)
    ranked = jnp.sort(probs)[::-1]
    before = jnp.cumsum(ranked) - ranked  # mass of the more likely tokens
    floor = jnp.min(jnp.where(before < top_p, ranked, jnp.inf))  # the least likely token kept
    drawn = jax.random.categorical(key, jnp.where(probs >= floor, scaled, -jnp.inf))
    return jnp.where(temperature <= 0, greedy, drawn).astype(jnp.int32)


@dataclass(frozen=True)
class Placement:
    """Where decoding runs: one device, or a tensor-parallel mesh of local devices."""

    params: Any        # a sharding per param (the model's tree)
    cache: Any         # the sharding of every KV-cache leaf


def model_def(model_cfg) -> ModelDef:
    cls = model_class(model_cfg)
    return ModelDef.from_factory(lambda rngs: cls(model_cfg, rngs))


def placement(cfg: Config, devices: int = 1) -> Placement:
    """The params split over `devices` local devices by the run's rules for `heads`, `mlp`,
    `vocab` (all on mesh.tensor); one device: everything on the first."""
    local = jax.local_devices()
    model = model_def(cfg.model)
    if devices == 1:
        one = make_single_device_sharding(local[0])
        return Placement(jax.tree.map(lambda _: one, model.shapes), one)
    plan = Plan(build_mesh(MeshConfig(data=1, tensor=devices), local[:devices]),
                cfg.sharding.resolved_rules(), zero_stage=0)
    try:
        specs = plan.tree_specs(model.axes, model.shapes, "param")
        cache = plan.spec(("layers", "batch", "seq", "kv_heads", "head_dim"),
                          (1, 1, 1, cfg.model.n_kv_heads, 1), "param", "the KV cache")
    except ConfigError as e:
        raise ConfigError(f"generate: --devices {devices} cannot split this model: {e}; "
                          f"valid: {valid_device_counts(cfg.model, len(local))}") from None
    return Placement(jax.tree.map(plan.sharding, specs), plan.sharding(cache))


def valid_device_counts(model_cfg, local: int) -> list[int]:
    dims = (model_cfg.n_heads, model_cfg.n_kv_heads, model_cfg.vocab_size, model_cfg.ffn_dim)
    return [n for n in range(1, local + 1) if all(d % n == 0 for d in dims)]


class Generator:
    """Decoding from `params` (a Llama's or MoELlama's, any placement) with a KV cache of
    `context` tokens, placed by `cache_sharding` (default: where jax puts it)."""

    def __init__(self, model_cfg, params, context: int, dtype=jnp.float32, cache_sharding=None,
                 context_from: str = "train.seq_len"):
        self.model_cfg, self.params, self.context, self.dtype = model_cfg, params, context, dtype
        self.context_from = context_from
        self.cache_sharding = cache_sharding
        self.model = model_def(model_cfg)

        def run(params, tokens, cache, pos):
            logits, cache = self.model.merge(self.model.state(params)).decode(tokens, cache, pos)
            return logits.astype(jnp.float32), cache

        def step(params, token, cache, pos, key, temperature, top_p):
            logits, cache = run(params, token[None, None], cache, pos)
            return sample(logits[0, -1], key, temperature, top_p), logits[0, -1], cache

        self._prefill = jax.jit(run, donate_argnums=2)
        self._step = jax.jit(step, donate_argnums=2)
        self._sample = jax.jit(sample)

    def generate(self, prompt: np.ndarray, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, eos_id: int | tuple[int, ...] | list[int] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(the new token ids, the float32 logits [prompt + new - 1, vocab] that predicted each
        position after the first). The prompt must fit the context; generation stops at `eos_id`
        (any of them, when several) or when the context is full."""
        check_options(max_tokens, temperature, top_p, seed)
        stops = set() if eos_id is None else {int(eos_id)} if np.ndim(eos_id) == 0 else set(map(int, eos_id))
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        n = len(prompt)
        if n == 0:
            raise ConfigError("generate: the prompt is empty; give --prompt some text")
        if n > self.context:
            raise ConfigError(f"generate: the prompt is {n} tokens, longer than the model's context of "
                              f"{self.context} tokens (its {self.context_from}); shorten the prompt")
        length = min(self.context, n + max_tokens)
        cache = init_cache(self.model_cfg, 1, length, self.dtype)
        if self.cache_sharding is not None:
            cache = jax.device_put(cache, self.cache_sharding)
        logits, cache = self._prefill(self.params, jnp.asarray(prompt[None]), cache, jnp.int32(0))
        all_logits = [np.asarray(logits[0])]
        key = jax.random.key(seed)
        temp, p = jnp.float32(temperature), jnp.float32(top_p)
        out: list[int] = []
        last = logits[0, -1]
        for pos in range(n, length):  # the token at `pos`
            key, sub = jax.random.split(key)
            if pos == n:  # the first new token comes from the prefill's last position
                token = self._sample(last, sub, temp, p)
            else:  # feed the token at pos - 1
                token, last, cache = self._step(self.params, token, cache, jnp.int32(pos - 1), sub, temp, p)
                all_logits.append(np.asarray(last)[None])
            out.append(int(token))
            if out[-1] in stops:
                break
        return np.array(out, np.int32), np.concatenate(all_logits)[: n + len(out) - 1]


def load(src: str | Path, devices: int = 1) -> tuple[Config, Any, Path, Placement]:
    """(the run's config, its params on `devices` local devices, the step dir, their placement)
    of a run dir, its checkpoints dir or one step dir (the latest complete step unless one is
    named)."""
    step_dir = checkpoint_step_dir(src, what="generate")
    try:
        cfg = Config.model_validate(read_config(step_dir))
    except Exception:  # noqa: BLE001 (pydantic: the saved config is not ours)
        raise CheckpointError(f"generate: {step_dir} has no valid saved config") from None
    local = len(jax.local_devices())
    if not 1 <= devices <= local:
        raise ConfigError(f"generate: --devices {devices} must be between 1 and the {local} local "
                          f"devices; valid for this model: {valid_device_counts(cfg.model, local)}")
    where = placement(cfg, devices)
    dtype = DTYPES[cfg.train.param_dtype]
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh),
                            model_def(cfg.model).shapes, where.params)
    return cfg, restore_params(step_dir, abstract), step_dir, where


def generate_text(src: str | Path, prompt: str, max_tokens: int = 200, temperature: float = 0.8,
                  top_p: float = 0.95, seed: int = 0, devices: int = 1,
                  tokenizer: str | Path | None = None) -> str:
    """What `jaxpar generate` prints: the prompt and its continuation (without its end token)."""
    check_options(max_tokens, temperature, top_p, seed)  # before loading anything
    cfg, params, _, where = load(src, devices)
    codec = codec_for(cfg, tokenizer)
    stops = stop_ids(cfg.model, codec)
    context, context_from = context_of(cfg.model, cfg.train.seq_len)
    gen = Generator(cfg.model, params, context, DTYPES[cfg.train.param_dtype], where.cache, context_from)
    given = prompt_ids(codec, cfg.model, prompt)
    ids, _ = gen.generate(given, max_tokens, temperature, top_p, seed, stops)
    if len(ids) and int(ids[-1]) in stops:
        ids = ids[:-1]
    return prompt + continuation(codec, given, ids)


def continuation(codec: Codec, prompt: np.ndarray, new: np.ndarray) -> str:
    """The text `new` ids add after `prompt`'s: decoded after the prompt, as part of the whole
    sequence, since alone a tokenizer's decoder treats them as a text's start (a SentencePiece
    one, Llama 2's or Mixtral's, strips the space their first token begins with)."""
    before = codec.decode(prompt)
    whole = codec.decode(np.concatenate([np.asarray(prompt, np.int64), np.asarray(new, np.int64)]))
    return whole[len(before):] if whole.startswith(before) else codec.decode(new)
