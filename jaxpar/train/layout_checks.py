"""The layout mistakes a config can make, each one clear ConfigError before anything is built:
read by the Trainer, and by the planner to reject a layout for the same reason."""
from __future__ import annotations

from jaxpar.attention import check as check_attention
from jaxpar.config import Config, ConfigError
from jaxpar.parallel.context import check_layout as check_context
from jaxpar.parallel.expert import check_layout as check_experts
from jaxpar.parallel.pipeline import check_pipeline_layout
from jaxpar.sharding import Plan


def check_layout(cfg: Config, plan: Plan, check_model: bool = True, platform: str | None = None) -> None:
    """User mistakes that would otherwise surface as deep JAX errors. `platform`: the devices'
    (default: the plan's mesh's; the planner checks layouts on a mesh without devices)."""
    shape = plan.mesh.shape
    m, t = cfg.model, cfg.train
    if check_model and shape["tensor"] > 1:
        for fld in ("n_heads", "n_kv_heads"):
            if getattr(m, fld) % shape["tensor"]:
                raise ConfigError(
                    f"model.{fld}={getattr(m, fld)} is not divisible by mesh.tensor={shape['tensor']}; "
                    f"use a tensor size that divides {getattr(m, fld)}"
                )
    if check_model:
        check_experts(m, shape)
        check_attention(m.attention, platform or plan.mesh.devices.flat[0].platform, t.compute_dtype)
    check_context(cfg, shape, check_model)
    if shape.get("pipeline", 1) > 1:
        check_pipeline_layout(cfg, plan, check_model)
    dp = plan.batch_size_divisor
    if t.global_batch % (dp * t.grad_accum):
        axes = "*".join(plan.batch_axes)
        raise ConfigError(
            f"train.global_batch={t.global_batch} must be divisible by the batch-parallel size "
            f"({axes} = {dp}) times train.grad_accum={t.grad_accum} = {dp * t.grad_accum}"
        )
