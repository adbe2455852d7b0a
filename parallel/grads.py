"""Gradient synchronization and clipping driven by each parameter's ShardSpec.

After backward, a sharded weight's gradient is already summed over Z (its reduce-scatter) and needs
only the data axis; other parameters need every axis over which their rows of data differ. Grads are
summed, not averaged: the loss is normalized by the global number of supervised tokens, so the sum
is the gradient of the global mean.

`sync_gradients` is the blocking path: every all-reduce after backward. bucketed.py's `grad_sync` gives the
same sums from all-reduces started during backward, as gradients become final.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import comm
from .grid import Grid
from .sharding import spec_of, unique_parameters

_SYNC_ENABLED = True

# One persistent flat buffer per bucket, keyed by the bucket's first parameter: a fresh torch.cat of a
# large bucket is a fresh allocation (mmap'ed, page-faulted and zeroed by the kernel every step), which
# costs ~10x the copy itself on CPU.
_FLAT_BUFFERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _flat_buffer(params: list, grads: list[torch.Tensor]) -> torch.Tensor:
    sig = (tuple(id(p) for p in params), tuple(g.numel() for g in grads), grads[0].dtype, grads[0].device)
    hit = _FLAT_BUFFERS.get(params[0])
    if hit is None or hit[0] != sig:
        hit = (sig, torch.empty(sum(sig[1]), dtype=grads[0].dtype, device=grads[0].device))
        _FLAT_BUFFERS[params[0]] = hit
    return hit[1]


def sync_enabled() -> bool:
    """False inside `no_sync()`."""
    return _SYNC_ENABLED


@contextmanager
def no_sync():
    """Skip `sync_gradients` inside (micro-batches of gradient accumulation); sync once after. An armed
    `grad_sync` launches nothing from a backward inside: only the step's last backward, outside, launches."""
    global _SYNC_ENABLED
    prev, _SYNC_ENABLED = _SYNC_ENABLED, False
    try:
        yield
    finally:
        _SYNC_ENABLED = prev


@torch.no_grad()
def sync_gradients(model_or_params, grid: Grid) -> None:
    """All-reduce (sum) gradients, one flat bucket per distinct set of reduce axes and dtype."""
    if not _SYNC_ENABLED:
        return
    buckets: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
    for p in unique_parameters(model_or_params):
        if p.grad is None:
            continue
        axes = tuple(a for a in spec_of(p).reduce_axes if grid.size(a) > 1)
        if axes:
            buckets[(axes, p.grad.dtype)].append(p)
    for (axes, _), params in buckets.items():
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads], out=_flat_buffer(params, grads))
        comm.all_reduce(flat, grid, axes)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _squared_norms(grads: list[torch.Tensor], dev: torch.device, multi_tensor: bool) -> torch.Tensor:
    """Each gradient's sum of squares, stacked on `dev` (empty for no gradients).

    grad_norm asks for multi_tensor off a CPU. On a CPU: one fp32 (or wider) cascade sum per tensor, within 1e-8
    of squaring in float64, 6x faster, and the arithmetic of every CPU result so far. Else torch's multi-tensor norm,
    as its own clip_grad_norm_ takes: the two kernels per tensor of the other way (a squared copy, then its sum)
    cost an H200 3-4 ms of a 160 ms llama-3.2-1b step and ~500 launches (2026-11-28). Each tensor's norm is then
    taken in fp32 and squared in float64: within a few fp32 ulps of float64's (tests/parallel/test_grads.py)."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=dev)
    if not multi_tensor:
        return torch.stack([(g if g.dtype in (torch.float32, torch.float64) else g.float()).square().sum().to(dev)
                            for g in grads])
    squares = []
    for (_, dtype), group in _grouped(grads).items():  # bf16 and fp16 accumulate in fp32, float64 in itself
        norms = torch._foreach_norm(group, 2.0, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        squares.append(torch.stack(norms).to(dev, torch.float64).square())  # one cast per group, not per tensor
    return torch.cat(squares)


def _grouped(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """torch's multi-tensor kernels take one device and dtype per call (a mixed list goes tensor by tensor)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.device, t.dtype].append(t)
    return groups


@torch.no_grad()
def grad_norm(model_or_params, grid: Grid) -> torch.Tensor:
    """The global L2 norm of all gradients, as if the model were whole on one process.

    Each parameter counts once: only the rank at coordinate 0 of every axis that replicates it adds
    its squared norm, then one all-reduce over the world sums the distinct shards.
    """
    coords = grid.coords
    params = [p for p in unique_parameters(model_or_params) if p.grad is not None]
    dev = params[0].grad.device if params else torch.device("cpu")
    counted = [p.grad for p in params
               if all(coords[a] == 0 for a in ("x", "y", "z", "data") if a not in spec_of(p).shard_axes)]
    squares = _squared_norms(counted, dev, multi_tensor=dev.type != "cpu")
    total = squares.double().sum()
    comm.all_reduce(total, grid, ("x", "y", "z", "data"))
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(model_or_params, max_norm: float, grid: Grid) -> torch.Tensor:
    """Scale gradients so their global norm is at most max_norm; returns the norm before clipping.

    As torch's clip_grad_norm_, the coefficient stays on the device and every gradient is multiplied by it, by
    exactly 1.0 when nothing is clipped: no host round trip (on a GPU the host goes on launching the optimizer while
    backward still runs) and one multi-tensor call per device and dtype. A NaN norm clips nothing; an infinite one
    zeroes the gradients."""
    params = unique_parameters(model_or_params)
    norm = grad_norm(params, grid)
    grads = [p.grad for p in params if p.grad is not None]
    coef = max_norm / (norm + 1e-6)
    scale = torch.where(coef < 1.0, coef, 1.0)
    for (device, dtype), group in _grouped(grads).items():
        # fp32 gradients get an fp32 factor: the same fp32 product a float64 one gave, but down torch's
        # multi-tensor path, where a float64 factor sends each tensor to a kernel of its own
        torch._foreach_mul_(group, (scale.float() if dtype == torch.float32 else scale).to(device))
    return norm.float()
