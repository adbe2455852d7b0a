"""How a sweep starts a run on this machine: the command prefix (python -m memtrain, torchrun, or a custom runner)
that a `train --config ... --out ...` tail is appended to, the environment it starts with, and a runner that
executes it with its output in the run directory. (Cluster launchers, slurm and submitit-local: jobs.py.)
(The local launcher forks its `python -m memtrain` runs from a warm server instead: warm.py.)"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from memtrain.run_files import CONFIG

# A runner executes one command for a run directory and returns (exit code, last stderr line or None).
Runner = Callable[[list, Path], "tuple[int, str | None]"]

LAUNCHERS = ("local", "torchrun", "slurm", "submitit-local")
CLUSTER_LAUNCHERS = ("slurm", "submitit-local")


def default_command(launcher: str = "local", nproc: int = 1, runner: str | None = None) -> list[str]:
    """The command prefix a `train --config ... --out ...` tail is appended to (with a cluster launcher: what each
    task of a job runs, one task per rank)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher {launcher!r} is invalid: use one of {', '.join(LAUNCHERS)}")
    if runner:
        return shlex.split(runner)
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "memtrain"]
    return [sys.executable, "-m", "memtrain"]


def train_tail(run_dir: Path, resume: bool = False) -> list[str]:
    """`train` of the config.toml in `run_dir`, into `run_dir`: what every point and base model runs."""
    return ["train", "--config", str(run_dir / CONFIG), "--out", str(run_dir)] + (["--resume"] if resume else [])


def last_line(text: str) -> str | None:
    """Last non-empty line of a process's output (progress bars' carriage returns count as breaks)."""
    for line in reversed(re.split(r"[\r\n]+", text)):
        if line.strip():
            return line.strip()
    return None


def run_env() -> dict[str, str]:
    """The environment a run starts with: this one, offline hub access and unbuffered output unless set."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Idle OpenMP threads sleep instead of spinning: on a shared or oversubscribed CPU, spinning threads
    # made small runs 4-20x slower here (a 7 s run took 47-238 s); on an idle machine it costs little.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


RUNNING: set[int] = set()
"""Process ids of the runs in flight. A signal reaches only the sweep's main thread: runs that side-by-side worker
threads wait for are stopped through this (`stop_running`), as Ctrl-C in a terminal stops them all at once."""


def stop_running() -> None:
    """SIGTERM every run in flight: each saves its step and ends, and the thread waiting for it goes on."""
    for pid in list(RUNNING):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def subprocess_runner(cmd: list, log_dir: Path) -> tuple[int, str | None]:
    """Run `cmd`, stdout and stderr to log_dir/{stdout,stderr}.log; a kill of the sweep stops it too."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = run_env()
    with open(log_dir / "stdout.log", "wb") as out, open(log_dir / "stderr.log", "wb") as err:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, env=env, preexec_fn=die_with_parent)
        RUNNING.add(proc.pid)
        try:
            rc = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        finally:
            RUNNING.discard(proc.pid)
    return rc, failure_line(log_dir, rc)


def failure_line(log_dir: Path, rc: int) -> str | None:
    """What a run that exited with `rc` said last on log_dir/stderr.log when it failed; None when it did not."""
    if rc == 0:
        return None
    return last_line((log_dir / "stderr.log").read_bytes()[-20000:].decode("utf-8", "replace"))


def die_with_parent() -> None:
    """In the child, before exec (a forked run: first thing): ask Linux for SIGTERM when its parent dies (the sweep,
    or the warm server, which ends with the sweep), even by SIGKILL (which no handler sees), so a killed sweep
    leaves no trainer running into a directory its --resume will reuse."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the run directory's lock still keeps a second trainer out
        pass
