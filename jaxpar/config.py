"""Typed experiment config: YAML file + dotted overrides, validated with clear errors.

A config is data. Every section is a strict pydantic model (unknown keys are errors with a
did-you-mean), and the resolved config is printed at start and saved in the run dir.
"""
from __future__ import annotations

import copy
import difflib
import functools
import os
import re
import typing
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jaxpar.registry import COMPRESSORS, PRESETS

MESH_AXES = ("data", "fsdp", "pipeline", "context", "tensor", "expert")
# model.attention (jaxpar/attention: one module per implementation; auto picks one per run)
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "blockwise", "cudnn")


class ConfigError(ValueError):
    """A user mistake in a config: the message names the field, the value and what is valid."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info) -> Any:
        """pydantic reads `true` as 1 for an int or float field (`train.steps: true` trained one
        step): a boolean is refused where the field takes numbers and no boolean."""
        if isinstance(value, bool) and _takes_numbers_not_bools(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        return value


def _takes_numbers_not_bools(annotation: Any) -> bool:
    """int or float, alone or among a union's alternatives, and no bool among them."""
    union = typing.get_origin(annotation) in (Union, UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    return bool not in args and any(a in (int, float) for a in args)


class MoEConfig(Strict):
    """Mixture-of-experts MLPs (models/moe.py). `num_experts: 0` is a dense model.

    Every `every_n`-th layer (the n-th, 2n-th, ...) has `num_experts` SwiGLU experts of
    `expert_ffn_dim` (default `model.ffn_dim`) and a softmax router choosing `top_k` per token
    (gates renormalized over the k when `normalize_gates`, default: top_k > 1), plus an optional
    always-on `shared_expert`. `dispatch`: `capacity` gives each expert
    ceil(capacity_factor * seq * top_k / num_experts) slots per sequence and drops the overflow
    (those tokens pass through the residual); `dropless` computes every assignment (ragged_dot).
    Router losses, averaged over the MoE layers and added to the loss with their coefficients:
    the Switch load-balancing loss and the router z-loss."""

    num_experts: int = Field(0, ge=0)
    top_k: int = Field(2, gt=0)
    every_n: int = Field(1, gt=0)
    expert_ffn_dim: int | None = Field(None, gt=0)
    shared_expert: bool = False
    shared_ffn_dim: int | None = Field(None, gt=0)
    dispatch: Literal["capacity", "dropless"] = "capacity"
    capacity_factor: float = Field(1.25, gt=0)
    normalize_gates: bool | None = None
    load_balance_coef: float = Field(0.01, ge=0)
    z_loss_coef: float = Field(0.001, ge=0)

    @model_validator(mode="after")
    def _check_k(self) -> "MoEConfig":
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} is above num_experts={self.num_experts}; a token picks "
                f"top_k distinct experts, so use top_k <= num_experts"
            )
        return self

    @property
    def gates_normalized(self) -> bool:
        """Whether the top-k gates are renormalised to sum to 1 (normalize_gates, else top_k > 1)."""
        return self.top_k > 1 if self.normalize_gates is None else self.normalize_gates


class RopeScalingConfig(Strict):
    """Llama 3.1's RoPE frequency scaling (`type: llama3`): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched by `factor`, those shorter
    than original_max_position_embeddings / high_freq_factor kept, the band between blended."""

    type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, gt=0)

    @model_validator(mode="after")
    def _band(self) -> "RopeScalingConfig":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor={self.high_freq_factor} must be above "
                             f"low_freq_factor={self.low_freq_factor}")
        return self


class ModelConfig(Strict):
    """A Llama-style decoder. `preset` fills the fields; fields given beside it win.
    `rope_scaling` (null: plain RoPE) is Llama 3.1's frequency scaling.

    `attention` (jaxpar/attention): `xla` materialises the [batch, heads, seq, seq] scores;
    `blockwise` holds one [attention_block, attention_block] tile per head at a time (any
    backend); `cudnn` is cuDNN flash attention (GPU, bfloat16/float16); `auto` takes cudnn where
    it runs, else blockwise from `attention_threshold` tokens on, else xla."""

    preset: str | None = None
    vocab_size: int = Field(256, gt=0)
    dim: int = Field(128, gt=0)
    n_layers: int = Field(2, gt=0)
    n_heads: int = Field(4, gt=0)
    n_kv_heads: int = Field(2, gt=0)
    head_dim: int | None = Field(None, gt=0)
    ffn_dim: int = Field(384, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScalingConfig | None = None
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = False
    init_std: float = Field(0.02, gt=0)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    attention: Literal[ATTENTION_IMPLEMENTATIONS] = "auto"
    attention_block: int = Field(512, gt=0, description="query/key tile of blockwise attention")
    attention_threshold: int = Field(2048, gt=0, description="auto: blockwise from this seq_len on")
    # not the shape: what an imported model (jaxpar/hf) says of itself, kept for generate and export
    max_positions: int | None = Field(None, gt=0,
                                      description="the model's context (HF max_position_embeddings)")
    bos_token_id: int | None = Field(None, ge=0)
    eos_token_id: int | list[int] | None = Field(None, description="generate stops at it (any of a list)")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            name = data["preset"]
            if name not in PRESETS:
                raise ValueError(
                    f"unknown preset {name!r}; valid presets: {', '.join(sorted(PRESETS.names()))}"
                )
            preset = PRESETS.get(name)
            merged = {**preset, **data}
            if isinstance(preset.get("moe"), dict) and isinstance(data.get("moe"), dict):
                merged["moe"] = {**preset["moe"], **data["moe"]}  # preset's moe, then yours
            return merged
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
        if self.resolved_head_dim % 2:  # RoPE rotates the two halves of each head
            how = f"head_dim={self.head_dim}" if self.head_dim else f"dim={self.dim} / n_heads={self.n_heads}"
            raise ValueError(f"the head dim ({how} = {self.resolved_head_dim}) must be even: RoPE rotates "
                             f"pairs of its dims; choose dim, n_heads or head_dim so that it is")
        return self

    @model_validator(mode="after")
    def _check_moe(self) -> "ModelConfig":
        if self.moe.num_experts and self.n_layers % self.moe.every_n:
            raise ValueError(f"n_layers={self.n_layers} is not a multiple of moe.every_n={self.moe.every_n}")
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads


class MeshConfig(Strict):
    """Axis sizes. One axis may be -1 (fills the rest). `dcn` is the across-hosts part of each
    axis (slow links); the in-host part is the size divided by it."""

    data: int = -1
    fsdp: int = 1
    pipeline: int = 1
    context: int = 1
    tensor: int = 1
    expert: int = 1
    dcn: dict[str, int] = Field(default_factory=dict)
    # `mesh: auto` in a config: the planner (jaxpar/planner) chooses the sizes for the devices
    # it finds, before anything is built; the resolved config has the chosen sizes.
    auto: bool = False

    @field_validator("data", "fsdp", "pipeline", "context", "tensor", "expert")
    @classmethod
    def _size(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"axis size must be a positive integer or -1 (fill the rest), got {v}")
        return v

    @field_validator("dcn")
    @classmethod
    def _dcn(cls, v: dict[str, int]) -> dict[str, int]:
        for k, n in v.items():
            if k not in MESH_AXES:
                raise ValueError(f"unknown mesh axis {k!r} in dcn; valid: {', '.join(MESH_AXES)}")
            if n < 1:
                raise ValueError(f"dcn.{k} must be >= 1, got {n}")
        return v

    @model_validator(mode="after")
    def _one_fill(self) -> "MeshConfig":
        fills = [a for a in MESH_AXES if getattr(self, a) == -1]
        if len(fills) > 1:
            raise ValueError(f"only one axis may be -1, got {fills}")
        return self

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}


DEFAULT_RULES: dict[str, list[str]] = {
    # activations and data
    "batch": ["data", "fsdp", "expert"],
    "seq": ["context"],  # context parallelism: each device holds its part of every sequence
    "residual_seq": [],  # 'tensor' when sharding.sequence_parallel is on
    # parameters (and the activations that carry the same dims)
    "embed": ["fsdp"],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "head_dim": [],
    "mlp": ["tensor"],
    "vocab": ["tensor"],
    "layers": ["pipeline"],
    "expert": ["expert"],
    "norm": [],
}


@functools.lru_cache(maxsize=256)
def _resolve_rules(sequence_parallel: bool, user: tuple) -> tuple[tuple[str, tuple[str, ...]], ...]:
    rules = {k: tuple(v) for k, v in DEFAULT_RULES.items()}
    if sequence_parallel:
        rules["residual_seq"] = ("tensor",)
    rules.update(user)
    return tuple(rules.items())


class ShardingConfig(Strict):
    """How logical axes map to mesh axes, and what ZeRO shards over `fsdp`."""

    zero_stage: Literal[0, 1, 2, 3, "auto"] = 1  # auto: the planner's choice
    # the residual stream split over `tensor` along the sequence (parallel/tensor.py); auto: the
    # planner's choice
    sequence_parallel: bool | Literal["auto"] = False
    rules: dict[str, list[str]] = Field(default_factory=dict)
    replicated_tolerance: float = Field(0.05, ge=0, le=1)

    @field_validator("rules", mode="before")
    @classmethod
    def _rules(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for k, axes in v.items():
            if axes is None:
                axes = []
            elif isinstance(axes, str):
                axes = [axes]
            for a in axes:
                if a not in MESH_AXES:
                    raise ValueError(
                        f"rule {k!r} maps to unknown mesh axis {a!r}; valid: {', '.join(MESH_AXES)}"
                    )
            out[k] = list(axes)
        return out

    def resolved_rules(self) -> dict[str, tuple[str, ...]]:
        return dict(self.resolved_rules_items())

    def resolved_rules_items(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """resolved_rules as (name, axes) pairs, hashable (the planner's search asks for them
        hundreds of thousands of times: resolved once per distinct setting)."""
        rules = tuple((k, tuple(v)) for k, v in self.rules.items())
        return _resolve_rules(self.sequence_parallel is True, rules)


class OptimizerConfig(Strict):
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    decay_steps: int | None = Field(None, gt=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    # AdamW's first moment; the second is float32 (optax keeps it in the dtype of the weights it
    # updates: the float32 init, or the float32 masters of bf16 params, see train.master_dtype)
    mu_dtype: Literal["float32", "bfloat16"] = "float32"
    weight_decay: float = Field(0.1, ge=0)
    clip_norm: float | None = Field(1.0, gt=0)
    # `onebit_adam`: exact Adam for `onebit_warmup_steps`, then frozen variance and momentum
    # reduced with 1-bit compression (signs + block scales) and error feedback.
    name: Literal["adamw", "onebit_adam"] = "adamw"
    onebit_warmup_steps: int = 100

    @field_validator("onebit_warmup_steps")
    @classmethod
    def _onebit_warmup(cls, v: int) -> int:
        if v < 1:
            raise ValueError(
                f"1-bit Adam estimates its (then frozen) variance during the warm-up, so it needs at "
                f"least one step of it: use onebit_warmup_steps >= 1 (default 100), not {v}")
        return v

    @model_validator(mode="after")
    def _decay_after_warmup(self) -> "OptimizerConfig":
        """decay_steps counts the warmup (the cosine runs from warmup_steps to decay_steps): one
        at or below warmup_steps has no cosine, and was silently a drop to the minimum."""
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"optimizer.decay_steps={self.decay_steps} is not after optimizer.warmup_steps="
                f"{self.warmup_steps}: decay_steps counts the warmup (the cosine runs from step "
                f"warmup_steps to decay_steps); use decay_steps > {self.warmup_steps}, or null "
                f"(train.steps)")
        return self


class GradientCompressionConfig(Strict):
    """Compression of the data-parallel gradient reduction (jaxpar/collectives).

    `method`: none (float32, the default path), bf16, fp16, int8, onebit, topk, powersgd.
    `axes`: the mesh axes whose reduction is compressed (default: every data-parallel axis the
    gradients are summed over); the others are reduced in float32 first (reduce-scatter) and
    after (all-gather). `scope: dcn` compresses only the across-host part of `data` (its size is
    `dcn_size`, default the number of processes along `data`; set it to simulate hosts on one).
    """

    method: str = "none"
    block_size: int = Field(256, gt=0, description="values per scale (int8, onebit) / per top-k block")
    error_feedback: bool = True
    topk_fraction: float = Field(0.01, gt=0, le=1)
    rank: int = Field(4, gt=0, description="PowerSGD rank")
    axes: list[str] | None = None
    scope: Literal["all", "dcn"] = "all"
    dcn_size: int | None = Field(None, gt=0)
    warmup_steps: int = Field(0, ge=0, description="steps of float32 reduction before compressing")

    @field_validator("method")
    @classmethod
    def _method(cls, v: str) -> str:
        if v not in COMPRESSORS:
            methods = COMPRESSORS.names()
            close = difflib.get_close_matches(v, methods, n=1)
            hint = f" did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown gradient compression method {v!r};{hint} valid: {', '.join(methods)}")
        return v

    @field_validator("axes")
    @classmethod
    def _axes(cls, v: list[str] | None) -> list[str] | None:
        for a in v or ():
            if a not in MESH_AXES:
                raise ValueError(f"unknown mesh axis {a!r}; valid: {', '.join(MESH_AXES)}")
        return v

    @model_validator(mode="after")
    def _blocks(self) -> "GradientCompressionConfig":
        if self.method == "onebit" and self.block_size % 8:
            raise ValueError(
                f"block_size={self.block_size} does not divide into bytes: onebit packs 8 signs per "
                f"byte, so the block size must be a multiple of 8 (e.g. 256)")
        if self.method == "topk" and self.block_size > 65536:
            raise ValueError(f"block_size={self.block_size}: topk indexes blocks with uint16 (<= 65536)")
        if self.scope == "dcn" and self.axes is not None:  # the dcn split picks its own group
            raise ValueError(
                f"axes={self.axes} with scope='dcn': scope dcn compresses only the across-host part "
                f"of `data` and reads no axes; drop axes, or use scope='all' with axes")
        return self


class LocalSGDConfig(Strict):
    """Local SGD: with `sync_every: H > 1`, data-parallel replicas step alone for H steps, then
    average their parameters (`outer: average`) or apply the average change with an outer
    Nesterov optimizer (`outer: nesterov`, DiLoCo: `outer_lr` 0.7, `outer_momentum` 0.9)."""

    sync_every: int = Field(1, gt=0)
    outer: Literal["average", "nesterov"] = "average"
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)


REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


class TrainConfig(Strict):
    steps: int = Field(100, gt=0)
    global_batch: int = Field(16, gt=0)
    seq_len: int = Field(128, gt=0)
    grad_accum: int | Literal["auto"] = 1  # auto: the planner's choice
    seed: int = 0
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Mixed precision (jaxpar/train/precision.py): with bf16 params the optimizer keeps float32
    # master weights (master_dtype: bfloat16 is pure bf16, no masters). grad_reduce_dtype: the
    # dtype of the data-parallel gradient reduction on the wire (accumulation is float32).
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    remat: Literal[REMAT_POLICIES + ("auto",)] = "none"  # jaxpar.nn.REMAT_POLICIES; auto: the planner's
    # float16 compute differentiates the loss times a scale, so that the backward's small float16
    # gradients survive (jaxpar/train/loss_scale.py): auto (dynamic with float16, else none),
    # dynamic (halved on an overflow, whose update is skipped; doubled after loss_scale_window
    # finite steps), none, or a number (a static scale).
    loss_scale: Literal["auto", "dynamic", "none"] | float = "auto"
    loss_scale_window: int = Field(1000, gt=0)
    # The loss over chunks of this many tokens (train/loss.DeferredLogits): the float32
    # [batch, seq, vocab] logits never exist at once (4 GB per 8K-token sequence at vocab 128K).
    loss_chunk: int | None = Field(None, gt=0)
    # Metrics stay on the devices between logged steps: a log (every `log_every` steps, the first
    # and the last) is the loop's only wait for the devices, besides checkpoints and evals.
    log_every: int = Field(10, gt=0)
    progress: bool = True
    resume: str = Field("auto", description="auto (latest good checkpoint of the run), never, or a path")
    # Start a fresh run from other weights (a resumed run keeps its own): `hf:DIR` (a Hugging Face
    # model dir) or a jaxpar checkpoint path; either fills model.* (jaxpar/hf/init.py).
    init_from: str | None = None
    skip_nonfinite: bool = Field(True, description="skip updates whose loss or grad norm is not finite")
    max_nonfinite: int = Field(5, ge=1, description="stop after this many non-finite steps in a row")
    nonfinite_rollback: bool = Field(False, description="instead of stopping: restore the last "
                                     "checkpoint and skip the batch that started the run of bad steps")

    @field_validator("grad_accum", mode="before")
    @classmethod
    def _grad_accum(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError("train.grad_accum must be a positive integer (microbatches per step) or auto")

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale(cls, v: Any) -> Any:
        if v in ("auto", "dynamic", "none"):
            return v
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"):
            return float(v)
        raise ValueError(f"train.loss_scale={v!r} is not valid: use auto, dynamic, none or a positive "
                         f"number (a static scale, e.g. 1024)")

    @model_validator(mode="after")
    def _loss_chunk(self) -> "TrainConfig":
        if self.loss_chunk is not None and self.seq_len % self.loss_chunk:
            near = max(d for d in range(1, self.loss_chunk + 1) if self.seq_len % d == 0)
            raise ValueError(f"train.loss_chunk={self.loss_chunk} must divide train.seq_len={self.seq_len}; "
                             f"use a divisor of {self.seq_len} (e.g. {near}) or null")
        return self

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or v.strip() == "hf:"):
            raise ValueError("train.init_from must be hf:DIR (a Hugging Face model dir) or a jaxpar "
                             "checkpoint path, or null")
        return v


class PipelineConfig(Strict):
    """Pipeline parallelism over `mesh.pipeline` (see jaxpar/parallel/pipeline). The layer stack
    splits into mesh.pipeline x virtual_stages stages; the embedding runs on the first stage and
    the head and loss on the last. `microbatches` (null: train.grad_accum) is how many pieces
    each data-parallel slice of the batch is cut into; it replaces gradient accumulation (set one
    of the two, or both to the same value)."""

    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "1f1b_split"] = "1f1b"
    virtual_stages: int = Field(1, gt=0, description="chunks per device (interleaved_1f1b)")
    microbatches: int | None = Field(None, gt=0, description="null: train.grad_accum")
    # false: a forward tick keeps its stage's vjp residuals for the backward (no second forward;
    # memory: the residuals of the microbatches in flight: up to 2p - 1 on the first stage with
    # 1f1b, p with 1f1b_split and zb_h1, m with gpipe);
    # true: keep only the stage input and recompute the stage's forward in the backward.
    recompute: bool = False

    def resolved_microbatches(self, grad_accum: int) -> int:
        if self.microbatches is None:
            return grad_accum
        if grad_accum not in (1, self.microbatches):
            raise ConfigError(
                f"pipeline.microbatches={self.microbatches} and train.grad_accum={grad_accum} differ; "
                f"with a pipeline the microbatches are the accumulation steps: set only one of them")
        return self.microbatches


class ContextConfig(Strict):
    """Context parallelism over `mesh.context` (jaxpar/parallel/context.py; only used when
    mesh.context > 1): each device holds 1/context of every sequence. `strategy`: `ring` keeps
    each device's queries and passes key/value chunks around the ring (ppermute), one
    online-softmax step per arriving chunk; `all_gather` is the ring's attention on every
    device's K and V gathered at once (any head count; it runs in a pipeline's stages, where
    the ring cannot; it holds the whole sequence's K and V for a layer); `all_to_all` (Ulysses)
    trades the sequence split for a head split around attention (n_heads and n_kv_heads must
    divide by mesh.context); `auto`: the planner's choice (all compute the same attention;
    jaxpar/planner). `layout`: `zigzag` gives device i chunks i and 2C-1-i of 2C (balanced
    causal work; train.seq_len divisible by 2 x mesh.context), `contiguous` chunk i of C."""

    strategy: Literal["ring", "all_to_all", "all_gather", "auto"] = "ring"
    layout: Literal["zigzag", "contiguous"] = "zigzag"


class DataConfig(Strict):
    """`text`: tokens of text files (default: the Python standard library's sources), bytes or,
    with `tokenizer` (a tokenizer.json), subwords; `bin`: a memory-mapped token file (`jaxpar data
    prepare` writes one); `synthetic`: a learnable random source."""

    source: Literal["text", "bin", "synthetic"] = "text"
    paths: list[str] = Field(default_factory=list)
    tokenizer: str | None = None
    bin_path: str | None = None
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    # The held-out split that eval.* evaluates on: `eval_fraction` of the documents (text: files;
    # bin: the documents of its .idx), chosen by a hash of each document's content and left out of
    # the training stream; or `eval_paths` (text: files or dirs; bin: one .bin), trained on never.
    # Synthetic data has no documents: any eval_fraction evaluates on rows training never draws.
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    eval_paths: list[str] = Field(default_factory=list)
    # Batches a background thread builds and places on the devices ahead of the step that
    # takes them (0: built in the loop, between steps). Batches depend on the step only, so
    # resuming is exact either way.
    prefetch: int = Field(2, ge=0)
    # Whole documents packed into each row (jaxpar/data/packing.py): attention never crosses a
    # document boundary and the loss skips the target after each end-of-text token and the
    # padding (jaxpar/train/batch.py). Needs documents that end with an end-of-text token: text
    # with data.tokenizer, or a .bin from `jaxpar data prepare` (its .idx and .json).
    packing: bool = False
    # With packing: RoPE positions restart at 0 in each document (else 0..seq_len-1 per row).
    reset_positions: bool = False

    @model_validator(mode="after")
    def _bin(self) -> "DataConfig":
        if self.source == "bin" and not self.bin_path:
            raise ValueError("data.source 'bin' needs data.bin_path (a .bin file of tokens)")
        if self.eval_fraction and self.eval_paths:
            raise ValueError(f"data.eval_fraction={self.eval_fraction} and data.eval_paths are both set; "
                             "give one held-out split (a fraction of the documents, or files)")
        if self.source == "synthetic" and self.eval_paths:
            raise ValueError("data.source 'synthetic' reads no files: data.eval_paths needs data.source "
                             "text or bin (synthetic data evaluates with any data.eval_fraction > 0)")
        if self.reset_positions and not self.packing:
            raise ValueError("data.reset_positions=true restarts positions per packed document: it needs "
                             "data.packing=true")
        if self.packing and self.source == "synthetic":
            raise ValueError("data.packing=true needs documents; data.source 'synthetic' has none: use "
                             "data.source text (with data.tokenizer) or bin")
        if self.packing and self.source == "text" and not self.tokenizer:
            raise ValueError("data.packing=true needs an end-of-text token between documents, and "
                             "byte-level text (no data.tokenizer) has none: set data.tokenizer (a "
                             "tokenizer.json) or use data.source bin")
        if self.source == "bin" and len(self.eval_paths) > 1:
            raise ValueError(f"data.eval_paths={self.eval_paths!r}: with data.source 'bin' give one "
                             ".bin file of held-out tokens")
        return self

    @property
    def has_eval_split(self) -> bool:
        return bool(self.eval_fraction or self.eval_paths)


class EvalConfig(Strict):
    """Held-out loss (data.eval_fraction or data.eval_paths) every `every` steps (0: never) and
    at the last step, over `batches` batches of train.global_batch x train.seq_len tokens (the
    same batches each time): `eval_loss` and `eval_ppl` in the metrics."""

    every: int = Field(0, ge=0)
    batches: int = Field(4, gt=0)


class CheckpointConfig(Strict):
    """Orbax checkpoints in `<run dir>/checkpoints` (or `dir`): every `every` steps and at the end,
    written in the background (`async_save`); keeps the latest `keep_last` plus every
    `keep_every`-th step. On SIGTERM/SIGINT a run saves and exits 0 within `preemption_grace_s`.
    `elastic`: when resuming on another device count, adapt the mesh and train.grad_accum so the
    global batch (and the loss curve) stays the same. A relative `dir` lies inside the run dir
    (`..` may not leave it); an absolute one is used as given."""

    enabled: bool = True
    dir: str | None = None
    every: int = Field(100, gt=0)
    keep_last: int = Field(3, ge=1)
    keep_every: int | None = Field(None, gt=0)
    async_save: bool = True
    preemption_grace_s: float = Field(120.0, gt=0)
    elastic: bool = True

    @field_validator("dir")
    @classmethod
    def _inside_run_dir(cls, v: str | None) -> str | None:
        # `~/ck` is the home dir's (expanded here, once: the saver and every reader of the saved
        # config agree; a literal `~` dir inside the run dir was saved to and never found)
        v = os.path.expanduser(v) if v else v
        if v and not os.path.isabs(v) and os.path.normpath(v).split(os.sep)[0] == "..":
            raise ValueError("a relative checkpoint.dir is inside the run dir (<run_dir>/<name>) and "
                             "'..' may not leave it; use a path inside it, or an absolute path")
        return v


class XlaConfig(Strict):
    """XLA options, applied by `Trainer` (scripts too), `jaxpar train` and `jaxpar bench` before
    JAX starts (jaxpar/xla.py). `gpu_overlap`: on GPU, the overlap flags of jaxpar.xla's
    gpu_overlap_flags() (latency-hiding scheduler, pipelined collectives in loops, combine
    thresholds, while-loop double buffering). `flags`: more flags; one named like a default
    replaces it (e.g. `--xla_gpu_enable_while_loop_double_buffering=false`)."""

    gpu_overlap: bool = True
    # The dot library of XLA:CPU. auto: oneDNN when train.compute_dtype is 16-bit (measured
    # faster in bf16 than XLA's default, YNNPACK, on CPUs with and without bf16 instructions),
    # XLA's default in float32 (faster there). YNNPACK takes every dot of the step since the
    # projections form their weight gradients in the weight's order (nn.project); before, JAX's
    # transposed form fell to a naive loop (bf16 steps 2-3x slower).
    # An option of the step's compile (jaxpar.xla.compiler_options), not of XLA_FLAGS.
    cpu_dots: Literal["auto", "onednn", "default"] = "auto"
    # XLA:CPU allocates each step's temporaries afresh: glibc serves a block above its mmap
    # threshold (at most 32 MiB) by a new mapping, so every page of it faults (the kernel zeroes
    # it) on every step. `keep`: large blocks come from the heap and freed ones stay there for the
    # next step (jaxpar.xla.keep_host_memory); auto: keep unless a GPU plugin is installed.
    host_memory: Literal["auto", "keep", "default"] = "auto"
    flags: list[str] = Field(default_factory=list)

    @field_validator("flags")
    @classmethod
    def _flag_syntax(cls, v: list[str]) -> list[str]:
        for f in v:
            if not re.fullmatch(r"--[A-Za-z0-9_]+(=\S*)?", f):
                raise ValueError(f"xla.flags entry {f!r} is not an XLA flag; write --name=value "
                                 "(e.g. --xla_gpu_enable_latency_hiding_scheduler=true), one flag each")
        return v


class PrometheusConfig(Strict):
    """A Prometheus endpoint (`/metrics`), off by default. Only process 0 serves unless
    `all_processes` (each process then serves on `port + process index`, with a `process` label).
    `port: 0` picks a free port. Bind `host: 0.0.0.0` to let another machine scrape it."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(9400, ge=0, le=65535)
    all_processes: bool = False


class WatchdogConfig(Strict):
    """Hang and straggler watchdog: warns (with every thread's Python stack) when a step takes
    more than `straggler_factor` x the median of the last `window` steps, or when no step
    finishes within `timeout_s`; with `abort` a hang exits the process with `exit_code`. A step
    finishes when its result is ready on the devices: a watchdog thread waits for it, the loop
    never does."""

    enabled: bool = False
    timeout_s: float = Field(900.0, gt=0)
    straggler_factor: float = Field(3.0, gt=1)
    window: int = Field(50, ge=1)
    min_steps: int = Field(5, ge=1, description="steps timed before the straggler check starts")
    abort: bool = False
    exit_code: int = Field(3, ge=1, le=255)

    @model_validator(mode="before")
    @classmethod
    def _no_sync(cls, data: Any) -> Any:
        if isinstance(data, dict) and "sync" in data:
            raise ValueError("observe.watchdog.sync is gone: the watchdog now waits for each step's "
                             "result in its own thread and never holds the loop; remove the setting")
        return data


class ObserveConfig(Strict):
    prometheus: PrometheusConfig = Field(default_factory=PrometheusConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)


class ProfileConfig(Strict):
    """`steps: [start, end]` traces steps start..end (inclusive, counted from 1) with
    jax.profiler into `<run dir>/<dir>` (TensorBoard's profile plugin or Perfetto). `dir` is
    relative and stays inside the run dir (`jaxpar profile RUN_DIR` looks there)."""

    steps: list[int] | None = None
    dir: str = "profile"
    perfetto: bool = True

    @field_validator("dir")
    @classmethod
    def _inside_run_dir(cls, v: str) -> str:
        # checkpoint.dir's rule for '..' (CheckpointConfig._inside_run_dir), and no absolute path
        if os.path.isabs(v) or os.path.normpath(v).split(os.sep)[0] == "..":
            raise ValueError("traces go inside the run dir (<run_dir>/<name>): use a relative path "
                             "without '..' (default 'profile'), not an absolute one")
        return v

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != 2 or not 1 <= v[0] <= v[1]):
            raise ValueError("profile.steps must be [start, end] with 1 <= start <= end (inclusive)")
        return v


class DistributedConfig(Strict):
    """Several processes (hosts) on jax.distributed, initialised before any other JAX call.

    `enabled`: null (auto) initialises when the settings below, the `JAXPAR_COORDINATOR_ADDRESS`
    / `JAXPAR_NUM_PROCESSES` / `JAXPAR_PROCESS_ID` environment (set by `jaxpar launch` and the
    deploy/ templates) or a SLURM step / Open MPI job say there is more than one process; true
    requires it (an error when nothing says how); false never initialises. Settings given here
    win over the environment. `cluster_detection` forces one of jax's detectors (slurm, ompi,
    mpi4py, k8s). `local_device_ids` restricts the devices a process uses (null: all it sees).
    A wrong setting fails within `initialization_timeout_s` with a message, never hangs."""

    enabled: bool | None = None
    coordinator_address: str | None = Field(None, description="host:port of process 0")
    num_processes: int | None = Field(None, gt=0)
    process_id: int | None = Field(None, ge=0)
    cluster_detection: Literal["slurm", "ompi", "mpi4py", "k8s"] | None = None
    local_device_ids: list[int] | None = None
    coordinator_bind_address: str | None = Field(None, description="host:port process 0 listens "
                                                 "on (default: the coordinator address when it is a "
                                                 "loopback one, else every interface, its port)")
    initialization_timeout_s: int = Field(300, gt=0)
    heartbeat_timeout_s: int = Field(100, gt=0)
    shutdown_timeout_s: int = Field(300, gt=0)
    cpu_collectives: Literal["gloo", "mpi"] = "gloo"

    @field_validator("coordinator_address", "coordinator_bind_address")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is not None:
            host, sep, port = v.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{v!r} must be host:port (e.g. 10.0.0.1:1234), the port in 1..65535")
        return v

    @model_validator(mode="after")
    def _id_in_range(self) -> "DistributedConfig":
        if (self.num_processes is not None and self.process_id is not None
                and self.process_id >= self.num_processes):
            raise ValueError(f"process_id={self.process_id} is not in 0..{self.num_processes - 1} "
                             f"(num_processes={self.num_processes})")
        return self


class PlannerConfig(Strict):
    """What `mesh: auto` (and the other `auto` settings) plan for: a cluster description (a
    preset of jaxpar/planner/clusters or a YAML file); null: the preset matching the devices."""

    cluster: str | None = None


AUTO_FIELDS = ("mesh", "sharding.zero_stage", "sharding.sequence_parallel", "train.remat", "train.grad_accum")


class Config(Strict):
    name: str = "run"
    run_dir: str = "runs"
    peak_flops: float | None = Field(None, gt=0, description="per-device peak FLOP/s for MFU")
    model: ModelConfig = Field(default_factory=ModelConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    gradient_compression: GradientCompressionConfig = Field(default_factory=GradientCompressionConfig)
    local_sgd: LocalSGDConfig = Field(default_factory=LocalSGDConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    context: ContextConfig = Field(default_factory=ContextConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    xla: XlaConfig = Field(default_factory=XlaConfig)
    observe: ObserveConfig = Field(default_factory=ObserveConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)

    @model_validator(mode="before")
    @classmethod
    def _mesh_auto(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mesh") == "auto":
            data = {**data, "mesh": {"auto": True}}
        return data

    def auto_fields(self) -> list[str]:
        """The settings left to the planner (AUTO_FIELDS that say auto)."""
        out = ["mesh"] if self.mesh.auto else []
        out += [f for f, v in (("sharding.zero_stage", self.sharding.zero_stage),
                               ("train.remat", self.train.remat),
                               ("train.grad_accum", self.train.grad_accum),
                               ("sharding.sequence_parallel", self.sharding.sequence_parallel),
                               ("context.strategy", self.context.strategy))
                if v == "auto"]
        return out

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # the run writes into <run_dir>/<name>: a path here would write somewhere else
        seps = {os.sep, os.altsep or os.sep, "/", "\\", "\0"}
        if v in ("", ".", "..") or any(c in v for c in seps):
            raise ValueError("the run name must be a plain file name (no '/' or '\\', not empty, "
                             "'.' or '..'): the run writes into <run_dir>/<name>")
        return v

    @model_validator(mode="after")
    def _eval_split(self) -> "Config":
        if self.eval.every and not self.data.has_eval_split:
            raise ValueError(f"eval.every={self.eval.every} needs a held-out split: set data.eval_fraction "
                             "(e.g. 0.01) or data.eval_paths, or eval.every=0")
        return self

    @model_validator(mode="after")
    def _profile_window(self) -> "Config":
        steps = self.profile.steps
        if steps is not None and steps[0] > self.train.steps:
            raise ValueError(f"profile.steps={steps} starts after train.steps={self.train.steps}: the window "
                             f"would never open and no trace be written; profile steps 1..{self.train.steps} "
                             f"(e.g. profile.steps=[{max(1, self.train.steps - 1)}, {self.train.steps}])")
        return self

    @property
    def out_dir(self) -> Path:
        return Path(self.run_dir) / self.name

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------- loading and errors


def _fields_at(model_cls: type[BaseModel], loc: tuple) -> list[str]:
    """The valid keys at `loc` (a pydantic error location), for did-you-mean hints."""
    cls = model_cls
    for part in loc[:-1]:
        field = cls.model_fields.get(str(part)) if isinstance(cls, type) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        cls = ann
    return list(cls.model_fields)


def _format_errors(err: ValidationError, cls: type[BaseModel]) -> str:
    return "invalid config:\n  " + "\n  ".join(validation_lines(err, cls))


def validation_lines(err: ValidationError, cls: type[BaseModel]) -> list[str]:
    """One line per error of `cls`'s validation: an unknown key with the valid ones (and the
    closest), a missing field by name, a bad value with its value (not its section's dict)."""
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        where = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            valid = _fields_at(cls, loc)
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f" did you mean {close[0]!r}?" if close else ""
            lines.append(f"unknown key {where!r}.{hint} valid keys here: {', '.join(valid)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            # a section's own check (e.g. eval.every needs a split) names its fields itself: the
            # whole section's dict would only bury the message
            if isinstance(value, dict):
                lines.append(msg if where == "<root>" else f"{where}: {msg}")
            else:
                lines.append(f"{where} = {value!r}: {msg}")
    return lines


class StrictYamlLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last one,
    so a second `train:` section silently replaced the whole first one. Merge keys (`<<`) stay
    overridable by the mapping's own keys, as YAML means them."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                continue
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first given on line {first.line + 1}); give each key "
                    f"once", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """yaml.safe_load, but a key given twice in a mapping is a yaml.YAMLError (StrictYamlLoader)."""
    return yaml.load(text, Loader=StrictYamlLoader)  # noqa: S506 (a SafeLoader subclass)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section (it is {nxt!r})")
        node = nxt
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like a.b=value")
        key, raw = item.split("=", 1)
        try:
            value = load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"override {item!r}: {raw!r} is not a YAML value ({first}); a list "
                              f"looks like [1, 2], a string with such characters needs quotes") from None
        out.append((key.strip(), value))
    return out


def make_config(raw: dict | None = None, overrides: list[str] = ()) -> Config:
    tree = copy.deepcopy(raw or {})  # the overrides must not write into the caller's nested dicts
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, Config)) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r} is a directory; give a YAML file, e.g. "
                              f"configs/quickstart.yaml")
        if not p.is_file():
            hint = ""
            if "=" in str(path) and not str(path).endswith((".yaml", ".yml")):
                hint = (f": the first argument is the config file and {str(path)!r} reads like an "
                        f"override; give a YAML first (an empty one takes every default), e.g. "
                        f"configs/quickstart.yaml {path}")
            raise ConfigError(f"config file {str(p)!r} not found{hint}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start}): a config is "
                              f"a YAML text file") from None
        except OSError as e:
            raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from None
        try:
            raw = load_yaml(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping, got {type(raw).__name__}")
    return make_config(raw, overrides)
