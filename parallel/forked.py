"""Run a function on N gloo ranks forked from this process: CPU tests and benchmarks of the engine.

Forking (not spawning) costs ~0.1 s instead of ~7 s for 8 ranks; the rendezvous is a file:// store in
a temporary directory (no ports), and every collective is bounded by the process-group timeout.
A rank that raises sends its traceback to the parent, which raises it; a rank that dies without a word
(os._exit, a segfault, the OOM killer) is noticed within POLL_S; a rank that hangs is killed after `timeout`
seconds. Functions should return measurements (errors, norms, times) rather than assert, so one bad case never
leaves the other ranks stuck in a collective.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback

import torch

# The first optimizer built in a process lazily imports torch._dynamo (~1 s per rank): pay it once, here.
import torch._dynamo  # noqa: F401
import torch.distributed as dist


def _forget_compile_threads() -> None:
    """A forked child inherits torch.compile's cached thread pool without its threads: a kernel compiled there would
    wait forever for them (torch's own after-fork hook resets only its process pool). Measured: ranks forked after
    a cold compile in the parent hung at their first compile."""
    inductor = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(inductor, "AsyncCompile", None), "pool", None)
    if hasattr(pool, "cache_clear"):
        pool.cache_clear()


def _child(rank, world_size, init_file, fn, args, q, backend, pg_timeout):
    try:
        _forget_compile_threads()
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        # Plain pickle: tensors travel by value (torch's queue reducer would share memory with a
        # process that is about to exit).
        q.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))


def _context():
    if not torch.cuda.is_available():
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # torch imported once, in the server
    return ctx


POLL_S = 0.25
"""Seconds between the parent's looks for a rank that died without reporting."""


def _collect(procs, q, timeout: float, results: list, errors: list) -> None:
    """Fill `results` by rank from the ranks' reports, or stop at the first error, dead rank or `timeout`."""
    deadline, reported = time.monotonic() + timeout, set()
    while len(reported) < len(procs):
        # Exit codes read before the queue: a rank that reported and exited has its report in the pipe by then.
        dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
        try:
            rank, status, payload = q.get(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
        except queue.Empty:
            if dead:
                code = procs[dead[0]].exitcode
                errors.append(f"rank {dead[0]} exited with code {code} without reporting"
                              f"{f' (killed by signal {-code})' if code < 0 else ''}")
                return
            if time.monotonic() >= deadline:
                errors.append(f"timed out after {timeout:.0f} s waiting for ranks")
                return
            continue
        reported.add(rank)
        if status != "ok":
            errors.append(f"rank {rank}:\n{payload}")
            return
        results[rank] = pickle.loads(payload)


def run_ranks(world_size: int, fn, *args, timeout: float = 600.0, backend: str = "gloo",
              pg_timeout: float = 120.0) -> list:
    """Run fn(rank, world_size, *args) on `world_size` forked ranks (one torch thread each); results by rank.

    On a machine with a GPU, a process that has run one backward pass cannot fork a working rank: autograd then
    starts a thread per GPU, and a forked child refuses autograd (as it refuses CUDA once the parent used it).
    There the ranks are forked by a fork server instead, a clean process started once per parent, and fn and
    args must be picklable (module-level functions)."""
    ctx = _context()
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child, args=(r, world_size, init_file, fn, args, q, backend, pg_timeout))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors = [None] * world_size, []
        try:
            _collect(procs, q, timeout, results, errors)
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return results
