"""Tuned GEMM layouts (AxoNN, SC'24: "automated tuning of BLAS kernels"), one choice for every rank.

Every sharded Linear (and LMHead, which shares its autograd function) runs three local products:
    fwd   y  = x  @ W^T      dgrad  dx = dy @ W      wgrad  dW = dy^T @ x
With tuning on, the first product of each key - (device, dtype, which GEMM, m x k x n, each operand's memory
order) - is timed on its real operands in every layout of LAYOUTS, and the fastest is kept:
    given       a @ b as the layer hands them over (the untuned path: the same call, the same bits)
    flip_a      a copied into the other memory order: row-major -> column-major (a.t().contiguous().t()), a
                column-major view (dy^T) -> row-major; "made column-major" alone would repeat `given` there
    flip_b      the same for b (W^T in the forward is a column-major view already)
    transposed  C^T = b^T @ a^T, copied back to row-major (the collectives after the product need it contiguous)
The copies a layout makes are paid on every call, so they are inside its timing. Candidates are timed in
interleaved rounds and compared by their fastest round (interference only ever adds time; so do the page faults
of a fresh output buffer, which hit whichever layout the allocator serves one: on a CPU the median picked layouts
1.7x "faster" by allocator luck alone); a layout replaces `given` only when it is MARGIN faster.

Agreement: AxoNN times on each rank alone, so noisy timings can give ranks different kernels. Here rank 0 of the
layer's grid times and broadcasts its choice over the whole grid, with a checksum of its key less the device: every
rank runs the same kernel (a rank whose shapes differ raises rather than running another one; one with other CPU
threads or another device name takes rank 0's choice). Every rank reaches each GEMM at the same point of the same
step (the engine splits batches evenly), so each key costs one 16-byte broadcast per process; it is setup, not a
step's traffic, and stays out of comm.LEDGER (the planner's byte model is a step's). Rank 0 answers from the cache
file when it holds the key, else times and adds it to the file (atomic rewrite; last writer wins). Choices differ
between runs only by timing noise: a run that must repeat bit for bit, or resume bitwise, reads its choices from a
file (the trainer keeps one in the run directory).

Numerics (NUMERICS): `given` is bitwise the untuned path; the other layouts sum in another order for some shapes
(MKL fp32: small ones, oneDNN bf16: long reductions): within a few fp32 roundings, or one bf16 rounding.
Default (DEFAULT_ON, when enabled=None): off on CPUs, measured; off on CUDA until measured there.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import comm
from .grid import AXES, Grid

GEMMS = ("fwd", "dgrad", "wgrad")


def _flip(t: torch.Tensor) -> torch.Tensor:
    """`t` in the other memory order: row-major -> column-major, anything else -> row-major."""
    return t.t().contiguous().t() if t.is_contiguous() else t.contiguous()


LAYOUTS = {
    "given": lambda a, b: a @ b,
    "flip_a": lambda a, b: _flip(a) @ b,
    "flip_b": lambda a, b: a @ _flip(b),
    "transposed": lambda a, b: (b.t() @ a.t()).t().contiguous(),
}
MARGIN = 0.05
"""How much faster (fastest round) than `given` another layout must time to be chosen."""
ROUNDS = 5
"""Timed rounds per key (after one untimed round), every candidate once per round in a rotated order."""
NUMERICS = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}
"""Largest difference between two layouts' products, relative to the product's largest magnitude, by dtype; from
the CPU build here (MKL sgemm, oneDNN for bf16; the ladder's shapes from 1 to 8192 rows, K up to 4096, 1 and 2
threads), where no layout is bitwise for every shape. fp32: bitwise from 256 rows on; below, MKL's small-matrix
and matrix-vector kernels sum in another order per layout: up to 2.8e-6 measured (K = 4096, 2-8 rows), so 1e-5,
as the layer tests allow sums reordered over shards. bf16: bitwise unless the reduction is long (K >= 2048: the
LM head's input gradient, weight gradients over 2048 rows), where under 0.1% of the elements differ by one bf16
rounding of the fp32 sum (oneDNN orders a long reduction by layout): up to 3.7e-3 measured, 2^-7 being one
rounding at the largest magnitude. `given` is the untuned call itself: bitwise always. Unmeasured on CUDA."""
DEFAULT_ON = {"cpu": False, "cuda": False}
"""Whether tuning is on when tune_matmul(enabled=None), by device type (others: off).

cpu - off, measured (python -m experiments.bench.gemm_tuning on an AMD EPYC, Zen 4 with AVX-512 and AVX512-BF16,
MKL and oneDNN, 2 ranks of one thread on 2 shared cores): ladder-1m and ladder-10m training steps, data=2 or x=2
sharded, fp32 and bf16, ran 0.96x to 1.01x the untuned step time (paired medians of 15 rounds; a case where every
choice was `given` read 1.006x, the noise), while timing its 108 GEMMs cost ~11 s of CPU in the first step, 1 to 4
steps' worth per case. `given` won 103 of the 108: MKL and oneDNN pack both operands whatever their order, so an
explicit copy mostly adds its own cost; the one product another layout wins is the LM head's weight gradient
(vocab x tokens x hidden, `transposed`: 1.06-1.25x in fp32), too small a share of a step to show. Off also keeps
bf16 bitwise equal to the untuned path.
cuda - off, measured on one GPU twice: `memtrain train` of llama-3.2-1b in bf16 at batch 8 x 1024 on grid (1,1,1,1)
ran 0.204 s per step tuned and 0.205 s untuned on an NVIDIA H100 (2026-11-24), 0.162 s both on an NVIDIA H200
(2026-11-28; torch 2.11.0+cu130; medians after the first step, one run each): no gain at one GPU's full-width
shapes. cuBLAS runs another kernel per transpose flag, where AxoNN measured its gains on the smaller shapes of
sharded grids: unmeasured here (one GPU was lent), so `parallel.tune_matmul = true` stays worth trying on multi-GPU
grids; timing adds milliseconds to the first step, and the trainer keeps the choices in the run directory, so a
resume stays bitwise."""


@dataclass
class _State:
    enabled: bool | None = None
    layouts: tuple[str, ...] = tuple(LAYOUTS)
    cache_file: Path | None = None
    cached: dict[str, dict] = field(default_factory=dict)  # the file's entries and this process's timings
    agreed: dict[str, str] = field(default_factory=dict)  # key -> layout broadcast by rank 0: equal on every rank


_S = _State()


def tune_matmul(enabled: bool | None = None, cache_file: str | os.PathLike | None = None,
                layouts: tuple[str, ...] | None = None) -> None:
    """Configure tuned GEMM layouts for every sharded Linear of this process; call it on every rank alike.

    enabled: True, False, or None for the device type's default (DEFAULT_ON).
    cache_file: a JSON file of timed choices, read now and extended with every new one (rank 0 writes it); a
    second run on the same machine reads its choices instead of timing. None: choices live in this process only.
    layouts: the candidates (names of LAYOUTS; default all); one alone forces it, untimed and never written to the
    file (the tests compare every layout with the untuned path so).
    The choices agreed so far are kept while layouts and cache_file stay the same (switching tuning off and on
    costs nothing); a change forgets them, so every rank starts again from the same empty table and none skips a
    broadcast another one waits in.
    """
    layouts = tuple(LAYOUTS) if layouts is None else tuple(layouts)
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or not layouts:
        named = f"unknown GEMM layout {unknown[0]!r}" if unknown else "no GEMM layout"
        raise ValueError(f"parallel.tune_matmul: {named}: use some of {', '.join(LAYOUTS)}")
    path = Path(cache_file) if cache_file is not None else None
    if (layouts, path) != (_S.layouts, _S.cache_file):
        cached = _read(path) if path is not None else {}
        _S.layouts, _S.cache_file, _S.cached, _S.agreed = layouts, path, cached, {}
    _S.enabled = enabled


def choices() -> dict[str, str]:
    """The layout agreed for every key met so far in this process (equal on every rank)."""
    return dict(_S.agreed)


def timings() -> dict[str, dict[str, float]]:
    """Seconds (fastest round) of each candidate per key met so far, as this rank timed them or read them from the
    cache file: on rank 0, every key timed (forced layouts are not)."""
    return {k: v.get("seconds", {}) for k, v in _S.cached.items() if k in _S.agreed}


def _read(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not all(isinstance(v, dict) and v.get("layout") in LAYOUTS for v in data.values()):
            raise ValueError("an entry names no known layout")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"parallel.tune_matmul cache {str(path)!r} is unreadable ({e}): delete it to tune "
                         f"again") from None
    return data


def _write(path: Path, entries: dict[str, dict]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, path)


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


@functools.cache
def _accelerator_name(device: torch.device) -> str:
    return f"{device.type} {getattr(torch, device.type).get_device_name(device)}"


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":  # the thread count changes which kernel is fastest
        return f"cpu {_cpu_name()} x{torch.get_num_threads()}"
    return _accelerator_name(device)


def _order(t: torch.Tensor) -> str:
    return "r" if t.is_contiguous() else "c" if t.t().is_contiguous() else "s"


def _problem(a: torch.Tensor, b: torch.Tensor, gemm: str) -> str:
    """What every rank of a grid must multiply alike: dtype, GEMM, shape and operand orders. The key adds the
    device (and CPU threads), which may differ between ranks: rank 0's choice holds for the grid all the same."""
    (m, k), n = a.shape, b.shape[1]
    return f"{str(a.dtype).removeprefix('torch.')}|{gemm}|{m}x{k}x{n}|{_order(a)}{_order(b)}"


def _clock(device: torch.device):
    """A timer for products on `device`: wall time after synchronizing on an accelerator; on a CPU the process's
    CPU time, which ranks and other jobs sharing the cores do not inflate (wall time there measures the scheduler:
    on 2 cores at load 5-7, two timings of the same 72 GEMMs agreed on 64 choices by wall time, on 70 by CPU time)."""
    if device.type == "cpu":
        return time.process_time
    sync = getattr(torch, device.type).synchronize

    def clock() -> float:
        sync(device)
        return time.perf_counter()

    return clock


def _time_layouts(a: torch.Tensor, b: torch.Tensor, names: tuple[str, ...]) -> dict[str, float]:
    """Seconds of each layout's fastest round of ROUNDS interleaved ones (after an untimed round)."""
    clock = _clock(a.device)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(ROUNDS + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = clock()
            LAYOUTS[name](a, b)
            if r:
                seconds[name].append(clock() - t0)
    return {n: min(s) for n, s in seconds.items()}


def _decide(a: torch.Tensor, b: torch.Tensor, key: str) -> str:
    """Rank 0's choice for `key`: from the file, by a single candidate, or timed (then added to the file)."""
    names = _S.layouts
    if len(names) == 1:
        return names[0]
    entry = _S.cached.get(key)
    if entry is not None and entry["layout"] in names:
        return entry["layout"]
    seconds = _time_layouts(a, b, names)
    best = min(seconds, key=seconds.get)
    if "given" in seconds and seconds[best] > (1 - MARGIN) * seconds["given"]:
        best = "given"
    _S.cached[key] = {"layout": best, "seconds": seconds}
    if _S.cache_file is not None:
        _write(_S.cache_file, _S.cached)
    return best


def _agree(a: torch.Tensor, b: torch.Tensor, key: str, problem: str, grid: Grid) -> str:
    """The layout for `key`, decided by rank 0 of `grid` and broadcast over it with a checksum of `problem` (one
    collective per key)."""
    names = tuple(LAYOUTS)
    checksum = zlib.crc32(problem.encode())
    msg = torch.tensor([names.index(_decide(a, b, key)) if grid.coord(AXES) == 0 else -1, checksum],
                       dtype=torch.int64, device=a.device)
    was, comm.LEDGER.enabled = comm.LEDGER.enabled, False  # setup, not a step's traffic (module docstring)
    try:
        comm.broadcast(msg, grid, AXES)
    finally:
        comm.LEDGER.enabled = was
    choice, theirs = (int(v) for v in msg.tolist())
    if theirs != checksum:
        raise RuntimeError(f"parallel.tune_matmul: rank {grid.rank} multiplies {problem} while rank 0 of its grid "
                           f"multiplies another shape: every rank must run the same shapes (an even batch split), "
                           f"or turn tuning off")
    _S.agreed[key] = names[choice]
    return names[choice]


def active(device: torch.device) -> bool:
    """Whether products on `device` are tuned now (tune_matmul's setting, else DEFAULT_ON); never on meta, the
    planner's dry run, where there is nothing to time."""
    on = _S.enabled if _S.enabled is not None else DEFAULT_ON.get(device.type, False)
    return on and device.type != "meta"


def matmul(a: torch.Tensor, b: torch.Tensor, gemm: str, grid: Grid) -> torch.Tensor:
    """a @ b in the layout agreed for it (a contiguous result either way): the local GEMM of a sharded Linear."""
    if not active(a.device):
        return a @ b
    problem = _problem(a, b, gemm)
    key = f"{_device_name(a.device)}|{problem}"
    name = _S.agreed.get(key) or _agree(a, b, key, problem, grid)
    return LAYOUTS[name](a, b)
