"""A warm server for a local sweep's runs: one process imports torch, transformers, wandb and memtrain once, and
forks every `python -m memtrain ARGS` the sweep runs from there.

A cold `python -m memtrain train` spends ~4 s on those imports before its first step (and ~1 s more in
transformers' lazy imports at the first model build): a fifth of a small run of the demo, paid 28 times. A fork
of the server starts in milliseconds and is still a process of its own: its own output files, exit code and
crash, in the server's environment, which is exactly the run's (a run whose environment differs gets a new
server), and in the caller's working directory.

    rc, last_stderr_line = warm_runner([sys.executable, "-m", "memtrain", "train", ...], run_dir)

The server (`python -m experiments.sweep.warm`) reads one JSON request a line on stdin and answers on stdout with
the child's pid, then its exit code. It runs no Python thread (a fork keeps only the forking thread: a lock another
held would stay held in the child) and never touches a GPU before forking. Its stdin closing ends it: at once when
the sweep died (even by SIGKILL), which takes its runs along (each run asks for SIGTERM when the server dies:
PR_SET_PDEATHSIG); else (the sweep done, or another environment wanted) once its runs have ended. (PR_SET_PDEATHSIG
on the server itself would fire when the sweep's thread that started it ends, not the sweep.)
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .launch import (
    RUNNING,
    default_command,
    die_with_parent,
    failure_line,
    last_line,
    run_env,
    subprocess_runner,
)

MODULES = ["memtrain.cli", "memtrain.config", "memtrain.training", "memtrain.evaluate",
           "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama", "scipy.stats",
           "sklearn.metrics", "torch._dynamo"]
"""What the server imports: all a `memtrain train` of a named (Llama) model imports, transformers' lazy modules
and torch._dynamo (its first optimizer imports it) included, and what its evaluation imports where it runs
(scipy.stats, scikit-learn). None of them starts a Python thread or initializes CUDA on import (torch and Arrow
start a few idle native threads, as in every process that forks DataLoader workers)."""
IF_INSTALLED = ["wandb", "wandb.sdk.launch.inputs.internal"]
"""Imported too where installed: a run imports wandb only to track to W&B (memtrain.training.tracking), so a cold
run with W&B off needs none, and neither may the server (a lent GPU's image lacked it; every fork died). Every
wandb.init imports the second (its launch inputs), 0.35 s of each forked run's start, measured (0.67 s -> 0.32 s)."""
STOP_GRACE_S = 15.0
"""A run told to stop (SIGTERM: it saves its step) gets this long before SIGKILL."""


class ServerEnded(RuntimeError):
    """The warm server died before a run's exit code came back (its import failed, or it was killed)."""


class Server:
    """The client's side: the server process, and the replies its reader thread sorts by request."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.stderr = tempfile.TemporaryFile()  # the server's own warnings stay off the sweep's console
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env=env)
        self.replies: dict[int, dict] = {}
        self.requests = 0
        self.cond = threading.Condition()
        self.ended = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self.cond:
                self.replies.setdefault(reply["id"], {}).update(reply)
                self.cond.notify_all()
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def _wait(self, i: int, key: str, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while key not in self.replies.get(i, {}):
                if self.ended:
                    self.stderr.seek(0)
                    said = last_line(self.stderr.read()[-20000:].decode("utf-8", "replace"))
                    raise ServerEnded(f"the sweep's warm server ended (exit {self.proc.wait()}) before its run did: "
                                       f"{said or 'no stderr'}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.cond.wait(left)
            return self.replies[i][key]

    def run(self, argv: list[str], log_dir: str, cwd: str) -> int:
        with self.cond:
            self.requests += 1
            i = self.requests
            self.proc.stdin.write(json.dumps({"id": i, "argv": argv, "log_dir": log_dir, "cwd": cwd}).encode()
                                  + b"\n")
            self.proc.stdin.flush()
        pid = self._wait(i, "pid")
        RUNNING.add(pid)
        try:
            return self._wait(i, "code")
        except BaseException:  # the sweep stops: so does the run, saved if it can
            os.kill(pid, signal.SIGTERM)
            if self._wait(i, "code", STOP_GRACE_S) is None:
                os.kill(pid, signal.SIGKILL)
                self._wait(i, "code")
            raise
        finally:
            RUNNING.discard(pid)

    def close(self) -> None:
        """No more requests: the server ends once its runs have."""
        with self.cond:
            self.proc.stdin.close()


_server: Server | None = None
_server_lock = threading.Lock()


def warm_runner(cmd: list, log_dir: Path) -> tuple[int, str | None]:
    """launch.subprocess_runner's contract (exit code, -N when killed by signal N, and the last stderr line of a
    failure) for `python -m memtrain ARGS`, forked from the warm server of this environment (started on first use:
    that run waits for its imports); any other command runs as a subprocess."""
    prefix = default_command()
    if [str(c) for c in cmd[:len(prefix)]] != prefix:
        return subprocess_runner(cmd, log_dir)
    global _server
    env = run_env()
    with _server_lock:
        if _server is None or _server.env != env or _server.ended:
            if _server is not None:
                _server.close()
            _server = Server(env)
        server = _server
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        rc = server.run([str(c) for c in cmd[len(prefix):]], str(log_dir), os.getcwd())
    except ServerEnded as e:  # the point fails with the reason; the next run starts a new server
        return 1, str(e)
    return rc, failure_line(log_dir, rc)


def _child(request: dict, replies: int) -> None:
    """The forked run: its own output, stdin, directory and Ctrl-C, then `python -m memtrain ARGV`; never returns."""
    code = 1
    try:
        die_with_parent()
        os.close(replies)
        os.chdir(request["cwd"])
        for fd, path in ((0, os.devnull), (1, os.path.join(request["log_dir"], "stdout.log")),
                         (2, os.path.join(request["log_dir"], "stderr.log"))):
            target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores Ctrl-C; a run stops on it
        from memtrain.cli import main

        code = main(request["argv"])
        if "wandb" in sys.modules:  # os._exit skips the atexit hook that stops W&B's service
            sys.modules["wandb"].teardown()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: its traceback is the run's last words, as in a cold process
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def preload(modules: list[str], if_installed: list[str]) -> None:
    """Import `modules`, and those of `if_installed` that are installed, so that every fork starts with them."""
    for name in modules:
        importlib.import_module(name)
    for name in if_installed:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:  # wandb missing, or a version without that module: the run imports its own
            pass


def serve() -> None:
    """The server's loop: fork a child per request, answer its pid, reap it and answer its exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the runs and the sweep; the sweep closes us
    sweep = os.getppid()
    replies = os.dup(1)
    os.dup2(2, 1)  # what an import prints must not mix with the replies
    preload(MODULES, IF_INSTALLED)
    children: dict[int, int] = {}
    pending, reading = b"", True

    def reply(message: dict) -> None:
        os.write(replies, json.dumps(message).encode() + b"\n")

    while reading or children:
        if not reading and os.getppid() != sweep:  # the sweep died (its pipe closed with it): our runs die with us
            return
        if reading and select.select([0], [], [], 0.2)[0]:
            chunk = os.read(0, 1 << 16)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, replies)
                children[pid] = request["id"]
                reply({"id": request["id"], "pid": pid})
        elif not reading:
            time.sleep(0.2)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
