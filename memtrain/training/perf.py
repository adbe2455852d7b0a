"""What this machine's matmuls achieve: the peak that is MFU's denominator, and whether bf16 beats fp32.

Both probe with their own random generator: a probe run after a resumed run restored the global RNG state
must not change it.
"""

from __future__ import annotations

import functools
import time

import torch


@functools.cache
def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                      reps: int = 5) -> float:
    """Best-of-`reps` FLOP/s of an n x n x n matmul on this device (measured once per process)."""
    return 2 * n**3 / _best_matmul_seconds(device, dtype, n, reps)


@functools.cache
def bf16_faster(device: torch.device, n: int = 256, reps: int = 3) -> bool:
    """Whether an n x n x n matmul runs faster in bf16 than in fp32 here (by 10% at least: a tie keeps fp32's
    precision). On CUDA: whether the GPU supports bf16."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    bf16 = _best_matmul_seconds(device, torch.bfloat16, n, reps)
    return bf16 < 0.9 * _best_matmul_seconds(device, torch.float32, n, reps)


def _best_matmul_seconds(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    best = float("inf")
    for _ in range(reps + 1):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
