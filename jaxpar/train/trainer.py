"""The Trainer: config -> mesh, plan, model, optimizer, compiled step, data; then the loop.

Scripts use it directly (`Trainer(cfg, model_factory=...)`), the CLI through `jaxpar train`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import Config, ConfigError
from jaxpar.data import DataLoader, build_source
from jaxpar.mesh import build_mesh, describe
from jaxpar.metrics import (CompositeWriter, JsonlWriter, Progress, TensorBoardWriter, compiled_memory,
                            format_banner, generic_flops_per_token, llama_flops_per_token, mfu,
                            peak_flops)
from jaxpar.sharding import Plan, check_replication, per_device_bytes
from jaxpar.train.model import ModelDef
from jaxpar.train.optimizer import build_optimizer, schedule
from jaxpar.train.step import DTYPES, make_init, make_step_spec, make_train_step


def check_layout(cfg: Config, plan: Plan, check_model: bool = True) -> None:
    """User mistakes that would otherwise surface as deep JAX errors."""
    shape = plan.mesh.shape
    m, t = cfg.model, cfg.train
    if check_model and shape["tensor"] > 1:
        for fld in ("n_heads", "n_kv_heads"):
            if getattr(m, fld) % shape["tensor"]:
                raise ConfigError(
                    f"model.{fld}={getattr(m, fld)} is not divisible by mesh.tensor={shape['tensor']}; "
                    f"use a tensor size that divides {getattr(m, fld)}"
                )
    dp = plan.batch_size_divisor
    if t.global_batch % (dp * t.grad_accum):
        axes = "*".join(plan.batch_axes)
        raise ConfigError(
            f"train.global_batch={t.global_batch} must be divisible by the batch-parallel size "
            f"({axes} = {dp}) times train.grad_accum={t.grad_accum} = {dp * t.grad_accum}"
        )


def llama_model_factory(cfg: Config) -> Callable[[nnx.Rngs], nnx.Module]:
    from models.llama import Llama
    return lambda rngs: Llama(cfg.model, rngs)


@dataclass
class Trainer:
    cfg: Config
    model_factory: Callable[[nnx.Rngs], nnx.Module] | None = None
    devices: list | None = None
    flops_per_token: float | None = None
    log: Callable[[str], None] = print
    writers: list = field(default_factory=list)
    callbacks: list = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.mesh = build_mesh(cfg.mesh, self.devices)
        self.plan = Plan(self.mesh, cfg.sharding.resolved_rules(), cfg.sharding.zero_stage,
                         cfg.sharding.replicated_tolerance)
        custom = self.model_factory is not None
        check_layout(cfg, self.plan, check_model=not custom)
        self.model = ModelDef.from_factory(self.model_factory or llama_model_factory(cfg))
        self.lr_schedule = schedule(cfg.optimizer, cfg.train.steps)
        self.tx = build_optimizer(cfg.optimizer, cfg.train.steps, self.model.axes)
        self.spec = make_step_spec(self.model, self.plan, self.tx)
        named = {}
        flat_specs = self.model.leaves_with_paths(self.spec.param_specs)
        for path, sds in self.model.leaves_with_paths(self.model.shapes).items():
            named[path] = (flat_specs[path], sds.shape, np.dtype(DTYPES[cfg.train.param_dtype]).itemsize)
        self.replication = check_replication(self.plan, named)
        self.step_fn = make_train_step(
            self.model, self.plan, self.tx, self.spec, grad_accum=cfg.train.grad_accum,
            compute_dtype=cfg.train.compute_dtype, remat=cfg.train.remat, lr_schedule=self.lr_schedule)
        self.init_fn = make_init(self.model, self.tx, self.spec, DTYPES[cfg.train.param_dtype])
        vocab = getattr(cfg.model, "vocab_size", 256)
        self.loader = DataLoader(build_source(cfg.data, vocab, cfg.train.seed), cfg.train.global_batch,
                                 cfg.train.seq_len, self.spec.batch_sharding)
        if self.flops_per_token is None:
            self.flops_per_token = self._flops_per_token(custom)
        self.peak = peak_flops(jax.devices()[0], cfg.peak_flops)
        self.compiled = None

    def _flops_per_token(self, custom: bool) -> float:
        n = self.model.n_params
        if custom:
            return generic_flops_per_token(n)
        m = self.cfg.model
        # The input embedding is a gather; the head matmul always runs (tied or not).
        non_embed = n - m.vocab_size * m.dim + (m.vocab_size * m.dim if m.tie_embeddings else 0)
        return llama_flops_per_token(non_embed, m.n_layers, self.cfg.train.seq_len,
                                     m.n_heads * m.resolved_head_dim)

    # ------------------------------------------------------------------ state and compile

    def init_state(self) -> dict:
        return self.init_fn(self.cfg.train.seed)

    def abstract_state(self) -> Any:
        return jax.eval_shape(self.init_fn, self.cfg.train.seed)

    def compile(self):
        """The compiled step (AOT), for its memory analysis and HLO."""
        state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             self.abstract_state(), self.spec.state_shardings)
        t = self.cfg.train
        batch = jax.ShapeDtypeStruct((t.global_batch, t.seq_len + 1), jnp.int32,
                                     sharding=self.spec.batch_sharding)
        self.compiled = self.step_fn.lower(state, batch).compile()
        return self.compiled

    def banner(self, compiled=None) -> str:
        mem = compiled_memory(compiled) if compiled is not None else {}
        state = self.abstract_state()
        shard = lambda tree, sh: per_device_bytes(jax.tree.map(
            lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x), tree, sh))
        lines = {
            "mesh": describe(self.mesh),
            "zero stage": str(self.plan.zero_stage),
            "params": f"{self.model.n_params:,}",
            "flops/token": f"{self.flops_per_token:.3e}",
            "params/device": _mib(shard(state["params"], self.spec.state_shardings["params"])),
            "opt state/device": _mib(shard(state["opt_state"], self.spec.state_shardings["opt_state"])),
            "replicated params": f"{self.replication['replicated_fraction']:.1%}",
        }
        if mem:
            lines["compiled step/device"] = (f"args {_mib(mem.get('argument_bytes', 0))}, "
                                             f"temp {_mib(mem.get('temp_bytes', 0))}")
        t = self.cfg.train
        lines["batch"] = (f"{t.global_batch} x {t.seq_len} tokens, grad_accum {t.grad_accum}, "
                          f"{t.compute_dtype} compute, remat {t.remat}")
        return format_banner(lines)

    # ------------------------------------------------------------------ the loop

    def fit(self, state: dict | None = None, start_step: int = 0, out_dir: Path | None = None,
            progress: bool | None = None) -> tuple[dict, list[dict]]:
        """Train from `start_step` to train.steps. Returns the final state and logged metrics."""
        cfg, t = self.cfg, self.cfg.train
        state = self.init_state() if state is None else state
        writers = list(self.writers)
        if out_dir is not None and jax.process_index() == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            writers += [JsonlWriter(out_dir / "metrics.jsonl"), TensorBoardWriter(out_dir / "tb")]
        writer = CompositeWriter(writers)
        show = t.progress if progress is None else progress
        bar = Progress(t.steps, start_step, enabled=show and jax.process_index() == 0)
        tokens_per_step = t.global_batch * t.seq_len
        step_fn = self.compiled or self.compile()
        history: list[dict] = []
        last, last_step = time.perf_counter(), start_step
        done = start_step  # steps completed
        for cb in self.callbacks:
            cb.on_start(self, start_step, state)
        try:
            for step in range(start_step, t.steps):
                state, metrics = step_fn(state, self.loader.batch(step))
                done = step + 1
                for cb in self.callbacks:
                    cb.on_step_end(self, step + 1, state, metrics)
                if (step + 1) % t.log_every == 0 or step + 1 == t.steps or step == start_step:
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    now = time.perf_counter()
                    dt, last, last_step = (now - last) / (step + 1 - last_step), now, step + 1
                    rec = {"step": step + 1, **metrics, "tokens_per_s": tokens_per_step / dt,
                           "step_time_s": dt}
                    u = mfu(rec["tokens_per_s"] / self.mesh.devices.size, self.flops_per_token, self.peak)
                    if u is not None:
                        rec["mfu"] = u
                    history.append(rec)
                    writer.write(step + 1, rec)
                    bar.update(step + 1, rec["loss"], rec["tokens_per_s"])
                    for cb in self.callbacks:
                        cb.on_log(self, rec)
        finally:
            bar.close()
            writer.close()
            for cb in self.callbacks:
                cb.on_end(self, done, state)
        return state, history


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run(cfg: Config, log: Callable[[str], None] = print) -> list[dict]:
    """What `jaxpar train` does: print the resolved config, save it, compile, train."""
    out = cfg.out_dir
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(cfg.to_yaml())
        log("resolved config:\n" + cfg.to_yaml())
    from jaxpar.observe import build_callbacks
    trainer = Trainer(cfg, log=log, callbacks=build_callbacks(cfg))
    compiled = trainer.compile()
    log(trainer.banner(compiled))
    _, history = trainer.fit(out_dir=out)
    if history:
        first, last = history[0], history[-1]
        log(f"done: {len(history)} logged steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
            f"{last['tokens_per_s']:.0f} tokens/s; metrics in {out / 'metrics.jsonl'}")
    return history
