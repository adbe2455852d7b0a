"""`memtrain plan`: which (data, x, y, z) grid to train a model with on N GPUs, decided before launching.

For every factorization of N the model's sizes and the batch allow (parallelize_hf.py's divisibility rules),
the planner estimates per-rank memory (parameters, gradients, AdamW state, activations) and drops grids that
do not fit the device; then it predicts the communication time of one optimizer step from plan_bytes' exact
records: each collective moves ring-model bytes (all-reduce 2(p-1)/p*M, the others (p-1)/p*M) at the
bandwidth of where its group sits, inside one node or across nodes (ranks are laid out X fastest, then Y, Z,
data), and grids are ranked by that time, as in AxoNN. Compute is the same work split N ways on every grid,
so it does not change the order and is not modelled.

    memtrain plan --model llama-3.1-405b --gpus 4096 --machine frontier
    torchrun --nproc-per-node 8 -m memtrain plan --measure --out bw.json    # this machine's bandwidths
    memtrain plan --model ladder-100m --gpus 8 --bandwidth bw.json --json plan.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from memtrain import plan_bytes as pb
from memtrain.files import write_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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

    def seconds(self, op: str, p: int, inside_node: bool, nbytes: int) -> float:
        """Time of one collective: latency + ring-moved bytes / bandwidth, from the nearest measured group size."""
        table = self.collectives.get(op) or self.collectives.get("all_gather", {})
        sizes = table.get("intra" if inside_node else "inter") or {}
        if sizes:
            q = min(sizes, key=lambda s: abs(math.log(int(s) / p)))
            gbps, latency_us = sizes[q]
        else:
            gbps, latency_us = (self.intra_node_gbps if inside_node else self.inter_node_gbps), 0.0
        return latency_us * 1e-6 + pb.moved(op, p, nbytes) / (gbps * GB)


def machines() -> dict[str, dict]:
    with open(MACHINES, "rb") as f:
        return tomllib.load(f)


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
        loaded = json.loads(text) if path.suffix == ".json" or text.lstrip().startswith("{") else tomllib.loads(text)
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


def inside_node(deg, axes, gpus_per_node: int) -> bool:
    """Whether every group over `axes` lies in one node. Rank = x + X*(y + Y*(z + Z*data)), so a group spans
    the contiguous block of ranks up to its slowest axis; it stays inside a node when nodes are whole such blocks."""
    world = pb.size(deg, pb.AXES)
    if world <= gpus_per_node:
        return True
    live = [i for i, a in enumerate(pb.AXES) if a in axes and deg[a] > 1]
    span = pb.size(deg, pb.AXES[:max(live) + 1]) if live else 1
    return span <= gpus_per_node and gpus_per_node % span == 0


# ---------------------------------------------------------------------------------------------------
# Planning.


@dataclass
class PlanConfig:
    """What to plan: the model, the GPU count and the training step (the flags of `memtrain plan`)."""

    model: str
    """A named model (`memtrain models`) or a local HF directory (its config.json)."""
    gpus: int
    batch: int | None = None
    """Global batch in sequences (None: one per GPU)."""
    seq: int = 2048
    """Tokens per sequence."""
    micro_batch: int | None = None
    """Sequences per rank per forward/backward; None: the largest divisor of the rank's share that fits."""
    mode: str = "auto"
    """'sharded', 'easy' or 'auto' (sharded for the architectures parallelize_hf.py has plans for)."""
    precision: str = "bf16"
    """'bf16' (autocast over fp32 parameters, the trainer on GPUs) or 'fp32'."""
    param_bytes: int = 4
    """Bytes per parameter (the trainer keeps fp32 parameters, gradients and AdamW state)."""
    activation_checkpointing: bool = False


@dataclass
class Plan:
    data: int
    x: int
    y: int
    z: int
    micro_batch: int
    micro_batches: int
    seconds: float
    """Predicted communication time of one optimizer step."""
    moved_bytes: float
    """Bytes one rank sends per step (ring model)."""
    memory: dict
    """Bytes per rank: params, grads, optimizer, activations, total."""
    axes: dict
    """Per axes label: payload bytes, moved bytes, seconds, whether its groups stay inside a node."""

    @property
    def grid(self) -> tuple[int, int, int, int]:
        return self.data, self.x, self.y, self.z


def load_config(model: str):
    """The transformers config of a named model or a local HF directory (ValueError names the choices)."""
    from memtrain.models import get_config

    if os.path.isdir(model):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    return get_config(model)


def resolve_mode(config, mode: str) -> str:
    from memtrain.parallelize_hf import PLANS

    if mode not in ("auto", "sharded", "easy"):
        raise ValueError(f"unknown mode {mode!r}: use sharded, easy or auto")
    if mode == "auto":
        return "sharded" if config.model_type in PLANS else "easy"
    return mode


def factorizations(n: int):
    """Every (data, x, y, z) whose product is n."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    for data in divs:
        for x in (d for d in divs if (n // data) % d == 0):
            for y in (d for d in divs if (n // data // x) % d == 0):
                yield data, x, y, n // data // x // y


def evaluate(shape, deg, mode: str, cfg: PlanConfig, net: Network, micro: int) -> Plan:
    """Predicted time, bytes and memory of one grid at a given micro-batch."""
    kw = dict(precision=cfg.precision, param_bytes=cfg.param_bytes)
    records = pb.step_records(shape, deg, mode, cfg.batch, cfg.seq, micro,
                              checkpointing=cfg.activation_checkpointing, **kw)
    axes: dict[str, dict] = {}
    for (op, lab, p, nbytes), n in records.items():
        inside = inside_node(deg, lab.split("+"), net.gpus_per_node)
        a = axes.setdefault(lab, {"payload": 0, "moved": 0.0, "seconds": 0.0, "inside_node": inside})
        a["payload"] += n * nbytes
        a["moved"] += n * pb.moved(op, p, nbytes)
        a["seconds"] += n * net.seconds(op, p, inside, nbytes)
    memory = pb.state_bytes(shape, deg, mode, cfg.param_bytes)
    memory["activations"] = pb.activation_bytes(shape, deg, mode, micro * cfg.seq,
                                                checkpointing=cfg.activation_checkpointing, **kw)
    memory["total"] = sum(memory.values())
    local = cfg.batch // (pb.size(deg, pb.AXES) if mode == "easy" else pb.size(deg, ("z", "data")))
    return Plan(deg["data"], deg["x"], deg["y"], deg["z"], micro, local // micro,
                sum(a["seconds"] for a in axes.values()), sum(a["moved"] for a in axes.values()), memory, axes)


def plan(cfg: PlanConfig, net: Network) -> tuple[list[Plan], dict]:
    """All grids that run and fit, fastest first, and a summary of what was dropped and why."""
    if cfg.gpus < 1:
        raise ValueError(f"--gpus {cfg.gpus} is invalid: plan for at least 1 GPU")
    cfg.batch = cfg.batch or cfg.gpus
    for what, v in (("batch", cfg.batch), ("seq", cfg.seq), ("micro-batch", cfg.micro_batch or 1)):
        if v < 1:
            raise ValueError(f"--{what} {v} is invalid: it must be at least 1")
    if cfg.precision not in ("bf16", "fp32"):
        raise ValueError(f"unknown precision {cfg.precision!r}: use bf16 or fp32")
    config = load_config(cfg.model)
    mode = resolve_mode(config, cfg.mode)
    shape = pb.shape_of(config)
    limit = net.gpu_memory_gb * GB
    plans, rejected, least = [], Counter(), None
    for d in factorizations(cfg.gpus):
        deg = pb.degrees(d)
        why = pb.check(shape, deg, mode, cfg.batch, cfg.micro_batch)
        if why:
            rejected[why] += 1
            continue
        local = cfg.batch // (pb.size(deg, pb.AXES) if mode == "easy" else pb.size(deg, ("z", "data")))
        micros = [cfg.micro_batch] if cfg.micro_batch else [m for m in range(local, 0, -1) if local % m == 0]
        state = sum(pb.state_bytes(shape, deg, mode, cfg.param_bytes).values())
        for micro in micros:  # the largest micro-batch that fits: fewest weight gathers per step
            total = state + pb.activation_bytes(
                shape, deg, mode, micro * cfg.seq, precision=cfg.precision, param_bytes=cfg.param_bytes,
                checkpointing=cfg.activation_checkpointing)
            if total <= limit:
                plans.append(evaluate(shape, deg, mode, cfg, net, micro))
                break
        else:
            rejected[f"needs more than {net.gpu_memory_gb:g} GB per GPU"] += 1
            least = total if least is None else min(least, total)
    plans.sort(key=lambda p: (p.seconds, p.memory["total"], p.grid))
    summary = {"model": cfg.model, "family": shape.family, "mode": mode, "grids": sum(rejected.values()) + len(plans),
               "valid": len(plans), "rejected": dict(rejected), "least_memory_over_limit": least}
    if not plans:
        raise ValueError(_no_plan(cfg, mode, rejected, least))
    return plans, summary


def _no_plan(cfg: PlanConfig, mode: str, rejected: Counter, least) -> str:
    reasons = "; ".join(f"{why} ({n} grid{'s' if n > 1 else ''})" for why, n in rejected.most_common(4))
    hint = ""
    if least is not None:
        hint = (f" (the smallest needs {least / GB:.1f} GB): use more GPUs, --activation-checkpointing, a "
                "smaller --micro-batch or --seq")
    return f"no grid of {cfg.gpus} GPUs runs {cfg.model} in {mode} mode with batch {cfg.batch}: {reasons}{hint}"


# ---------------------------------------------------------------------------------------------------
# Output.


def table(plans: list[Plan], top: int) -> str:
    head = (f"{'rank':>4} {'data':>5} {'x':>4} {'y':>4} {'z':>4} {'micro':>9} {'comm s':>9} {'GB sent':>9} "
            f"{'state GB':>9} {'act GB':>8} {'total GB':>9}  slowest axes")
    lines = [head]
    for i, p in enumerate(plans[:top], 1):
        worst = sorted(p.axes.items(), key=lambda kv: -kv[1]["seconds"])[:2]
        slow = ", ".join(f"{k}{'' if v['inside_node'] else '*'} {v['seconds']:.3g}s" for k, v in worst)
        m = p.memory
        state = m["params"] + m["grads"] + m["optimizer"]
        lines.append(f"{i:>4} {p.data:>5} {p.x:>4} {p.y:>4} {p.z:>4} {f'{p.micro_batch}x{p.micro_batches}':>9} "
                     f"{p.seconds:>9.4g} {p.moved_bytes / GB:>9.4g} {state / GB:>9.4g} "
                     f"{m['activations'] / GB:>8.4g} {m['total'] / GB:>9.4g}  {slow}")
    return "\n".join(lines)


def to_json(plans: list[Plan], summary: dict, cfg: PlanConfig, net: Network) -> dict:
    return {"config": asdict(cfg), "network": asdict(net), "summary": summary,
            "plans": [dict(asdict(p), rank=i) for i, p in enumerate(plans, 1)]}


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
                    points.append((pb.moved(op, p, 4 * n), timed(op, grid, p, n) - latency))
                slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
                if slope <= 0:  # noise swamped the sizes: take the largest message's plain rate
                    slope = (max(points)[1] + latency) / max(points)[0]
                out.setdefault(op, {}).setdefault(place, {})[str(p)] = [1 / slope / GB, latency * 1e6]
            grid._groups.clear()
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


# ---------------------------------------------------------------------------------------------------
# CLI.


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="memtrain plan", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="named model or local HF directory")
    ap.add_argument("--gpus", type=int, help="number of GPUs (ranks) N")
    ap.add_argument("--batch", type=int, help="global batch in sequences (default: one per GPU)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    ap.add_argument("--micro-batch", type=int,
                    help="sequences per rank per forward/backward (default: the largest that fits)")
    ap.add_argument("--mode", default="auto", choices=("auto", "sharded", "easy"))
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    ap.add_argument("--machine", help=f"interconnect preset from memtrain/machines.toml (default {DEFAULT_MACHINE})")
    ap.add_argument("--bandwidth", help="bandwidth table: JSON from --measure, or TOML with machines.toml's keys")
    ap.add_argument("--gpus-per-node", type=int)
    ap.add_argument("--gpu-memory-gb", type=float)
    ap.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    ap.add_argument("--json", help="write every fitting grid, ranked, to this JSON file")
    ap.add_argument("--measure", action="store_true", help="measure this machine's collectives (under torchrun)")
    ap.add_argument("--out", default="bandwidth.json", help="--measure: where to write the table")
    ap.add_argument("--sizes-mb", default="0.25,1,4", help="--measure: message sizes in MiB")
    ap.add_argument("--iters", type=int, default=5, help="--measure: timed calls per size")
    args = ap.parse_args(argv)
    if args.measure:
        return measure(args.out, [float(s) for s in args.sizes_mb.split(",")], args.iters)
    if args.model is None or args.gpus is None:
        raise ValueError("plan needs --model NAME_OR_DIR and --gpus N (or --measure)")
    start = time.perf_counter()
    net = load_network(args.machine, args.bandwidth, args.gpus_per_node, args.gpu_memory_gb)
    cfg = PlanConfig(args.model, args.gpus, args.batch, args.seq, args.micro_batch, args.mode, args.precision,
                     activation_checkpointing=args.activation_checkpointing)
    plans, summary = plan(cfg, net)
    print(f"{cfg.model} on {cfg.gpus} GPUs, {summary['mode']} mode, batch {cfg.batch} x {cfg.seq} tokens, "
          f"{cfg.precision}{', activation checkpointing' if cfg.activation_checkpointing else ''}; {net.name}: "
          f"{net.gpus_per_node} GPUs/node, {net.gpu_memory_gb:g} GB, {net.intra_node_gbps:.3g} GB/s in a node, "
          f"{net.inter_node_gbps:.3g} GB/s across")
    print(f"{summary['grids']} grids, {summary['valid']} run and fit; ranked by predicted communication time "
          f"per step (* = groups span nodes; micro = sequences x micro-batches):")
    print(table(plans, args.top))
    if args.json:
        write_atomic(args.json, json.dumps(to_json(plans, summary, cfg, net), indent=1) + "\n")
        print(f"wrote {args.json}")
    print(f"planned in {time.perf_counter() - start:.1f} s")
