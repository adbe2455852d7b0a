"""Every collective the engine issues goes through here, so it is counted once in the ledger.

The ledger records (operation, axes, group size, payload bytes) per call. Payload is the size of the
full message M: the input of an all-reduce or reduce-scatter, the output of an all-gather, the input
of an all-to-all. `moved_bytes` applies the ring model the planner uses (all-reduce 2(p-1)/p*M,
all-gather and reduce-scatter (p-1)/p*M, all-to-all (p-1)/p*M) for the bytes one rank sends.
Groups of one member cost nothing and are not recorded.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .grid import Grid

# torch 2.13 deprecates the *_tensor spellings; fall back for older releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# torch.compile cannot trace collectives that autograd Functions run in place: code that issues them runs eagerly
# inside a compiled model, a graph break on either side. torch.compiler.disable imports torch._dynamo when it
# decorates, 1.3 s of `memtrain config`'s 4.4 s start; torch's own lazy form (its optimizers use it) imports it at
# the first call, so a process that compiles nothing and builds no optimizer (plan, config, eval, a bad-input exit)
# never does. The public decorator where a torch lacks the lazy one.
eager_under_compile = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


@dataclass(frozen=True)
class Record:
    op: str
    axes: str
    group_size: int
    nbytes: int

    @property
    def moved_bytes(self) -> float:
        p = self.group_size
        factor = 2 * (p - 1) / p if self.op == "all_reduce" else (p - 1) / p
        return factor * self.nbytes


class Ledger:
    """Append-only record of collectives; `reset()` between steps to read per-step figures."""

    def __init__(self):
        self.records: list[Record] = []
        self.enabled = True
        self.timed = False
        self.blocked: list[float | None] = []
        """With `timed` on, one entry per record: the host seconds its call took when blocking (on gloo the whole
        collective, its members' waiting for one another included; on NCCL only its launch), None when async (its
        cost is in a wait elsewhere)."""

    def add(self, op: str, grid: Grid, axes, nbytes: int) -> None:
        if self.enabled:
            self.records.append(Record(op, grid.label(axes), grid.size(axes), int(nbytes)))

    def call(self, fn, *args, async_op: bool = False, **kwargs):
        """Issue the collective just recorded; with `timed` on, note how long the call held this process."""
        if not (self.timed and self.enabled):
            return fn(*args, async_op=async_op, **kwargs)
        start = time.perf_counter()
        work = fn(*args, async_op=async_op, **kwargs)
        self.blocked.append(None if async_op else time.perf_counter() - start)
        return work

    def reset(self) -> None:
        self.records.clear()
        self.blocked.clear()

    def totals(self) -> dict[tuple[str, str], int]:
        """Payload bytes per (operation, axes)."""
        return totals(self.records)

    def moved_by_axes(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for r in self.records:
            out[r.axes] += r.moved_bytes
        return dict(out)


LEDGER = Ledger()


def totals(records) -> dict[tuple[str, str], int]:
    """Payload bytes per (operation, axes) of records: a list of them, or a mapping {record: times issued}."""
    pairs = records.items() if isinstance(records, Mapping) else ((r, 1) for r in records)
    out: dict[tuple[str, str], int] = defaultdict(int)
    for r, n in pairs:
        out[(r.op, r.axes)] += r.nbytes * n
    return dict(out)


class _Done:
    """Stand-in work handle for collectives that completed synchronously (or were no-ops)."""

    def wait(self):
        return True


def all_reduce(t: torch.Tensor, grid: Grid, axes, async_op: bool = False, op=dist.ReduceOp.SUM):
    """In-place all-reduce of `t` over `axes`; returns a work handle when async_op."""
    group = grid.group(axes)
    if group is None:
        return _Done() if async_op else None
    LEDGER.add("all_reduce", grid, axes, t.numel() * t.element_size())
    work = LEDGER.call(dist.all_reduce, t, op=op, group=group, async_op=async_op)
    return work if async_op else None


def all_gather(t: torch.Tensor, grid: Grid, axes, async_op: bool = False):
    """Concatenate every member's `t` along dim 0 (group order). Returns out, or (out, work)."""
    group = grid.group(axes)
    if group is None:
        return (t, _Done()) if async_op else t
    p = grid.size(axes)
    out = torch.empty((p * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    LEDGER.add("all_gather", grid, axes, out.numel() * out.element_size())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        work = LEDGER.call(_all_gather, out, t.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter(t: torch.Tensor, grid: Grid, axes, async_op: bool = False):
    """Sum over members, each keeping its 1/p chunk of dim 0. Returns out, or (out, work)."""
    group = grid.group(axes)
    if group is None:
        return (t, _Done()) if async_op else t
    p = grid.size(axes)
    if t.shape[0] % p:
        raise ValueError(f"reduce_scatter over {axes}: dim 0 ({t.shape[0]}) is not divisible by {p}")
    out = torch.empty((t.shape[0] // p, *t.shape[1:]), dtype=t.dtype, device=t.device)
    LEDGER.add("reduce_scatter", grid, axes, t.numel() * t.element_size())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        work = LEDGER.call(_reduce_scatter, out, t.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def all_to_all(t: torch.Tensor, grid: Grid, axes) -> torch.Tensor:
    """Chunk i of dim 0 goes to member i; chunk j of the result came from member j."""
    group = grid.group(axes)
    if group is None:
        return t
    out = torch.empty_like(t)
    LEDGER.add("all_to_all", grid, axes, t.numel() * t.element_size())
    LEDGER.call(dist.all_to_all_single, out, t.contiguous(), group=group)
    return out


def broadcast(t: torch.Tensor, grid: Grid, axes, src_index: int = 0) -> torch.Tensor:
    """Broadcast from the member at index `src_index` of the group over `axes` (in place)."""
    group = grid.group(axes)
    if group is None:
        return t
    LEDGER.add("broadcast", grid, axes, t.numel() * t.element_size())
    LEDGER.call(dist.broadcast, t, group_src=src_index, group=group)
    return t
