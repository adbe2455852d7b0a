"""Timing this machine's collectives for the planner's table (`memtrain plan --measure`, inside a process group).

Every op per group size and payload, three ways (network.SERIES): one call after a stretch of compute, for the
ops the engine also issues async a call queued behind others, and for the re-layout ops a blocking call back to
back with others; and how much of a stream of async calls compute hides (`measure_overlap`). `Network` reads what
this returns; probes.py runs it beside the other probes.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

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
LEAD_MATMULS = 16
"""Matmuls of LEAD_DIM squared that run before an isolated call, as a step's compute runs before its blocking
collectives: members then reach the call when their own compute ends, not together as after a barrier, and each
waits in the call for the last. On 8 gloo ranks sharing 2 cores (ladder-1m, sharded mode) a blocking all-reduce
over 2, 4 and 8 ranks held a rank 3.0, 6.7 and 15.8 ms in a step (experiments/bench/planner.py's in-step table),
1.5, 1.2 and 1.3x its time after a barrier; after this lead (about 0.5 ms), 2.6-3.1, 6.9-7.9 and 15.2-15.3 ms."""
LEAD_DIM = 96
OVERLAP_BYTES = 2**20
"""Payload of each async all-reduce of the overlap probe: a gradient bucket's order of size."""


def lead_operand(device=None) -> torch.Tensor:
    """The lead's operand, the same on every call (no random generator's state is touched)."""
    return torch.linspace(-1.0, 1.0, LEAD_DIM * LEAD_DIM, device=device).reshape(LEAD_DIM, LEAD_DIM)


def lead(operand: torch.Tensor, matmuls: int = LEAD_MATMULS) -> torch.Tensor:
    """Compute that runs before a timed call: chained matmuls, tanh keeping the values bounded."""
    for _ in range(matmuls):
        operand = torch.tanh(operand @ operand * 0.01)
    return operand


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
    SMALL_MESSAGES up through `sizes_mb`: one call after `lead` (each rank's time in the call), for ASYNC_OPS one
    call of STREAMED queued back to back, and for CHAINED_OPS one of STREAMED blocking calls back to back. The
    rounds over every op and payload repeat (`iters` timed after one warm-up), so load drifting on a shared machine
    moves every figure alike; each figure is its median over rounds, then the slowest rank's (a collective ends
    when its last member does), but for the call after the lead the mean over ranks: there the first to arrive
    waits for the last, who then waits least, so over a step's many calls a rank spends about the mean.
    Returns {"collective_curves": ..., "collectives": ..., "overlap": ...} (`Network`'s fields), the second a
    latency + bandwidth summary of the first: the smallest payload's isolated time, and the least-squares slope of
    time - latency against moved bytes over `sizes_mb`; the third `measure_overlap` over the largest group. Every
    rank returns the same.
    `grids`: probe_grids built earlier, to time on groups that already existed while something else was timed."""
    calls = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter,
             "all_to_all": comm.all_to_all}
    operand, clocked = lead_operand(device), partial(_clocked, device=device)

    def timed(op, grid, tensors) -> tuple[float, float, float]:
        """Seconds of one call in each of SERIES, in its order: isolated (this rank's time in the call after the
        lead), streamed, chained (isolated where the op has no such series)."""
        isolated = stream = chain = clocked(lambda: calls[op](tensors[0], grid, "x"), before=lambda: lead(operand))
        if op in ASYNC_OPS:
            stream = clocked(lambda: _wait([calls[op](t, grid, "x", async_op=True) for t in tensors])) / len(tensors)
        if op in CHAINED_OPS:
            chain = clocked(lambda: [calls[op](t, grid, "x") for t in tensors]) / len(tensors)
        return isolated, stream, chain

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
            medians = across_ranks(torch.tensor([[statistics.median(s[k] for s in v) for k in range(len(SERIES))]
                                                 for v in samples.values()], dtype=torch.float64, device=device))
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
        overlap = measure_overlap(grids[max(grids)], iters, device)
    finally:
        parallel.LEDGER.enabled = was
        if own:
            for grid in grids.values():
                grid.release_groups()
    return {"collective_curves": curves, "collectives": summary, "overlap": overlap}


def across_ranks(medians: torch.Tensor) -> torch.Tensor:
    """What the table keeps of every rank's medians [figures, SERIES] (every rank calls it and gets the same): the
    isolated series' mean over ranks, the others' maximum (see measure_collectives)."""
    mean = medians[:, 0].clone()
    dist.all_reduce(mean)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    medians[:, 0] = mean / dist.get_world_size()
    return medians


def measure_overlap(grid: Grid, iters: int = 5, device=None) -> float:
    """The fraction of the shorter of compute and a stream of async all-reduces (STREAMED calls of OVERLAP_BYTES
    over the grid's X groups) that runs hidden when both are issued together: (compute + stream - both) / the
    shorter, from each one's median over `iters` rounds (after a warm-up) and the slowest rank's, clipped to [0, 1].
    The compute is `lead`'s matmuls, as many as take about the stream's time alone (rank 0's count, so every rank
    runs the same). A GPU runs a collective on its own engine beside the compute; CPU ranks run it on the cores
    the compute needs: on 8 gloo ranks sharing 2 cores it measured 0.00-0.22 (nine runs of bench.planner),
    where the planner had credited 1."""
    operand, clocked = lead_operand(device), partial(_clocked, device=device)
    tensors = [torch.ones(OVERLAP_BYTES // 4, device=device) for _ in range(STREAMED)]

    def stream():
        return [comm.all_reduce(t, grid, "x", async_op=True) for t in tensors]

    def calibrate() -> int:
        clocked(lambda: _wait(stream()))  # warm-up: buffers, connections
        unit = statistics.median(clocked(lambda: lead(operand)) for _ in range(3)) / LEAD_MATMULS
        alone = statistics.median(clocked(lambda: _wait(stream())) for _ in range(3))
        count = torch.tensor([max(1, round(alone / unit))], device=device)
        dist.broadcast(count, src=0)
        return int(count.item())

    matmuls = calibrate()
    samples = {"compute": [], "stream": [], "both": []}
    for _ in range(iters):
        samples["compute"].append(clocked(lambda: lead(operand, matmuls)))
        samples["stream"].append(clocked(lambda: _wait(stream())))
        samples["both"].append(clocked(lambda: _wait_after(stream(), lambda: lead(operand, matmuls))))
    medians = torch.tensor([statistics.median(v) for v in samples.values()], dtype=torch.float64, device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return hidden_fraction(*medians.tolist())


def hidden_fraction(compute: float, stream: float, both: float) -> float:
    """The fraction of the shorter of two times that ran hidden when both ran together in `both` seconds: 1 when
    `both` is the longer, 0 when it is their sum, clipped to [0, 1] (on a busy machine both can take longer)."""
    return min(1.0, max(0.0, (compute + stream - both) / min(compute, stream)))


def _clocked(fn, device=None, before=None) -> float:
    """Seconds of fn() on this rank until its device work is done, from a barrier, or from the end of before()
    run after the barrier."""
    cuda = device is not None and torch.device(device).type == "cuda"
    dist.barrier()
    if before is not None:
        before()
        if cuda:
            torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _wait(works) -> None:
    for w in works:
        (w[1] if isinstance(w, tuple) else w).wait()


def _wait_after(works, fn) -> None:
    fn()
    _wait(works)
