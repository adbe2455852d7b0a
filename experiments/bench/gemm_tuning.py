"""Benchmark: what parallel.tune_matmul does to a ladder LM's training step, and the GEMM timings behind its choices.

On forked gloo ranks (as many as each of `--grids` has; file:// rendezvous, one torch thread each), every case - a
`--models` ladder LM on a grid in `--mode`, in each of `--precisions` - trains with the trainer's step
(memtrain.training.train_step: forward + backward, overlapped gradient sync, clipping, AdamW). Every round runs
each case twice, one step untuned (tune_matmul(False)) and one tuned (tune_matmul(True): rank 0's choices, timed
in the first tuned step of the warm-up and kept), the pair's order swapped every round and the cases' order
rotated, each step after a barrier and timed as the slowest rank. Reported per case: the median step time without
and with tuning, the ratio of the medians and the median of the per-round paired ratios tuned / untuned (it
cancels load drifting between rounds); then every GEMM key rank 0 met (which product, dtype, m x k x n, operand
orders) with the time of each layout as the tuner measured it, the one chosen and its speed-up over `given` (the
micro-benchmark behind gemm_tuning.DEFAULT_ON); the CPU model as lscpu names it, the load average before and after.

    python -m experiments.bench.gemm_tuning [--models ladder-1m,ladder-10m] [--grids 2,1,1,1;1,2,1,1]
        [--mode sharded] [--precisions fp32,bf16] [--batch 16] [--seq 128] [--rounds 15] [--warmup 2] [--json f]

On a shared 2-core machine the figures compare the two paths under the same load; they are not a scaling
measurement. bf16 runs under torch.autocast as the trainer's train.precision = 'bf16' does: fast only on a CPU with
native bf16 (AVX512-BF16 or AMX).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

import parallel
from experiments.bench.common import load_average, machine, paired_ratio, table, write_json
from memtrain.config import RunConfig
from memtrain.hf import parallelize
from memtrain.models import build_model
from memtrain.training import build_optimizer, train_step
from parallel import gemm_tuning
from parallel.forked import run_ranks

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def lscpu() -> str:
    """lscpu's model name, family and model (the generation a bare 'AMD EPYC' leaves out), or machine()."""
    try:
        fields = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                                                     check=True).stdout.splitlines() if ":" in line)
    except (OSError, subprocess.CalledProcessError):
        return machine()
    f = {k.strip(): v.strip() for k, v in fields.items()}
    return f"{f.get('Model name', '?')} (family {f.get('CPU family', '?')}, model {f.get('Model', '?')}); {machine()}"


def _step(case, tuned: bool) -> float:
    plm, grid, opt, ids, labels, amp = case
    parallel.tune_matmul(tuned)
    dist.barrier()
    start = time.perf_counter()
    train_step(plm, grid, opt, ids, labels, labels != -100, ids.shape[0], amp=amp)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return float(elapsed)


def worker(rank: int, world: int, args) -> dict | None:
    grids = {}
    cases = {}
    g = torch.Generator().manual_seed(0)
    for model in args.models:
        for degrees in args.grids:
            if degrees not in grids:
                grids[degrees] = parallel.Grid(*degrees, rank=rank)
                grids[degrees].build_groups()
            grid = grids[degrees]
            for precision in args.precisions:
                plm = parallelize(build_model(model, device="meta"), grid, args.mode, seed=0, device="cpu")
                vocab = plm.config.vocab_size
                ids, labels = torch.randint(0, vocab, (2, args.batch, args.seq), generator=g)
                cases[(model, degrees, precision)] = (plm, grid, build_optimizer(plm, RunConfig()), ids, labels,
                                                      DTYPES[precision])
    keys = list(cases)
    times = {(k, tuned): [] for k in keys for tuned in (False, True)}
    for r in range(args.warmup + args.rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            for tuned in ((False, True) if r % 2 else (True, False)):
                dt = _step(cases[k], tuned)
                if r >= args.warmup:
                    times[(k, tuned)].append(dt)
    if rank:
        return None
    return {"times": times, "choices": gemm_tuning.choices(), "timings": gemm_tuning.timings()}


def _grid(text: str) -> tuple[int, int, int, int]:
    degrees = tuple(int(v) for v in text.split(","))
    if len(degrees) != 4:
        raise argparse.ArgumentTypeError(f"grid {text!r}: give data,x,y,z, e.g. 1,2,1,1")
    return degrees


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="ladder-1m,ladder-10m")
    ap.add_argument("--grids", default="2,1,1,1;1,2,1,1", help="data,x,y,z grids separated by ';'")
    ap.add_argument("--mode", default="sharded", choices=parallel.MODES)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    args.grids = [_grid(t) for t in args.grids.split(";")]
    args.precisions = args.precisions.split(",")
    unknown = [p for p in args.precisions if p not in DTYPES]
    if unknown:
        ap.error(f"--precisions: unknown {unknown[0]!r}: use fp32 and/or bf16")
    world = {d[0] * d[1] * d[2] * d[3] for d in args.grids}
    if len(world) != 1:
        ap.error(f"--grids {args.grids}: every grid needs the same number of ranks")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before, t0 = load_average(), time.perf_counter()
    res = run_ranks(world.pop(), worker, args, timeout=args.timeout, pg_timeout=600)[0]
    print(f"parallel.tune_matmul on a training step: batch {args.batch} x {args.seq}, {args.mode} mode; median of "
          f"{args.rounds} interleaved rounds; CPU: {lscpu()}; load {load_before} before, {load_average()} after "
          f"({time.perf_counter() - t0:.0f} s)")
    rows, out = [], {"cases": []}
    for (model, degrees, precision) in dict.fromkeys(k for k, _ in res["times"]):
        off, on = res["times"][((model, degrees, precision), False)], res["times"][((model, degrees, precision), True)]
        fig = {"model": model, "grid": degrees, "precision": precision, "untuned_s": statistics.median(off),
               "tuned_s": statistics.median(on), "paired_ratio": paired_ratio(on, off)}
        fig["ratio_of_medians"] = fig["tuned_s"] / fig["untuned_s"]
        out["cases"].append(fig)
        rows.append((model, degrees, precision, f"{fig['untuned_s']:.4f}", f"{fig['tuned_s']:.4f}",
                     f"{fig['ratio_of_medians']:.3f}", f"{fig['paired_ratio']:.3f}"))
    print(table(["model", "grid (d,x,y,z)", "dtype", "untuned s", "tuned s", "ratio", "paired ratio"], rows))
    names = tuple(gemm_tuning.LAYOUTS)
    gemm_rows = []
    for key, layout in sorted(res["choices"].items(), key=lambda kv: kv[0].split("|")[1:]):
        _, dtype, gemm, shape, orders = key.split("|")
        s = res["timings"][key]
        gemm_rows.append((f"{gemm} {dtype} {shape} {orders}", *(f"{1e6 * s[n]:.0f}" for n in names), layout,
                          f"{s['given'] / s[layout]:.2f}"))
    moved = sum(layout != "given" for layout in res["choices"].values())
    print(f"\nrank 0's timings (us of process CPU time, fastest of {gemm_tuning.ROUNDS} rounds) of the "
          f"{len(res['choices'])} GEMM keys: {moved} chose another layout than 'given' (one must be "
          f"{gemm_tuning.MARGIN:.0%} faster)")
    print(table(["gemm dtype m x k x n orders", *names, "chosen", "given/chosen"], gemm_rows))
    out.update(choices=res["choices"], timings=res["timings"], cpu=lscpu(), load_before=load_before,
               load_after=load_average(), args={k: v for k, v in vars(args).items() if k != "json"})
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
