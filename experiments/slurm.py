"""Cluster sweeps: every point of a sweep is one SLURM job of its own nodes and GPUs, through submitit.

    memtrain sweep paper --launcher slurm --partition gpu --account proj42      # submit, then collect as jobs end
    memtrain sweep paper --launcher slurm --dry-run          # print each point's sbatch script, submit nothing
    memtrain sweep paper --launcher slurm --no-wait          # submit and exit; later, from any shell:
    memtrain sweep paper --launcher slurm --resume           # collect what finished, resubmit failed/missing points

A point's job (its options, nodes x tasks and sbatch script: experiments/slurm_options.py) runs the point's
command in every task, the same `python -m memtrain train --config RUN/config.toml --out RUN` a user would
type; the engine reads its rank from SLURM's variables (parallel/grid.py).

Each run directory holds its job: job.json (job id, tasks, config digest, when submitted) and submitit/ (the
sbatch script, one log pair per task, the pickles). `--resume` reads job.json: a job still queued or running
is waited for, never submitted twice; a finished job whose result is not in results.jsonl yet is collected;
a failed or missing point is submitted again, continuing from its last checkpoint. A job that reaches its
time limit or is preempted is requeued by submitit and continues from its last checkpoint
(train.checkpoint_every_min).

`--launcher submitit-local` runs the same jobs through submitit's LocalExecutor on this machine (one node;
tasks = ranks, each told its rank through RANK/WORLD_SIZE): the tests' path, and a rehearsal of a cluster sweep.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission

from memtrain.files import write_atomic

from .launch import die_with_parent, last_line, prepare_run_dir, run_env, train_tail
from .results import make_record, now, read_results
from .slurm_options import ClusterOptions, Shape, check, minutes, sbatch_script, shape, slurm_parameters

if TYPE_CHECKING:  # every task of a job unpickles TrainJob from this module: no torch at its top
    from memtrain.config import RunConfig

    from .base_models import BaseModels
    from .spec import Point, Spec

JOB_FILE = "job.json"
LOGS = "submitit"
LOCAL_TIMEOUT_MIN = 7 * 24 * 60
"""submitit-local without --time: a week (submitit's own default would stop a job after 2 minutes)."""


class RunFailed(RuntimeError):
    """A task's command exited non-zero; the message is its last stderr line."""


class TrainJob(Checkpointable):
    """What every task of a job runs: the point's command, output streamed into submitit's task logs. (submitit's
    CommandFunction would hold a multi-day run's whole output in memory and pickle it as the result.) At a time
    limit or preemption submitit requeues the job with `checkpoint()`: the same command, resuming."""

    def __init__(self, command: list[str], out: str | Path, env: dict[str, str] | None = None):
        self.command = [str(c) for c in command]
        self.out = str(out)
        self.env = dict(env or {})

    def __call__(self) -> dict:
        env = run_env() | self.env
        job = submitit.JobEnvironment()
        if job.cluster == "local" and job.num_tasks > 1:  # what srun's SLURM_PROCID/SLURM_NTASKS say on a cluster
            env.update(RANK=str(job.global_rank), WORLD_SIZE=str(job.num_tasks), LOCAL_RANK=str(job.local_rank),
                       MASTER_ADDR="127.0.0.1")
        print(f"memtrain task {job.global_rank}/{job.num_tasks}: {shlex.join(self.command)}", flush=True)
        started, t0 = now(), time.time()
        proc = subprocess.Popen(self.command, stderr=subprocess.PIPE, env=env, preexec_fn=_task_child)
        tail = b""
        try:
            while chunk := proc.stderr.read1(1 << 16):
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
                tail = (tail + chunk)[-20000:]
            rc = proc.wait()
        except BaseException:  # the requeue handler's exit, a cancel: the trainer stops with the task
            proc.terminate()
            proc.wait()
            raise
        if rc != 0:
            raise RunFailed(last_line(tail.decode("utf-8", "replace")) or f"exit code {rc}, no stderr")
        return {"started": started, "seconds": round(time.time() - t0, 1)}

    def checkpoint(self, *args, **kwargs) -> DelayedSubmission:
        command = [c for c in self.command if c not in ("--resume", "--force")]
        done = (Path(self.out) / "checkpoints" / "latest").is_file()
        return DelayedSubmission(TrainJob(command + ["--resume" if done else "--force"], self.out, self.env))


def _task_child() -> None:
    # submitit's time-limit warning (USR2) is for the task, which requeues the job; the trainer would die of it
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    die_with_parent()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_running(pid: int) -> bool:
    """A submitit-local job's controller (its job id is the pid) still runs: not gone, not a zombie, still ours."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path(f"/proc/{pid}")
    try:
        if "\nState:\tZ" in (proc / "status").read_text():
            return False
        return b"submitit" in (proc / "cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid


class Cluster:
    """Submits commands as jobs (SLURM, or submitit's LocalExecutor), finds them again, tells how they ended."""

    def __init__(self, launcher: str, opts: ClusterOptions, log=print):
        check(opts, launcher)
        self.local = launcher == "submitit-local"
        self.kind = "local" if self.local else "slurm"
        self.opts = opts
        self.log = log
        self.poll_s = opts.poll_s if opts.poll_s is not None else (1.0 if self.local else 30.0)

    def require_scheduler(self) -> None:
        if not self.local and shutil.which("sbatch") is None:
            raise ValueError("--launcher slurm: no `sbatch` on this machine: submit from a SLURM login node (or "
                             "see the scripts with --dry-run, or try the jobs here with --launcher submitit-local)")

    def shape(self, cfg: RunConfig, what: str = "point") -> Shape:
        return shape(cfg, self.opts, self.local, what)

    def script(self, run_dir: Path, cfg: RunConfig, name: str, command: list[str]) -> tuple[Shape, str]:
        sh = self.shape(cfg, name)
        return sh, sbatch_script(run_dir / LOGS, slurm_parameters(self.opts, sh, name, command))

    def submit(self, command: list[str], run_dir: Path, cfg: RunConfig, name: str):
        sh = self.shape(cfg, name)
        folder = run_dir / LOGS
        if self.local:
            ex = submitit.LocalExecutor(folder)
            ex.update_parameters(timeout_min=minutes(self.opts.time) or LOCAL_TIMEOUT_MIN,
                                 tasks_per_node=sh.tasks_per_node, gpus_per_node=sh.gpus_per_node)
            env = {"MASTER_PORT": str(_free_port())} if sh.world > 1 else {}
        else:
            ex = submitit.SlurmExecutor(folder)
            ex.update_parameters(**slurm_parameters(self.opts, sh, name, command))
            env = {}
        try:
            job = ex.submit(TrainJob(command, run_dir, env))
        except Exception as e:  # noqa: BLE001 - sbatch's refusal (bad partition, account, limits): one line
            detail = last_line(str(e)) or type(e).__name__
            raise ValueError(f"the job of {name} was not submitted: {detail}") from None
        return job, sh

    def reattach(self, run_dir: Path, info: dict):
        cls = submitit.LocalJob if self.local else submitit.SlurmJob
        return cls(run_dir / LOGS, str(info["job_id"]), tasks=list(range(int(info.get("tasks", 1)))))

    def running(self, job, reattached: bool) -> bool:
        if self.local and reattached:  # no process handle in this process: ask the system
            return _pid_running(int(job.job_id)) and not job.task(0).paths.result_pickle.exists()
        return not job.done()

    def outcome(self, job) -> tuple[str, str | None, dict]:
        """('ok' | 'failed', the error with its log path, task 0's return value) of a finished job."""
        first = job.task(0)
        exc = first.exception()  # waits briefly for a result a shared file system has not shown yet
        if exc is None:
            result = first.result()
            return "ok", None, result if isinstance(result, dict) else {}
        errors: list[tuple[int, str, Path]] = []  # rank 0's error, and another rank's if it says something else
        for i in range(job.num_tasks):
            task = job.task(i)
            has_result = task.paths.result_pickle.exists()
            if i and not has_result:
                continue  # a rank that left no result was stopped with the job: rank 0's line and log say more
            e = exc if i == 0 else task.exception()
            if e is None:
                continue
            line = _error_line(str(e)) if has_result else f"job {job.job_id} ended without a result ({job.state})"
            if all(line != seen for _, seen, _ in errors):
                errors.append((i, line, task.paths.stderr))
            if len(errors) == 2:
                break
        text = "; ".join((f"task {i}: " if len(errors) > 1 else "") + f"{line} [log: {log}]"
                         for i, line, log in errors)
        return "failed", text, {}


def _error_line(message: str) -> str:
    """The useful line of submitit's error: our RunFailed's message, else the traceback's last line."""
    m = re.search(r"RunFailed: (.*)", message)
    if m:
        return m.group(1).strip()
    trace = message.split("-" * 22)
    return last_line(trace[1] if len(trace) > 2 else message) or "unknown error"


# ---------------------------------------------------------------------------------------------------
# a sweep's points as jobs


@dataclass
class _Flight:
    point: Point
    job: object
    run_dir: Path
    info: dict
    reattached: bool = False


def read_job(run_dir: Path) -> dict | None:
    try:
        info = json.loads((run_dir / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("job_id") else None


def recorded_jobs(results: Path) -> set[str]:
    return {str(r["job"]["id"]) for r in read_results(results) if isinstance(r.get("job"), dict)}


def dry_run(spec: Spec, points: list[Point], out: Path, opts: ClusterOptions, prefix: list[str]) -> str:
    """Every point's sbatch script, as --launcher slurm would submit it."""
    cluster = Cluster("slurm", opts)
    parts = []
    for p in points:
        run_dir = (out / p.id).absolute()
        command = prefix + train_tail(run_dir / "config.toml", run_dir)
        sh, text = cluster.script(run_dir, p.cfg, f"{spec.name}-{p.id}", command)
        pretrain = spec.pretrain.steps > 0 and not p.cfg.model.init
        note = " (after its base model is pretrained: a job of the same shape)" if pretrain else ""
        parts.append(f"#### {p.id}: {sh}{note}\n{text}")
    return "\n".join(parts)


def run_points(spec: Spec, todo: list[Point], out: Path, *, launcher: str, opts: ClusterOptions, prefix: list[str],
               resume: bool, limit: int | None, wait: bool, finish, results: Path, log=print) -> list[str]:
    """Submit `todo` as jobs, at most `limit` queued or running at once, and hand each finished job's record to
    `finish(point, record)` (which appends it). Returns the ids of points still queued, running or unsubmitted."""
    from .base_models import BaseModels

    cluster = Cluster(launcher, opts, log)
    if todo:
        cluster.require_scheduler()
    done_jobs = recorded_jobs(results)
    queue: list[Point] = []
    flights: list[_Flight] = []
    out = out.absolute()  # jobs start in the submitting shell's directory, wherever that is
    for p in todo:  # first the jobs an earlier sweep left: wait for them, collect them, or submit again
        run_dir = out / p.id
        info = read_job(run_dir) if resume else None
        if info is None or info.get("cluster") != cluster.kind:
            queue.append(p)
            continue
        f = _Flight(p, cluster.reattach(run_dir, info), run_dir, info, reattached=True)
        if cluster.running(f.job, True):
            if info.get("digest") != p.digest:
                raise ValueError(f"{p.id}: job {info['job_id']} of an older config is still queued or running: "
                                 f"cancel it (scancel {info['job_id']}) or wait for it, then --resume")
            log(f"{p.id}: job {info['job_id']} still queued or running: waiting for it")
            flights.append(f)
        elif str(info["job_id"]) not in done_jobs and info.get("digest") == p.digest:
            if _collect(f, spec, cluster, finish, log) != "ok":
                queue.append(p)
        else:
            queue.append(p)

    bases = BaseModels(spec.pretrain, prefix, _blocking(cluster, spec.name), log=log)
    needs_base = [p for p in queue if spec.pretrain.steps > 0 and not p.cfg.model.init]
    if needs_base:  # base models first, side by side as jobs of their points' shape (two points may share one)
        first = {(p.cfg.model.name, json.dumps(p.cfg.to_dict()["data"], sort_keys=True)): p for p in needs_base}
        with ThreadPoolExecutor(len(first)) as pool:
            list(pool.map(lambda p: _try_base(bases, p), first.values()))

    total = len(queue)
    while queue or flights:
        while queue and (limit is None or len(flights) < limit):
            p = queue.pop(0)
            f = _submit(p, spec, out, cluster, prefix, bases, resume, finish, log, total - len(queue), total)
            if f is not None:
                flights.append(f)
        if not wait:
            break
        for f in [f for f in flights if not cluster.running(f.job, f.reattached)]:
            flights.remove(f)
            _collect(f, spec, cluster, finish, log)
        if flights or queue:
            time.sleep(cluster.poll_s)
    return [f.point.id for f in flights] + [p.id for p in queue]


def _try_base(bases: BaseModels, p: Point) -> None:
    from .base_models import BaseModelError

    try:
        bases.get(p.cfg)
    except BaseModelError:  # remembered by `bases`: the point that needs it fails with it
        pass


def _submit(p: Point, spec: Spec, out: Path, cluster: Cluster, prefix, bases: BaseModels, resume: bool, finish, log,
            i: int, n: int) -> _Flight | None:
    from .base_models import BaseModelError

    run_dir = out / p.id
    base_dir = None
    if spec.pretrain.steps > 0 and not p.cfg.model.init:
        try:
            base_dir = bases.get(p.cfg)
        except BaseModelError as e:
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            finish(p, make_record(spec.name, p, run_dir, None, "failed", str(e), now(), 0.0))
            return None
        p.cfg.model.init = str(base_dir)
    resume_run = prepare_run_dir(run_dir, p.cfg, resume)
    command = prefix + train_tail(run_dir / "config.toml", run_dir, resume_run)
    job, sh = cluster.submit(command, run_dir, p.cfg, f"{spec.name}-{p.id}")
    info = {"job_id": str(job.job_id), "cluster": cluster.kind, "tasks": sh.world, "nodes": sh.nodes,
            "tasks_per_node": sh.tasks_per_node, "digest": p.digest, "base_dir": str(base_dir) if base_dir else None,
            "submitted": now(), "command": command, "resumed": resume_run}
    write_atomic(run_dir / JOB_FILE, json.dumps(info, indent=1))
    log(f"[{i}/{n}] {p.id}: job {job.job_id} submitted ({sh}){', resuming' if resume_run else ''}; "
        f"logs in {run_dir / LOGS}")
    return _Flight(p, job, run_dir, info)


def _collect(f: _Flight, spec: Spec, cluster: Cluster, finish, log) -> str:
    status, error, result = cluster.outcome(f.job)
    seconds = result.get("seconds")
    if seconds is None:  # failed: the time since submission, queueing included
        t0 = _parse_time(f.info.get("submitted"))
        seconds = time.time() - t0 if t0 else 0.0
    base_dir = Path(f.info["base_dir"]) if f.info.get("base_dir") else None
    record = make_record(spec.name, f.point, f.run_dir, base_dir, status, error,
                         result.get("started") or f.info.get("submitted") or now(), seconds)
    log_path = f.job.task(0).paths.stderr
    if record["status"] != "ok" and "[log:" not in (record["error"] or ""):
        record["error"] = f"{record['error']} [log: {log_path}]"
    record["job"] = {"id": str(f.job.job_id), "cluster": cluster.kind, "nodes": f.info.get("nodes"),
                     "tasks_per_node": f.info.get("tasks_per_node"), "log": str(log_path)}
    finish(f.point, record)
    return record["status"]


def _parse_time(stamp: str | None) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(stamp).timestamp() if stamp else None
    except ValueError:
        return None


def _blocking(cluster: Cluster, sweep: str):
    """A Runner (launch.py) that runs one command as a job and waits for it: how base models are pretrained."""
    lock = threading.Lock()

    def run(command: list, folder: Path) -> tuple[int, str | None]:
        from memtrain.config import from_dict, load_toml

        cfg = from_dict(load_toml(folder / "config.toml", "base model config"))
        with lock:  # submitit's executors are not made for threads
            job, sh = cluster.submit(command, folder, cfg, f"{sweep}-base-{folder.name}")
        cluster.log(f"base model {cfg.model.name}: job {job.job_id} ({sh}); logs in {folder / LOGS}")
        while cluster.running(job, False):
            time.sleep(cluster.poll_s)
        status, error, _ = cluster.outcome(job)
        return (0, None) if status == "ok" else (1, error)

    return run
