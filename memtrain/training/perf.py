"""MFU's numerator and denominator, and whether bf16 beats fp32 here.

The numerator is the planner's (`Shape.flops_per_token`): 6 x the parameters that multiply + attention's products,
so a run's MFU and `memtrain plan`'s predicted one compare.

On a CUDA GPU the denominator is its dense bf16 tensor-core peak from NVIDIA's datasheet (`BF16_DATASHEET`),
whatever precision the run uses: MFU then says how far a run is from what the GPU can do, and an fp32 run shows
what it leaves. A GPU the table does not know, and every CPU, get a matmul measured on it instead
(`matmul_peak_flops`, in the run's dtype). `mfu_peak` says which one it took.

The measurements probe with their own random generator: a probe run after a resumed run restored the global
RNG state must not change it.
"""

from __future__ import annotations

import functools
import re
import time
from typing import NamedTuple

import torch

from memtrain.hf.architectures import architecture_of

# Dense bf16 tensor-core peaks, TFLOP/s. NVIDIA's datasheets print the figure with sparsity (marked *), twice
# these. Matched in order against torch.cuda.get_device_name: the H100 SXM reports "NVIDIA H100 80GB HBM3", the
# PCIe card "NVIDIA H100 PCIe" (HBM2e memory). Left out on purpose: H100/H200 NVL, GH200 and every other GPU
# (measured instead rather than guessed).
BF16_DATASHEET: tuple[tuple[str, float, str], ...] = (
    (r"\bH100\b(?!.*NVL).*(HBM3|SXM)", 989.0, "H100 SXM"),  # NVIDIA H100 Tensor Core GPU datasheet: 1,979* (SXM)
    (r"\bH100\b(?!.*NVL).*(PCIe|HBM2e)", 756.0, "H100 PCIe"),  # NVIDIA H100 Tensor Core GPU datasheet: 1,513* (PCIe)
    (r"^(NVIDIA )?H200(?!.*NVL)", 989.0, "H200 SXM"),  # NVIDIA H200 Tensor Core GPU datasheet: 1,979* (SXM)
    (r"\bA100\b", 312.0, "A100"),  # NVIDIA A100 Tensor Core GPU datasheet: 312 / 624* (SXM and PCIe alike)
    (r"\bL4\b", 121.0, "L4"),  # NVIDIA L4 Tensor Core GPU datasheet: 242*
)


def flops_per_token(config, num_params: int, seq: int) -> float:
    """Training FLOPs per token of a transformers model at sequence length `seq` (`Shape.flops_per_token`). An
    architecture the planner does not model counts every parameter but an untied input embedding's as multiplying,
    and attention as hidden_size-wide."""
    arch = architecture_of(config)
    if arch.sharded:
        return arch.shape(config).flops_per_token(seq)
    lookup = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * config.hidden_size
    return 6.0 * (num_params - lookup) + 12.0 * config.num_hidden_layers * config.hidden_size * seq


class Peak(NamedTuple):
    """FLOP/s that MFU divides by, and where the figure comes from (for run.json and benchmark tables)."""

    flops: float
    source: str


def datasheet_peak(device_name: str) -> Peak | None:
    """The dense bf16 datasheet peak of a GPU named as torch.cuda.get_device_name names it; None if unknown."""
    for pattern, tflops, label in BF16_DATASHEET:
        if re.search(pattern, device_name, re.IGNORECASE):
            return Peak(tflops * 1e12, f"{label} dense bf16 datasheet peak ({device_name})")
    return None


def mfu_peak(device: torch.device, dtype: torch.dtype = torch.float32) -> Peak:
    """MFU's denominator on `device` for a run computing its matmuls in `dtype` (module docstring)."""
    if device.type == "cuda":
        known = datasheet_peak(torch.cuda.get_device_name(device))
        if known is not None:
            return known
        # n = 1024 is launch-bound on a large GPU (reads far below its peak); 8192 keeps the tensor cores busy
        n, where = 8192, torch.cuda.get_device_name(device)
    else:
        n, where = 1024, "this CPU"
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    return Peak(matmul_peak_flops(device, dtype, n), f"measured {name} {n}^3 matmul on {where}")


@functools.cache
def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                      reps: int = 5) -> float:
    """Best-of-`reps` FLOP/s of an n x n x n matmul on this device (measured once per process)."""
    return 2 * n**3 / _best_matmul_seconds(device, (dtype,), n, reps)[dtype]


@functools.cache
def bf16_faster(device: torch.device, n: int = 256, reps: int = 10) -> bool:
    """Whether an n x n x n matmul runs faster in bf16 than in fp32 here (by 10% at least: a tie keeps fp32's
    precision). On CUDA: whether the GPU supports bf16.

    The answer decides a run's dtype, so it must not depend on the load of the moment (two identical runs on a
    busy machine chose differently, twice in the test suite):
    - it compares the kernels on one thread: with two, under load, a call waits until both threads are scheduled,
      which swung the bf16/fp32 ratio from 0.52 to 0.65 here (AMD EPYC with AVX512-BF16, 2 cores, 6 busy
      processes), where one thread measured 0.51-0.53;
    - the two dtypes' calls alternate and each keeps its best of `reps`: a burst of other processes' work slows
      both alike, and one unhurried call of each suffices."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = _best_matmul_seconds(device, (torch.bfloat16, torch.float32), n, reps)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] < 0.9 * best[torch.float32]


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The probes' timed call, a function of its own so that a test can time it on a fake clock."""
    return a @ b


def _best_matmul_seconds(device: torch.device, dtypes: tuple[torch.dtype, ...], n: int, reps: int) -> dict:
    """Best-of-`reps` seconds of an n x n x n matmul in each of `dtypes`, their calls interleaved."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    operands = {dtype: (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)) for dtype in dtypes}
    best = dict.fromkeys(dtypes, float("inf"))
    for rep in range(reps + 1):  # the first round warms up
        for dtype, (x, y) in operands.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            _matmul(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep:
                best[dtype] = min(best[dtype], time.perf_counter() - t0)
    return best
