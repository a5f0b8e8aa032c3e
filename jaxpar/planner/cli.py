"""`jaxpar plan CONFIG --cluster NAME|FILE [--devices N] [--top K] [--layout mesh.x=..] [--explain]
[--json]`, `jaxpar plan calibrate [-o FILE]`, `jaxpar plan fit RUN_DIRS... --cluster C [-o FILE]`."""
from __future__ import annotations

import argparse
import json

from jaxpar.config import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the automatic parallel planner: best layouts for a config on a cluster "
                                    "(also: plan calibrate, plan fit RUN_DIRS)")
    p.add_argument("target", nargs="+", help="CONFIG [overrides...] | calibrate | fit RUN_DIR...")
    p.add_argument("--cluster", default=None, help="required (except for plan calibrate): a preset (see "
                                                   "jaxpar/planner/clusters) or a YAML file")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to plan for, >= 1 (default: the cluster's)")
    p.add_argument("--top", type=int, default=None, help="layouts to print, >= 1 (default 5)")
    p.add_argument("--layout", action="extend", nargs="+", default=[], metavar="mesh.x=N",
                   help="score only layouts with these settings (mesh.*, sharding.zero_stage, train.remat, "
                        "train.grad_accum, pipeline.schedule, pipeline.virtual_stages, pipeline.recompute, "
                        "sharding.sequence_parallel, context.strategy); several after one --layout, "
                        "or repeated")
    p.add_argument("--explain", action="store_true", help="break the best plan into its terms")
    p.add_argument("--json", action="store_true")
    p.add_argument("-o", "--output", default=None, help="calibrate / fit: the cluster file to write")
    p.set_defaults(fn=run)


LAYOUT_KEYS = {"sharding.zero_stage": "zero_stage", "train.remat": "remat", "train.grad_accum": "grad_accum",
               "pipeline.schedule": "schedule", "pipeline.virtual_stages": "virtual_stages",
               "pipeline.recompute": "recompute", "sharding.sequence_parallel": "sequence_parallel",
               "context.strategy": "context_strategy"}
FLAGS = ("pipeline.recompute", "sharding.sequence_parallel")  # true / false


def parse_layout(items: list[str]) -> tuple[dict[str, int], dict]:
    """--layout settings -> (fixed mesh sizes, fixed step options); one clear error for a bad one."""
    import yaml
    from jaxpar.config import MESH_AXES
    mesh, opts = {}, {}
    for item in items:
        for part in item.split():
            if "=" not in part:
                raise ConfigError(f"--layout {part!r}: expected key=value, e.g. mesh.tensor=8")
            key, raw = part.split("=", 1)
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                raise ConfigError(f"--layout {part!r}: {raw!r} is not a YAML value; write key=value, "
                                  f"e.g. mesh.tensor=8") from None
            if key.startswith("mesh.") and key[5:] in MESH_AXES:
                if not isinstance(value, int) or value < 1:
                    raise ConfigError(f"--layout {key}={raw!r}: a mesh size must be a positive integer")
                mesh[key[5:]] = value
            elif key in LAYOUT_KEYS:
                opts[LAYOUT_KEYS[key]] = _layout_value(key, raw, value)
            else:
                valid = [f"mesh.{a}" for a in MESH_AXES] + list(LAYOUT_KEYS)
                raise ConfigError(f"--layout {key!r} is not a layout setting; valid: {', '.join(valid)}")
    return mesh, opts


def _layout_value(key: str, raw: str, value):
    """A pinned step option, checked (one clear error naming what would be valid)."""
    from jaxpar.config import REMAT_POLICIES
    from jaxpar.parallel.pipeline.schedule import SCHEDULES
    from jaxpar.planner.search import CONTEXT_STRATEGIES
    valid = {"sharding.zero_stage": (0, 1, 2, 3), "train.remat": REMAT_POLICIES,
             "pipeline.schedule": SCHEDULES, "context.strategy": CONTEXT_STRATEGIES,
             **{k: (False, True) for k in FLAGS}}.get(key)
    flag = key in FLAGS
    if valid is not None and (value not in valid or isinstance(value, bool) != flag):
        names = "true, false" if flag else ", ".join(map(str, valid))
        raise ConfigError(f"--layout {key}={raw!r}: valid values are {names}")
    if valid is None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"--layout {key}={raw!r}: must be a positive integer")
    return value


# the options each form reads; another given is an error (it did nothing before: -o on a plan, a
# file name after calibrate, --layout with fit)
USES = {"calibrate": {"output"}, "fit": {"cluster", "devices", "json", "output"},
        "plan": {"cluster", "devices", "top", "layout", "explain", "json"}}
UNSET = {"cluster": None, "devices": None, "top": None, "layout": [], "explain": False, "json": False,
         "output": None}


def check_options(args: argparse.Namespace) -> None:
    """One error naming the options (or arguments) this form of `jaxpar plan` does not read."""
    form = args.target[0] if args.target[0] in ("calibrate", "fit") else "plan"
    bad = [f"--{k}" for k, unset in UNSET.items() if k not in USES[form] and getattr(args, k) != unset]
    if form == "calibrate" and len(args.target) > 1:
        bad.append(f"the argument(s) {' '.join(args.target[1:])} (write the file with -o FILE)")
    if bad:
        raise ConfigError(f"jaxpar plan{'' if form == 'plan' else ' ' + form}: {', '.join(bad)} "
                          f"{'is' if len(bad) == 1 else 'are'} not read by this form; it reads "
                          f"{', '.join('--' + k for k in sorted(USES[form]))}")


def run(args: argparse.Namespace) -> int:
    head = args.target[0]
    check_options(args)
    if args.devices is not None and args.devices < 1:
        raise ConfigError(f"jaxpar plan: --devices must be >= 1 (got {args.devices})")
    args.top = 5 if args.top is None else args.top
    if args.top < 1:
        raise ConfigError(f"jaxpar plan: --top must be >= 1 (got {args.top})")
    if head == "calibrate":
        from jaxpar.planner.calibrate import calibrate
        cluster = calibrate()
        text = cluster.to_yaml()
        if args.output:
            open(args.output, "w").write(text)
        print(text, end="")
        return 0
    if args.cluster is None:
        raise ConfigError("jaxpar plan: --cluster is required (a preset name or a cluster YAML file)")
    from jaxpar.planner.cluster import load_cluster
    cluster = load_cluster(args.cluster)
    if args.devices is not None:
        cluster = cluster.with_devices(args.devices)
    if head == "fit":
        from jaxpar.planner.fit import fit_cluster
        fitted, report = fit_cluster(cluster, args.target[1:])
        if args.output:
            open(args.output, "w").write(fitted.to_yaml())
        print(json.dumps(report, indent=2) if args.json else report["text"])
        return 0
    from jaxpar.config import load_config
    from jaxpar.planner.report import format_result, to_json
    from jaxpar.planner.search import search
    from jaxpar.train.builtin import llama_model_factory
    from jaxpar.train.model import ModelDef
    cfg = load_config(head, args.target[1:])
    mesh, opts = parse_layout(args.layout)
    model = ModelDef.from_factory(llama_model_factory(cfg))
    result = search(cfg, cluster, model, fixed=mesh, options_fixed=opts)
    if args.json:
        print(json.dumps(to_json(result, args.top, args.explain), indent=2))
    else:
        print(format_result(result, args.top, f"{cluster.name} ({cluster.devices} devices)", args.explain))
    return 0 if result.ranked else 1
