"""`memtrain plan`: which (data, x, y, z) grid to train a model with on N GPUs, decided before launching.

    memtrain plan --model llama-3.1-405b --gpus 4096 --machine frontier
    torchrun --nproc-per-node 8 -m memtrain plan --measure --out bw.json    # this machine's bandwidths, matmuls
    memtrain plan --model ladder-100m --gpus 8 --bandwidth bw.json --json plan.json
    memtrain plan --validate --model llama-3.1-405b --gpus 4096 --grid=-1,4,8,16 --batch 128 --micro-batch 1 \
        --activation-checkpointing        # one step of that grid, simulated as one of 4,096 ranks (dryrun.py)

--validate runs one training step of one grid (--grid, default the planner's best) on a fake process group at
the full world size, with the model on fake tensors, and checks the planner's per-rank memory and every
collective against what the engine really issues: exit 0 when every exact figure is equal, 1 when one differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from memtrain import bounds
from memtrain.commandline import ArgumentParser, at_most, positive_float, positive_int
from memtrain.config import PARALLEL_MODES, PRECISIONS
from memtrain.files import write_atomic
from memtrain.plan.network import DEFAULT_MACHINE, load_network
from memtrain.plan.probes import measure
from memtrain.plan.search import PlanConfig, fewest_gpus, plan, table, to_json
from parallel import GRAD_SYNCS, resolve_degrees

MESSAGE_MB = 4096.0
"""The largest --sizes-mb message: every rank allocates collectives.STREAMED buffers of it (the queued calls' probe)."""


def main(argv: list[str] | None = None) -> int | None:
    ap = ArgumentParser(prog="memtrain plan", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="named model or local HF directory")
    ap.add_argument("--gpus", type=at_most(positive_int, bounds.DEGREE), help="number of GPUs (ranks) N")
    ap.add_argument("--batch", type=at_most(positive_int, bounds.SEQUENCES),
                    help="global batch in sequences (default: one per GPU)")
    ap.add_argument("--seq", type=at_most(positive_int, bounds.POSITIONS), default=2048,
                    help="tokens per sequence (default 2048)")
    ap.add_argument("--micro-batch", type=at_most(positive_int, bounds.SEQUENCES),
                    help="sequences per rank per forward/backward (default: the largest that fits)")
    ap.add_argument("--mode", default="auto", choices=PARALLEL_MODES)
    ap.add_argument("--precision", default="bf16", choices=[p for p in PRECISIONS if p != "auto"])
    ap.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    ap.add_argument("--offload", action="store_true",
                    help="AdamW state and fp32 master weights in host memory (train.optimizer_offload); also prints "
                         "the fewest GPUs that hold the model with and without it")
    ap.add_argument("--host-gbps", type=host_gbps, default=25.0,
                    help="--offload: GB/s between a GPU and host memory per direction (default 25, PCIe 4.0 x16; "
                         "0: the ranks are CPUs, nothing crosses)")
    ap.add_argument("--machine",
                    help=f"interconnect preset from memtrain/plan/machines.toml (default {DEFAULT_MACHINE})")
    ap.add_argument("--bandwidth", help="bandwidth table: JSON from --measure, or TOML with machines.toml's keys")
    ap.add_argument("--gpus-per-node", type=at_most(positive_int, bounds.DEGREE))
    ap.add_argument("--gpu-memory-gb", type=at_most(positive_float, bounds.GPU_MEMORY_GB))
    ap.add_argument("--validate", action="store_true",
                    help="dry-run one step of a grid at full scale and check the planner's figures against it")
    ap.add_argument("--grid", help="--validate: DATA,X,Y,Z, one of them -1 to infer (--grid=-1,4,8,16); "
                                   "default the best plan's grid")
    ap.add_argument("--rank", type=int, default=0, help="--validate: the rank simulated (default 0)")
    ap.add_argument("--grad-sync", choices=GRAD_SYNCS, default=PlanConfig.grad_sync,
                    help="the trainer's gradient sync, parallel.grad_sync (default %(default)s: bucket buffers kept "
                         "on the device, all-reduce hidden behind backward)")
    ap.add_argument("--steps", type=at_most(positive_int, 1000), default=1,
                    help="--validate: steps to run; the last is measured (default 1)")
    ap.add_argument("--top", type=positive_int, default=10, help="rows to print (default 10)")
    ap.add_argument("--json", help="write every fitting grid, ranked (--validate: the dry run), to this JSON file")
    ap.add_argument("--measure", action="store_true",
                    help="measure this machine's collectives and matmuls (under torchrun)")
    ap.add_argument("--out", default="bandwidth.json", help="--measure: where to write the table")
    ap.add_argument("--sizes-mb", default="0.25,1,4", help="--measure: message sizes in MiB")
    ap.add_argument("--iters", type=at_most(positive_int, 10_000), default=5, help="--measure: timed calls per size")
    args = ap.parse_args(argv)
    if args.measure:
        return measure(args.out, message_sizes(args.sizes_mb), args.iters)
    if args.model is None or args.gpus is None:
        raise ValueError("plan needs --model NAME_OR_DIR and --gpus N (or --measure)")
    if args.json and Path(args.json).is_dir():
        raise ValueError(f"--json {args.json!r} is a directory: name the JSON file to write, e.g. plan.json")
    start = time.perf_counter()
    net = load_network(args.machine, args.bandwidth, args.gpus_per_node, args.gpu_memory_gb)
    cfg = PlanConfig(args.model, args.gpus, args.batch, args.seq, args.micro_batch, args.mode, args.precision,
                     activation_checkpointing=args.activation_checkpointing, offload=args.offload,
                     host_gbps=args.host_gbps, grad_sync=args.grad_sync)
    if args.validate:
        if args.offload:
            raise ValueError("--offload applies to planning only (the dry run checks the on-device optimizer): "
                             "drop --offload or --validate")
        return validate(args, cfg, net, start)
    if args.grid is not None:
        raise ValueError("--grid applies to --validate only: add --validate")
    plans, summary = plan(cfg, net)
    extras = (", activation checkpointing" if cfg.activation_checkpointing else "") + (
        f", optimizer offload ({cfg.host_gbps:g} GB/s to the host)" if cfg.offload else "")
    guess = {k: " (not in the table: the preset's)" if k in net.unmeasured else "" for k in
             ("gpu_memory_gb", "inter_node_gbps")}
    print(f"{cfg.model} on {cfg.gpus} GPUs, {summary['mode']} mode, batch {cfg.batch} x {cfg.seq} tokens, "
          f"{cfg.precision}{extras}; {net.name}: "
          f"{net.gpus_per_node} GPUs/node, {net.gpu_memory_gb:g} GB{guess['gpu_memory_gb']}, "
          f"{net.intra_node_gbps:.3g} GB/s in a node, {net.inter_node_gbps:.3g} GB/s across{guess['inter_node_gbps']}, "
          f"{compute_text(net, cfg.precision)}")
    hides = "" if net.overlap == 1 else f" (this machine hides {net.overlap:.0%} of what could)"
    print(f"{summary['grids']} grids, {summary['valid']} run and fit; ranked by predicted step time: compute + the "
          f"communication overlap cannot hide{hides} (* = groups span nodes; micro = sequences x micro-batches):")
    print(table(plans, args.top))
    if guess["inter_node_gbps"] and any(not a["inside_node"] for p in plans[:args.top] for a in p.axes.values()):
        print(f"note: the grids marked * communicate across nodes, which the bandwidth table does not measure: their "
              f"time assumes the preset's {net.inter_node_gbps:g} GB/s. Measure on 2+ nodes, or give --gpus-per-node "
              f"{cfg.gpus} to plan as if on one node")
    if cfg.offload:
        print(fewest_text(cfg, net, args.batch))
    if args.json:
        write_atomic(args.json, json.dumps(to_json(plans, summary, cfg, net), indent=1) + "\n")
        print(f"wrote {args.json}")
    print(f"planned in {time.perf_counter() - start:.1f} s")


def host_gbps(text: str) -> float:
    """--host-gbps: a finite number >= 0 (0: CPU ranks, no device<->host link), any spelling of 0 included."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value == 0:
        return 0.0
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{value} is invalid: use a finite number >= 0 (0: CPU ranks)")
    return positive_float(text, 1e6)


def fewest_text(cfg: PlanConfig, net, batch: int | None) -> str:
    """The fewest GPUs (powers of two) that hold the model without and with optimizer offload."""
    found = {o: fewest_gpus(dataclasses.replace(cfg, offload=o), net, batch) for o in (False, True)}
    say = {o: f"{n} GPU{'s' * (n != 1)}" if n else why for o, (n, why) in found.items()}
    return (f"fewest GPUs that hold {cfg.model} (powers of two, micro-batch {cfg.micro_batch or 1}, "
            f"{f'batch {batch}' if batch else 'one sequence per GPU'}, {net.gpu_memory_gb:g} GB each): "
            f"{say[False]} without optimizer offload, {say[True]} with")


def message_sizes(text: str) -> list[float]:
    """--sizes-mb: comma-separated MiB, each finite, > 0 and at most MESSAGE_MB."""
    try:
        return [positive_float(s, MESSAGE_MB) for s in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--sizes-mb {text!r}: {e}: give sizes in MiB such as 0.25,1,4") from None


def compute_text(net, precision: str) -> str:
    peak = net.peak_flops(precision)
    if net.matmuls:
        return f"{precision} matmuls measured (best {peak / 1e9:.3g} GFLOP/s per rank)"
    return f"{precision} peak {peak / 1e12:.3g} TFLOP/s x {net.matmul_efficiency:g} reached by matmuls"


def parse_grid(text: str, gpus: int) -> tuple[int, int, int, int]:
    """'DATA,X,Y,Z' (one may be -1) -> degrees whose product is gpus."""
    parts = text.split(",")
    try:
        degrees = [int(p) for p in parts]
    except ValueError:
        degrees = []
    if len(degrees) != 4:
        raise ValueError(f"--grid {text!r} is invalid: give DATA,X,Y,Z, e.g. -1,4,8,16 (data inferred)")
    return resolve_degrees(gpus, *degrees)


def validate(args, cfg: PlanConfig, net, start: float) -> int:
    """`plan --validate`: the dry run of one grid against the planner; 1 when an exact figure differs."""
    from memtrain.plan import dryrun

    cfg.batch = cfg.batch or cfg.gpus
    if args.grid:
        grid = parse_grid(args.grid, cfg.gpus)
    else:
        plans, _ = plan(cfg, net)
        grid = plans[0].grid
        cfg.micro_batch = cfg.micro_batch or plans[0].micro_batch  # choose_micro would search again for it
        print(f"validating the best plan's grid: data={grid[0]} x={grid[1]} y={grid[2]} z={grid[3]}")
    cfg.micro_batch = dryrun.choose_micro(cfg, grid, net)
    run = dryrun.dry_run(cfg, grid, rank=args.rank, steps=args.steps)
    print(dryrun.header(run))
    print(dryrun.table(run))
    if args.json:
        write_atomic(args.json, json.dumps(dryrun.to_json(run), indent=1) + "\n")
        print(f"wrote {args.json}")
    s = run.seconds
    print(f"{'every exact figure equal' if run.ok else 'MISMATCH: the planner differs from the engine'}; "
          f"dry run in {time.perf_counter() - start:.1f} s (step {s['step']:.1f} s, activations "
          f"{s['activations']:.1f} s, model {s['model']:.1f} s, grid {s['grid']:.2f} s)")
    return 0 if run.ok else 1
