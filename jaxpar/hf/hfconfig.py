"""Hugging Face `config.json` <-> jaxpar's `model.*` fields (a ModelConfig), both ways.

Reads both styles found in published checkpoints: `rope_theta` / `rope_scaling` at the top level
(most Llama 3.x) and the newer `rope_parameters` (transformers >= 5). Anything jaxpar's model
cannot represent (biases, another activation, sliding-window attention, another RoPE scaling,
another head than the causal LM's) is an HFError naming the field, never a silent approximation.
`max_position_embeddings` and the bos/eos token ids (generation_config.json's win: generate
reads them there) are kept in model.* so that export writes them back and generate stops at eos.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jaxpar.config import ConfigError, ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
# transformers' defaults for keys a config.json may leave out, per model type
DEFAULTS = {"llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False},
            "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False}}
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
GENERATION = "generation_config.json"


class HFError(ConfigError):
    """A Hugging Face checkpoint jaxpar cannot read: the message names the file and the field."""


def read_hf_config(hf_dir: str | Path) -> dict:
    """The parsed config.json of `hf_dir` (HFError when missing or not a JSON object)."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise HFError(f"{hf_dir}: not a directory (expected a Hugging Face model dir with config.json)")
    if not path.is_file():
        raise HFError(f"{path} not found: a Hugging Face model dir holds config.json beside its "
                      f"*.safetensors")
    return _json_object(path)


def read_generation_config(hf_dir: str | Path) -> dict:
    """The parsed generation_config.json of `hf_dir`, {} when it has none."""
    path = Path(hf_dir) / GENERATION
    return _json_object(path) if path.is_file() else {}


def _json_object(path: Path) -> dict:
    """A JSON file holding an object (HFError naming the file otherwise)."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise HFError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _tokens(hf: dict, generation: dict, where: str) -> dict[str, Any]:
    """max_positions, bos_token_id, eos_token_id (generation_config.json's ids win)."""
    out: dict[str, Any] = {}
    n = hf.get("max_position_embeddings")
    if n is not None:
        if not _is_id(n) or n == 0:
            raise HFError(f"{where}: max_position_embeddings = {n!r}: a positive integer is required")
        out["max_positions"] = n
    for key in ("bos_token_id", "eos_token_id"):
        src, file = (generation, GENERATION) if generation.get(key) is not None else (hf, where)
        v = src.get(key)
        if v is None:
            continue
        ok = _is_id(v) or (key == "eos_token_id" and isinstance(v, list) and v and all(map(_is_id, v)))
        if not ok:
            valid = "a token id (an integer >= 0)" + (" or a list of them" if key == "eos_token_id" else "")
            raise HFError(f"{file}: {key} = {v!r} is not {valid}")
        out[key] = v
    return out


def _architecture(hf: dict, kind: str, where: str) -> None:
    """`architectures`, when given, must name the causal LM jaxpar reads (not a classifier's head)."""
    archs = hf.get("architectures")
    if archs is None:
        return
    if not (isinstance(archs, list) and ARCHITECTURES[kind] in archs):
        raise HFError(f"{where}: architectures = {archs!r} is not supported for model_type {kind!r}; "
                      f"jaxpar reads the causal LM: [{ARCHITECTURES[kind]!r}]")


def _rope(hf: dict, where: str) -> tuple[float | None, dict | None]:
    """(rope_theta, scaling fields or None) from either config style."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise HFError(f"{where}: rope_parameters = {params!r} must be an object")
    src = dict(params or {})
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise HFError(f"{where}: rope_scaling = {scaling!r} must be an object or null")
        src = {**scaling, **src}
    theta = src.get("rope_theta", hf.get("rope_theta"))
    kind = src.get("rope_type", src.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        field = "rope_parameters.rope_type" if params else "rope_scaling.rope_type"
        raise HFError(f"{where}: {field} = {kind!r} is not supported; jaxpar's RoPE supports "
                      f"'default' and 'llama3' (Llama 3.1 frequency scaling)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in src]
    if missing:
        raise HFError(f"{where}: rope scaling 'llama3' lacks {', '.join(missing)}")
    return theta, {"type": "llama3", **{k: src[k] for k in keys}}


def _unsupported(hf: dict, kind: str, where: str) -> None:
    """HFError for a config field whose value jaxpar's model cannot represent. (pretraining_tp
    is how transformers slices its matmuls, not a different model: ignored.)"""
    checks = [("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")]
    if kind == "mixtral":
        checks.append(("router_jitter_noise", 0))  # training-time noise on the router logits
    for key, ok in checks:
        if hf.get(key) not in (None, ok):
            raise HFError(f"{where}: {key} = {hf[key]!r} is not supported (jaxpar's model has "
                          f"{key} = {ok!r})")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise HFError(f"{where}: sliding_window = {hf['sliding_window']!r} is not supported "
                      f"(jaxpar's attention is full causal); null is")


def model_fields(hf: dict, where: str = "config.json", generation: dict | None = None) -> dict[str, Any]:
    """The `model.*` fields (a ModelConfig's input) of a parsed HF config (and its parsed
    generation_config.json, whose bos/eos token ids win)."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise HFError(f"{where}: model_type = {kind!r} is not supported; valid: "
                      f"{', '.join(ARCHITECTURES)}")
    _architecture(hf, kind, where)
    _unsupported(hf, kind, where)
    for key in REQUIRED:
        if not _is_id(hf.get(key)) or hf[key] == 0:
            raise HFError(f"{where}: {key} = {hf.get(key)!r}: a positive integer is required")
    hf = {**DEFAULTS[kind], **{k: v for k, v in hf.items() if v is not None}}
    # the values go to ModelConfig as they are: its validation (model_config) names a wrong one
    theta, scaling = _rope(hf, where)
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), ffn_dim=hf["intermediate_size"],
        rope_theta=theta if theta is not None else DEFAULTS[kind]["rope_theta"],
        rope_scaling=scaling, norm_eps=hf["rms_norm_eps"],
        tie_embeddings=hf["tie_word_embeddings"], init_std=hf.get("initializer_range", 0.02))
    fields.update(_tokens(hf, generation or {}, where))
    if fields["head_dim"] == hf["hidden_size"] // hf["num_attention_heads"]:
        fields["head_dim"] = None  # jaxpar's default: dim // n_heads
    if kind == "mixtral":
        # transformers' Mixtral: softmax router, top-k renormalised, every token computed (no drop)
        fields["moe"] = dict(num_experts=hf.get("num_local_experts", 8),
                             top_k=hf.get("num_experts_per_tok", 2), every_n=1, normalize_gates=True,
                             dispatch="dropless",
                             load_balance_coef=hf.get("router_aux_loss_coef", 0.001), z_loss_coef=0.0)
    return fields


def model_config(hf: dict, where: str = "config.json", generation: dict | None = None) -> ModelConfig:
    """A validated ModelConfig of a parsed HF config (the jaxpar validation errors as HFError)."""
    fields = model_fields(hf, where, generation)
    try:
        return ModelConfig.model_validate(fields)
    except ValidationError as e:  # the HF file, and each check's own message (not pydantic's layout)
        why = [(f"model.{'.'.join(map(str, x['loc']))} = {x.get('input')!r}: " if x["loc"] else "")
               + x["msg"].removeprefix("Value error, ") for x in e.errors()]
        raise HFError(f"{where}: jaxpar cannot represent this model: {'; '.join(why)}") from None


def read_model_config(hf_dir: str | Path) -> ModelConfig:
    """The ModelConfig of an HF model dir: config.json and generation_config.json (if any)."""
    return model_config(read_hf_config(hf_dir), str(Path(hf_dir) / "config.json"),
                        read_generation_config(hf_dir))


def generation_config(m: ModelConfig) -> dict[str, Any] | None:
    """generation_config.json for a jaxpar model: its bos/eos ids (None when neither is known)."""
    ids = {k: getattr(m, k) for k in ("bos_token_id", "eos_token_id") if getattr(m, k) is not None}
    return {"_from_model_config": True, **ids} if ids else None


def hf_config(m: ModelConfig) -> dict[str, Any]:
    """config.json for a jaxpar model (RoPE in both styles; max_position_embeddings and the
    bos/eos ids only where model.* knows them)."""
    moe = m.moe.num_experts > 0
    if moe and (m.moe.every_n != 1 or m.moe.shared_expert or m.moe.expert_ffn_dim not in (None, m.ffn_dim)):
        raise HFError("model.moe: only Mixtral's shape exports (an MoE every layer, no shared expert, "
                      "expert_ffn_dim = ffn_dim, renormalised gates)")
    if moe and not m.moe.gates_normalized:  # transformers' Mixtral always renormalises them
        raise HFError(f"model.moe.normalize_gates={m.moe.normalize_gates} with top_k={m.moe.top_k}: "
                      f"this model's gates are the router's probabilities, but Mixtral (the only MoE "
                      f"export) renormalises its top-k gates to sum to 1, so transformers would compute "
                      f"another model; only a model trained with normalize_gates=true exports")
    kind = "mixtral" if moe else "llama"
    rope: dict[str, Any] = {"rope_theta": m.rope_theta, "rope_type": "default"}
    if m.rope_scaling is not None:
        rope = {"rope_theta": m.rope_theta, "rope_type": "llama3",
                **m.rope_scaling.model_dump(exclude={"type"})}
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": m.vocab_size,
        "hidden_size": m.dim, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.resolved_head_dim,
        "intermediate_size": m.ffn_dim, "rms_norm_eps": m.norm_eps, "rope_parameters": rope,
        # the older style too, for transformers < 5 (which ignores rope_parameters)
        "rope_theta": m.rope_theta, "rope_scaling": None if m.rope_scaling is None else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu", "initializer_range": m.init_std,
        "dtype": "float32",
    }
    if m.max_positions is not None:
        out["max_position_embeddings"] = m.max_positions
    out.update({k: getattr(m, k) for k in ("bos_token_id", "eos_token_id") if getattr(m, k) is not None})
    if kind == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(num_local_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k,
                   router_aux_loss_coef=m.moe.load_balance_coef, sliding_window=None)
    return out
