"""`jaxpar generate RUN_OR_CKPT --prompt TEXT`: sample from a checkpoint with a KV cache.

The params are restored onto one local device, whatever layout they were saved in (orbax
reshards), in the run's train.param_dtype. Decoding is the model's `decode` path
(models/llama.py): the prompt in one jitted call (prefill), then one jitted call per token, each
writing its keys and values into the cache. Temperature 0 is greedy (argmax); otherwise the
logits are divided by the temperature and sampled from the smallest set of tokens whose
probability reaches `top_p` (nucleus sampling). Text goes through the run's tokenizer
(data.tokenizer, or the one that prepared data.bin_path) or, without one, bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxpar.checkpoint import CheckpointError, read_config, restore_params
from jaxpar.config import Config, ConfigError
from jaxpar.data import text
from jaxpar.data.tokenizer import Tokenizer
from jaxpar.hf.init import checkpoint_step_dir
from jaxpar.train.model import ModelDef
from jaxpar.train.precision import DTYPES
from models.llama import Llama, init_cache


@dataclass(frozen=True)
class Codec:
    """Text <-> ids: a tokenizer.json, or bytes."""

    encode: Callable[[str], np.ndarray]
    decode: Callable[[Any], str]
    eos_id: int | None = None
    name: str = "bytes"


def codec_for(cfg: Config) -> Codec:
    path = cfg.data.tokenizer
    if not path and cfg.data.source == "bin" and cfg.data.bin_path:
        meta = Path(str(cfg.data.bin_path) + ".json")  # written by jaxpar data prepare
        if meta.is_file():
            path = json.loads(meta.read_text()).get("tokenizer")
    if path:
        tok = Tokenizer(path)
        tok.check_vocab(cfg.model.vocab_size)
        return Codec(tok.encode, tok.decode, tok.eos_id, str(path))
    if cfg.model.vocab_size < text.VOCAB_SIZE:
        raise ConfigError(f"generate: the run has no data.tokenizer and model.vocab_size="
                          f"{cfg.model.vocab_size} is too small for bytes ({text.VOCAB_SIZE})")
    return Codec(text.encode, text.decode)


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


class Generator:
    """Decoding from `params` (a Llama's, any placement) with a KV cache of `context` tokens."""

    def __init__(self, model_cfg, params, context: int, dtype=jnp.float32):
        self.model_cfg, self.params, self.context, self.dtype = model_cfg, params, context, dtype
        self.model = ModelDef.from_factory(lambda rngs: Llama(model_cfg, rngs))

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
                 seed: int = 0, eos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(the new token ids, the float32 logits [prompt + new - 1, vocab] that predicted each
        position after the first). The prompt must fit the context; generation stops at `eos_id`
        or when the context is full."""
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        n = len(prompt)
        if n == 0:
            raise ConfigError("generate: the prompt is empty; give --prompt some text")
        if n > self.context:
            raise ConfigError(f"generate: the prompt is {n} tokens, longer than the model's context of "
                              f"{self.context} tokens (its train.seq_len); shorten the prompt")
        if not 0.0 < top_p <= 1.0 or temperature < 0 or max_tokens < 0:
            raise ConfigError(f"generate: --top-p {top_p} must be in (0, 1], --temperature {temperature} "
                              f">= 0 and --max-tokens {max_tokens} >= 0")
        length = min(self.context, n + max_tokens)
        cache = init_cache(self.model_cfg, 1, length, self.dtype)
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
            if eos_id is not None and out[-1] == eos_id:
                break
        return np.array(out, np.int32), np.concatenate(all_logits)[: n + len(out) - 1]


def load(src: str | Path) -> tuple[Config, Any, Path]:
    """(the run's config, its params on one local device, the step dir) of a run dir, its
    checkpoints dir or one step dir (the latest complete step unless one is named)."""
    step_dir = checkpoint_step_dir(src, what="generate")
    try:
        cfg = Config.model_validate(read_config(step_dir))
    except Exception:  # noqa: BLE001 (pydantic: the saved config is not ours)
        raise CheckpointError(f"generate: {step_dir} has no valid saved config") from None
    if cfg.model.moe.num_experts:
        raise ConfigError("generate: mixture-of-experts models (model.moe.num_experts > 0) have no "
                          "decode path yet; only dense Llama models")
    shapes = ModelDef.from_factory(lambda rngs: Llama(cfg.model, rngs)).shapes
    where = SingleDeviceSharding(jax.local_devices()[0])
    dtype = DTYPES[cfg.train.param_dtype]
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=where), shapes)
    return cfg, restore_params(step_dir, abstract), step_dir


def generate_text(src: str | Path, prompt: str, max_tokens: int = 200, temperature: float = 0.8,
                  top_p: float = 0.95, seed: int = 0) -> str:
    """What `jaxpar generate` prints: the prompt and its continuation."""
    cfg, params, _ = load(src)
    codec = codec_for(cfg)
    gen = Generator(cfg.model, params, cfg.train.seq_len, DTYPES[cfg.train.param_dtype])
    ids, _ = gen.generate(codec.encode(prompt), max_tokens, temperature, top_p, seed, codec.eos_id)
    if codec.eos_id is not None and len(ids) and ids[-1] == codec.eos_id:
        ids = ids[:-1]
    return prompt + codec.decode(ids)
