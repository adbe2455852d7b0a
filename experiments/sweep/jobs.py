"""A command as a cluster job, through submitit: submitted (SLURM, or submitit's LocalExecutor on this machine),
found again from another process, and told how it ended. slurm.py makes a sweep's points into such jobs.

A job runs the command in every task: the point's `python -m memtrain train --config RUN/config.toml --out RUN`,
the same a user would type; the engine reads its rank from SLURM's variables (parallel/grid.py). Its folder
(<run>/submitit/) holds the sbatch script, one log pair per task and submitit's pickles. A job that reaches its
time limit or is preempted is requeued by submitit (`TrainJob.checkpoint`) and continues from its last
checkpoint (train.checkpoint_every_min).

`--launcher submitit-local` runs the same jobs through submitit's LocalExecutor on this machine (one node;
tasks = ranks, each told its rank through RANK/WORLD_SIZE): the tests' path, and a rehearsal of a cluster sweep.

submitit follows a SLURM job through `sacct`; where job accounting is off (sacct missing or refusing), it would
report a job that died before writing its result (a node lost, the task killed) as unknown, and the sweep would
wait for it forever. There `Cluster.running` asks squeue instead: a job squeue no longer lists as queued or
running, with no result after five more polls (a shared file system may show the result late), ended without one.

Every task of a job unpickles TrainJob from this module: nothing here imports torch at its top.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import TYPE_CHECKING

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission

from experiments.results import now
from memtrain.run_files import CHECKPOINTS, CONFIG, LATEST

from .launch import Runner, die_with_parent, last_line, run_env
from .slurm_options import ClusterOptions, Shape, check, minutes, sbatch_script, shape, slurm_parameters

if TYPE_CHECKING:
    from memtrain.config import RunConfig

LOGS = "submitit"
LOCAL_TIMEOUT_MIN = 7 * 24 * 60
"""submitit-local without --time: a week (submitit's own default would stop a job after 2 minutes)."""
ENDED = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT")
"""squeue's states of a job that will not run again (squeue lists one for a few minutes after it ends)."""


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
        done = (Path(self.out) / CHECKPOINTS / LATEST).is_file()
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
        return _is_controller((proc / "status").read_text(), (proc / "cmdline").read_bytes())
    except OSError:
        return True  # no /proc: trust the pid


def _is_controller(status: str, cmdline: bytes) -> bool:
    """From /proc/<pid>: a zombie has ended; a command line without submitit is another program that got the pid. An
    empty one is a controller still starting: right after its submission returns, the new process can run for a
    while with an empty command line (on this 2-core VM: 4 of 20 two-job submissions, read at once), and a
    --resume right after a --no-wait sweep took such a job for ended and ran it again."""
    if "\nState:\tZ" in status:
        return False
    return not cmdline or b"submitit" in cmdline


class Cluster:
    """Submits commands as jobs (SLURM, or submitit's LocalExecutor), finds them again, tells how they ended."""

    def __init__(self, launcher: str, opts: ClusterOptions, log=print):
        check(opts, launcher)
        self.local = launcher == "submitit-local"
        self.kind = "local" if self.local else "slurm"
        self.opts = opts
        self.log = log
        self.poll_s = opts.poll_s if opts.poll_s is not None else (1.0 if self.local else 30.0)
        self._submit_lock = threading.Lock()  # submitit's executors are not made for threads
        self._accounting: bool | None = None  # whether sacct answers (asked once)
        self._gone_since: dict[str, float] = {}  # jobs squeue no longer lists as live, without a result yet
        self._lost: dict[str, str] = {}  # jobs that ended without a result: why

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
        if self.local or self._has_accounting(job):
            return not job.done()
        state = _squeue_state(str(job.job_id))  # before the results: a job ending between the two looks lost
        if all(job.task(i).paths.result_pickle.exists() for i in range(job.num_tasks)):
            return False
        if state is None or (state != "" and state not in ENDED):  # live, or squeue cannot say now: wait on
            self._gone_since.pop(str(job.job_id), None)
            return True
        gone = self._gone_since.setdefault(str(job.job_id), time.time())
        logs = [f.stat().st_mtime for i in range(job.num_tasks) if (f := job.task(i).paths.stderr).exists()]
        ended = min(gone, max(logs, default=gone))  # its last log line: a --resume may find it gone long since
        if time.time() - ended < 5 * self.poll_s:
            return True
        self._lost[str(job.job_id)] = (f"job {job.job_id} ended ({state or 'no longer listed by squeue'}) without "
                                       "writing its result (a node lost or the task killed; this cluster keeps no "
                                       "job accounting to say more)")
        return False

    def _has_accounting(self, job) -> bool:
        if self._accounting is None:
            try:
                r = subprocess.run(["sacct", "-n", "-X", "-o", "State", "-j", str(job.job_id)], capture_output=True,
                                   timeout=60)
                self._accounting = r.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                self._accounting = False
            if not self._accounting:
                self.log("no job accounting here (sacct missing or refusing): following jobs with squeue")
        return self._accounting

    def outcome(self, job) -> tuple[str, str | None, dict]:
        """('ok' | 'failed', the error with its log path, task 0's return value) of a finished job."""
        if str(job.job_id) in self._lost:  # submitit would wait for its result forever
            return "failed", self._lost[str(job.job_id)], {}
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

    def runner(self, sweep: str) -> Runner:
        """A Runner (launch.py) that runs one command as a job and waits for it: how base models are pretrained
        on a cluster, as jobs of their points' shape."""

        def run(command: list, folder: Path) -> tuple[int, str | None]:
            from memtrain.config import from_dict, load_toml  # the submitting side only: tasks need no torch

            cfg = from_dict(load_toml(folder / CONFIG, "base model config"))
            with self._submit_lock:
                job, sh = self.submit(command, folder, cfg, f"{sweep}-base-{folder.name}")
            self.log(f"base model {cfg.model.name}: job {job.job_id} ({sh}); logs in {folder / LOGS}")
            while self.running(job, False):
                time.sleep(self.poll_s)
            status, error, _ = self.outcome(job)
            return (0, None) if status == "ok" else (1, error)

        return run


def _squeue_state(job_id: str) -> str | None:
    """squeue's state of a job ('RUNNING', 'PENDING', ...), '' when it lists no such job (ended a while ago), None
    when squeue itself cannot say (missing, or the controller not answering)."""
    try:
        r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return "" if "invalid job id" in r.stderr.lower() else None
    return r.stdout.split()[0] if r.stdout.split() else ""


def _error_line(message: str) -> str:
    """The useful line of submitit's error: our RunFailed's message, else the traceback's last line."""
    m = re.search(r"RunFailed: (.*)", message)
    if m:
        return m.group(1).strip()
    trace = message.split("-" * 22)
    return last_line(trace[1] if len(trace) > 2 else message) or "unknown error"
