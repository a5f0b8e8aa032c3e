"""`jaxpar bench overhead-point`: jaxpar's compiled step vs a minimal hand-written `jax.jit` step
(one cell of `jaxpar bench overhead`, which runs the dtype x remat x layout matrix).

The baseline is what one would write without jaxpar: the same `models.llama.Llama` (nnx, same
seed, so the same initial params), `jax.value_and_grad` of the mean token cross-entropy, and
optax clip-by-global-norm + AdamW with the config's schedule and hyperparameters (no decay on
norms, like jaxpar), in one `jax.jit` whose params and optimizer state have jaxpar's shardings
for the layout (replicated for data parallelism; fsdp / tensor shards otherwise) and whose batch
has jaxpar's batch sharding, on the same mesh, with the same batch. GSPMD inserts every
collective. Both steps donate their state.

Default layout: pure data parallel (mesh data=-1, zero_stage 0).

Timing: `warmup` steps of each, then `train.steps` steps alternating jaxpar / baseline, who
goes first alternating too (so load from other processes hits both alike), each timed to
`block_until_ready`. Reported: the median step time of each and jaxpar / baseline (target
<= 1.05); also the ratio of the fastest steps and the median ratio of back-to-back pairs,
which a busy machine disturbs less, and the ratio of
the process's CPU time per step (total work, which other processes' load barely changes).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import nn
from jaxpar.bench.common import describe_config, fmt_ratio, mesh_overrides, table
from jaxpar.config import Config
from jaxpar.mesh import describe
from jaxpar.metrics.hlo import naive_dots
from jaxpar.train.precision import DTYPES
from jaxpar.train.trainer import Trainer
from models.llama import Llama

LAYOUT: list[str] = [*mesh_overrides(data=-1), "sharding.zero_stage=0"]
TARGET = 1.05


def build_baseline(cfg: Config, mesh, batch_sharding: NamedSharding, param_shardings=None,
                   opt_param_shardings=None):
    """(init() -> (params, opt_state), jitted step(params, opt_state, tokens)) written by hand.
    Params (and the optimizer's per-param state) are replicated unless shardings are given:
    then plain GSPMD with those shardings, which places every collective itself."""
    t, o = cfg.train, cfg.optimizer
    seed, pdt, cdt = t.seed, DTYPES[t.param_dtype], DTYPES[t.compute_dtype]
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(cfg.model, nnx.Rngs(seed))), nnx.Param)
    lr = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(o.decay_steps or t.steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, p: p.ndim >= 2 and "norm" not in jax.tree_util.keystr(path), params)

    tx = optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    if o.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)
    repl = NamedSharding(mesh, P())

    def init():
        state = nnx.split(Llama(cfg.model, nnx.Rngs(seed)), nnx.Param)[1]
        params = nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()
        params = jax.tree.map(lambda x: x.astype(pdt), params)
        return params, tx.init(params)

    def loss_fn(params, tokens):
        params = jax.tree.map(lambda x: x.astype(cdt), params)
        with nn.use_context(nn.Context(remat=t.remat)):  # the model's own remat switch only
            logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        if t.grad_accum == 1:
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        else:  # microbatch i = rows i, i+A, i+2A, ...: every device keeps its rows
            b, s = tokens.shape
            mbs = tokens.reshape(b // t.grad_accum, t.grad_accum, s).swapaxes(0, 1)

            def body(acc, mb):
                loss, g = jax.value_and_grad(loss_fn)(params, mb)
                return jax.tree.map(jnp.add, acc, g), loss

            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, losses = jax.lax.scan(body, zeros, mbs)
            grads = jax.tree.map(lambda g: g / t.grad_accum, grads)
            loss = losses.mean()
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": _norm(grads)}

    p_sh, o_sh = repl, repl
    if param_shardings is not None:  # the optimizer's per-param state follows its own shardings
        p_sh = param_shardings
        o_sh = optax.tree_map_params(tx, lambda _, sh: sh, jax.eval_shape(lambda: init()[1]),
                                     opt_param_shardings or param_shardings,
                                     transform_non_params=lambda _: repl,
                                     is_leaf=lambda x: isinstance(x, NamedSharding))
    step_jit = jax.jit(step, in_shardings=(p_sh, o_sh, batch_sharding),
                       out_shardings=(p_sh, o_sh, None), donate_argnums=(0, 1))
    return jax.jit(init, out_shardings=(p_sh, o_sh)), step_jit


def jaxpar_shardings(trainer):
    """(param shardings, optimizer per-param shardings) of jaxpar's plan, for the baseline."""
    plan, model = trainer.plan, trainer.model
    sh = lambda use: jax.tree.map(lambda ax, s: plan.sharding(plan.spec(ax, s.shape, use)),
                                  model.axes, model.shapes, is_leaf=lambda x: isinstance(x, tuple))
    return sh("param"), sh("opt")


def _norm(tree):
    return optax.tree.norm(tree) if hasattr(optax, "tree") else optax.global_norm(tree)


def _stats(times: list[float]) -> dict:
    s = sorted(times)
    return {"median_s": statistics.median(s), "min_s": s[0], "max_s": s[-1],
            "mean_s": statistics.fmean(s), "n": len(s)}


def run(cfg: Config, log: Callable[[str], None] = lambda s: None, warmup: int = 3) -> dict:
    steps = cfg.train.steps
    trainer = Trainer(cfg, log=log)
    log(f"overhead: {describe(trainer.mesh)}, zero {trainer.plan.zero_stage}, "
        f"{trainer.model.n_params:,} params; compiling")
    t0 = time.perf_counter()
    jp_step = trainer.compile()
    jp_compile = time.perf_counter() - t0
    batch = trainer.loader.batch(0)
    jp_state = trainer.init_state()

    # the baseline gets jaxpar's param/opt shardings
    init, bl_jit = build_baseline(cfg, trainer.mesh, batch.sharding, *jaxpar_shardings(trainer))
    params, opt_state = init()
    t0 = time.perf_counter()
    bl_step = bl_jit.lower(params, opt_state, batch).compile(compiler_options=trainer.compiler_options)
    bl_compile = time.perf_counter() - t0

    def run_jp():
        nonlocal jp_state
        jp_state, m = jp_step(jp_state, batch)
        jax.block_until_ready((jp_state, m))
        return m

    def run_bl():
        nonlocal params, opt_state
        params, opt_state, m = bl_step(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, m))
        return m

    first = {"jaxpar": float(run_jp()["loss"]), "baseline": float(run_bl()["loss"])}
    for _ in range(max(warmup - 1, 0)):
        run_jp()
        run_bl()
    log(f"overhead: timing {steps} steps each")
    jp_times, bl_times, jp_cpu, bl_cpu = [], [], [], []
    for i in range(steps):
        pair = ((run_jp, jp_times, jp_cpu), (run_bl, bl_times, bl_cpu))
        for fn, acc, cpu in pair if i % 2 == 0 else pair[::-1]:  # alternate who goes first
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            acc.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)  # this process's CPU work: other load barely moves it
    jp, bl = _stats(jp_times), _stats(bl_times)
    jp["cpu_median_s"], bl["cpu_median_s"] = statistics.median(jp_cpu), statistics.median(bl_cpu)
    r = jp["median_s"] / bl["median_s"]
    paired = statistics.median(a / b for a, b in zip(jp_times, bl_times))
    return {
        "mesh": describe(trainer.mesh),
        "mesh_shape": dict(trainer.mesh.shape),
        "zero_stage": trainer.plan.zero_stage,
        "n_params": trainer.model.n_params,
        **describe_config(cfg),
        "steps": steps,
        "warmup": warmup,
        "jaxpar": {**jp, "compile_s": jp_compile, "first_loss": first["jaxpar"]},
        "baseline": {**bl, "compile_s": bl_compile, "first_loss": first["baseline"]},
        "ratio": r,
        "ratio_min": jp["min_s"] / bl["min_s"],
        "ratio_paired_median": paired,
        "cpu_ratio": jp["cpu_median_s"] / bl["cpu_median_s"],
        "target": TARGET,
        "within_target": r <= TARGET,
    }


def format_result(res: dict) -> str:
    t = res["train"]
    ms = lambda x: f"{x * 1e3:.2f}"
    rows = [[name, ms(res[k]["median_s"]), ms(res[k]["min_s"]), ms(res[k]["max_s"]),
             f"{res[k]['compile_s']:.2f}", f"{res[k]['first_loss']:.4f}"]
            for k, name in (("jaxpar", "jaxpar step"), ("baseline", "hand-written jax.jit"))]
    head = (f"overhead: {res['mesh']}, zero stage {res['zero_stage']}, {res['n_params']:,} params, "
            f"batch {t['global_batch']} x {t['seq_len']}, grad_accum {t['grad_accum']}, "
            f"{t['compute_dtype']} compute; {res['steps']} timed steps each after {res['warmup']} warm-up, "
            f"interleaved")
    verdict = "within" if res["within_target"] else "ABOVE"
    return "\n".join([
        head, "",
        table(["step", "median ms", "min ms", "max ms", "compile s", "loss @1"], rows), "",
        f"ratio jaxpar/baseline (median): {fmt_ratio(res['ratio'])}  ({verdict} target <= {res['target']})",
        f"  of the fastest steps: {fmt_ratio(res['ratio_min'])};  median of back-to-back pairs: "
        f"{fmt_ratio(res['ratio_paired_median'])}  (less sensitive to load from other processes);  "
        f"of CPU time per step: {fmt_ratio(res['cpu_ratio'])}",
    ])


def compiled_structure(cfg: Config) -> dict:
    """Compile (never run) jaxpar's step and the hand-written one for `cfg`: XLA's bytes accessed
    and the bf16 dots left to XLA:CPU's naive emitter, per step; both with the step's compiler
    options (CPU dots)."""
    trainer = Trainer(cfg, log=lambda s: None)
    batch = trainer.abstract_batch()
    state = jax.eval_shape(trainer.init_fn, cfg.train.seed)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state,
                         trainer.spec.state_shardings)
    init, bl_jit = build_baseline(cfg, trainer.mesh, batch.sharding, *jaxpar_shardings(trainer))
    params, opt_state = jax.eval_shape(init)
    out = {}
    opts = trainer.compiler_options
    for name, lowered in (("jaxpar", trainer.step_fn.lower(state, batch)),
                          ("baseline", bl_jit.lower(params, opt_state, batch))):
        compiled = lowered.compile(compiler_options=opts)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out[name] = {"bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                     "flops": float(cost.get("flops", 0.0)),
                     "naive_bf16_dots": naive_dots(compiled.as_text(), "bf16")}
    return out
