"""`jaxpar train CONFIG [a.b=value ...]`, `jaxpar bench NAME ...`, `jaxpar plot RUN_DIR...`,
`jaxpar profile [RUN_DIR]`, `jaxpar convert from-hf|to-hf SRC DST`, `jaxpar data prepare|train-tokenizer`,
`jaxpar generate RUN_OR_CKPT --prompt TEXT`, `jaxpar goodput RUN_DIR [--json]`,
`jaxpar launch --nprocs N --devices-per-proc K -- train CONFIG ...`,
`jaxpar launch --ray [ADDRESS] --nodes N [--min-nodes M] -- train CONFIG ...`.

User mistakes (bad config, bad checkpoint) print one clear message and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys

from jaxpar.config import ConfigError, load_config


# Each command imports what it runs inside its function: `jaxpar --help`, `launch` and `plot` then
# start without jax (heavy), and `train` sets XLA flags and jax.distributed up before jax loads.


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from jaxpar.xla import apply_xla_flags
    apply_xla_flags(cfg)
    from jaxpar.distributed import initialize, is_main_process  # before any other JAX call
    initialize(cfg.distributed, log=print)
    from jaxpar.train.trainer import run
    # one copy of the run's messages (warnings and errors: all)
    run(cfg, log=print if is_main_process() else (lambda msg: None))
    return 0


def _launch(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("jaxpar launch: give the command after --, e.g. "
                          "jaxpar launch --nprocs 2 --devices-per-proc 4 -- train CONFIG")
    if args.max_restarts < 0:
        raise ConfigError(f"jaxpar launch: --max-restarts must be >= 0 (got {args.max_restarts})")
    for opt, value in (("--kill-timeout", args.kill_timeout), ("--grace", args.grace)):
        if not value > 0:
            raise ConfigError(f"jaxpar launch: {opt} must be > 0 seconds (got {value:g})")
    if args.ray is not None:
        return _launch_ray(args, command)
    ray_only = [opt for opt, value in (("--nodes", args.nodes), ("--min-nodes", args.min_nodes),
                                       ("--devices-per-node", args.devices_per_node)) if value is not None]
    if ray_only:
        raise ConfigError(f"jaxpar launch: {', '.join(ray_only)}: --nodes/--min-nodes/--devices-per-node are "
                          f"for --ray (a Ray cluster); on this machine give --nprocs N --devices-per-proc K")
    from jaxpar.launch import JAXPAR_COMMANDS, LaunchOptions, launch, missing_program, run_dir_of
    if args.nprocs is None:
        raise ConfigError("jaxpar launch: give --nprocs N (processes on this machine) or --ray [ADDRESS] "
                          "--nodes N (one process per node of a Ray cluster)")
    if args.nprocs < 1 or args.devices_per_proc < 1:
        raise ConfigError("jaxpar launch: --nprocs and --devices-per-proc must be >= 1")
    if args.min_nprocs is not None and not 1 <= args.min_nprocs <= args.nprocs:
        raise ConfigError(f"jaxpar launch: --min-nprocs must be in 1..{args.nprocs}")
    program = missing_program(command)
    if program is not None:
        raise ConfigError(f"jaxpar launch: command {program!r} not found (not a jaxpar command, "
                          f"{', '.join(JAXPAR_COMMANDS)}, nor a program on PATH)")
    run_dir = args.run_dir if args.run_dir is not None else run_dir_of(command)
    return launch(LaunchOptions(args.nprocs, args.devices_per_proc, command, max_restarts=args.max_restarts,
                                min_nprocs=args.min_nprocs, kill_timeout=args.kill_timeout, grace=args.grace,
                                run_dir=str(run_dir) if run_dir is not None else None))


def _goodput(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from jaxpar.observe.events import EVENTS_FILE
    from jaxpar.observe.goodput import format_report, goodput_of, skipped_note
    skipped: list[tuple[int, str]] = []
    g = goodput_of(args.run_dir, skipped)
    if skipped:  # stderr: --json's output stays one JSON document
        print(skipped_note(Path(args.run_dir) / EVENTS_FILE, skipped), file=sys.stderr)
    print(json.dumps(g.to_dict(), indent=1) if args.json else format_report(g, args.run_dir))
    return 0


def _launch_ray(args: argparse.Namespace, command: list[str]) -> int:
    from jaxpar.launch_ray import RayOptions, launch_ray
    if args.nodes is None:
        raise ConfigError(f"jaxpar launch --ray {args.ray}: give --nodes N (one jaxpar process per node)")
    if args.nprocs is not None:
        raise ConfigError(f"jaxpar launch: --nprocs {args.nprocs} is for one machine; with --ray the "
                          f"processes are --nodes (one per node)")
    return launch_ray(RayOptions(args.nodes, command, address=args.ray, min_nodes=args.min_nodes,
                                 devices_per_node=args.devices_per_node, node_resource=args.node_resource,
                                 run_dir=args.run_dir, max_restarts=args.max_restarts,
                                 kill_timeout=args.kill_timeout, grace=args.grace,
                                 node_timeout=args.node_timeout))


def _int_list(text: str) -> list[int]:
    """`4096,8192` -> [4096, 8192] (argparse reports the error with the option's name)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers separated by commas, "
                                         "e.g. 4096,8192")
    return values


def _positive_float(text: str) -> float:
    """A finite number > 0 (argparse reports the error with the option's name)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0, e.g. 5")
    return value


def _name_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected names separated by commas, e.g. xla,blockwise")
    return values


def _bench(args: argparse.Namespace) -> int:
    from jaxpar.bench import run_bench
    options = {k: v for k, v in (("seqs", args.seqs), ("impls", args.impls)) if v is not None}
    try:
        return run_bench(args.name, args.config, args.overrides, as_json=args.json, plot=args.plot,
                         options=options)
    except ConfigError as e:
        hint = _bench_layout_hint(args.name, args.config, args.overrides, str(e))
        if hint is None:
            raise
        raise ConfigError(f"{e}\n  {hint}") from None


def _bench_layout_hint(name: str, config: str | None, overrides: list[str], message: str) -> str | None:
    """An error that names a value the benchmark's own layout (its LAYOUT overrides) set, not the
    user: say so, and what the benchmark needs (its LAYOUT_HINTS), e.g. `bench convert model.dim=64`
    against its n_heads=12."""
    from jaxpar.bench import BENCHMARKS, get, split_args
    if name not in BENCHMARKS:
        return None
    mod = get(name)
    given = {o.split("=", 1)[0] for o in split_args(config, overrides)[1]}
    layout = [item.split("=", 1) for item in getattr(mod, "LAYOUT", []) if "=" in item]
    named = [(key, value) for key, value in layout if key not in given and re.search(
        rf"(?<![\w.]){re.escape(key.rsplit('.', 1)[-1])}={re.escape(value)}(?![\w.])", message)]
    if not named:
        return None
    hints = getattr(mod, "LAYOUT_HINTS", {})
    extra = list(dict.fromkeys(hints[k] for k, _ in named if k in hints))
    return (f"(jaxpar bench {name} sets {', '.join(f'{k}={v}' for k, v in named)} in its own layout, over "
            f"the config; {'; '.join(extra) or 'override it too'})")


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from jaxpar.observe.plots import plot_runs
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"jaxpar plot -o {args.out}: an existing file; -o must be a directory "
                          f"(the PNGs go into it; a new one is created)")
    try:
        written = plot_runs(args.run_dirs, args.out)
    except NotADirectoryError as e:
        raise ConfigError(f"jaxpar plot -o {args.out}: {e}; -o must be a directory") from None
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    for path, lines in written.items():
        print(f"{path}: " + ", ".join(f"{label} ({n} points)" for label, n in lines.items()))
    return 0


def _profile(args: argparse.Namespace) -> int:
    from jaxpar.observe.profiler import HOW_TO_OPEN, run_profile_dir, trace_files
    if args.run_dir and not os.path.isdir(args.run_dir):
        raise ConfigError(f"jaxpar profile: RUN_DIR {args.run_dir!r} is not a directory; give a run's "
                          f"directory (<run_dir>/<name> of its config, e.g. runs/quickstart)")
    sub = run_profile_dir(args.run_dir) if args.run_dir else "profile"
    if args.summary:
        return _profile_summary(args.run_dir, sub, args.json)
    print(HOW_TO_OPEN.replace("RUN_DIR/profile", f"{args.run_dir or 'RUN_DIR'}/{sub}")
          .replace("RUN_DIR", args.run_dir or "RUN_DIR"))
    if args.run_dir:
        files = trace_files(args.run_dir, sub)
        if not files:
            print(f"no trace files under {args.run_dir}/{sub} yet")
            return 1
        print("trace files:")
        for f in files:
            print(f"  {f}")
    return 0


def _profile_summary(run_dir: str | None, sub: str, as_json: bool) -> int:
    """`jaxpar profile RUN_DIR --summary`: the window's device busy / idle time and top ops."""
    import json
    from pathlib import Path

    import yaml

    from jaxpar.observe.plots import read_metrics
    from jaxpar.observe.trace_summary import format_summary, load_trace, perfetto_trace, summarize
    if not run_dir:
        raise ConfigError("jaxpar profile --summary: give the run's directory (RUN_DIR)")
    trace = perfetto_trace(run_dir, sub)
    if trace is None:
        print(f"no perfetto_trace.json.gz under {run_dir}/{sub} (a profile.steps run with "
              f"profile.perfetto=true writes one)")
        return 1
    try:
        saved = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
        window = saved.get("profile", {}).get("steps")
    except (OSError, ValueError, AttributeError):
        window = None
    steps = window[1] - window[0] + 1 if window else None
    # jaxpar plot's reader: skips a line cut short by a crash, keeps a resumed step's last record
    records = read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").is_file() else []
    try:
        summary = summarize(load_trace(trace), steps)
    except (OSError, ValueError) as e:  # not gzip, not JSON, no events
        raise ConfigError(f"jaxpar profile --summary: cannot read {trace}: {e}") from e
    summary.update({"trace": str(trace), "profiled_steps": window})
    if as_json:
        print(json.dumps({**summary, "records": records}, indent=2))
    else:
        print(f"trace: {trace}" + (f" (steps {window[0]}-{window[1]})" if window else ""))
        print(format_summary(summary, [r for r in records if "tokens_per_s" in r]))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from jaxpar.hf.convert import from_hf, to_hf
    if args.direction == "from-hf":
        from_hf(args.src, args.dst)
    else:
        to_hf(args.src, args.dst, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 2**30))
    return 0


def _data(args: argparse.Namespace) -> int:
    if args.action == "train-tokenizer":
        from jaxpar.data.tokenizer import train_bpe, trained_size
        out = train_bpe(args.files, args.vocab_size, args.output)
        print(f"{out}: byte-level BPE, {trained_size(out, args.vocab_size)}, trained on "
              f"{len(args.files)} files")
        return 0
    from jaxpar.data.prepare import prepare
    r = prepare(args.tokenizer, args.output, args.files, workers=args.workers, text_field=args.text_field)
    print(f"{args.output}: {r['tokens']:,} {r['dtype']} tokens, {r['documents']:,} documents "
          f"({r['tokens_per_s']:,.0f} tokens/s, {r['workers']} workers); index {args.output}.idx; "
          f"train with data.source=bin data.bin_path={args.output} data.bin_dtype={r['dtype']}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from jaxpar.generate import generate_text
    print(generate_text(args.src, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, seed=args.seed, devices=args.devices, tokenizer=args.tokenizer))
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    """The report; exit 1 when a finished step is unusable (scripts check it before deleting)."""
    from jaxpar.checkpoint.report import inspect_report
    text, usable = inspect_report(args.dir, verify_data=args.verify)
    print(text)
    return 0 if usable else 1


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
    b.add_argument("--plot", default=None, metavar="FILE.png", help="pipeline: draw the timetable")
    b.add_argument("--seqs", default=None, type=_int_list, metavar="N,N",
                   help="attention: the sequence lengths (default 2048,8192)")
    b.add_argument("--impls", default=None, type=_name_list, metavar="NAME,NAME",
                   help="attention: the implementations, of xla, blockwise, cudnn (default xla,blockwise; "
                        "cudnn runs only on a GPU in 16 bits, elsewhere it is skipped with the reason)")
    b.set_defaults(fn=_bench)
    from jaxpar.planner.cli import add_parser as add_plan_parser
    add_plan_parser(sub)
    pl = sub.add_parser("plot", help="PNGs of loss, throughput and MFU vs step (several runs overlaid)")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    pl.add_argument("-o", "--out", default=None, help="where the PNGs go (default: the first RUN_DIR)")
    pl.set_defaults(fn=_plot)
    gp = sub.add_parser("goodput", help="productive time / wall time of a run and the time lost, by cause "
                        "(from RUN_DIR/events.jsonl, across restarts)")
    gp.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory: <run_dir>/<name> of its config")
    gp.add_argument("--json", action="store_true", help="machine-readable output")
    gp.set_defaults(fn=_goodput)
    pr = sub.add_parser("profile", help="how to open a profile.steps trace (and which files a run has)")
    pr.add_argument("run_dir", nargs="?", default=None, metavar="RUN_DIR")
    pr.add_argument("--summary", action="store_true", help="the trace's figures: device busy / idle time per "
                    "step (the loop's host gap), collectives under compute, top device ops, MFU")
    pr.add_argument("--json", action="store_true", help="--summary: machine-readable output")
    pr.set_defaults(fn=_profile)
    ck = sub.add_parser("checkpoint", help="look into checkpoints: jaxpar checkpoint inspect DIR")
    ck_sub = ck.add_subparsers(dest="action", required=True)
    ins = ck_sub.add_parser("inspect", help="steps (complete or not), arrays, saved mesh, config")
    ins.add_argument("dir", help="a run dir, its checkpoints/ dir, or one step dir")
    ins.add_argument("--verify", action="store_true",
                     help="also load every complete step and compare its checksums (exit 1 when a "
                          "step is corrupted or incomplete)")
    ins.set_defaults(fn=_checkpoint)
    cv = sub.add_parser("convert", help="Hugging Face checkpoints: jaxpar convert from-hf HF_DIR OUT_CKPT "
                        "| to-hf RUN_OR_CKPT OUT_DIR")
    cv.add_argument("direction", choices=("from-hf", "to-hf"))
    cv.add_argument("src", help="from-hf: a Hugging Face model dir; to-hf: a run dir, checkpoints dir "
                    "or step dir")
    cv.add_argument("dst", help="from-hf: a new checkpoints dir; to-hf: a new Hugging Face model dir")
    cv.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="to-hf: the safetensors dtype")
    cv.add_argument("--max-shard-gb", type=_positive_float, default=5.0,
                    help="to-hf: split files above this size")
    cv.set_defaults(fn=_convert)
    ge = sub.add_parser("generate", help="sample text from a checkpoint (KV-cached decoding)")
    ge.add_argument("src", metavar="RUN_OR_CKPT", help="a run dir, its checkpoints dir or one step dir")
    ge.add_argument("--prompt", required=True)
    ge.add_argument("--max-tokens", type=int, default=200, help="new tokens at most (the context bounds it)")
    ge.add_argument("--temperature", type=float, default=0.8, help="0: greedy (argmax)")
    ge.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: keep this probability mass")
    ge.add_argument("--seed", type=int, default=0)
    ge.add_argument("--devices", type=int, default=1,
                    help="decode tensor-parallel over this many local devices (heads split over them)")
    ge.add_argument("--tokenizer", default=None, metavar="PATH",
                    help="a tokenizer.json to use instead of the run's (data.tokenizer)")
    ge.set_defaults(fn=_generate)
    da = sub.add_parser("data", help="jaxpar data prepare | train-tokenizer")
    da_sub = da.add_subparsers(dest="action", required=True)
    dp = da_sub.add_parser("prepare", help="tokenize files (text, .jsonl, .parquet) into a .bin + index")
    dp.add_argument("files", nargs="+")
    dp.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    dp.add_argument("--output", required=True, help="the .bin to write (and OUTPUT.idx, OUTPUT.json)")
    dp.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                    help="tokenizer processes (default: the cores, at most 8: %(default)s here)")
    dp.add_argument("--text-field", default="text", help="the JSONL field / parquet column")
    dp.set_defaults(fn=_data)
    dt = da_sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer.json on local files")
    dt.add_argument("files", nargs="+")
    dt.add_argument("--vocab-size", type=int, default=8192)
    dt.add_argument("--output", required=True, help="the tokenizer.json to write")
    dt.set_defaults(fn=_data)
    la = sub.add_parser("launch", help="N local processes x K CPU devices on jax.distributed "
                        "(jaxpar launch --nprocs 2 --devices-per-proc 4 -- train CONFIG ...), or one "
                        "per node of a Ray cluster (jaxpar launch --ray [ADDRESS] --nodes N -- ...)")
    la.add_argument("--nprocs", type=int, default=None, help="processes to start on this machine")
    la.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                    help="one process per node of a Ray cluster (ADDRESS: its head host:port; alone: "
                    "RAY_ADDRESS or the cluster on this machine); elastic, see jaxpar/launch_ray.py")
    la.add_argument("--nodes", type=int, default=None, help="with --ray: nodes (processes) to run on")
    la.add_argument("--min-nodes", type=int, default=None,
                    help="with --ray: go on with this few nodes after losing some (default: --nodes)")
    la.add_argument("--devices-per-node", type=int, default=None,
                    help="with --ray: K forced CPU devices per process (default: the node's accelerators)")
    la.add_argument("--node-resource", default="jaxpar_node",
                    help="with --ray: the custom resource each node offers once (ray start --resources)")
    la.add_argument("--node-timeout", type=float, default=600.0,
                    help="with --ray: seconds to wait for --min-nodes before giving up")
    la.add_argument("--devices-per-proc", type=int, default=1, help="CPU devices of each process")
    la.add_argument("--max-restarts", type=int, default=0,
                    help="restart the group this many times after a failure (it resumes from its checkpoint)")
    la.add_argument("--min-nprocs", type=int, default=None,
                    help="elastic: a rank failing twice in a row is left out, down to this many processes")
    la.add_argument("--kill-timeout", type=float, default=10.0,
                    help="seconds between SIGTERM and SIGKILL for the others after one fails")
    la.add_argument("--grace", type=float, default=180.0,
                    help="seconds the processes get to save and exit after a forwarded SIGTERM/SIGINT")
    la.add_argument("--run-dir", default=None, metavar="RUN_DIR",
                    help="the run's directory (the launchers' events for jaxpar goodput; with --ray also "
                         "the checkpoints it watches); default: <run_dir>/<name> of a `train CONFIG` command")
    la.add_argument("command", nargs=argparse.REMAINDER,
                    help="after --: a jaxpar command (train CONFIG ...) or a program (python script.py)")
    la.set_defaults(fn=_launch)
    return p


# a dotted override (train.steps=10): what a command's list of overrides takes
OVERRIDE = re.compile(r"[A-Za-z_][\w]*(\.[\w]+)*=.*")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with overrides allowed after a command's options too (`jaxpar plan
    CONFIG --cluster C train.steps=10`): argparse ends a list of positionals at the first option
    and would call what follows unrecognized."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    field = next((f for f in ("overrides", "target") if isinstance(getattr(args, f, None), list)), None)
    if extra and field is not None and all(OVERRIDE.fullmatch(e) for e in extra):
        getattr(args, field).extend(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"jaxpar: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of stdout went away (`jaxpar plan ... | head`): stop quietly, as a Unix tool
        # does; stdout goes to devnull so the interpreter's final flush cannot raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
