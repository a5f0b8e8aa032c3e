"""The Trainer: config -> mesh, plan, model, optimizer, compiled step, data; then the loop.

Scripts use it directly (`Trainer(cfg, model_factory=...)`), the CLI through `jaxpar train`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.checkpoint import (Checkpointer, Preemption, ResumePlan, checkpoint_dir, ensure_writable,
                               layout_meta, plan_resume)
from jaxpar.config import Config, ConfigError
from jaxpar.data import DataLoader, build_source
from jaxpar.distributed import barrier, initialize, same_config_on_every_process
from jaxpar.hf.init import init_config, initial_params
from jaxpar.mesh import build_mesh, describe
from jaxpar.metrics import (compiled_memory, format_banner, generic_flops_per_token, llama_flops_per_token,
                            peak_flops)
from jaxpar.observe import build_callbacks
from jaxpar.observe.events import RunEvents
from jaxpar.observe.watchdog import exempt_current_step
from jaxpar.planner.auto import PredictionReport, resolve_auto
from jaxpar.sharding import Plan, check_replication, per_device_bytes
from jaxpar.train.layout_checks import check_layout
from jaxpar.train.model import ModelDef
from jaxpar.train.model_checks import check_custom_model, check_factory
from jaxpar.train.optimizer import build_optimizer, schedule
from jaxpar.train.batch import Documents
from jaxpar.train.builtin import llama_model_factory
from jaxpar.train.loop import NonfiniteWatch, StepLog
from jaxpar.train.precision import DTYPES, apply_precision, check_precision
from jaxpar.train.preflight import check_activations_fit, check_attention_fits, check_step_fits
from jaxpar.train.evaluate import Evaluator, make_eval_step
from jaxpar.train.loss_scale import loss_scale_of
from jaxpar.train.step import make_init, make_step_spec, make_train_step, reorder_state
from jaxpar.platform import building_for
from jaxpar.xla import apply_xla_flags, compiler_options
from models.moe import active_param_count


class TrainingStopped(ConfigError):
    """The run cannot go on as configured (e.g. train.max_nonfinite bad steps in a row)."""


@dataclass
class Trainer:
    cfg: Config
    model_factory: Callable[[nnx.Rngs], nnx.Module] | None = None
    devices: list | None = None
    flops_per_token: float | None = None
    log: Callable[[str], None] = print
    writers: list = field(default_factory=list)
    callbacks: list = field(default_factory=list)
    events: RunEvents | None = None  # the run dir's event log (goodput); fit opens one for its out_dir

    def __post_init__(self) -> None:
        if not isinstance(self.cfg, Config):
            raise ConfigError(f"Trainer(cfg=...) takes a jaxpar Config, got {type(self.cfg).__name__}: "
                              f"build it with jaxpar.make_config(dict, overrides) or "
                              f"jaxpar.load_config(path, overrides)")
        self.cfg = cfg = init_config(self.cfg)  # train.init_from fills model.*
        apply_xla_flags(cfg, log=self.log)  # before JAX starts (scripts too, not only the CLI)
        initialize(cfg.distributed)  # several processes: before the first JAX call (no-op otherwise)
        same_config_on_every_process(cfg)  # else different programs: the first step hangs
        # mesh: auto & co.: the planner chooses for these devices (jaxpar train resolves earlier)
        self.cfg = cfg = self._resolve_auto(cfg)
        self.mesh = build_mesh(cfg.mesh, self.devices)
        # interleaved_1f1b: each device's layers stored in the order it runs them (Plan.layer_order)
        self.plan = Plan(self.mesh, cfg.sharding.resolved_rules(), cfg.sharding.zero_stage,
                         cfg.sharding.replicated_tolerance, layer_rounds=cfg.pipeline.virtual_stages)
        custom = self.model_factory is not None
        if custom:
            check_factory(self.model_factory)
        check_layout(cfg, self.plan, check_model=not custom)
        check_precision(cfg)
        self.model = ModelDef.from_factory(self.model_factory or llama_model_factory(cfg))
        if custom:
            check_custom_model(self.model, cfg, self.plan)
        self.lr_schedule = schedule(cfg.optimizer, cfg.train.steps)
        self.tx = apply_precision(build_optimizer(cfg.optimizer, cfg.train.steps, self.model.axes), cfg.train)
        self.spec = make_step_spec(self.model, self.plan, self.tx, compression=cfg.gradient_compression,
                                   optimizer=cfg.optimizer, local_sgd=cfg.local_sgd,
                                   grad_reduce_dtype=cfg.train.grad_reduce_dtype,
                                   grad_accum=cfg.train.grad_accum, context=cfg.context,
                                   loss_scale=loss_scale_of(cfg.train))
        named = {}
        flat_specs = self.model.leaves_with_paths(self.spec.param_specs)
        flat_axes = self.model.leaves_with_paths(self.model.axes)
        for path, sds in self.model.leaves_with_paths(self.model.shapes).items():
            named[path] = (flat_specs[path], sds.shape, np.dtype(DTYPES[cfg.train.param_dtype]).itemsize,
                           flat_axes[path])
        unnamed = frozenset(path for path, ax in flat_axes.items() if all(a is None for a in ax))
        self.replication = check_replication(self.plan, named, unnamed)
        self.loader = self._loader("train")
        # data.packing: the step reads the documents out of the rows by the source's end-of-text id
        self.documents = (Documents(self.loader.source.eos_id, cfg.data.reset_positions)
                          if cfg.data.packing else None)
        self.step_fn = self.make_step()
        self.init_fn = make_init(self.model, self.plan, self.tx, self.spec, DTYPES[cfg.train.param_dtype])
        self._reorders: dict[str, Callable] = {}
        self.evaluator = self.make_evaluator() if cfg.eval.every else None
        if self.flops_per_token is None:
            self.flops_per_token = self._flops_per_token(custom)
        self.peak = peak_flops(jax.devices()[0], cfg.peak_flops)
        self.compiled = None
        self.skipped_steps = 0          # non-finite steps skipped so far (restored on resume)
        self.skipped_batches: list[int] = []  # data steps never trained on (nonfinite_rollback)
        self.preempted: str | None = None   # the signal that stopped the last fit, if any
        self.checkpointer = None

    def _resolve_auto(self, cfg: Config) -> Config:
        n = len(self.devices) if self.devices else None
        cfg, plan = resolve_auto(cfg, n, self.model_factory, self.log)
        if plan is not None:
            self.callbacks = [*self.callbacks, PredictionReport(plan, self.log)]
        return cfg

    def make_step(self, **overrides):
        """The jitted train step of this config; `overrides` go to make_train_step (tests and
        debugging: return_grads=True, a loss_sum_fn)."""
        cfg = self.cfg
        kw = dict(grad_accum=cfg.train.grad_accum, pipeline=cfg.pipeline,
                  compute_dtype=cfg.train.compute_dtype, remat=cfg.train.remat,
                  lr_schedule=self.lr_schedule, skip_nonfinite=cfg.train.skip_nonfinite,
                  loss_chunk=cfg.train.loss_chunk, documents=self.documents, context=cfg.context)
        return make_train_step(self.model, self.plan, self.tx, self.spec, **{**kw, **overrides})

    def make_evaluator(self) -> Evaluator:
        """The held-out loss of this config's eval split (eval.batches batches), on this mesh."""
        cfg = self.cfg
        step = make_eval_step(self.model, self.plan, self.spec.param_specs, self.spec.batch_sharding,
                              compute_dtype=cfg.train.compute_dtype, loss_chunk=cfg.train.loss_chunk,
                              documents=self.documents, context=cfg.context,
                              batch_layout=self.spec.batch_layout)
        return Evaluator(step, self._loader("eval"), cfg.eval.batches)

    def _loader(self, split: str) -> DataLoader:
        """Global batches of the `split` ("train" or "eval") of the configured source."""
        cfg = self.cfg
        vocab = getattr(cfg.model, "vocab_size", 256)
        return DataLoader(build_source(cfg.data, vocab, cfg.train.seed, split=split), cfg.train.global_batch,
                          cfg.train.seq_len, self.spec.batch_sharding,
                          columns=self.spec.batch_layout.columns(cfg.train.seq_len))

    def put_batch(self, rows) -> jax.Array:
        """Host rows [global_batch, seq_len + 1] of token ids, placed as the step takes them (under
        mesh.context, each row's columns in the loader's layout)."""
        rows = np.asarray(rows, np.int32)
        cols = self.spec.batch_layout.columns(self.cfg.train.seq_len)
        return jax.device_put(rows if cols is None else rows[:, cols], self.spec.batch_sharding)

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        """The step's batch argument: shape, dtype and sharding (a compile target)."""
        t = self.cfg.train
        cols = self.spec.batch_layout.columns(t.seq_len)
        width = t.seq_len + 1 if cols is None else len(cols)
        return jax.ShapeDtypeStruct((t.global_batch, width), jnp.int32, sharding=self.spec.batch_sharding)

    def _flops_per_token(self, custom: bool) -> float:
        n = self.model.n_params
        if not custom and self.cfg.model.moe.num_experts:  # the experts a token does not visit cost nothing
            n = active_param_count(self.cfg.model)
        if custom:
            return generic_flops_per_token(n)
        m = self.cfg.model
        # The input embedding is a gather; the head matmul always runs (tied or not).
        non_embed = n - m.vocab_size * m.dim + (m.vocab_size * m.dim if m.tie_embeddings else 0)
        return llama_flops_per_token(non_embed, m.n_layers, self.cfg.train.seq_len,
                                     m.n_heads * m.resolved_head_dim)

    # ------------------------------------------------------------------ state and compile

    def init_state(self) -> dict:
        params = initial_params(self.cfg, self.spec.state_shardings["params"])  # None: random init
        return self.init_fn(self.cfg.train.seed, params)

    def abstract_state(self) -> Any:
        return jax.eval_shape(self.init_fn, self.cfg.train.seed)

    @property
    def platform(self) -> str:
        """The platform of the devices the step runs on (jaxpar.platform)."""
        return self.mesh.devices.flat[0].platform

    @property
    def compiler_options(self) -> dict[str, object]:
        """The step program's own XLA options (jaxpar.xla.compiler_options: CPU dots), for its
        devices' platform."""
        return compiler_options(self.cfg, self.platform)

    def compile(self):
        """The compiled step (AOT), for its memory analysis and HLO; every run of the step goes
        through it (its compiler_options apply)."""
        state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             self.abstract_state(), self.spec.state_shardings)
        t0 = time.perf_counter()
        with building_for(self.platform):  # traced for its devices, whatever the host's backend
            lowered = self.step_fn.lower(state, self.abstract_batch())
        self.compiled = lowered.compile(compiler_options=self.compiler_options)
        if self.events is not None:
            self.events("compiled", seconds=time.perf_counter() - t0)
        return self.compiled

    def abstract_state_sharded(self) -> Any:
        """The state's shapes and dtypes carrying this trainer's shardings (a restore target)."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            self.abstract_state(), self.spec.state_shardings)

    def data_step(self, step: int) -> int:
        """The data index of train step `step` (the step itself unless batches were skipped)."""
        d = step
        for b in sorted(self.skipped_batches):
            if b <= d:
                d += 1
        return d

    # ------------------------------------------------------------------ checkpoints

    def make_checkpointer(self, out_dir: Path | None = None):
        """The run's Checkpointer (`checkpoint.dir` or `<out_dir>/checkpoints`), or None when off."""
        if not self.cfg.checkpoint.enabled:
            return None
        return Checkpointer.for_run(self.cfg, checkpoint_dir(self.cfg, out_dir), log=self.log)

    def checkpoint_meta(self, step: int) -> dict:
        seed = self.cfg.train.seed
        return {"data": {"position": self.data_step(step), "step": step, "seed": seed,
                         "skipped_batches": list(self.skipped_batches)},
                "rng": {"seed": seed, "data": "splitmix64(seed, data step, row)", "init": "nnx.Rngs(seed)"},
                **layout_meta(self.cfg, self.mesh),
                "nonfinite": {"skipped": self.skipped_steps}}

    def in_order(self, state: dict, to: str) -> dict:
        """`state` with its layer stacks in `to` order: "canonical" (the model's: what a checkpoint
        holds, so any layout, `jaxpar generate` and the HF export read it) or "stored" (what the
        step runs on; they differ only with interleaved_1f1b: sharding.Plan.layer_order). One
        jitted permutation, paid only at checkpoint time; "stored" donates its input (a restored
        state)."""
        if not self.plan.interleaves_layers:
            return state
        core = tuple(k for k in ("params", "opt_state", "local") if k in state)  # what reorder_state moves
        if to not in self._reorders:
            self._reorders[to] = jax.jit(
                lambda st: reorder_state(st, self.model, self.plan, self.tx, self.spec.sync, to),
                out_shardings={k: self.spec.state_shardings[k] for k in core},
                donate_argnums=(0,) if to == "stored" else ())
        return {**state, **self._reorders[to]({k: state[k] for k in core})}

    def save(self, ckpt, step: int, state: dict) -> None:
        ckpt.save(step, self.in_order(state, "canonical"), self.checkpoint_meta(step),
                  self.cfg.model_dump(mode="json"))

    def restore_step(self, ckpt, step: int | None = None,
                     at_most: int | None = None) -> tuple[dict, dict, int]:
        """(state, meta, step) of `ckpt`'s `step` (None: its latest good one, up to `at_most`)
        onto this trainer's layout, layer stacks in the stored order."""
        state, meta, step = ckpt.restore(self.abstract_state_sharded(), step,
                                         config=self.cfg.model_dump(mode="json"), at_most=at_most)
        return self.in_order(state, "stored"), meta, step

    def _save_blocking(self, ckpt, step: int, state: dict, save: bool = True, wait: bool = False) -> None:
        """Save (and with `wait`, wait until every save has landed); the time the loop was blocked
        goes to the event log. The steps still running are waited for first: their time is
        training, not the save's."""
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        if save:
            self.save(ckpt, step, state)
        if wait:
            ckpt.wait()
        if self.events is not None:
            self.events("checkpoint_save", step=step, blocking_s=time.perf_counter() - t0)

    def restore(self, plan=None, out_dir: Path | None = None) -> tuple[dict | None, int, str]:
        """Per train.resume: (state, step to start from, what happened, for the banner).
        (None, 0, ...) when there is nothing to resume. `plan` comes from
        `jaxpar.checkpoint.plan_resume` (run() makes it before building the trainer, so the
        layout can adapt to the device count); without it, it is made here."""
        if not self.cfg.checkpoint.enabled:
            return None, 0, "checkpoints off"
        own = checkpoint_dir(self.cfg, out_dir)
        if plan is None:  # the trainer is built: its layout stays as it is
            plan = plan_resume(self.cfg, self.mesh.devices.size, own_root=own)
            plan.changes = []
        if not plan.resuming:
            why = "train.resume=never" if self.cfg.train.resume == "never" else f"no checkpoint in {own}"
            return None, 0, f"fresh start ({why})"
        if plan.notices:  # legitimate, but never silent
            self.log("resume: changed since the checkpoint: " + "; ".join(plan.notices))
        if Path(plan.root).absolute() == own.absolute():
            src = self._own_ckpt(own)
        else:  # another run's checkpoints: read only
            src = Checkpointer(plan.root, async_save=False, read_only=True, log=self.log)
        t0 = time.perf_counter()
        state, meta, step = self.restore_step(src, plan.step)
        if self.events is not None:
            self.events("checkpoint_restore", step=int(step), blocking_s=time.perf_counter() - t0)
            self.events("resume", step=int(step))
        if src is not self.checkpointer:
            src.close()
        else:
            self._supersede(src, int(step))
        reset = [k for k in meta.get("reset", []) if k in self.spec.state_shardings]
        if reset:  # e.g. error-feedback residuals of another device count: start them afresh
            state = {**state, **self._fresh(reset)}
        self.skipped_steps = int(meta.get("nonfinite", {}).get("skipped", 0))
        self.skipped_batches = [int(b) for b in meta.get("data", {}).get("skipped_batches", [])]
        self.loader.load_state_dict({"step": step})
        saved = ",".join(f"{a}={v}" for a, v in meta.get("mesh", {}).items() if v != 1) or "1 device"
        msg = f"{plan.root / str(step)} (step {step}; saved on {saved}, {meta.get('devices')} devices)"
        if plan.changes:
            msg += "; changed " + "; ".join(plan.changes)
        if meta.get("reset"):
            what = {"comm": "comm (the gradient reduction's error feedback / 1-bit Adam's state)"}
            msg += (f"; state not carried over (the checkpoint's layout or settings differ), started afresh: "
                    f"{', '.join(what.get(k, k) for k in meta['reset'])}")
        return state, int(step), msg

    def _supersede(self, ckpt, step: int) -> None:
        """Resumed from an older step of the dir this run saves into: its later steps are another
        future of the run. Moved aside to `<step>.superseded` (kept, not resumed from) so the steps
        can be saved again."""
        later = [s for s in ckpt.all_steps() if s > step]
        if later:
            self.log(f"resume: resuming from step {step} of {ckpt.root}: its later checkpoints "
                     f"({', '.join(map(str, later))}) are moved aside to <step>.superseded")
            ckpt.set_aside(later, "superseded")

    def _fresh(self, keys: list[str]) -> dict:
        """Freshly initialised top-level state entries (placed by the plan)."""
        if keys == ["comm"] and self.spec.sync.comm_specs():
            return {"comm": jax.jit(self.spec.sync.init_comm,
                                    out_shardings=self.spec.state_shardings["comm"])()}
        state = self.init_state()
        return {k: state[k] for k in keys}

    def _own_ckpt(self, root: Path):
        if self.checkpointer is None or self.checkpointer.root != root.absolute():
            self.checkpointer = Checkpointer.for_run(self.cfg, root, log=self.log)
        return self.checkpointer

    def banner(self, compiled=None, extra: dict | None = None) -> str:
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
        scaler = self.spec.loss_scale
        if scaler.mode != "none":
            lines["loss scale"] = (f"dynamic from {scaler.value:g}, x2 after {scaler.window} finite steps, "
                                   f"/2 on an overflow" if scaler.dynamic else f"static {scaler.value:g}")
        lines.update(extra or {})
        return format_banner(lines)

    # ------------------------------------------------------------------ the loop

    def fit(self, state: dict | None = None, start_step: int = 0, out_dir: Path | None = None,
            progress: bool | None = None) -> tuple[dict, list[dict]]:
        """Train from `start_step` to train.steps. Returns the final state and logged metrics.

        With `out_dir` (and checkpoint.enabled): resumes per train.resume when `state` is None,
        saves checkpoints every checkpoint.every steps and at the end, and on SIGTERM/SIGINT
        finishes the step, saves and returns (`self.preempted` names the signal).

        The loop never waits for the devices between logged steps: it dispatches the next step
        while the last runs, the batches come from a prefetch thread (data.prefetch), and the
        metrics and non-finite flags stay on the devices until a log, checkpoint or eval step.
        Nor at a log: a logged step's metrics are read once the step after it is dispatched, so
        the devices always have a step queued (log_every=1 too); only the last step, an eval or
        a checkpoint step waits for its own."""
        cfg, t = self.cfg, self.cfg.train
        out_dir = Path(out_dir) if out_dir is not None else None
        self._open_events(out_dir)
        ckpt, state, start_step = self._begin(state, start_step, out_dir)
        step_fn = self.compiled or self.compile()  # before the log's clock starts: no step's time
        log = StepLog(self, out_dir, start_step, t.progress if progress is None else progress)
        barrier("fit start")  # processes start their collectives together
        watch = NonfiniteWatch(t.max_nonfinite if t.skip_nonfinite else None)
        done = step = start_step  # steps completed
        rollbacks, finished, self.preempted, first = 0, False, None, True
        for cb in self.callbacks:
            cb.on_start(self, start_step, state)
        batches = self._batches(step)
        deferred = None  # (step, metrics) of a logged step, read once the next one is dispatched
        try:
            with Preemption(cfg.checkpoint.preemption_grace_s, self.log) as preemption:
                while step < t.steps:
                    _, batch = next(batches)
                    state, metrics = step_fn(state, batch)
                    step = done = step + 1
                    if deferred is not None:  # before this step's flag joins the pending ones
                        self._log_step(watch, log, *deferred)
                        deferred = None
                        if watch.tripped:  # a streak ended at the logged step: this one is dropped
                            done = step - 1
                    if first and self.events is not None:  # dispatched, not waited for
                        self.events("first_step", step=step)
                    first = False
                    if not watch.tripped:
                        watch.push(step, metrics.get("nonfinite"))
                        for cb in self.callbacks:
                            cb.on_step_end(self, step, state, metrics)
                        evaluated = self._evaluate(step, state, metrics, log)
                        logged = step % t.log_every == 0 or step == t.steps or step == 1 or evaluated
                        saving = ckpt is not None and step % cfg.checkpoint.every == 0
                        stopping = preemption.should_stop(step)
                        if logged and not (saving or evaluated or stopping or step == t.steps):
                            deferred = (step, metrics)
                        elif logged or saving:
                            self._log_step(watch, log, step, metrics if logged else None)
                    if watch.tripped:
                        batches.close()
                        state, step = self._on_nonfinite_streak(ckpt, state, *watch.tripped, rollbacks)
                        watch.reset()
                        done, rollbacks = step, rollbacks + 1
                        log.truncate(step)
                        batches = self._batches(step)
                        continue
                    if saving:
                        jax.block_until_ready(state)
                        with log.paused():
                            self._save_blocking(ckpt, step, state)
                    if stopping:
                        self.preempted = preemption.requested
                        break
                self._learn_skipped(watch, log)  # after a preemption: counted in the last save
                self._final_save(ckpt, done, start_step, state)
                if self.events is not None:
                    self.events("preempted" if self.preempted else "end", step=done)
            finished = True
        finally:
            batches.close()
            self._end(ckpt, finished, log, done, state)
        return state, log.history

    def _open_events(self, out_dir: Path | None) -> None:
        """The event log of `out_dir` (process 0; none without a run dir), started once."""
        if out_dir is None:
            self.events = None
            return
        if self.events is None or self.events.run_dir != out_dir:
            self.events = RunEvents(out_dir if jax.process_index() == 0 else None)
        self.events.start()

    def _batches(self, step: int):
        """The batches of steps `step`.. (their data steps, fixed now: a rollback starts anew)."""
        steps = [self.data_step(s) for s in range(step, self.cfg.train.steps)]
        return self.loader.prefetch(steps, self.cfg.data.prefetch)

    def _log_step(self, watch: NonfiniteWatch, log: StepLog, step: int, metrics: dict | None) -> None:
        """Learn the skipped steps up to `step` and, when `metrics` are given, log them."""
        self._learn_skipped(watch, log)
        if metrics is not None:
            log.record(step, metrics)

    def _learn_skipped(self, watch: NonfiniteWatch, log: StepLog) -> None:
        """Fetch the pending non-finite flags (one transfer) and report the skipped steps."""
        bad = watch.resolve()
        if not bad:
            return
        self.skipped_steps += len(bad)
        which = f"step {bad[0]}" if len(bad) == 1 else "steps " + ", ".join(map(str, bad))
        log.bar.write(f"{which}: loss or gradient norm not finite, update skipped "
                      f"({self.skipped_steps} skipped so far)", self.log)

    def _begin(self, state, start_step: int, out_dir: Path | None):
        """(checkpointer or None, the state to start from, its step): resumed per train.resume
        when a run directory is given and no state, else freshly initialised."""
        ckpt = None
        if out_dir is not None and self.cfg.checkpoint.enabled:
            ckpt = self._own_ckpt(checkpoint_dir(self.cfg, out_dir))
            if state is None:
                state, start_step, where = self.restore(out_dir=out_dir)
                if state is not None:
                    self.log(f"resumed from {where}")
        if start_step == 0:
            self.skipped_steps, self.skipped_batches = 0, []
        return ckpt, self.init_state() if state is None else state, start_step

    def _evaluate(self, step: int, state, metrics: dict, log: StepLog) -> bool:
        """At eval.every steps (and the last): the held-out loss added to `metrics`, and logged."""
        if self.evaluator is None or (step % self.cfg.eval.every and step != self.cfg.train.steps):
            return False
        jax.block_until_ready(state)  # the step's own time stays in its step_time_s
        with log.paused():
            metrics.update(self.evaluator(state["params"]))
        exempt_current_step()  # the next step's time holds the evaluation: no straggler (watchdog)
        msg = f"step {step}: eval_loss {metrics['eval_loss']:.4f}, eval_ppl {metrics['eval_ppl']:.2f}"
        log.bar.write(msg, self.log)
        return True

    def _final_save(self, ckpt, done: int, start_step: int, state) -> None:
        """The last step is saved (unless it already was) and every save has landed."""
        if ckpt is None:
            return
        self._save_blocking(ckpt, done, state, save=ckpt.last_saved != done and done > start_step, wait=True)

    def _end(self, ckpt, finished: bool, log: StepLog, done: int, state) -> None:
        if ckpt is not None and not finished:
            try:  # let a save in flight complete (it is whole or absent either way)
                ckpt.wait()
            except Exception:  # noqa: BLE001
                pass
        log.close()
        for cb in self.callbacks:
            cb.on_end(self, done, state)
        if self.preempted:
            self.log(self._stop_message(ckpt, finished, done))

    def _stop_message(self, ckpt, finished: bool, done: int) -> str:
        """What a preempted fit left behind: "saved" only once the save of `done` has landed."""
        head = f"stopped by {self.preempted} after step {done}: "
        if ckpt is None:
            return head + "checkpoints off; metrics flushed"
        where = ckpt.root / str(done)
        if finished and where.is_dir():
            return head + f"checkpoint saved in {where}; metrics flushed"
        latest = ckpt.latest_step()
        return head + (f"the save of step {done} did not complete; the latest complete checkpoint is "
                       f"{ckpt.root / str(latest) if latest is not None else 'none'}")

    def _on_nonfinite_streak(self, ckpt, state, last_bad: int, streak: int,
                             rollbacks: int) -> tuple[dict, int]:
        """train.max_nonfinite bad steps in a row (the last one: step `last_bad`): stop, or with
        nonfinite_rollback restore the last checkpoint from before the streak and never train on
        the batch that started it."""
        t = self.cfg.train
        step = last_bad
        first_bad = step - streak  # loop index of the first bad step
        msg = (f"{streak} non-finite steps in a row (steps {first_bad + 1}..{step}; loss or gradient "
               f"norm inf/nan; updates were skipped)")
        if not t.nonfinite_rollback or ckpt is None or rollbacks >= t.max_nonfinite:
            why = "" if t.nonfinite_rollback and ckpt is not None else (
                "; set train.nonfinite_rollback=true to roll back to the last checkpoint "
                "and skip the batch, ")
            raise TrainingStopped(f"stopping: {msg}{why or '; '}lower optimizer.lr or check the data "
                                  f"(data step {self.data_step(first_bad)})")
        ckpt.wait()
        good = [s for s in ckpt.all_steps() if s <= first_bad]
        if not good:
            raise TrainingStopped(f"stopping: {msg}; no checkpoint from before step {first_bad + 1} "
                                  f"to roll back to")
        bad_batch = self.data_step(first_bad)
        del state
        # the latest good step before the streak; a damaged one falls back to the one before
        state, meta, restored = self.restore_step(ckpt, at_most=good[-1])
        # the checkpoints taken since (in or after the streak) are a future the run no longer has:
        # set aside, so the steps can be saved again and a later resume does not start from them
        ckpt.set_aside([s for s in ckpt.all_steps() if s > restored], "rolled_back")
        self.skipped_batches = sorted(set(self.skipped_batches) | {bad_batch})
        self.log(f"jaxpar: {msg}: rolled back to step {restored} and skipping data step {bad_batch}")
        return state, int(restored)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run(cfg: Config, log: Callable[[str], None] = print, callbacks: list | None = None) -> list[dict]:
    """What `jaxpar train` does: plan the resume (adapting the layout to the device count), print
    the resolved config, save it, compile, restore, train; save on SIGTERM/SIGINT and return."""
    entered = time.time()  # the start event's time (written once process 0 is known)
    initialize(cfg.distributed)  # several processes: before the first JAX call (no-op otherwise)
    cfg = init_config(cfg)  # train.init_from fills model.* (saved in config.yaml, checked on resume)
    same_config_on_every_process(cfg)  # before anything reads checkpoints or compiles
    if cfg.checkpoint.enabled:  # a checkpoint dir that cannot be written fails before compiling
        ensure_writable(checkpoint_dir(cfg), cfg)
    replanned = bool(cfg.auto_fields())
    cfg, predicted = resolve_auto(cfg, log=log)  # mesh: auto & co. (for the devices found now)
    # an elastic resume of an auto layout takes the planner's choice for the new device count
    plan = plan_resume(cfg, adapt=not replanned) if cfg.checkpoint.enabled else ResumePlan(cfg)
    cfg = plan.cfg
    for change in plan.changes:
        log(("resume: " if change.startswith("train.resume=") else "elastic resume: ") + change)
    out = cfg.out_dir
    events = RunEvents(out if jax.process_index() == 0 else None)
    events.start(time=entered)
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(cfg.to_yaml())
        log("resolved config:\n" + cfg.to_yaml())
    extra = [PredictionReport(predicted, log)] if predicted is not None else []
    trainer = Trainer(cfg, log=log, callbacks=build_callbacks(cfg) + extra + list(callbacks or []),
                      events=events)
    check_attention_fits(cfg, trainer.plan)  # nothing allocated yet, nothing compiled
    check_activations_fit(cfg, trainer.plan)
    compiled = trainer.compile()
    check_step_fits(cfg, trainer.plan, compiled)  # before the state is allocated
    state, start, where = trainer.restore(plan, out_dir=out)
    log(trainer.banner(compiled, extra={"resumed from" if state is not None else "start": where}))
    if start >= cfg.train.steps:
        log(f"nothing to train: the checkpoint is at step {start} and train.steps={cfg.train.steps}")
    _, history = trainer.fit(state, start, out_dir=out)
    if history:
        first, last = history[0], history[-1]
        # None: the peak is unknown (CPU)
        mfu = f", MFU {100 * last['mfu']:.1f}%" if last.get("mfu") is not None else ""
        log(f"done: {len(history)} logged steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
            f"{last['tokens_per_s']:.0f} tokens/s{mfu}; metrics in {out / 'metrics.jsonl'}")
    return history
