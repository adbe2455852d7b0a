"""What every benchmark shares: the machine it ran on, timing, paired ratios, rank agreement, tables, JSON.

A figure is only readable beside the CPU it was measured on (machines differ: with or without native bf16),
and on a shared machine only as medians and paired ratios (each step of one side next to the same step of
the other, so load drifting between steps hits both alike).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def machine() -> str:
    """The CPU model, its core count and whether it has native bf16 (lscpu's fields, from /proc/cpuinfo)."""
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    bf16 = "native bf16 (" + ", ".join(sorted(flags & {"avx512_bf16", "amx_bf16"})) + ")" \
        if flags & {"avx512_bf16", "amx_bf16"} else "no native bf16 (AVX2 only)" if "avx2" in flags else "?"
    return f"{model}, {os.cpu_count()} cores, {bf16}"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def median_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median wall seconds of `fn` over `reps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the per-step ratios a[i] / b[i] (steps measured back to back)."""
    return statistics.median(x / y for x, y in zip(a, b))


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation: the Pearson correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b, exactly over every pair: (concordant - discordant) / sqrt((pairs - pairs tied in a) x
    (pairs - pairs tied in b)); a pair tied in both counts in neither sum."""
    n = len(a)
    concordant = discordant = tied_a = tied_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            da, db = a[i] - a[j], b[i] - b[j]
            tied_a += da == 0
            tied_b += db == 0
            concordant += da * db > 0
            discordant += da * db < 0
    pairs = n * (n - 1) // 2
    return (concordant - discordant) / ((pairs - tied_a) * (pairs - tied_b)) ** 0.5


def fastest(values: Sequence[float], k: int) -> set[int]:
    """Indices of the k smallest values: those fewer than k others are strictly smaller than (ties at the
    boundary all count, so the set can hold more than k)."""
    return {i for i, v in enumerate(values) if sum(u < v for u in values) < k}


def top_k_recall(measured: Sequence[float], predicted: Sequence[float], k: int = 3) -> float:
    """Of the k fastest measured items, the fraction that are among the k fastest predicted (`fastest`)."""
    best = fastest(measured, k)
    return len(best & fastest(predicted, k)) / len(best)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned, floats as given."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def write_json(path: str | None, figures: dict) -> None:
    """Write the figures to `path` (nothing when None), with the machine they were measured on."""
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine(), **figures}, f, indent=1, default=str)


# Multi-rank benchmarks: forked gloo ranks (parallel.forked.run_ranks), every variant living in every rank.

def global_sum(value: float) -> float:
    """`value` summed over all ranks, in float64 so the sum adds no rounding of its own to a parity check."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def timed_rounds(steps: dict[str, Callable[[], object]], warmup: int, rounds: int) -> tuple[dict, dict]:
    """Run every step once per round, `warmup` untimed rounds then `rounds` timed ones, the order rotated each
    round so that no variant always runs after the same one (caches, the allocator, a neighbour's load). Each
    step starts after a barrier and lasts as long as its slowest rank. Returns ({name: slowest-rank seconds per
    timed round}, {name: this rank's return values of the timed steps})."""
    names = list(steps)
    times, results = {n: [] for n in names}, {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            out = steps[n]()
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
                results[n].append(out)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: t[i].tolist() for i, n in enumerate(names)}, results


def _local_bytes(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)  # DTensor (FSDP2) -> this rank's shard
    return t.numel() * t.element_size()


def param_opt_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """This rank's bytes of parameters and of optimizer state (its shards only)."""
    params = sum(_local_bytes(p) for p in model.parameters())
    state = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return params, state


def fsdp2(model: torch.nn.Module, blocks, world: int) -> torch.nn.Module:
    """torch FSDP2 as its documentation applies it: fully_shard on every block, then on the root, over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)
