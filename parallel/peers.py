"""Which ranks are gone when a collective fails.

A rank that dies mid-run (killed, out of memory, its node lost) reaches the others as a library error from
whatever collective they were in: gloo's "Connection reset by peer" or a timeout, naming an address, never a
rank. `register` (parallel.init, under a launcher) leaves every rank's host and pid in the rendezvous store, and
`lost` answers after such an error which ranks are gone and how: a peer on this host by its process (ended, or
stopped), any rank by not checking in within `wait_s` (each rank checks in here once a collective of its own has
failed, which happens within a step: every step reaches every rank).

The store lives with torchrun's agent, or with rank 0 under srun; when it does not answer either, that is the
answer.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

_PREFIX = "parallel/peers/"
_store = None


def register(store, rank: int) -> None:
    """Leave this rank's host and pid in `store` (the one every rank rendezvoused through) for `lost`."""
    global _store
    _store = dist.PrefixStore(_PREFIX, store)
    _store.set(f"proc/{rank}", f"{socket.gethostname()} {os.getpid()}")


def forget() -> None:
    global _store
    _store = None


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another rank went away (or hangs): gloo's errors, which carry
    gloo's source path, and torch.distributed's own error types."""
    return isinstance(e, dist.DistError) or (type(e) is RuntimeError and "gloo/" in str(e))


def lost(rank: int, world: int, wait_s: float = 10.0) -> str | None:
    """After a collective failed: which other ranks are gone and how, as a phrase ('rank 1 (pid 42 on node3)
    ended', 'ranks 2, 3 did not answer within 10 s (gone, or stuck)'); None when every rank answered (or this
    process never registered: no launcher)."""
    if _store is None:
        return None
    try:
        _store.set_timeout(datetime.timedelta(seconds=min(wait_s, 5.0)))
        _store.set(f"alive/{rank}", "1")
        procs = {r: _store.get(f"proc/{r}").decode().split() for r in range(world) if r != rank}
        deadline = time.monotonic() + wait_s
        while True:
            here = socket.gethostname()
            gone = [f"rank {r} (pid {pid} on {host}) {state}" for r, (host, pid) in procs.items()
                    if host == here and (state := _ended(int(pid)))]
            if gone:
                return ", ".join(gone)
            silent = [r for r in procs if not _store.check([f"alive/{r}"])]
            if not silent:
                return None
            if time.monotonic() > deadline:
                return f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer within " \
                       f"{wait_s:.0f} s (gone, or stuck)"
            time.sleep(0.2)
    except (RuntimeError, ValueError, OSError):  # torch's store errors are RuntimeErrors
        return "the rendezvous store does not answer either (it lives with rank 0 or torchrun's agent)"


def _ended(pid: int) -> str | None:
    """'ended' or 'is stopped' for a process that no longer runs, None while it does."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return "ended"
    except OSError:  # no /proc: whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "ended"
        except PermissionError:  # another user's process of that number: ours is gone
            return "ended"
        return None
    state = status.split("State:", 1)[1].split()[0] if "State:" in status else ""
    return {"Z": "ended", "X": "ended", "T": "is stopped", "t": "is stopped"}.get(state)
