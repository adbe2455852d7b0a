"""Short progress lines on stderr, from global rank 0 only: what data preparation and evaluation are doing.

    note("data: 1,234 documents, 5.6M chars")        # one line
    with stage("eval: extraction of 32 canaries"):    # "eval: extraction of 32 canaries... 4.1 s"
        ...
    with quiet():                                     # nothing from this thread's calls inside
        ...

The rank is torch.distributed's once a process group exists, else the launcher's (RANK, SLURM_PROCID), else 0:
a single process prints, the other ranks of a torchrun/srun job stay silent. Cached work prints nothing, so a
run whose data is ready starts straight with the training bar.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

_LOCAL = threading.local()


def is_main() -> bool:
    """Global rank 0 (or a process outside any distributed job)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    for var in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value) == 0
    return True


def _enabled() -> bool:
    return not getattr(_LOCAL, "quiet", 0) and is_main()


def note(msg: str) -> None:
    """One line on stderr (global rank 0 only)."""
    if _enabled():
        print(msg, file=sys.stderr, flush=True)


def seconds(s: float) -> str:
    """59.94 -> '59.9 s'; 119.7 -> '2 min 00 s' (rounded first: never '60.0 s' or '1 min 60 s')."""
    if round(s, 1) < 60:
        return f"{s:.1f} s"
    whole = round(s)
    return f"{whole // 60} min {whole % 60:02d} s"


@contextlib.contextmanager
def stage(msg: str):
    """`msg...` when the stage starts and its duration on the same line when it ends (global rank 0 only)."""
    if not _enabled():
        yield
        return
    print(f"{msg}...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        print(file=sys.stderr, flush=True)  # the error, if one is printed, starts a line of its own
        raise
    print(f" {seconds(time.perf_counter() - t0)}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet():
    """Silence `note` and `stage` in this thread (e.g. a sweep reading a corpus its runs will report on)."""
    _LOCAL.quiet = getattr(_LOCAL, "quiet", 0) + 1
    try:
        yield
    finally:
        _LOCAL.quiet -= 1


def count(n: float) -> str:
    """1234 -> '1,234'; 5_600_000 -> '5.6M'."""
    if round(n / 1e9, 1) >= 1:  # 999,999,999 rounds to '1.0G', not '1000.0M'
        return f"{n / 1e9:.1f}G"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n:,.0f}"
