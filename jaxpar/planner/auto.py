"""`mesh: auto` (and `sharding.zero_stage`, `sharding.sequence_parallel`, `train.remat`,
`train.grad_accum`, `context.strategy: auto`): the planner's best plan for the devices this run
finds, taken into the config before anything is built. The settings the user gave are kept; the
global batch is never changed, so an elastic resume on another device count re-plans under the
same batch."""
from __future__ import annotations

from typing import Callable

import jax

from jaxpar.config import MESH_AXES, Config, ConfigError, make_config
from jaxpar.planner.cluster import Cluster, load_cluster
from jaxpar.train.callbacks import Callback

# device_kind substring -> preset (the first match wins)
GPU_PRESETS = (("H200", "h200_x8"), ("H100", "h100_80gb_x8"), ("A100", "a100_80gb_x8"))


def detect_cluster(cfg: Config, n_devices: int) -> Cluster:
    """planner.cluster, or the preset matching these devices, sized to n_devices."""
    if cfg.planner.cluster:
        try:
            cluster = load_cluster(cfg.planner.cluster)
        except ConfigError as e:
            raise ConfigError(f"planner.cluster: {e}") from None
    else:
        dev = jax.devices()[0]
        kind = str(getattr(dev, "device_kind", ""))
        if dev.platform == "cpu":
            cluster = load_cluster("cpu8")
        elif dev.platform == "tpu" and "v5p" in kind.lower():
            cluster = load_cluster("tpu_v5p")
        else:
            name = next((p for k, p in GPU_PRESETS if k in kind), None)
            if name is None:
                raise ConfigError(f"mesh: auto: no cluster preset for device kind {kind!r}; set "
                                  "planner.cluster "
                                  "to a cluster YAML (see jaxpar plan calibrate) or a preset")
            cluster = load_cluster(name)
    per_host = max(1, n_devices // max(1, jax.process_count()))
    return cluster.model_copy(update={"devices_per_host": per_host, "hosts": n_devices // per_host})


def resolve_auto(cfg: Config, n_devices: int | None = None, model_factory: Callable | None = None,
                 log: Callable[[str], None] = print):
    """(cfg with every `auto` setting chosen by the planner, the chosen plan or None)."""
    auto = cfg.auto_fields()
    if not auto:
        return cfg, None
    from jaxpar.mesh import resolve_sizes
    from jaxpar.planner.search import search
    from jaxpar.train.builtin import llama_model_factory
    from jaxpar.train.model import ModelDef
    n = n_devices or jax.device_count()
    cluster = detect_cluster(cfg, n)
    fixed = None if cfg.mesh.auto else {a: s for a, s in resolve_sizes(cfg.mesh, n).items() if a in MESH_AXES}
    keep = {}
    if "sharding.zero_stage" not in auto:
        keep["zero_stage"] = cfg.sharding.zero_stage
    if "train.remat" not in auto:
        keep["remat"] = cfg.train.remat
    if "train.grad_accum" not in auto:
        keep["grad_accum"] = cfg.train.grad_accum
    if "sharding.sequence_parallel" not in auto:
        keep["sequence_parallel"] = cfg.sharding.sequence_parallel
    if "context.strategy" not in auto:
        keep["context_strategy"] = cfg.context.strategy
    # plan with concrete placeholders for the auto fields (the search sets its own values)
    raw = cfg.model_dump(mode="json")
    raw["mesh"] = {a: (fixed or {}).get(a, 1) for a in MESH_AXES} | {"dcn": cfg.mesh.dcn}
    raw["sharding"]["zero_stage"] = keep.get("zero_stage", 1)
    raw["train"]["remat"] = keep.get("remat", "none")
    raw["train"]["grad_accum"] = keep.get("grad_accum", 1)
    raw["sharding"]["sequence_parallel"] = keep.get("sequence_parallel", False)
    raw["context"]["strategy"] = keep.get("context_strategy", "ring")  # the chosen one where context > 1
    base = make_config(raw)
    model = ModelDef.from_factory(model_factory or llama_model_factory(base))
    result = search(base, cluster, model, fixed=fixed, options_fixed=keep)
    if not result.ranked:
        reasons = result.note or "\n  ".join(f"{len(v)} x {r.splitlines()[0]}" for r, v in
                                              sorted(result.rejected.items(), key=lambda kv: -len(kv[1]))[:5])
        raise ConfigError(f"{', '.join(auto)}: auto: no valid layout of this model on {n} devices "
                          f"({cluster.name}); the most common reasons:\n  {reasons}")
    best = result.ranked[0]
    chosen = make_config(raw, best.layout.overrides())
    t = best.time
    log(f"planner ({', '.join(auto)}: auto, cluster {cluster.name}, {n} devices): {best.layout.label()}; "
        f"predicted {t.step_s * 1e3:.1f} ms/step, {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%}, "
        f"{best.memory['total'] / 2**30:.2f} GiB per device ({result.considered} layouts considered, "
        f"{len(result.ranked)} valid)")
    return chosen, best


class PredictionReport(Callback):
    """A loop callback that prints the plan's predicted figures beside the measured ones at the
    second logged step (the first includes compilation)."""

    def __init__(self, plan, log: Callable[[str], None] = print):
        self.plan, self.log, self.seen = plan, log, 0

    def on_log(self, trainer, record: dict) -> None:
        self.seen += 1
        if self.seen == 2 and jax.process_index() == 0 and record.get("tokens_per_s"):
            t = self.plan.time
            measured = record["tokens_per_s"]
            self.log(f"planner: predicted {t.tokens_per_s:,.0f} tokens/s, measured {measured:,.0f} "
                     f"({measured / t.tokens_per_s:.2f}x the prediction)")
