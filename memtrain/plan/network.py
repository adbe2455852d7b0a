"""The machine as the planner sees it: node size, device memory, and what each collective achieves.

Presets live in machines.toml beside this file (with their sources); `memtrain plan --measure` writes a
measured table (latency and bus bandwidth of every collective per group size) that `--bandwidth` reads.
A collective costs latency + ring-moved bytes (`parallel.comm.Record.moved_bytes`) / bandwidth, at the
bandwidth of where its group sits: inside one node or across nodes (ranks are laid out X fastest, then Y,
Z, data).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from memtrain.config import load_toml
from memtrain.files import write_atomic
from parallel import AXES, Grid
from parallel.comm import Record

MACHINES = Path(__file__).with_name("machines.toml")
DEFAULT_MACHINE = "dgx-a100"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
GB = 1e9


@dataclass
class Network:
    """The machine as the planner sees it: node size, device memory, and what a ring collective achieves."""

    name: str = DEFAULT_MACHINE
    gpus_per_node: int = 8
    """Ranks per node. Groups whose ranks all sit in one node use the intra-node figures."""
    gpu_memory_gb: float = 80.0
    intra_node_gbps: float = 300.0
    """Ring bandwidth inside a node, GB/s per GPU per direction (used when no measured entry applies)."""
    inter_node_gbps: float = 25.0
    """Ring bandwidth across nodes, GB/s per GPU (the node's network injection bandwidth per GPU)."""
    collectives: dict = field(default_factory=dict)
    """Measured: op -> "intra"/"inter" -> {group size: [GB/s, latency us]}, from `memtrain plan --measure`."""
    source: str = ""

    def seconds(self, record: Record, inside_node: bool) -> float:
        """Time of one collective: latency + ring-moved bytes / bandwidth, from the nearest measured group size."""
        table = self.collectives.get(record.op) or self.collectives.get("all_gather", {})
        sizes = table.get("intra" if inside_node else "inter") or {}
        if sizes:
            q = min(sizes, key=lambda s: abs(math.log(int(s) / record.group_size)))
            gbps, latency_us = sizes[q]
        else:
            gbps, latency_us = (self.intra_node_gbps if inside_node else self.inter_node_gbps), 0.0
        return latency_us * 1e-6 + record.moved_bytes / (gbps * GB)


def machines() -> dict[str, dict]:
    return load_toml(MACHINES, "machine presets")


def load_network(machine: str | None = None, bandwidth: str | None = None, gpus_per_node: int | None = None,
                 gpu_memory_gb: float | None = None) -> Network:
    """A preset of machines.toml, then a bandwidth file (JSON from --measure, or TOML with the same keys) over it,
    then explicit values over both."""
    known = machines()
    name = machine or DEFAULT_MACHINE
    if name not in known:
        raise ValueError(f"unknown machine {name!r}: use one of {', '.join(known)}, or --bandwidth FILE")
    values = dict(known[name], name=name)
    if bandwidth:
        path = Path(bandwidth)
        if not path.is_file():
            raise FileNotFoundError(f"bandwidth table {str(path)!r} does not exist: write one with "
                                    "`torchrun ... -m memtrain plan --measure --out FILE`")
        text = path.read_text()
        loaded = json.loads(text) if path.suffix == ".json" or text.lstrip().startswith("{") \
            else load_toml(path, "bandwidth table")
        allowed = {f.name for f in fields(Network)}
        unknown = sorted(set(loaded) - allowed - {"backend", "world_size", "message_mb"})
        if unknown:
            raise ValueError(f"{str(path)!r}: unknown key {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
        values.update({k: v for k, v in loaded.items() if k in allowed and v is not None})
    for key, value in (("gpus_per_node", gpus_per_node), ("gpu_memory_gb", gpu_memory_gb)):
        if value is not None:
            if value <= 0:
                raise ValueError(f"--{key.replace('_', '-')}={value} is invalid: it must be positive")
            values[key] = value
    return Network(**values)


def inside_node(grid: Grid, axes, gpus_per_node: int) -> bool:
    """Whether every group over `axes` lies in one node. Rank = x + X*(y + Y*(z + Z*data)), so a group spans
    the contiguous block of ranks up to its slowest axis; it stays inside a node when nodes are whole such blocks."""
    if grid.world_size <= gpus_per_node:
        return True
    live = [i for i, a in enumerate(AXES) if a in axes and grid.size(a) > 1]
    span = grid.size(AXES[:max(live) + 1]) if live else 1
    return span <= gpus_per_node and gpus_per_node % span == 0




# ---------------------------------------------------------------------------------------------------
# Measuring this machine's collectives (inside an initialized process group).


def measure_table(rank: int, world: int, gpus_per_node: int, sizes_mb=(0.25, 1.0, 4.0), iters: int = 5,
                  device=None) -> dict:
    """Latency and bus bandwidth of each collective per group size (groups of consecutive ranks): the latency is
    the time of a one-value-per-member message, the bandwidth the least-squares slope of time - latency against
    moved bytes over `sizes_mb`. Every rank returns the same table."""
    import torch
    import torch.distributed as dist

    import parallel
    from parallel import comm

    calls = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter,
             "all_to_all": comm.all_to_all}
    cuda = device is not None and torch.device(device).type == "cuda"

    def timed(op, grid, p, n) -> float:
        t = torch.ones(n // p if op == "all_gather" else n, device=device)
        samples = []
        for _ in range(iters + 1):  # the first call warms up buffers and connections
            dist.barrier()
            start = time.perf_counter()
            calls[op](t, grid, "x")
            if cuda:
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        median = torch.tensor([sorted(samples[1:])[iters // 2]], dtype=torch.float64, device=device)
        dist.all_reduce(median, op=dist.ReduceOp.MAX)  # a collective ends when its last member does
        return float(median)

    was, parallel.LEDGER.enabled = parallel.LEDGER.enabled, False  # not a training step
    out: dict = {}
    try:
        for p in (d for d in range(2, world + 1) if world % d == 0):
            grid = parallel.Grid(world // p, p, 1, 1, rank=rank)
            grid.build_groups()
            place = "intra" if p <= gpus_per_node else "inter"
            for op in OPS:
                latency = timed(op, grid, p, p)
                points = []
                for mb in sizes_mb:
                    n = max(p, int(mb * 2**20) // 4 // p * p)  # fp32 values, divisible by the group
                    points.append((Record(op, "x", p, 4 * n).moved_bytes, timed(op, grid, p, n) - latency))
                slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
                if slope <= 0:  # noise swamped the sizes: take the largest message's plain rate
                    slope = (max(points)[1] + latency) / max(points)[0]
                out.setdefault(op, {}).setdefault(place, {})[str(p)] = [1 / slope / GB, latency * 1e6]
            grid.release_groups()
    finally:
        parallel.LEDGER.enabled = was
    return out


def measure(out: str, sizes_mb, iters: int) -> None:
    """`memtrain plan --measure`: run under torchrun/srun; rank 0 writes a table `--bandwidth` reads."""
    import torch

    import parallel

    grid = parallel.init()
    world = grid.world_size
    if world < 2:
        raise ValueError("--measure needs at least 2 processes: run it under torchrun --nproc-per-node G "
                         "(or srun), one process per GPU")
    gpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    table_ = measure_table(grid.rank, world, gpn, sizes_mb, iters, device)
    if grid.rank == 0:
        def best(place):
            rates = [v[0] for v in table_["all_reduce"].get(place, {}).values()]
            return min(rates) if rates else None

        doc = {"name": f"measured-{os.uname().nodename}", "backend": torch.distributed.get_backend(),
               "world_size": world, "gpus_per_node": gpn, "intra_node_gbps": best("intra"),
               "inter_node_gbps": best("inter"), "message_mb": list(sizes_mb), "collectives": table_,
               "source": "memtrain plan --measure"}
        write_atomic(out, json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}: all-reduce " + ", ".join(f"{place} {doc[f'{place}_node_gbps']:.3g} GB/s"
              for place in ("intra", "inter") if doc[f"{place}_node_gbps"]) + " (slowest group size)")
    parallel.shutdown()
