"""`memtrain sweep` (and `memtrain demo`, a preset's sweep): the options, then --list, --dry-run or the sweep.
Bad input is one line `memtrain: error: ...` and exit 2; a failed point exit 1; Ctrl-C or SIGTERM exit 130."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from pathlib import Path

from memtrain.commandline import ArgumentParser, at_most, fail, positive_int
from memtrain.config import WANDB_MODES
from memtrain.run_files import check_output

from . import slurm
from .jobs import Cluster
from .launch import LAUNCHERS, default_command, stop_running
from .run import run_sweep
from .slurm_options import add_arguments, merge, options_from_args
from .spec import MAX_JOBS, load_spec, points_of, presets

MAX_NPROC = 1024
"""--nproc: processes torchrun starts on this machine for one run."""


def build_parser(preset: str | None = None, prog: str = "memtrain sweep",
                 description: str | None = None) -> argparse.ArgumentParser:
    """The sweep's options; with `preset`, a command that runs that preset (no SPEC argument), e.g. `memtrain demo`."""
    ap = ArgumentParser(
        prog=prog, description=description or "Run a memorization sweep: for each point of a grid of configs, one "
        "full `memtrain train` run (fine-tuning a base model pretrained once and cached, where the spec has "
        "[pretrain] steps) for the config's train.epochs passes over its canaried stream, then its evaluation; "
        "results appended to <out>/results.jsonl, then a report.",
        epilog=None if preset else f"presets: {', '.join(presets())} (experiments/presets/). Each sets its own "
        "number of passes (train.epochs); `memtrain sweep PRESET --list` prints its description and points, and "
        "--set train.epochs=N changes it.")
    if preset:
        ap.set_defaults(spec=preset)
    else:
        ap.add_argument("spec", help="a preset name or a sweep TOML file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override the base config (TOML value syntax; repeatable); pretrain.*, "
                         "sweep.keep_checkpoints and sweep.keep_final_weights set the sweep's own sections")
    ap.add_argument("--out", default=None, help="the sweep's directory (default runs/<sweep name>)")
    ap.add_argument("--resume", action="store_true",
                    help="run only points without a finished result of their config as it is now: failed points, "
                         "and points whose config changed since (other --set values, an edited spec), run again, "
                         "their new result appended beside the old")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="local",
                    help="local: one process per run; torchrun: torchrun --standalone --nproc-per-node N; slurm: "
                         "each point a SLURM job of its nodes and GPUs; submitit-local: the same jobs on this machine")
    ap.add_argument("--nproc", type=at_most(positive_int, MAX_NPROC), default=None,
                    help="processes per run with --launcher torchrun")
    ap.add_argument("--jobs", type=at_most(positive_int, MAX_JOBS), default=None,
                    help="points run side by side, each with its share of the cores (default: the spec's, or 1); "
                         "with slurm: jobs queued or running at once (default: all)")
    ap.add_argument("--wandb", choices=WANDB_MODES, default=None,
                    help="W&B mode of every run (default: the spec's wandb.mode, 'auto')")
    ap.add_argument("--runner", default=None,
                    help="command that replaces `python -m memtrain` to launch runs (tests, custom launchers)")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="run only the points whose id matches (e.g. one model size per launcher)")
    ap.add_argument("--no-report", action="store_true", help="do not draw the report at the end")
    ap.add_argument("--list", action="store_true", help="print the points of the sweep and exit")
    add_arguments(ap)
    return ap


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = (parser or build_parser()).parse_args(argv)
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGTERM, _terminate)  # like Ctrl-C: the running child is stopped too
    try:
        spec = load_spec(args.spec)
        cluster = options_from_args(args)
        if args.dry_run or args.list:
            spec, points = points_of(spec, args.overrides, args.wandb, args.only)
        if args.dry_run:
            out = check_output(Path("runs") / spec.name if args.out is None else args.out)
            print(slurm.dry_run(spec, points, out, Cluster("slurm", merge(spec.slurm, cluster)),
                                default_command("slurm", 1, args.runner)))
            return 0
        if args.list:
            print(f"sweep {spec.name}: {spec.description}".rstrip(": "))
            print(f"pretrain: {spec.pretrain.steps} steps" + (f" ({spec.pretrain.corpus} corpus)"
                                                            if spec.pretrain.steps else ""))
            for p in points:
                print(f"  {p.id}  " + "  ".join(f"{k}={json.dumps(v)}" for k, v in p.axes.items()))
            return 0
        summary = run_sweep(spec, args.out, overrides=args.overrides, resume=args.resume, launcher=args.launcher,
                            nproc=args.nproc or 1, wandb_mode=args.wandb, runner=args.runner,
                            report=not args.no_report, only=args.only, jobs=args.jobs, cluster=cluster,
                            wait=not args.no_wait)
    except KeyboardInterrupt:
        jobs = " (submitted jobs go on: --resume collects them)" if args.launcher == "slurm" else ""
        print(f"\ninterrupted: finished runs are in results.jsonl{jobs}; continue with --resume", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader went away: memtrain.commandline ends it (not bad input)
        raise
    except (ValueError, OSError) as e:
        return fail(str(e))
    if summary["failed"]:
        n, ids = summary["failed"], summary["failed_ids"]
        every = "all " if summary["ok"] == summary["skipped"] == 0 and not summary["pending"] else ""
        listed = ", ".join(ids[:3]) + (f" and {n - 3} more" if n > 3 else "")
        print(f"memtrain: error: {every}{n} point(s) failed ({listed}): their logs are in {summary['out']}/<point>/, "
              f"their errors in {summary['results']}; --resume retries them", file=sys.stderr)
        return 1
    return 0


def _terminate(signum, frame):
    stop_running()  # the runs side-by-side threads wait for: the signal reached this thread only
    raise KeyboardInterrupt
