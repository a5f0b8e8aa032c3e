"""A candidate layout: mesh sizes and the step options the planner chooses, as config overrides."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import jax

from jaxpar.config import MESH_AXES, Config, make_config
from jaxpar.sharding import Plan, entry_axes

SEARCHED_AXES = ("data", "fsdp", "tensor", "pipeline", "expert", "context")  # context: long sequences


@dataclass(frozen=True)
class Layout:
    mesh: dict[str, int]
    zero_stage: int = 1
    remat: str = "none"
    grad_accum: int = 1
    schedule: str = "1f1b"        # pipeline.schedule (used when mesh.pipeline > 1)
    virtual_stages: int = 1
    microbatches: int | None = None  # pipeline.microbatches; None: grad_accum
    recompute: bool = False          # pipeline.recompute
    dcn: dict[str, int] = field(default_factory=dict)  # the across-hosts part of each axis
    sequence_parallel: bool = False  # sharding.sequence_parallel (used when mesh.tensor > 1)
    context_strategy: str = "ring"   # context.strategy (used when mesh.context > 1)

    @property
    def micro(self) -> int:
        """Microbatches per step (the accumulation scan's, or the pipeline's)."""
        return (self.microbatches or self.grad_accum) if self.size("pipeline") > 1 else self.grad_accum

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    def size(self, axis: str) -> int:
        return self.mesh.get(axis, 1)

    def overrides(self) -> list[str]:
        out = [f"mesh.{a}={self.mesh.get(a, 1)}" for a in MESH_AXES]
        out += [f"sharding.zero_stage={self.zero_stage}", f"train.remat={self.remat}",
                f"train.grad_accum={self.grad_accum}",
                f"sharding.sequence_parallel={str(self.sequence_parallel).lower()}"]
        if self.size("pipeline") > 1:
            out += [f"pipeline.schedule={self.schedule}", f"pipeline.virtual_stages={self.virtual_stages}",
                    f"pipeline.microbatches={self.microbatches or 'null'}",
                    f"pipeline.recompute={str(self.recompute).lower()}"]
        if self.size("context") > 1:
            out.append(f"context.strategy={self.context_strategy}")
        if any(n > 1 for n in self.dcn.values()):
            out.append("mesh.dcn={" + ",".join(f"{a}: {n}" for a, n in self.dcn.items() if n > 1) + "}")
        return out

    def config(self, cfg: Config) -> Config:
        """`cfg` with this layout (validated like any config)."""
        return make_config(cfg.model_dump(mode="json"), self.overrides())

    def label(self) -> str:
        mesh = " ".join(f"{a}={n}" for a, n in self.mesh.items() if n > 1) or "1 device"
        extra = f" zero={self.zero_stage} remat={self.remat} accum={self.grad_accum}"
        extra += " seqpar" if self.sequence_parallel and self.size("tensor") > 1 else ""
        extra += f" {self.context_strategy}" if self.size("context") > 1 else ""
        if self.size("pipeline") > 1:
            extra += f" {self.schedule}" + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
            extra += " recompute" if self.recompute else ""
        return mesh + extra

    @classmethod
    def of_config(cls, cfg: Config, devices: int) -> "Layout":
        """The layout a resolved config describes on `devices` devices."""
        from jaxpar.mesh import resolve_sizes
        sizes = resolve_sizes(cfg.mesh, devices)
        t = cfg.train
        return cls({a: sizes[a] for a in MESH_AXES}, cfg.sharding.zero_stage, t.remat, t.grad_accum,
                   cfg.pipeline.schedule, cfg.pipeline.virtual_stages, cfg.pipeline.microbatches,
                   cfg.pipeline.recompute, dict(cfg.mesh.dcn), cfg.sharding.sequence_parallel is True,
                   cfg.context.strategy if cfg.context.strategy != "auto" else "ring")


def abstract_plan(cfg: Config, layout: Layout) -> Plan:
    """The sharding plan of `layout` on a mesh without devices (shapes only: any cluster size);
    one object per mesh, rules and ZeRO stage (a search asks for each many times)."""
    rules = _sorted(cfg.sharding.resolved_rules_items())
    return _abstract_plan(tuple(layout.mesh.get(a, 1) for a in MESH_AXES), rules, layout.zero_stage,
                          cfg.sharding.replicated_tolerance)


@functools.lru_cache(maxsize=256)
def _sorted(items: tuple) -> tuple:
    return tuple(sorted(items))


@functools.lru_cache(maxsize=8192)
def _abstract_plan(sizes: tuple, rules: tuple, zero_stage: int, tolerance: float) -> Plan:
    names = tuple(MESH_AXES)
    return Plan(jax.sharding.AbstractMesh(sizes, names), dict(rules), zero_stage, tolerance)


def shard_elems(plan: Plan, axes, shape, use: str, skip: tuple[str, ...] = ()) -> int:
    """Elements per device of an array with logical `axes` under the plan's spec for `use`,
    not counting the mesh axes in `skip` (("fsdp",) with "act": a ZeRO-3 gather's result)."""
    spec = plan.spec(axes, shape, use)
    mesh = plan.mesh.shape
    n = 1
    for d, e in zip(shape, (*spec, *(None,) * (len(shape) - len(spec)))):
        n *= d // math.prod(mesh[a] for a in entry_axes(e) if a not in skip)
    return n


@functools.lru_cache(maxsize=4096)
def timetable(schedule: str, p: int, m: int, v: int, recompute: bool):
    """The pipeline runner's timetable of a layout (cached: the search asks for each often)."""
    from jaxpar.parallel.pipeline.schedule import build_timetable
    return build_timetable(schedule, p, m, v, recompute)
