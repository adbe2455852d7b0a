"""Running a sweep: its points (spec.points_of), the ones left to run (results.jsonl and --resume), each point's
life (point.py) here, `jobs` side by side, or as cluster jobs (slurm.py), and at the end the report
(experiments.report), drawn from results.jsonl alone.

One sweep at a time writes a sweep directory (a lock), and never into the results of another unless told to
--resume: a point whose recorded result is ok for its current config is skipped; a failed, missing or changed
one runs again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from experiments.report import build_report
from experiments.results import RESULTS, now, read_results
from memtrain.config import RunConfig
from memtrain.files import file_lock, write_atomic
from memtrain.models import param_count
from memtrain.run_files import check_output
from memtrain.secrets import redact

from . import slurm
from .base_models import BaseModels
from .jobs import Cluster
from .launch import CLUSTER_LAUNCHERS, Runner, default_command, subprocess_runner
from .point import PointLife, check_point_dir
from .slurm_options import ClusterOptions, merge
from .spec import Point, Spec, points_of
from .warm import warm_runner


def run_sweep(spec: Spec, out_dir: str | Path | None = None, *, overrides: list[str] | None = None,
              resume: bool = False, launcher: str = "local", nproc: int = 1, wandb_mode: str | None = None,
              runner: str | None = None, run_fn: Runner | None = None, report: bool = True, only: str | None = None,
              jobs: int | None = None, cluster: ClusterOptions | None = None, wait: bool = True,
              log=print) -> dict:
    """Run every point of `spec` not already finished (only those whose id matches the regular expression
    `only`, if given), `jobs` at a time (default: the spec's; with a cluster launcher, jobs queued or running,
    default all); returns {ok, failed, skipped, pending, results, out, report}. A cluster launcher (slurm,
    submitit-local) takes `cluster` over the spec's [slurm] section; `wait=False` submits and returns."""
    spec, points = points_of(spec, overrides, wandb_mode, only)
    out = check_output(Path("runs") / spec.name if out_dir is None else out_dir)
    on_cluster = launcher in CLUSTER_LAUNCHERS
    jobs = jobs or (None if on_cluster else spec.jobs)
    if on_cluster or (jobs is not None and jobs > 1):  # runs report from threads: one line at a time
        log = _serialized(log)
    cl = Cluster(launcher, merge(spec.slurm, cluster), log) if on_cluster else None  # checks the options
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs {jobs} is invalid: run at least 1 point at a time")
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out / ".sweep.lock"), _threads_per_job(1 if on_cluster else jobs):
        return _run_points(spec, points, out, overrides=overrides, resume=resume, launcher=launcher, nproc=nproc,
                           runner=runner, run_fn=run_fn, report=report, jobs=jobs, cluster=cl, wait=wait, log=log)


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
                report, jobs, cluster: Cluster | None, wait, log) -> dict:
    results = out / RESULTS
    previous = read_results(results)
    if previous and not resume:
        raise FileExistsError(f"{str(results)!r} already holds {len(previous)} result(s): pass --resume to run "
                              "only the missing points, or choose another --out")
    submitted = [p.id for p in points if (out / p.id / slurm.JOB_FILE).is_file()]
    if submitted and not resume:
        raise FileExistsError(f"{str(out)!r} holds the jobs of an earlier sweep ({', '.join(submitted[:3])}): "
                              "pass --resume to collect them and run only the missing points, or choose another --out")
    write_atomic(out / "sweep.json", json.dumps({
        "name": spec.name, "description": spec.description, "source": spec.source, "overrides": overrides or [],
        "launcher": launcher, "nproc": nproc, "cluster": redact(dataclasses.asdict(cluster.opts)) if cluster else None,
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
    for p in todo:  # before any point runs: a run the sweep did not make is refused, never replaced
        check_point_dir(out / p.id, p.cfg)
    skipped = len(points) - len(todo)
    log(f"sweep {spec.name}: {len(points)} point(s), {len(todo)} to run"
        + (f", {skipped} already done" if skipped else "") + f" -> {out}")

    command = default_command(launcher, nproc, runner)
    run_fn = run_fn or (warm_runner if launcher == "local" else subprocess_runner)
    # on a cluster, base models are jobs too; jobs start in the submitting shell's directory: absolute paths
    bases = BaseModels(spec.pretrain, command, cluster.runner(spec.name) if cluster else run_fn, log=log)
    life = PointLife(spec, out.absolute() if cluster else out, command, bases, resume, log)
    launched: list[str] = []
    lock = threading.Lock()

    def run_point(p: Point) -> None:
        launch = life.prepare(p)
        if launch is None:  # its base model failed: recorded already
            return
        with lock:
            launched.append(p.id)
            i = len(launched)
        log(f"[{i}/{len(todo)}] {p.id}: {'resuming' if launch.resumed else 'training'} in {launch.run_dir}")
        rc, err = run_fn(launch.command, launch.run_dir)
        life.finish(life.ended(launch, "ok" if rc == 0 else "failed", None if rc == 0 else err or f"exit code {rc}"))

    pending: list[str] = []
    if cluster is not None:
        pending = slurm.run_points(life, todo, cluster, limit=jobs, wait=wait)
    elif jobs == 1:
        for p in todo:
            run_point(p)
    else:  # biggest first, so that the last runs to finish are short ones
        _side_by_side(sorted(todo, key=lambda p: -_size(p.cfg.model.name)), bases, run_point, jobs)
    failed = [i for i in life.failed if i not in pending]  # a failed job collected and submitted again is pending
    ok = len(todo) - len(failed) - len(pending)
    waiting = f", {len(pending)} queued, running or not yet submitted (collect them with --resume)" if pending else ""
    log(f"sweep {spec.name}: {ok} ok, {len(failed)} failed, {skipped} skipped{waiting}; results: {results}")
    summary = {"ok": ok, "failed": len(failed), "failed_ids": sorted(failed), "skipped": skipped,
               "pending": sorted(pending), "results": results, "out": out}
    if report and results.is_file() and not pending:
        if any(r.get("status") == "ok" for r in read_results(results).values()):
            config = dict(dataclasses.asdict(spec), overrides=overrides or [])
            summary["report"] = _report(out, points[0].cfg if points else None, config, log)
        else:  # build_report refuses it: its figures and tables would all be empty
            earlier = " (the report.md there is an earlier draw's, of results since failed)" if (
                out / "report.md").is_file() else ""
            log(f"no report: no point in {results} succeeded{earlier}")
    if not pending:  # a run still in flight would be uploaded half-written
        _say_sync(out, bases.pretrained, log)
    return summary


def _side_by_side(order: list[Point], bases: BaseModels, run_point, jobs: int) -> None:
    """Run the points `jobs` at a time in `order`, each once its base model is built, and those base models: a
    free worker takes the next base still to build, else the next point whose base is ready. The smaller bases'
    points then start while the biggest base still pretrains (waiting for every base left a core idle for ~50 s
    of the demo's width-384 pretraining). A bug in one worker stops the others taking more work."""
    need = {p.id: bases.need(p.cfg) for p in order}
    first: dict[str, RunConfig] = {}
    for p in order:
        if need[p.id] is not None:
            first.setdefault(need[p.id], p.cfg)
    tasks: list[tuple] = [("base", key, cfg) for key, cfg in first.items()] + [("point", need[p.id], p)
                                                                             for p in order]
    built: set[str] = set()
    cond = threading.Condition()
    stopping = threading.Event()

    def take() -> tuple | None:
        with cond:
            while tasks and not stopping.is_set():
                task = next((t for t in tasks if t[0] == "base" or t[1] is None or t[1] in built), None)
                if task is not None:
                    tasks.remove(task)
                    return task
                cond.wait()
            return None

    def halt() -> None:
        stopping.set()
        with cond:
            cond.notify_all()

    def work() -> None:
        try:
            while (task := take()) is not None:
                kind, key, what = task
                if kind == "point":
                    run_point(what)
                    continue
                try:
                    bases.try_get(what)  # a failure is the points' to record
                finally:
                    with cond:
                        built.add(key)
                        cond.notify_all()
        except BaseException:
            halt()
            raise

    with ThreadPoolExecutor(jobs) as pool:
        workers = [pool.submit(work) for _ in range(jobs)]
        try:
            for f in workers:
                f.result()
        except BaseException:  # Ctrl-C reaches this thread: the runs in flight end (they got it too), no more start
            halt()
            raise


def _size(model: str) -> int:
    try:
        return param_count(model)
    except (ValueError, OSError):  # a directory or hub id that cannot be read here: last
        return 0


def _report(out: Path, cfg: RunConfig | None, spec: dict, log) -> dict | None:
    """Draw the report; mirror it to a W&B 'report' run of the sweep's group (W&B settings from `cfg`, a point's;
    config: `spec`, the sweep's). Never fails the sweep."""
    try:
        made = build_report(out / RESULTS, out)
    except Exception as e:  # noqa: BLE001 - results.jsonl is safe; the report can be redrawn with `memtrain plot`
        log(f"warning: the report could not be drawn ({type(e).__name__}: {e}); retry with `memtrain plot {out}`")
        return None
    log(f"report: {made['report']}\nfigures: {made['figures_dir']}")
    if cfg is not None and cfg.wandb.mode != "disabled":
        from memtrain.training.tracking import Tracker  # the trainer's modules: only when a report is mirrored

        tracker = Tracker.start(cfg, out / "report", 0, job_type="report", name=f"{cfg.wandb.group}-report",
                                config=spec)
        tracker.log_table("results", made.get("table", []))
        tracker.log_images(made["figures"])
        tracker.finish(say_sync=False)  # _say_sync names it with the sweep's runs
    return made


def _say_sync(out: Path, bases: list[Path], log) -> None:
    """One `wandb sync` command for every offline W&B run of the sweep: its points', its report's and those of the
    base models it pretrained (a plain `wandb sync` looks in ./wandb only, where none of them is)."""
    from memtrain.training.tracking import OFFLINE_RUNS, sync_all

    found = sync_all([(out, "*/" + OFFLINE_RUNS), *((base, OFFLINE_RUNS) for base in bases)])
    if found:
        log(f"W&B: {found[0]} offline run(s) of this sweep; upload them all with: {found[1]}")
