"""Planner vs measurement: does `memtrain plan` predict the step time of every 8-rank grid on this machine?

On `--world` forked gloo ranks (file:// rendezvous, one torch thread each):
1. measure this machine as `memtrain plan --measure` does, on every rank at once: its collectives per group size
   (`measure_table`) and the fp32 matmul rate per shape (`measure_matmuls`; ranks sharing the cores share them
   in the probe as in the steps, so the rates are one rank's share);
2. time one training step of `--model` on every grid of that many ranks, in sharded and easy mode: the
   trainer's step (forward + backward per micro-batch, sync_gradients, clip_grad_norm_, AdamW). Grids run
   interleaved, one step each per round in a rotated order, each step after a barrier and timed as the slowest
   rank, so load drifting on a shared machine hits every grid alike; the median over rounds is kept;
3. predict every grid's step time from those two tables (`search.evaluate`: compute + the communication overlap
   cannot hide) and print both, the Spearman rank correlation of predicted and measured step times and the median
   ratio error |predicted / measured - 1|, per mode and over all (and, for reference, the Spearman of the
   communication time alone, what the planner ranked by before it modelled compute).

    python -m experiments.bench.planner [--model ladder-1m] [--batch 16] [--seq 64] [--rounds 5] [--json out.json]

Nothing is fitted: the prediction uses only the tables measured in step 1. What it leaves out (norms, activations,
the loss's softmax, AdamW, Python and autograd overhead, ranks waiting for each other more than in the probes)
shows as the ratio error; on 2 shared cores it is large, so the figures are a check of the model, not a test.
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
from memtrain.plan.network import Network, measure_matmuls, measure_table
from memtrain.training import build_optimizer, train_step
from parallel.forked import run_ranks

MODES = ("sharded", "easy")


def grids(world: int) -> list[tuple[int, int, int, int]]:
    return sorted(search.factorizations(world))


def worker(rank: int, world: int, args) -> dict:
    bandwidth = measure_table(rank, world, world, sizes_mb=(0.05, 0.25, 1.0), iters=5)
    matmuls = measure_matmuls(("fp32",))
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
    return {"table": bandwidth, "matmuls": matmuls, "times": {k: statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ladder-1m")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", help="write measured and predicted figures here")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    res = run_ranks(args.world, worker, args, timeout=args.timeout, pg_timeout=300)[0]
    net = Network(name="measured", gpus_per_node=args.world, gpu_memory_gb=1e6, collectives=res["table"],
                  matmuls=res["matmuls"], source="experiments/bench/planner.py")
    shape = cost.shape_of(build_model(args.model, device="meta").config)
    cfg = search.PlanConfig(args.model, args.world, args.batch, args.seq, precision="fp32")
    peak = net.peak_flops("fp32")
    rows = []
    for (degrees, mode), measured in res["times"].items():
        grid = parallel.Grid(*degrees)
        p = search.evaluate(shape, grid, mode, cfg, net, args.batch // cost.rows_split(grid, mode))
        rows.append({"grid": degrees, "mode": mode, "measured_s": measured, "predicted_s": p.step_seconds,
                     "compute_s": p.compute_seconds, "comm_s": p.comm_seconds, "ratio": p.step_seconds / measured,
                     "predicted_mfu": p.mfu, "measured_mfu": p.mfu * p.step_seconds / measured,
                     "moved_mb": p.moved_bytes / 2**20})
    print(f"{args.model}, batch {args.batch} x {args.seq}, {args.world} gloo ranks; median of {args.rounds} rounds; "
          f"best matmul {peak / 1e9:.3g} GFLOP/s per rank (all ranks at once); {machine()}")
    print(table(["grid (d,x,y,z)", "mode", "measured s", "predicted s", "ratio", "compute s", "comm s",
                 "MFU meas", "MFU pred", "MiB sent"],
                [(r["grid"], r["mode"], f"{r['measured_s']:.4f}", f"{r['predicted_s']:.4f}", f"{r['ratio']:.2f}",
                  f"{r['compute_s']:.4f}", f"{r['comm_s']:.4f}", f"{100 * r['measured_mfu']:.2f}%",
                  f"{100 * r['predicted_mfu']:.2f}%", f"{r['moved_mb']:.2f}")
                 for r in sorted(rows, key=lambda r: r["measured_s"])]))
    out = {"rows": rows, "table": res["table"], "matmuls": res["matmuls"], "spearman": {},
           "spearman_comm_only": {}, "median_ratio_error": {}}
    for name, subset in [(m, [r for r in rows if r["mode"] == m]) for m in MODES] + [("all", rows)]:
        measured = [r["measured_s"] for r in subset]
        out["spearman"][name] = spearman(measured, [r["predicted_s"] for r in subset])
        out["spearman_comm_only"][name] = spearman(measured, [r["comm_s"] for r in subset])
        out["median_ratio_error"][name] = statistics.median(abs(r["ratio"] - 1) for r in subset)
        print(f"{name} ({len(subset)} grids): Spearman {out['spearman'][name]:.3f} (communication alone "
              f"{out['spearman_comm_only'][name]:.3f}), median ratio error {out['median_ratio_error'][name]:.2f}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
