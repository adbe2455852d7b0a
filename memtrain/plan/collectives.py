"""Timing this machine's collectives for the planner's table (`memtrain plan --measure`, inside a process group).

Every op per group size and payload, three ways (network.SERIES): one call alone after a barrier, for the ops the
engine also issues async a call queued behind others, and for the re-layout ops a blocking call back to back with
others. `Network` reads what this returns; probes.py runs it beside the other probes.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import parallel
from memtrain.plan.network import ASYNC_OPS, CHAINED_OPS, GB, OPS, SERIES, SERIES_OPS, inside_node
from parallel import Grid, comm
from parallel.comm import Record

SMALL_MESSAGES = (64, 4096, 65536)
"""Payload bytes the collective probe times below its MiB sizes: a step's losses, norm statistics and small shards.
There a CPU group's time is mostly its members waking one another, and no latency + bytes / bandwidth line
fits it: on 8 gloo ranks sharing 2 cores an all-reduce of one value per member took half the time of a 1 KiB one."""
STREAMED = 3
"""Calls the probe issues in a row to time one call of a stream (async, queued) or of a chain (blocking, back to
back)."""


def probe_grids(rank: int, world: int) -> dict:
    """The grids the collective probe times a group size p on: Grid(world / p, p, 1, 1), groups of p consecutive
    ranks, every divisor p > 1 of the world, their process groups built (every rank calls it, in the same order)."""
    grids = {p: Grid(world // p, p, 1, 1, rank=rank) for p in range(2, world + 1) if world % p == 0}
    for grid in grids.values():
        grid.build_groups()
    return grids


def measure_collectives(rank: int, world: int, gpus_per_node: int, sizes_mb=(0.25, 1.0, 4.0), iters: int = 5,
                        device=None, grids: dict | None = None) -> dict:
    """Every collective per group size (groups of consecutive ranks, all groups at once), timed at payloads from
    SMALL_MESSAGES up through `sizes_mb`: one call alone after a barrier, for ASYNC_OPS one call of STREAMED
    queued back to back, and for CHAINED_OPS one of STREAMED blocking calls back to back. The rounds over every op
    and payload repeat (`iters` timed after one warm-up), so load drifting on a shared machine moves every figure
    alike; each figure is its median over rounds, then the slowest rank's (a collective ends when its last member
    does). Returns {"collective_curves": ..., "collectives": ...} (`Network`'s fields), the second a latency +
    bandwidth summary of the first: the smallest payload's isolated time, and the least-squares slope of time -
    latency against moved bytes over `sizes_mb`. Every rank returns the same.
    `grids`: probe_grids built earlier, to time on groups that already existed while something else was timed."""
    calls = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter,
             "all_to_all": comm.all_to_all}
    cuda = device is not None and torch.device(device).type == "cuda"

    def finish():
        if cuda:
            torch.cuda.synchronize()

    def timed(op, grid, tensors) -> tuple[float, float, float]:
        """Seconds of one call in each of SERIES, in its order: alone, streamed, chained (alone where the op has
        no such series)."""
        dist.barrier()
        start = time.perf_counter()
        calls[op](tensors[0], grid, "x")
        finish()
        alone = stream = chain = time.perf_counter() - start
        if op in ASYNC_OPS:
            dist.barrier()
            start = time.perf_counter()
            works = [calls[op](t, grid, "x", async_op=True) for t in tensors]
            for w in works:
                (w[1] if isinstance(w, tuple) else w).wait()
            finish()
            stream = (time.perf_counter() - start) / len(tensors)
        if op in CHAINED_OPS:
            dist.barrier()
            start = time.perf_counter()
            for t in tensors:
                calls[op](t, grid, "x")
            finish()
            chain = (time.perf_counter() - start) / len(tensors)
        return alone, stream, chain

    was, parallel.LEDGER.enabled = parallel.LEDGER.enabled, False  # not a training step
    curves: dict = {}
    summary: dict = {}
    own = grids is None  # grids built here are released here; a caller's stay its own
    grids = probe_grids(rank, world) if own else grids
    try:
        for p, grid in grids.items():
            # network.inside_node's rule, by which the planner looks the curve up: groups of p consecutive ranks
            # straddle nodes when p does not divide gpus_per_node, even when p <= gpus_per_node
            place = "intra" if inside_node(grid, ("x",), gpus_per_node) else "inter"
            large = {max(p, int(mb * 2**20) // 4 // p * p) for mb in sizes_mb}  # fp32 values, divisible by p
            counts = sorted(large | {max(p, b // 4 // p * p) for b in SMALL_MESSAGES})
            samples = {(op, n): [] for op in OPS for n in counts}
            for round_ in range(iters + 1):  # the first round warms up buffers and connections
                for (op, n), kept in samples.items():
                    tensors = [torch.ones(n // p if op == "all_gather" else n, device=device) for _ in range(STREAMED)]
                    sample = timed(op, grid, tensors)
                    if round_:
                        kept.append(sample)
            medians = torch.tensor([[statistics.median(s[k] for s in v) for k in range(len(SERIES))]
                                    for v in samples.values()], dtype=torch.float64, device=device)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
            for (op, n), figures in zip(samples, medians.tolist()):
                by_size = curves.setdefault(op, {}).setdefault(place, {})
                curve = by_size.setdefault(str(p), {"bytes": []})
                curve["bytes"].append(4 * n)
                for series, seconds in zip(SERIES, figures):
                    if op in SERIES_OPS[series]:
                        curve.setdefault(series, []).append(seconds)
            for op in OPS:
                curve = curves[op][place][str(p)]
                latency = curve["isolated"][0]
                points = [(Record(op, "x", p, b).moved_bytes, t - latency)
                          for b, t in zip(curve["bytes"], curve["isolated"]) if b // 4 in large]
                slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
                if slope <= 0:  # noise swamped the sizes: take the largest message's plain rate
                    slope = curve["isolated"][-1] / points[-1][0]
                summary.setdefault(op, {}).setdefault(place, {})[str(p)] = [1 / slope / GB, latency * 1e6]
    finally:
        parallel.LEDGER.enabled = was
        if own:
            for grid in grids.values():
                grid.release_groups()
    return {"collective_curves": curves, "collectives": summary}
