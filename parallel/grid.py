"""The 4D process grid: data x X x Y x Z, validated once, groups built once.

Rank layout (as in AxoNN): X varies fastest, then Y, then Z, then data, so the tensor-parallel axes
sit on neighbouring ranks (inside a node) and data parallelism spans nodes:

    rank = x + X * (y + Y * (z + Z * data))

Every collective in the engine names the axes it runs over ("x", "z", ("z", "data"), ...); the grid
maps each combination of axes to one process group containing this rank.
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import peers

AXES = ("x", "y", "z", "data")
KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl", "fake")


def _canonical(axes) -> tuple[str, ...]:
    if isinstance(axes, str):
        axes = (axes,)
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"unknown grid axis {unknown[0]!r}: use one of {', '.join(AXES)}")
    return tuple(a for a in AXES if a in axes)


@dataclass(frozen=True)
class Grid:
    """Degrees of the four parallel axes and this process's place in them."""

    data: int
    x: int
    y: int
    z: int
    rank: int = 0
    _groups: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"parallel.{axis}={getattr(self, axis)} is invalid: degrees must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a grid of {self.world_size} ranks")

    @property
    def world_size(self) -> int:
        return self.data * self.x * self.y * self.z

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live: its CUDA device when the process group runs NCCL (parallel.init set it
        from LOCAL_RANK), else the CPU, also on a machine with a GPU: under gloo (forked CPU ranks cannot touch
        CUDA) and for a grid made by hand without a process group (tests, simulation)."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def tensor_parallel_size(self) -> int:
        return self.x * self.y * self.z

    def size(self, axes) -> int:
        n = 1
        for a in _canonical(axes):
            n *= getattr(self, a)
        return n

    def coords_of(self, rank: int) -> dict[str, int]:
        out = {}
        for a in AXES:
            out[a] = rank % getattr(self, a)
            rank //= getattr(self, a)
        return out

    @property
    def coords(self) -> dict[str, int]:
        return self.coords_of(self.rank)

    def coord(self, axes) -> int:
        """This rank's index inside the group over `axes` (first axis fastest)."""
        idx, stride, c = 0, 1, self.coords
        for a in _canonical(axes):
            idx += c[a] * stride
            stride *= getattr(self, a)
        return idx

    def rank_of(self, coords: dict[str, int]) -> int:
        r, stride = 0, 1
        for a in AXES:
            r += coords[a] * stride
            stride *= getattr(self, a)
        return r

    def group_ranks(self, axes, rank: int | None = None) -> list[int]:
        """Global ranks sharing `rank`'s coordinates on every axis not in `axes`, in group order."""
        axes = _canonical(axes)
        base = self.coords_of(self.rank if rank is None else rank)
        ranges = [range(getattr(self, a)) for a in axes]
        ranks = []
        for combo in itertools.product(*ranges):
            c = dict(base, **dict(zip(axes, combo)))
            ranks.append(self.rank_of(c))
        return sorted(ranks)

    def group(self, axes):
        """The process group over `axes` containing this rank, or None when it has one member."""
        key = tuple(a for a in _canonical(axes) if getattr(self, a) > 1)
        if not key:
            return None
        if key not in self._groups:
            raise RuntimeError(f"process group for axes {key} was not built: call parallel.init() first")
        return self._groups[key]

    def label(self, axes) -> str:
        return "+".join(a for a in _canonical(axes) if getattr(self, a) > 1) or "none"

    def release_groups(self) -> None:
        """Forget the process groups (before destroy_process_group, or to build another layout)."""
        self._groups.clear()

    def build_groups(self) -> None:
        """Create one group per non-trivial combination of axes (15 at most), members only."""
        live = [a for a in AXES if getattr(self, a) > 1]
        seen: dict[tuple[int, ...], object] = {}
        for n in range(1, len(live) + 1):
            for key in itertools.combinations(live, n):
                ranks = tuple(self.group_ranks(key))
                if len(ranks) == dist.get_world_size():
                    seen.setdefault(ranks, dist.group.WORLD)
                elif ranks not in seen:
                    seen[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
                self._groups[key] = seen[ranks]


_GRID: Grid | None = None


def current() -> Grid:
    if _GRID is None:
        raise RuntimeError("no parallel grid: call parallel.init(...) first")
    return _GRID


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


_SLURM_HOSTS = re.compile(r"(?:[^\[\],]+|\[[^\[\]]+\])+")  # text and [ranges], up to a comma outside brackets


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-006,9],login1' -> 'gpu003', 'node[01-02]-ib' -> 'node01-ib'."""
    m = _SLURM_HOSTS.match(nodelist)
    if not m or nodelist[m.end():m.end() + 1] not in ("", ","):
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}: set MASTER_ADDR explicitly")
    return re.sub(r"\[([^\]]+)\]", lambda r: re.split("[,-]", r.group(1))[0], m.group())


def _launch_env() -> tuple[int, int] | None:
    """(rank, world_size) from torchrun or SLURM variables; None for a plain single process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        if "MASTER_ADDR" not in os.environ:  # not setdefault: it would parse the list even when the address is set
            os.environ["MASTER_ADDR"] = first_slurm_host(os.environ.get("SLURM_JOB_NODELIST", ""))
        os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        return rank, world
    return None


def launch_world_size() -> int:
    """Processes the launcher (torchrun, srun) started this one among; 1 for a plain process."""
    env = _launch_env()
    return env[1] if env else 1


def resolve_degrees(world_size: int, data: int, x: int, y: int, z: int) -> tuple[int, int, int, int]:
    """Validate degrees against the world size, inferring at most one given as -1."""
    degrees = {"data": data, "x": x, "y": y, "z": z}
    inferred = [a for a, d in degrees.items() if d == -1]
    if len(inferred) > 1:
        raise ValueError(f"parallel.{inferred[1]}=-1: only one degree may be -1 (inferred)")
    for a, d in degrees.items():
        if d != -1 and (not isinstance(d, int) or d < 1):
            raise ValueError(f"parallel.{a}={d!r} is invalid: degrees are integers >= 1 (or -1 to infer)")
    known = 1
    for d in degrees.values():
        known *= d if d != -1 else 1
    if inferred:
        if world_size % known:
            raise ValueError(
                f"cannot infer parallel.{inferred[0]}: world size {world_size} is not divisible by "
                f"the other degrees' product {known}"
            )
        degrees[inferred[0]] = world_size // known
    elif known != world_size:
        shown = " ".join(f"{a}={d}" for a, d in degrees.items())
        raise ValueError(
            f"grid {shown} has {known} ranks but the world size is {world_size}: choose degrees whose "
            f"product is {world_size}, or set one of them to -1 to infer it"
        )
    return degrees["data"], degrees["x"], degrees["y"], degrees["z"]


def init(data: int = -1, x: int = 1, y: int = 1, z: int = 1, *, backend: str | None = None,
         timeout_s: float = 600.0) -> Grid:
    """Start torch.distributed if needed and build the grid (data defaults to the remaining ranks).

    Works as a plain single process, under torchrun (RANK/WORLD_SIZE/MASTER_*), and under SLURM srun
    (SLURM_PROCID/SLURM_NTASKS/SLURM_JOB_NODELIST). Everything is validated before any collective.
    """
    global _GRID
    if backend is not None and backend not in KNOWN_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(KNOWN_BACKENDS[:-1])}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend='nccl' needs CUDA GPUs and none is visible: use 'gloo', or leave it "
                         "unset to choose by the hardware")
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        degrees = resolve_degrees(world, data, x, y, z)
    else:
        env = _launch_env()
        rank, world = env if env else (0, 1)
        degrees = resolve_degrees(world, data, x, y, z)
        backend = backend or default_backend()
        if backend == "nccl":
            local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
            if local >= gpus:
                raise ValueError(f"LOCAL_RANK={local} under NCCL, but this node shows {gpus} GPU(s): start one "
                                 "process per GPU (torchrun --nproc-per-node, srun --ntasks-per-node), or set "
                                 "parallel.backend='gloo' for CPU ranks")
            torch.cuda.set_device(local)
        timeout = datetime.timedelta(seconds=timeout_s)
        if env:  # the rendezvous init_method="env://" does, keeping its store for peers.lost
            store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timeout))
            store.set_timeout(timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
            peers.register(store, rank)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    grid = Grid(*degrees, rank=rank)
    grid.build_groups()
    _GRID = grid
    return grid


def shutdown() -> None:
    global _GRID
    if _GRID is not None:
        # Layers keep the grid; a process group still referenced after destroy_process_group is freed at
        # interpreter exit, where gloo aborts ("terminate called without an active exception") at random.
        _GRID.release_groups()
    _GRID = None
    peers.forget()
    if dist.is_initialized():
        dist.destroy_process_group()
