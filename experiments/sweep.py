"""Memorization sweeps: one full run (fine-tune one pass, then evaluate) per point of a grid of configs.

    memtrain sweep quick                                  # a preset from experiments/presets/
    memtrain sweep my_sweep.toml --set train.lr=3e-4 --out runs/mine
    memtrain sweep quick --resume                         # run only points without a finished result
    memtrain sweep quick --list                           # print the points and exit
    memtrain sweep paper --launcher slurm --partition gpu # each point a SLURM job (experiments/slurm.py)
    python -m experiments.sweep quick ...                 # the same without the console script

A sweep spec is a TOML file:

    [sweep]
    name = "quick"                      # default --out is runs/<name>
    description = "..."
    keep_checkpoints = true             # false: delete each fine-tuned run's checkpoints once evaluated
    jobs = 1                            # points run side by side here (each with cores / jobs threads)

    [base]                              # a partial RunConfig: sections model, train, loss, data, ...
    data = { max_docs = 300, seq_len = 128 }

    [axes]                              # the grid is the product of every axis, in this order
    "model.name" = ["ladder-1m", "ladder-3m"]           # section.key = list of values
    loss = [{ kind = "standard" }, { kind = "goldfish", k = 4 }]   # section = list of tables
    seeds = [0, 1]                                      # shorthand for "train.seed"

    [pretrain]                          # the base model each fine-tuning run starts from
    steps = 200                         # 0: no pretraining (fine-tune from model.init or the seeded init)
    lr = 3e-3
    corpus = "disjoint"                 # see PretrainSpec

    [slurm]                             # defaults of --launcher slurm (its options win): see ClusterOptions
    gpus_per_node = 8
    time = "24:00:00"

Every point runs `python -m memtrain train --config RUN_DIR/config.toml --out RUN_DIR` (or under
torchrun, or as a SLURM job: experiments/slurm.py) in its own directory <out>/<point-id>, and appends one
line to <out>/results.jsonl when it ends: its axes, status, run and base directories, the eval.json
contents, final training metrics and a compact per-canary list. The file is only ever appended to (and
flushed), never rewritten; a failed run is recorded with the last line of its stderr and the sweep goes on.
The report (experiments.report) is drawn from results.jsonl alone at the end.

Base models: a fine-tuning study needs a trained model to start from. Offline, the sweep pretrains one
per model size on a corpus WITHOUT canaries, cached under <cache>/base/<hash> (cache = data.cache_dir,
$MEMTRAIN_CACHE or ~/.cache/memtrain) by a hash of everything that determines it, so later sweeps and
other presets reuse it; fine-tuning runs set model.init to it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from memtrain.cli import ArgumentParser, fail, positive_int
from memtrain.config import RunConfig
from memtrain.files import file_lock, write_atomic
from memtrain.models import param_count

from . import slurm, slurm_options
from .base_models import BaseModelError, BaseModels
from .launch import (
    CLUSTER_LAUNCHERS,
    LAUNCHERS,
    Runner,
    default_command,
    prepare_run_dir,
    subprocess_runner,
    train_tail,
)
from .results import RESULTS, append_result, latest_by_point, make_record, now, read_results
from .spec import Point, Spec, apply_spec_overrides, expand, load_spec, presets, select, split_overrides

# ---------------------------------------------------------------------------------------------------
# the sweep


def run_sweep(spec: Spec, out_dir: str | Path | None = None, *, overrides: list[str] | None = None,
              resume: bool = False, launcher: str = "local", nproc: int = 1, wandb_mode: str | None = None,
              runner: str | None = None, run_fn: Runner | None = None, report: bool = True, only: str | None = None,
              jobs: int | None = None, cluster: slurm_options.ClusterOptions | None = None, wait: bool = True,
              log=print) -> dict:
    """Run every point of `spec` not already finished (only those whose id matches the regular expression
    `only`, if given), `jobs` at a time (default: the spec's; with a cluster launcher, jobs queued or running,
    default all); returns {ok, failed, skipped, pending, results, out, report}. A cluster launcher (slurm,
    submitit-local) takes `cluster` over the spec's [slurm] section; `wait=False` submits and returns."""
    run_over, pre_over, sw_over = split_overrides(list(overrides or []))
    spec = copy.deepcopy(spec)
    apply_spec_overrides(spec, pre_over, sw_over)
    points = select(expand(spec, run_over, wandb_mode), only)
    out = Path(out_dir) if out_dir else Path("runs") / spec.name
    on_cluster = launcher in CLUSTER_LAUNCHERS
    opts = slurm_options.merge(spec.slurm, cluster) if on_cluster else None
    if opts is not None:
        slurm_options.check(opts, launcher)
    jobs = jobs or (None if on_cluster else spec.jobs)
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs {jobs} is invalid: run at least 1 point at a time")
    if on_cluster or jobs > 1:  # runs report from threads: one line at a time
        log = _serialized(log)
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out / ".sweep.lock"), _threads_per_job(1 if on_cluster else jobs):
        return _run_points(spec, points, out, overrides=overrides, resume=resume, launcher=launcher, nproc=nproc,
                           runner=runner, run_fn=run_fn, report=report, jobs=jobs, opts=opts, wait=wait, log=log)


def _serialized(log):
    lock = threading.Lock()

    def locked(*args, **kwargs):
        with lock:
            log(*args, **kwargs)

    return locked


@contextlib.contextmanager
def _threads_per_job(jobs: int):
    """Split the cores between the runs that share the machine (unless OMP_NUM_THREADS says otherwise): runs of
    small models scale badly across threads, so two one-thread runs beat one two-thread run on two cores."""
    if jobs == 1 or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


@contextlib.contextmanager
def _exclusive(path: Path):
    """Fail at once if another sweep is writing into the same directory."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(file_lock(path, blocking=False))
        except BlockingIOError:
            raise FileExistsError(f"another sweep is running in {str(path.parent)!r}: wait for it, or use "
                                  "another --out") from None
        yield


def _run_points(spec: Spec, points: list[Point], out: Path, *, overrides, resume, launcher, nproc, runner, run_fn,
                report, jobs, opts, wait, log) -> dict:
    results = out / RESULTS
    previous = latest_by_point(read_results(results))
    if previous and not resume:
        raise FileExistsError(f"{str(results)!r} already holds {len(previous)} result(s): pass --resume to run "
                              "only the missing points, or choose another --out")
    submitted = [p.id for p in points if (out / p.id / slurm.JOB_FILE).is_file()]
    if submitted and not resume:
        raise FileExistsError(f"{str(out)!r} holds the jobs of an earlier sweep ({', '.join(submitted[:3])}): "
                              "pass --resume to collect them and run only the missing points, or choose another --out")
    write_atomic(out / "sweep.json", json.dumps({
        "name": spec.name, "description": spec.description, "source": spec.source, "overrides": overrides or [],
        "launcher": launcher, "nproc": nproc, "cluster": dataclasses.asdict(opts) if opts else None,
        "pretrain": dataclasses.asdict(spec.pretrain), "axes": spec.axes, "points": [p.id for p in points],
        "written": now()}, indent=1, default=str))

    todo = []
    for p in points:
        prev = previous.get(p.id)
        if prev and prev.get("status") == "ok" and prev.get("config_digest") == p.digest:
            continue
        if prev and prev.get("status") == "ok":
            log(f"{p.id}: its config changed since the recorded result: running it again")
        todo.append(p)
    skipped = len(points) - len(todo)
    log(f"sweep {spec.name}: {len(points)} point(s), {len(todo)} to run"
        + (f", {skipped} already done" if skipped else "") + f" -> {out}")

    command = default_command(launcher, nproc, runner)
    run_fn = run_fn or subprocess_runner
    bases = BaseModels(spec.pretrain, command, run_fn, log=log)
    launched: list[str] = []
    failed: list[str] = []
    lock = threading.Lock()

    def finish(p: Point, record: dict) -> None:
        """Append a finished run's record (as it ends: the results file is the sweep's progress) and say so."""
        run_dir = Path(record["run_dir"])
        with lock:
            append_result(results, record)
            if record["status"] != "ok":
                failed.append(p.id)
            elif p.id in failed:  # failed, then collected again and ok (cluster sweeps)
                failed.remove(p.id)
        if record["status"] == "ok":
            if not spec.keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            ev = record["eval"] or {}
            log(f"{p.id}: ok in {record['seconds']:.0f}s  params={_num(record['params'])}  "
                f"exact={_num(ev.get('exact_match_rate'))}  rougeL={_num(ev.get('rougeL'))}  "
                f"mia_auc={_num(ev.get('mia_auc_loss'))}  val_loss={_num(ev.get('val_loss'))}")
        else:
            where = "" if "[log:" in (record["error"] or "") else f"  [logs: {run_dir}]"
            log(f"{p.id}: FAILED after {record['seconds']:.0f}s: {record['error']}{where}")

    def run_point(p: Point) -> None:
        run_dir = out / p.id
        started, t0 = now(), time.time()
        base_dir = None
        status, error = "ok", None
        try:
            if spec.pretrain.steps > 0 and not p.cfg.model.init:
                base_dir = bases.get(p.cfg)
                p.cfg.model.init = str(base_dir)
            started, t0 = now(), time.time()  # the run's own time, without building its base model
            resume_run = prepare_run_dir(run_dir, p.cfg, resume)
            with lock:
                launched.append(p.id)
                i = len(launched)
            log(f"[{i}/{len(todo)}] {p.id}: {'resuming' if resume_run else 'training'} in {run_dir}")
            rc, err = run_fn(command + train_tail(run_dir / "config.toml", run_dir, resume_run), run_dir)
            if rc != 0:
                status, error = "failed", err or f"exit code {rc}"
        except BaseModelError as e:
            status, error = "failed", str(e)
            shutil.rmtree(run_dir, ignore_errors=True)  # no stale files of an older run in this record
            run_dir.mkdir(parents=True)
        finish(p, make_record(spec.name, p, run_dir, base_dir, status, error, started, time.time() - t0))

    pending: list[str] = []
    if opts is not None:
        pending = slurm.run_points(spec, todo, out, launcher=launcher, opts=opts, prefix=command, resume=resume,
                                   limit=jobs, wait=wait, finish=finish, results=results, log=log)
    elif jobs == 1:
        for p in todo:
            run_point(p)
    else:  # biggest first, so that the last runs to finish are short ones
        order = sorted(todo, key=lambda p: -_size(p.cfg.model.name))
        with ThreadPoolExecutor(jobs) as pool:
            if spec.pretrain.steps > 0:  # the bases first, side by side (two points of one size share one)
                first = {(p.cfg.model.name, json.dumps(p.cfg.to_dict()["data"], sort_keys=True)): p
                         for p in order if not p.cfg.model.init}
                list(pool.map(lambda p: _build_base(bases, p), first.values()))
            list(pool.map(run_point, order))
    failed = [i for i in failed if i not in pending]  # a failed job collected and submitted again is pending
    ok = len(todo) - len(failed) - len(pending)
    waiting = f", {len(pending)} queued, running or not yet submitted (collect them with --resume)" if pending else ""
    log(f"sweep {spec.name}: {ok} ok, {len(failed)} failed, {skipped} skipped{waiting}; results: {results}")
    summary = {"ok": ok, "failed": len(failed), "failed_ids": sorted(failed), "skipped": skipped,
               "pending": sorted(pending), "results": results, "out": out}
    if report and results.is_file() and not pending:
        summary["report"] = _report(out, points[0].cfg if points else None, log)
    return summary


def _size(model: str) -> int:
    try:
        return param_count(model)
    except (ValueError, OSError):  # a directory or hub id that cannot be read here: last
        return 0


def _build_base(bases: BaseModels, p: Point) -> None:
    with contextlib.suppress(BaseModelError):  # remembered by `bases`: the point that needs it fails with it
        bases.get(p.cfg)


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v / 1e6:.2f}M"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _report(out: Path, cfg: RunConfig | None, log) -> dict | None:
    """Draw the report; mirror it to a W&B 'report' run of the sweep's group. Never fails the sweep."""
    try:
        from experiments import report as rep

        made = rep.build_report(out / RESULTS, out)
    except Exception as e:  # noqa: BLE001 - results.jsonl is safe; the report can be redrawn with `memtrain plot`
        log(f"warning: the report could not be drawn ({type(e).__name__}: {e}); retry with `memtrain plot {out}`")
        return None
    log(f"report: {made['report']}\nfigures: {made['figures_dir']}")
    if cfg is not None and cfg.wandb.mode != "disabled":
        from memtrain.training.tracking import Tracker

        tracker = Tracker.start(cfg, out / "report", 0, job_type="report", name=f"{cfg.wandb.group}-report")
        tracker.log_table("results", made.get("table", []))
        tracker.log_images(made["figures"])
        tracker.finish()
    return made


# ---------------------------------------------------------------------------------------------------
# CLI


def build_parser(preset: str | None = None, prog: str = "memtrain sweep",
                 description: str | None = None) -> argparse.ArgumentParser:
    """The sweep's options; with `preset`, a command that runs that preset (no SPEC argument), e.g. `memtrain demo`."""
    ap = ArgumentParser(
        prog=prog, description=description or "Run a memorization sweep: one full run (train one pass, evaluate) "
        "per point of a grid of configs, results appended to <out>/results.jsonl, then a report.",
        epilog=None if preset else f"presets: {', '.join(presets())} (experiments/presets/)")
    if preset:
        ap.set_defaults(spec=preset)
    else:
        ap.add_argument("spec", help="a preset name or a sweep TOML file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override the base config (TOML value syntax; repeatable); pretrain.* and "
                         "sweep.keep_checkpoints set the sweep's own sections")
    ap.add_argument("--out", default=None, help="the sweep's directory (default runs/<sweep name>)")
    ap.add_argument("--resume", action="store_true",
                    help="run only points without a finished result (failed points are retried)")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="local",
                    help="local: one process per run; torchrun: torchrun --standalone --nproc-per-node N; slurm: "
                         "each point a SLURM job of its nodes and GPUs; submitit-local: the same jobs on this machine")
    ap.add_argument("--nproc", type=positive_int, default=None, help="processes per run with --launcher torchrun")
    ap.add_argument("--jobs", type=positive_int, default=None,
                    help="points run side by side, each with its share of the cores (default: the spec's, or 1); "
                         "with slurm: jobs queued or running at once (default: all)")
    ap.add_argument("--wandb", choices=("auto", "online", "offline", "disabled"), default=None,
                    help="W&B mode of every run (default: the spec's wandb.mode, 'auto')")
    ap.add_argument("--runner", default=None,
                    help="command that replaces `python -m memtrain` to launch runs (tests, custom launchers)")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="run only the points whose id matches (e.g. one model size per launcher)")
    ap.add_argument("--no-report", action="store_true", help="do not draw the report at the end")
    ap.add_argument("--list", action="store_true", help="print the points of the sweep and exit")
    slurm_options.add_arguments(ap)
    return ap


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = (parser or build_parser()).parse_args(argv)
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGTERM, _terminate)  # like Ctrl-C: the running child is stopped too
    try:
        spec = load_spec(args.spec)
        cluster = slurm_options.options_from_args(args)
        if args.dry_run:
            run_over, pre_over, sw_over = split_overrides(args.overrides)
            apply_spec_overrides(spec, pre_over, sw_over)
            points = select(expand(spec, run_over, args.wandb), args.only)
            out = Path(args.out) if args.out else Path("runs") / spec.name
            print(slurm.dry_run(spec, points, out, slurm_options.merge(spec.slurm, cluster),
                                default_command("slurm", 1, args.runner)))
            return 0
        if args.list:
            run_over, pre_over, sw_over = split_overrides(args.overrides)
            apply_spec_overrides(spec, pre_over, sw_over)
            points = select(expand(spec, run_over, args.wandb), args.only)
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
    except (ValueError, OSError) as e:
        return fail(str(e))
    if summary["failed"]:
        print(f"memtrain: error: {summary['failed']} point(s) failed ({', '.join(summary['failed_ids'])}): their "
              "logs are in their run directories; --resume retries them", file=sys.stderr)
        return 1
    return 0


def _terminate(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
