"""What every memtrain command line shares: one-line errors, exit codes, argument types.

memtrain/cli.py, `memtrain plan` (memtrain/plan/cli.py) and the experiments layer's commands all parse with
`ArgumentParser` and run through `run_command`, so bad input anywhere ends the same way: one line
`memtrain: error: ...` naming the value and the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import sys


def run_command(fn) -> int:
    """Run a command; bad input (a ValueError, or an OSError such as a missing path, a full disk or a denied
    write) ends as one line and exit 2, Ctrl-C or SIGTERM as exit 130. Anything else is a bug: its traceback
    is shown."""
    try:
        return fn() or 0
    except KeyboardInterrupt:
        print("memtrain: interrupted: a run continues from its last checkpoint with --resume", file=sys.stderr)
        return 130
    except KeyError as e:  # str() of a KeyError is the repr of its argument
        return fail(e.args[0] if e.args else "KeyError")
    except OSError as e:
        if e.filename is not None and e.strerror:
            return fail(f"{e.filename}: {e.strerror} (check the path, its permissions and the free space)")
        return fail(str(e))
    except ValueError as e:
        return fail(str(e))


def fail(message: str) -> int:
    """Print the house error line and return the exit code for bad input."""
    print(f"memtrain: error: {message}", file=sys.stderr)
    return 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are the house one-liner (no usage dump): `memtrain: error: ...`, exit 2."""

    def error(self, message):
        where = "" if self.prog == "memtrain" else f"{self.prog}: "
        self.exit(2, f"memtrain: error: {where}{message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type for counts that must be >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: use an integer >= 1")
    return value


def positive_float(text: str) -> float:
    """An argparse type for sizes that must be > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is invalid: use a number > 0")
    return value
