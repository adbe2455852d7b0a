"""What every memtrain command line shares: one-line errors, exit codes, argument types.

memtrain/cli.py, `memtrain plan` (memtrain/plan/cli.py) and the experiments layer's commands all parse with
`ArgumentParser` and run through `run_command`, so bad input anywhere ends the same way: one line
`memtrain: error: ...` naming the value and the fix, and exit code 2.

Exit codes (EXIT_CODES, shown by --help): each but 0 and 141 comes with one line on stderr, 130 and 143 with the
--resume hint. SIGTERM is memtrain/signals.py's.
"""

from __future__ import annotations

import argparse
import os
import sys

from memtrain import bounds, signals

EXIT_CODES = ("exit codes: 0 done; 1 a failed sweep point, or a rank of the run lost; 2 bad input, or a path, "
              "permission or full disk refusing a write; 130 Ctrl-C; 141 the output's reader went away (| head); "
              "143 SIGTERM (what SLURM and torchrun send: training saves the step it is at first)")
PIPE_CLOSED = 141
"""128 + SIGPIPE: how a process that wrote into a closed pipe ends by default, and what shells report for it."""


def run_command(fn) -> int:
    """Run a command; bad input (a ValueError, or an OSError such as a missing path, a full disk or a denied
    write) ends as one line and exit 2, a lost rank as one line and exit 1, Ctrl-C as exit 130 and SIGTERM as
    exit 143. Anything else is a bug: its traceback is shown."""
    signals.handle()
    try:
        return fn() or 0
    except BaseException as e:  # noqa: BLE001 - each kind ends in _ended; a bug is raised again
        signals.ignore()  # ending already: a SIGTERM now (torchrun's, after a lost rank) would cut it short
        _release_a_lone_process_group()
        code = _ended(e)
        if code is None:
            raise
        return code


def _release_a_lone_process_group() -> None:
    """A command ending on an error or a signal destroys its process group where it is the only rank, before its
    line is printed: NCCL's would otherwise warn at exit, after that line (seen on one GPU). With several ranks a
    graceful destroy waits for collectives a departed peer never completes, so the exit's own teardown stays."""
    if "parallel" not in sys.modules:  # no process group can have started
        return
    import torch.distributed as dist

    import parallel

    if dist.is_initialized() and dist.get_world_size() == 1:
        parallel.shutdown()


def _ended(e: BaseException) -> int | None:
    """The exit code of a command that raised `e`, its line printed; None when `e` is a bug."""
    if isinstance(e, BrokenPipeError):
        return closed_pipe()
    if isinstance(e, KeyboardInterrupt):
        print(f"memtrain: interrupted: {e.args[0] if e.args else signals.RESUME_HINT}", file=sys.stderr)
        return 130
    if isinstance(e, signals.Terminated):
        print(f"memtrain: {e}", file=sys.stderr)
        return signals.EXIT_CODE
    if isinstance(e, KeyError):  # str() of a KeyError is the repr of its argument
        return fail(e.args[0] if e.args else "KeyError")
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return fail(f"{e.filename}: {e.strerror} (check the path, its permissions and the free space)")
    if isinstance(e, (OSError, ValueError)):
        return fail(str(e))
    lost = _lost_rank(e) if isinstance(e, RuntimeError) else None
    if lost is None:
        return None
    fail(lost)
    return 1


def _lost_rank(e: RuntimeError) -> str | None:
    """What a collective's failure says about the other ranks (parallel/peers.py), None when `e` is no such
    failure (or no process group ever started: then it cannot be)."""
    if "parallel" not in sys.modules:
        return None
    import torch.distributed as dist

    from parallel import peers

    if not (dist.is_initialized() and peers.is_peer_failure(e)):
        return None
    who = peers.lost(dist.get_rank(), dist.get_world_size())
    cause = str(e).split("] ", 1)[-1].split(". This is typically", 1)[0]  # gloo's source line and advice cut
    return (f"rank {dist.get_rank()} lost contact with the other ranks: {who or cause}: this rank stopped too; "
            f"{signals.RESUME_HINT}")


def closed_pipe() -> int:
    """stdout's reader went away (`memtrain ... | head`): end quietly with PIPE_CLOSED, not as bad input, with stdout
    pointed at /dev/null so that nothing flushes into the closed pipe at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return PIPE_CLOSED


def fail(message: str) -> int:
    """Print the house error line and return the exit code for bad input."""
    print(f"memtrain: error: {message}", file=sys.stderr)
    return 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are the house one-liner (no usage dump): `memtrain: error: ...`, exit 2."""

    def error(self, message):
        where = "" if self.prog == "memtrain" else f"{self.prog}: "
        self.exit(2, f"memtrain: error: {where}{message} (see {self.prog} --help)\n")


def positive_int(text: str, limit: int = bounds.DEFAULT) -> int:
    """An argparse type for counts that must be >= 1 (and at most `limit`: see `at_most`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: use an integer >= 1")
    if value > limit:
        raise argparse.ArgumentTypeError(f"{value} is too large: use at most {bounds.shown(limit)}")
    return value


def positive_float(text: str, limit: float = bounds.DEFAULT) -> float:
    """An argparse type for sizes that must be finite and > 0 (and at most `limit`: see `at_most`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is invalid: use a finite number > 0")
    if value > limit:
        raise argparse.ArgumentTypeError(f"{value:g} is too large: use at most {bounds.shown(limit)}")
    return value


def at_most(kind, limit):
    """`positive_int` or `positive_float` with its own bound (memtrain/bounds.py): `type=at_most(positive_int, N)`."""
    def parse(text: str):
        return kind(text, limit)
    parse.__name__ = kind.__name__  # argparse names the type in some of its messages
    return parse
