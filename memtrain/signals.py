"""SIGTERM as a scheduler delivers it: SLURM at a job's time limit or on scancel, torchrun passing its own on to
every rank, a sweep stopping its runs. A command ends on it as on Ctrl-C, with one line saying so and how to go
on, and exit code 143 (128 + 15, what a shell reports for a process SIGTERM killed), instead of dying mid-write
without a word.

`handle()` (commandline.run_command, main thread) makes SIGTERM raise `Terminated` wherever the program is.
The training loop narrows that with `deferred()`: inside it SIGTERM only sets a flag, which the loop reads at the
next step boundary, where every rank agrees to stop, saves a checkpoint and raises `Terminated` itself; a resume
then continues from exactly that step. A command already ending (`ignore()`) lets its line and exit code out whole.
"""

from __future__ import annotations

import contextlib
import signal
import threading

EXIT_CODE = 128 + signal.SIGTERM
RESUME_HINT = "a run continues from its last checkpoint with --resume"

_deferring = False
_pending = False


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, as KeyboardInterrupt is: no `except Exception` on the way swallows it."""


def handle() -> None:
    """Make SIGTERM raise `Terminated` (only the main thread may set a handler; elsewhere this does nothing)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def ignore() -> None:
    """Ignore SIGTERM from now on: for a command already ending with its line. Ignored, not deferred: Python puts
    its own handlers back to the default when the interpreter shuts down, and a SIGTERM then (torchrun sends one
    to every rank once one has failed) would replace the command's exit code with a death by signal."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _on_sigterm(signum, frame) -> None:
    global _pending
    if _deferring:
        _pending = True
        return
    raise Terminated(f"terminated by SIGTERM: {RESUME_HINT}")


def pending() -> bool:
    """Whether a SIGTERM arrived inside `deferred()` and is waiting for the next step boundary."""
    return _pending


@contextlib.contextmanager
def deferred():
    """Inside the block SIGTERM only sets `pending()`, for the block's owner to act on where it is safe: the
    training loop, at a step boundary."""
    global _deferring, _pending
    outer = _deferring
    _deferring = True
    if not outer:
        _pending = False
    try:
        yield
    finally:
        _deferring = outer
