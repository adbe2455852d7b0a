"""The machine's measured matmul peak, the denominator of MFU."""

from __future__ import annotations

import functools
import time

import torch


@functools.cache
def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                      reps: int = 5) -> float:
    """Best-of-`reps` FLOP/s of an n x n x n matmul on this device (measured once per process)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
