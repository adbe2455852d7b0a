"""Planner ranking vs measurement: does `memtrain plan` order the 8-rank grids the way this machine does?

On `--world` forked gloo ranks (file:// rendezvous, one torch thread each):
1. measure this machine's collectives per group size (`measure_table`, as `memtrain plan --measure`);
2. time one training step of `--model` on every grid of that many ranks, in sharded and easy mode: the
   trainer's step (forward + backward per micro-batch, sync_gradients, clip_grad_norm_, AdamW). Grids run
   interleaved, one step each per round in a rotated order, each step after a barrier and timed as the slowest
   rank, so load drifting on a shared machine hits every grid alike; the median over rounds is kept;
3. predict every grid's communication time with the measured table (`search.evaluate`) and print both orders
   and the Spearman rank correlation, per mode and over all.

    python -m experiments.bench.planner [--model ladder-1m] [--batch 16] [--seq 64] [--rounds 4] [--json out.json]

The planner predicts communication only (compute is the same work on every grid); on 2 shared cores the
measured times also carry compute and scheduling noise, so the correlation is a figure, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import parallel
from experiments.bench.common import machine, spearman, table, write_json
from memtrain.config import RunConfig
from memtrain.hf import parallelize
from memtrain.models import build_model
from memtrain.plan import cost, search
from memtrain.plan.network import Network, measure_table
from memtrain.training import build_optimizer, train_step
from parallel.forked import run_ranks

MODES = ("sharded", "easy")


def grids(world: int) -> list[tuple[int, int, int, int]]:
    return sorted(search.factorizations(world))


def worker(rank: int, world: int, args) -> dict:
    bandwidth = measure_table(rank, world, world, sizes_mb=(0.05, 0.25, 1.0), iters=5)
    runs = {}
    for degrees in grids(world):
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        for mode in MODES:
            plm = parallelize(build_model(args.model, device="meta"), grid, mode, seed=0, device="cpu")
            runs[(degrees, mode)] = (plm, grid, build_optimizer(plm, RunConfig()))
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(runs.values()))[0].config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    labels = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    times = {key: [] for key in runs}
    keys = list(runs)
    for r in range(args.warmup + args.rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            plm, grid, opt = runs[key]
            dist.barrier()
            start = time.perf_counter()
            train_step(plm, grid, opt, ids, labels, labels != -100, args.batch, overlap=True)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r >= args.warmup:
                times[key].append(float(elapsed))
    return {"table": bandwidth, "times": {k: statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ladder-1m")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", help="write measured and predicted figures here")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    res = run_ranks(args.world, worker, args, timeout=args.timeout, pg_timeout=300)[0]
    net = Network(name="measured", gpus_per_node=args.world, gpu_memory_gb=1e6, collectives=res["table"],
                  source="experiments/bench/planner.py")
    shape = cost.shape_of(build_model(args.model, device="meta").config)
    cfg = search.PlanConfig(args.model, args.world, args.batch, args.seq, precision="fp32")
    rows = []
    for (degrees, mode), measured in res["times"].items():
        grid = parallel.Grid(*degrees)
        p = search.evaluate(shape, grid, mode, cfg, net, args.batch // cost.rows_split(grid, mode))
        rows.append({"grid": degrees, "mode": mode, "measured_s": measured, "predicted_s": p.seconds,
                     "moved_mb": p.moved_bytes / 2**20})
    print(f"{args.model}, batch {args.batch} x {args.seq}, {args.world} gloo ranks; median of {args.rounds} rounds; "
          f"{machine()}")
    print(table(["grid (d,x,y,z)", "mode", "measured s", "predicted comm s", "MiB sent"],
                [(r["grid"], r["mode"], f"{r['measured_s']:.4f}", f"{r['predicted_s']:.4f}", f"{r['moved_mb']:.2f}")
                 for r in sorted(rows, key=lambda r: r["measured_s"])]))
    out = {"rows": rows, "table": res["table"], "spearman": {}}
    for name, subset in [(m, [r for r in rows if r["mode"] == m]) for m in MODES] + [("all", rows)]:
        rho = spearman([r["measured_s"] for r in subset], [r["predicted_s"] for r in subset])
        out["spearman"][name] = rho
        print(f"Spearman rank correlation, {name} ({len(subset)} grids): {rho:.3f}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
