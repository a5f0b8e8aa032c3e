"""`jaxpar train CONFIG [a.b=value ...]`, `jaxpar bench NAME ...`.

User mistakes (bad config, bad checkpoint) print one clear message and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys

from jaxpar.config import ConfigError, load_config


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from jaxpar.xla import apply_xla_flags
    apply_xla_flags(cfg.xla)
    from jaxpar.train.trainer import run
    run(cfg)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from jaxpar.bench import run_bench
    return run_bench(args.name, args.config, args.overrides, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train from a YAML config")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10 mesh.data=4")
    t.set_defaults(fn=_train)
    b = sub.add_parser("bench", help="benchmarks that print figures (overhead, memory, comm)")
    b.add_argument("name")
    b.add_argument("config", nargs="?", default=None)
    b.add_argument("overrides", nargs="*")
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.set_defaults(fn=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"jaxpar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
