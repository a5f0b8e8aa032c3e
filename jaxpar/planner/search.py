"""Enumerate the layouts of a model on a cluster, reject the invalid ones for the reason the
config checks give (or the memory budget), and rank the rest by predicted step time."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from jaxpar.config import MESH_AXES, Config, ConfigError
from jaxpar.parallel.pipeline.schedule import SCHEDULES, SPLIT
from jaxpar.planner.cluster import Cluster
from jaxpar.planner.comm import step_collectives
from jaxpar.planner.layout import Layout, abstract_plan
from jaxpar.planner.memory import estimate, state_terms
from jaxpar.planner.sync import planned_sync
from jaxpar.planner.timing import StepTime, step_time
from jaxpar.sharding import check_replication
from jaxpar.train.layout_checks import check_layout
from jaxpar.train.precision import DTYPES

REMATS = ("none", "dots_saveable", "full")  # searched; --layout may pin any of config.REMAT_POLICIES
# every schedule is searched; zb_h1 and 1f1b_split only without pipeline.recompute (their split
# backward reads the forward's residuals): zb_h1's bubble is a third of 1f1b's, paid for with the
# cotangents Bx keeps for W (memory.w_kept_bytes); 1f1b_split holds p microbatches' residuals
# where 1f1b holds up to 2p - 1, paid for with mixed ticks as long as a backward's larger half
PIPELINE_OPTIONS = ("schedule", "virtual_stages")
# where mesh.context > 1 every strategy is searched: they compute the same attention, ring with
# K/V chunks passed around (C - 1 hops a pass; not in a pipeline's stages), all_to_all with q, k,
# v and the output resharded to a head split (heads and KV heads must divide by context x
# tensor), all_gather with every chunk's K and V gathered at once (any heads, any stage)
CONTEXT_STRATEGIES = ("ring", "all_to_all", "all_gather")
# sequence parallelism is searched where mesh.tensor > 1: a tensor-th of the residual stream's
# activations for more bytes in the tensor collectives (the backward gathers the norm outputs
# again; XLA:CPU has no reduce-scatter: all-reduce, then a slice), so it wins where memory binds
MAX_MICROBATCHES = 512
# mesh.context is searched from this sequence length on (or when --layout fixes it): below it the
# activations it divides are small next to the weights, and its collectives run every layer
CONTEXT_MIN_SEQ = 8192
HEADROOM = 0.9  # of device memory the plan may use (allocator fragmentation, XLA's own buffers)
# which axes cross hosts first: data parallel replicas are the cheapest to split over slow links
DCN_ORDER = ("data", "pipeline", "fsdp", "expert", "context", "tensor")


@dataclass(frozen=True)
class Scored:
    layout: Layout
    memory: dict[str, float]
    comm: dict
    time: StepTime

    def terms(self) -> dict[str, float]:
        """Seconds per step by term: compute, memory traffic, fixed overheads, exposed
        collectives by purpose, bubble."""
        t = self.time
        return {"compute": t.compute_s, "memory": t.memory_s, "overhead": t.overhead_s,
                **{f"comm:{k}": v for k, v in t.comm_s.items()}, "bubble": t.bubble_s}


@dataclass
class Result:
    ranked: list[Scored]
    rejected: dict[str, list[Layout]] = field(default_factory=dict)  # reason -> the layouts it rejects
    considered: int = 0
    note: str = ""  # why nothing was considered (the fixed mesh sizes fit no mesh of the devices)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(devices: int, axes: tuple[str, ...]):
    """Every assignment of sizes to `axes` whose product is `devices`."""
    if len(axes) == 1:
        yield {axes[0]: devices}
        return
    for d in divisors(devices):
        for rest in mesh_shapes(devices // d, axes[1:]):
            yield {axes[0]: d, **rest}


def dcn_split(mesh: dict[str, int], cluster: Cluster) -> dict[str, int]:
    """The across-hosts factor of each axis: hosts taken by DCN_ORDER's axes first."""
    hosts, out = cluster.hosts, {}
    for a in DCN_ORDER:
        if hosts == 1:
            break
        g = math.gcd(hosts, mesh.get(a, 1))
        if g > 1:
            out[a] = g
            hosts //= g
    if hosts != 1:
        raise ConfigError(f"mesh {mesh} cannot be split over {cluster.hosts} hosts")
    return out


def check(cfg: Config, layout: Layout, model, platform: str, cache: dict | None = None) -> str | None:
    """Why the config checks refuse `layout` (None: they accept it). `cache` keeps the
    replication check's answer per mesh and ZeRO stage."""
    cache = {} if cache is None else cache
    # the config as the layout runs it: the same for every mesh, made once per option set (the
    # configs one search passes differ only in sharding.sequence_parallel)
    opts = ("config", cfg.sharding.sequence_parallel, layout.grad_accum, layout.remat, layout.schedule,
            layout.recompute, layout.virtual_stages, layout.microbatches, layout.context_strategy)
    if opts not in cache:
        t = cfg.train.model_copy(update={"grad_accum": layout.grad_accum, "remat": layout.remat})
        pipe = cfg.pipeline.model_copy(update={"schedule": layout.schedule, "recompute": layout.recompute,
                                               "virtual_stages": layout.virtual_stages,
                                               "microbatches": layout.microbatches})
        ctx = cfg.context.model_copy(update={"strategy": layout.context_strategy})
        cache[opts] = cfg.model_copy(update={"train": t, "pipeline": pipe, "context": ctx})
    c = cache[opts]
    plan = abstract_plan(c, layout)
    try:
        check_layout(c, plan, platform=platform)
        planned_sync(c, layout, model, plan, cache)  # a sync that refuses the mesh (local SGD at data 1)
    except ConfigError as e:
        return str(e)
    key = (tuple(layout.mesh.values()), layout.zero_stage)
    if key not in cache:  # the params' specs: the same under either context strategy
        cache[key] = _replication(plan, model, np.dtype(DTYPES[cfg.train.param_dtype]).itemsize)
    return cache[key]


def _replication(plan, model, itemsize: int) -> str | None:
    try:
        named = {path: (plan.spec(ax, sds.shape, "param", path), sds.shape, itemsize, ax)
                 for path, (ax, sds) in _flat(model).items()}
        check_replication(plan, named)
    except ConfigError as e:
        return str(e)
    return None


def _flat(model) -> dict:
    axes = model.leaves_with_paths(model.axes)
    shapes = model.leaves_with_paths(model.shapes)
    return {k: (axes[k], shapes[k]) for k in axes}


def options(cfg: Config, mesh: dict[str, int], pin: dict | None = None):
    """The step options to try on one mesh: ZeRO stage, remat, accumulation, schedule. `pin`:
    options the user fixed (--layout); they replace the searched range, so a value the search
    would not try (ZeRO-1 without an fsdp axis, as one device's config has it, or the
    dots_with_no_batch_dims_saveable policy) is still scored. Pinned pipeline options skip
    meshes without a pipeline; a pinned context strategy (like sequence parallelism) applies
    where its axis is above 1."""
    pin = pin or {}
    m, t = cfg.model, cfg.train
    dp = math.prod(mesh.get(a, 1) for a in cfg.sharding.resolved_rules().get("batch", ()))
    stages = (1, 2, 3) if mesh.get("fsdp", 1) > 1 else (0,)
    per_replica = t.global_batch // dp if t.global_batch % dp == 0 else 1
    accums = [a for a in divisors(per_replica) if a <= MAX_MICROBATCHES] or [1]
    stages = (pin["zero_stage"],) if "zero_stage" in pin else stages
    remats = (pin["remat"],) if "remat" in pin else REMATS
    accums = [pin["grad_accum"]] if "grad_accum" in pin else accums
    schedules = (pin["schedule"],) if "schedule" in pin else SCHEDULES
    p = mesh.get("pipeline", 1)
    if p == 1 and any(k in pin for k in PIPELINE_OPTIONS):
        return
    sps = ((pin["sequence_parallel"],) if "sequence_parallel" in pin
           else (False, True) if mesh.get("tensor", 1) > 1 else (False,))
    strategies = ((pin["context_strategy"],) if "context_strategy" in pin
                  else CONTEXT_STRATEGIES if mesh.get("context", 1) > 1 else ("ring",))
    for zero, remat, accum, sp, cs in itertools.product(stages, remats, accums, sps, strategies):
        step = dict(zero_stage=zero, remat=remat, grad_accum=accum, sequence_parallel=sp, context_strategy=cs)
        yield from _pipeline_options(m, p, pin, schedules, step)


def _pipeline_options(m, p: int, pin: dict, schedules, step: dict):
    """`step` as is without a pipeline; with one, each schedule (and recompute) to try."""
    if p == 1:
        yield step
        return
    for sched in schedules:
        v = pin.get("virtual_stages", 2 if sched == "interleaved_1f1b" else 1)
        if v > 1 and m.n_layers % (p * v):
            continue
        recomputes = (False,) if sched in SPLIT else (False, True)
        if "recompute" in pin:
            recomputes = tuple(r for r in recomputes if r == pin["recompute"])
        for recompute in recomputes:
            yield dict(step, schedule=sched, virtual_stages=v, recompute=recompute)


def search(cfg: Config, cluster: Cluster, model, *, fixed: dict[str, int] | None = None,
           options_fixed: dict | None = None, clock: str = "lockstep") -> Result:
    """Every valid layout of `cfg`'s model on `cluster`, best first. `fixed`: mesh sizes to keep
    (--layout); `options_fixed`: step options to keep (zero_stage, remat, grad_accum, ...);
    `clock`: how a pipeline is timed (timing.CLOCKS: jaxpar's runner, or Megatron-LM's)."""
    axes = ("data", "fsdp", "tensor", "pipeline") + (("expert",) if cfg.model.moe.num_experts else ())
    if cfg.train.seq_len >= CONTEXT_MIN_SEQ or (fixed or {}).get("context", 1) > 1:
        axes += ("context",)
    result = Result([])
    budget = cluster.memory_bytes * HEADROOM
    state_cache: dict = {}
    check_cache: dict = {}
    sync_cache: dict = {}
    # the config as each layout runs it: with and without sequence parallelism, under each
    # context strategy (its settings outside the mesh and the step options that the cost model
    # reads from the config)
    variants = {(sp, cs): cfg.model_copy(update={
        "sharding": cfg.sharding.model_copy(update={"sequence_parallel": sp}),
        "context": cfg.context.model_copy(update={"strategy": cs})})
        for sp in (False, True) for cs in CONTEXT_STRATEGIES}
    meshes_with_options = meshes_past_checks = 0
    for mesh in mesh_shapes(cluster.devices, axes):
        if fixed and any(mesh.get(a, 1) != n for a, n in fixed.items()):
            continue
        mesh = {a: mesh.get(a, 1) for a in MESH_AXES}
        dcn = dcn_split(mesh, cluster)
        # the checks of the mesh alone (heads vs tensor, layers vs pipeline, batch vs data):
        # a family that fails them fails with every option, so it is rejected once
        # (under each context strategy the options may take: ring and all_to_all refuse different
        # meshes, e.g. ring beside a pipeline, all_to_all where the heads do not divide)
        pinned = (options_fixed or {}).get("context_strategy")
        strategies = (pinned,) if pinned else CONTEXT_STRATEGIES if mesh["context"] > 1 else ("ring",)
        reasons = [check(cfg, Layout(mesh, zero_stage=3 if mesh["fsdp"] > 1 else 0, schedule="gpipe", dcn=dcn,
                                     context_strategy=cs), model, cluster.platform, check_cache)
                   for cs in strategies]
        reason = None if None in reasons else reasons[0]
        family = Layout(mesh, zero_stage=3 if mesh["fsdp"] > 1 else 0, schedule="gpipe", dcn=dcn,
                        context_strategy=strategies[0])
        if reason is not None:
            result.rejected.setdefault(reason, []).append(family)
            result.considered += 1
            continue
        meshes_past_checks += 1
        before = result.considered
        for opt in options(cfg, mesh, options_fixed):
            layout = Layout(mesh, dcn=dcn, **opt)
            result.considered += 1
            c = variants[layout.sequence_parallel, layout.context_strategy]
            reason = check(c, layout, model, cluster.platform, check_cache)
            if reason is not None:
                result.rejected.setdefault(reason, []).append(layout)
                continue
            key = (tuple(mesh.values()), layout.zero_stage, layout.micro > 1)
            if key not in state_cache:
                state_cache[key] = state_terms(c, layout, model)
            st = state_cache[key]
            # the state alone over the budget: no activation term can bring the total under it
            # (most layouts of a large model on many devices, and the search's costliest step)
            over = st["params"] + st["opt_state"] + st["sync_state"] > budget
            mem = None if over else estimate(c, layout, model, st, cluster.platform)
            if over or mem["total"] > budget:
                result.rejected.setdefault(
                    f"memory: needs more than {HEADROOM:.0%} of {cluster.memory_gib:g} GiB per device",
                    []).append(layout)
                continue
            comm = step_collectives(c, layout, model, abstract_plan(c, layout), sync_cache,
                                    cluster.platform, clock)
            result.ranked.append(Scored(layout, mem, comm, step_time(c, layout, model, cluster, comm,
                                                                   st, clock)))
        meshes_with_options += result.considered > before
    if not result.considered or (meshes_past_checks and not meshes_with_options):  # none left to score
        sizes = " ".join(f"mesh.{a}={n}" for a, n in (fixed or {}).items()) or "(none)"
        piped = any(k in (options_fixed or {}) for k in PIPELINE_OPTIONS)
        result.note = (f"no mesh of {cluster.devices} devices has the fixed sizes {sizes}"
                       + (" and a pipeline axis above 1 (pipeline options are fixed)" if piped else ""))
    result.ranked.sort(key=lambda s: (s.time.step_s, s.memory["total"]))
    return result


def why_slower(best: Scored, other: Scored) -> str:
    """The term that costs `other` the most time against `best`."""
    a, b = best.terms(), other.terms()
    diffs = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
    k = max(diffs, key=diffs.get)
    pct = other.time.step_s / best.time.step_s - 1
    return f"+{pct:.0%} step time, mostly {k} ({_s(b.get(k, 0.0))} vs {_s(a.get(k, 0.0))})"


def _s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"
