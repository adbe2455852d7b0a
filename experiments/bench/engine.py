"""Benchmark: memtrain's 4D engine (parallel/) vs torch DDP and FSDP2 on one MLP stack, in one run.

The model is `--layers` residual blocks x + Linear(4H -> H)(GELU(Linear(H -> 4H)(x))), H = `--hidden`,
trained with MSE against a fixed random target and AdamW (same hyper-parameters everywhere). A training
step is forward, backward, gradient sync and the AdamW step (+ zero_grad). `--world` ranks are forked
once (gloo, file:// rendezvous, one torch thread each) and every variant (experiments/bench/mlp_variants.py)
lives in every rank:

    ddp          torch DistributedDataParallel, torch.nn.Linear                  (peer of mt-data)
    mt-data      memtrain grid data=4, easy mode, parallel.grad_sync             target <= 1.05x ddp
                 (bucketed all-reduces launched during backward, as DDP's; every mt-* variant syncs so,
                 as the trainer does by default)
    mt-data-blocking  the same, synced after backward by parallel.sync_gradients (what overlap is worth)
    fsdp2        torch fully_shard per block + root, torch.nn.Linear             (peer of mt-z*)
    mt-z         memtrain grid z=4, easy mode (each rank its own rows)           target <= 1.0x fsdp2
    mt-z+ov      the same inside parallel.overlap(model) (OAR/ORS/OAG)
    mt-x2y2-sh   memtrain x=2 y=2, sharded mode, transposed second layers        (information)
    mt-x2z2-easy memtrain x=2 z=2, easy mode                                     (information)

Every model starts from the same full weights (memtrain's grid-independent seeded init; the torch
models load the same matrices and biases). Before timing, steps 1 and 2 of every variant are checked
against the peer's global loss (step 2 follows one synchronized AdamW update, so it checks gradients
and sync too). Then the variants run interleaved, one step each per round with the order rotated every
round; each step starts after a barrier and its time is the slowest rank's. Reported: median step
time over the timed rounds, the ratio to the peer (ratio of medians, and median of the per-round
paired ratios, which cancels load drifting between rounds), bytes per step (memtrain: from
parallel.LEDGER, payload and ring-model moved bytes per axis; peers: the same ring model computed
from their parameter sizes, marked "model"), per-rank parameter + optimizer-state memory, and where
the time goes (forward+backward, gradient sync after backward: for parallel.grad_sync the wait for the
buckets still in flight and the copy back; optimizer; `--profile mt-z,...` adds torch.profiler tables of a
few extra steps). A loss mismatch above 1e-5 (relative) is flagged and fails the run. For variants with z > 1
also the Z weight all-gather bytes of one step in fp32 and of one untimed step under bf16 autocast (the shard
is cast before the gather): their ratio must be 0.5, or the run fails.

    python -m experiments.bench.engine [--world 4] [--hidden 512] [--layers 4] [--batch 128]
                                       [--steps 20] [--warmup 3] [--variants ddp,mt-data,...] [--json out.json]

`--batch` is the global number of rows per step (each data-parallel rank holds batch/world of them).
On a shared 2-core machine 4 ranks oversubscribe the cores: the figures compare implementations
under the same conditions, they are not a scaling measurement.

The same comparison on a language model (a ladder Llama), on EVERY 4- and 8-rank grid in both modes:
`python -m experiments.bench.engine_lm` (experiments/bench/engine_lm.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

import parallel
from experiments.bench.common import (
    global_sum,
    machine,
    paired_ratio,
    param_opt_bytes,
    rel_diff,
    timed_rounds,
    write_json,
)
from experiments.bench.mlp_variants import SEED, Variant, full_params, make_variants
from parallel.forked import run_ranks

ALL_VARIANTS = ("ddp", "mt-data", "mt-data-blocking", "fsdp2", "mt-z", "mt-z+ov", "mt-x2y2-sh", "mt-x2z2-easy")
PEER = {"mt-data": "ddp", "mt-data-blocking": "ddp", "mt-z": "fsdp2", "mt-z+ov": "fsdp2", "mt-x2y2-sh": "ddp",
        "mt-x2z2-easy": "ddp", "fsdp2": "ddp"}
TARGET = {"mt-data": 1.05, "mt-z": 1.0, "mt-z+ov": 1.0}
LOSS_TOL = 1e-5


# ---------------------------------------------------------------------------------------------- worker

def worker(rank, world, args):
    names = args.variants
    X = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(SEED + 2))
    T = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(SEED + 3))
    init = full_params(args.hidden, args.layers)
    if rank == 0:  # the torch models load memtrain's seeded init: check it is the same function
        ref = parallel.Linear(args.hidden, 4 * args.hidden, grid=parallel.Grid(1, 1, 1, 1), seed=SEED,
                              name="block0.fc1", init_std=args.hidden ** -0.5)
        assert torch.equal(ref.weight.view(4 * args.hidden, args.hidden), init["block0.fc1"][0])
    classes = make_variants(world)
    variants = {n: classes[n](rank, world, args, init, X, T) for n in names}
    out = {"losses": {}, "ledger": {}, "memory": {}}

    # Steps 1 and 2 (fresh weights; step 2 after one synchronized AdamW update): global losses.
    for n in names:
        out["losses"][n] = [global_sum(float(variants[n].step())) for _ in range(2)]
    # Bytes per step from the ledger (one more, untimed step each), memory after the optimizer exists.
    for n in names:
        parallel.LEDGER.reset()
        variants[n].step()
        recs = parallel.LEDGER.records
        led: dict[str, list] = {}
        for r in recs:
            e = led.setdefault(f"{r.op} {r.axes}", [0, 0.0, 0])
            e[0] += r.nbytes
            e[1] += r.moved_bytes
            e[2] += 1
        out["ledger"][n] = led or {k: [v[0], v[1], None] for k, v in variants[n].comm_model().items()}
        out["memory"][n] = param_opt_bytes(variants[n].model, variants[n].opt)
    out["z_gather"] = z_gather_bytes(variants, names, out["ledger"])
    parallel.LEDGER.reset()

    def timed(v: Variant) -> tuple:
        c0 = time.process_time()
        v.step()
        cpu = time.process_time() - c0  # all threads of this rank, gloo's included
        parallel.LEDGER.reset()  # the ledger would grow with every step
        return (*v.phases, cpu)

    out["times"], phases = timed_rounds({n: partial(timed, variants[n]) for n in names}, args.warmup, args.steps)
    ph = torch.tensor([phases[n] for n in names], dtype=torch.float64)  # [variant, step, phase]
    dist.all_reduce(ph)
    out["phases"] = {n: (ph[i] / world).median(dim=0).values.tolist() for i, n in enumerate(names)}
    if args.profile:
        out["profile"] = profile(variants, args.profile, rank)
    return out if rank == 0 else None


def z_gather_bytes(variants, names, ledger) -> dict:
    """{variant: [fp32, bf16] Z all-gather payload bytes per step} of the memtrain variants with z > 1: the fp32
    step is the ledger step above, the bf16 one an untimed step under torch.autocast (bf16 matmuls are 15-40x
    slower than fp32 on a CPU without bf16 units; nothing in bf16 is timed). With overlap the first bf16 step
    only records the prefetcher's order and dtypes, the second is counted."""
    out = {}
    for n in names:
        v = variants[n]
        if v.grid is None or v.grid.z == 1:
            continue
        for _ in range(2 if v.use_overlap else 1):
            parallel.LEDGER.reset()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                v.step()
        bf16 = sum(r.nbytes for r in parallel.LEDGER.records if (r.op, r.axes) == ("all_gather", "z"))
        out[n] = [ledger[n]["all_gather z"][0], bf16]
    return out


def profile(variants, names, rank, steps=5):
    """Self-CPU time by operator over a few steps of the named variants (rank 0's view)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    tables = {}
    for n in names:
        with tprof(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                dist.barrier()
                variants[n].step()
        tables[n] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18) if rank == 0 else ""
    return tables


# ---------------------------------------------------------------------------------------------- report

def _mb(b) -> str:
    return f"{b / 2**20:.1f}"


def report(res, args) -> dict:
    names = args.variants
    times = res["times"]
    med = {n: statistics.median(times[n]) for n in names}
    summary = {}
    hdr = (f"{'variant':<16} {'step ms':>8} {'IQR ms':>11} {'peer':>6} {'ratio':>6} {'paired':>7} {'target':>7} "
           f"{'loss rel diff s1/s2':>20} {'params MB':>9} {'opt MB':>7}")
    print(hdr)
    print("-" * len(hdr))
    for n in names:
        q = statistics.quantiles(times[n], n=4) if len(times[n]) > 1 else [med[n]] * 3
        peer = PEER.get(n)
        row = {"median_ms": 1e3 * med[n], "q1_ms": 1e3 * q[0], "q3_ms": 1e3 * q[2],
               "times_ms": [1e3 * t for t in times[n]]}
        ratio = paired = diff = None
        if peer in names:
            ratio = med[n] / med[peer]
            paired = paired_ratio(times[n], times[peer])
            diff = [rel_diff(a, b) for a, b in zip(res["losses"][n], res["losses"][peer])]
            row.update(peer=peer, ratio=ratio, paired_ratio=paired, loss_rel_diff=diff)
        p_b, o_b = res["memory"][n]
        row.update(losses=res["losses"][n], param_bytes=p_b, opt_bytes=o_b, ledger=res["ledger"][n])
        summary[n] = row
        target = TARGET.get(n)
        print(f"{n:<16} {1e3 * med[n]:8.1f} {1e3 * q[0]:5.1f}-{1e3 * q[2]:<5.1f} {peer or '-':>6} "
              f"{f'{ratio:.3f}' if ratio else '-':>6} {f'{paired:.3f}' if paired else '-':>7} "
              f"{f'<={target}' if target else '':>7} "
              f"{(f'{diff[0]:.1e}/{diff[1]:.1e}' if diff else '-'):>20} {_mb(p_b):>9} {_mb(o_b):>7}")
    print("\nwhere the time goes (rank-mean, median over steps, ms): wall fwd+bwd (DDP/FSDP2: incl. their sync) "
          "| wall gradient sync after backward | wall AdamW+zero_grad || CPU time of the whole step (all threads) "
          "and its ratio to the peer's (work done, less sensitive to the machine's load than wall time)")
    for n in names:
        fb, sy, op, cpu = res["phases"][n]
        summary[n]["phases_ms"] = {"fwd_bwd": 1e3 * fb, "sync": 1e3 * sy, "optimizer": 1e3 * op, "cpu": 1e3 * cpu}
        peer = PEER.get(n)
        cr = f"{cpu / res['phases'][peer][3]:.3f}" if peer in names else "-"
        print(f"  {n:<16} {1e3 * fb:7.1f} | {1e3 * sy:6.1f} | {1e3 * op:6.1f} || {1e3 * cpu:6.1f}  {cr:>6}")
    bad = [n for n in names if max(summary[n].get("loss_rel_diff") or [0.0]) > LOSS_TOL]
    print(f"\nstep-1 global loss: {res['losses'][names[0]][0]:.6f}   (rel diff vs peer: step 1 = same init, "
          f"step 2 = after one synced AdamW step)")
    print("\nbytes per step (per rank; payload = full message M, moved = ring model), MB:")
    for n in names:
        led = res["ledger"][n]
        if not led:
            print(f"  {n:<16} none")
            continue
        parts = []
        for k, (payload, moved, calls) in sorted(led.items()):
            c = f" x{calls}" if calls else ""
            parts.append(f"{k}{c}: {_mb(payload)} / {_mb(moved)}")
        print(f"  {n:<16} " + "; ".join(parts))
        axes: dict[str, float] = {}
        for k, (_, moved, calls) in led.items():
            if calls is not None:
                ax = k.split()[1]
                axes[ax] = axes.get(ax, 0.0) + moved
        if axes:
            print(f"  {'':<16} moved per axis: " + ", ".join(f"{a} {_mb(b)}" for a, b in sorted(axes.items())))
    if res["z_gather"]:
        print("\nZ weight all-gather bytes per step (per rank, ledger payload), fp32 vs bf16 autocast (untimed step):")
    for n, (fp32, bf16) in res["z_gather"].items():
        summary[n]["z_gather_bytes"] = {"fp32": fp32, "bf16": bf16, "ratio": bf16 / fp32}
        flag = "" if 2 * bf16 == fp32 else "   NOT HALF"
        print(f"  {n:<16} fp32 {_mb(fp32)} MB, bf16 {_mb(bf16)} MB, ratio {bf16 / fp32:.3f}{flag}")
        if flag:
            bad.append(n)
    for n, table in (res.get("profile") or {}).items():
        print(f"\nprofile of {n} (rank 0, 5 steps):\n{table}")
    if bad:
        print(f"\nLOSS MISMATCH (> {LOSS_TOL:g} relative to the peer) or Z bytes not halved: {', '.join(bad)}")
    summary["_loss_mismatch"] = bad
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128, help="global rows per step")
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (one step of every variant each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS))
    ap.add_argument("--profile", default="", help="comma-separated variants to profile after timing")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--pg-timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    args.profile = [v for v in args.profile.split(",") if v]
    unknown = [v for v in args.variants + args.profile if v not in ALL_VARIANTS]
    if unknown:
        ap.error(f"unknown variant {unknown[0]!r}: choose from {', '.join(ALL_VARIANTS)}")
    if args.world % 4 and any(v.startswith("mt-x2") for v in args.variants):
        ap.error("the 3D variants need a world size divisible by 4")
    if args.batch % args.world:
        ap.error(f"--batch {args.batch} must be divisible by --world {args.world}")
    print(f"memtrain engine benchmark: world {args.world} (gloo, fork, 1 thread/rank), MLP {args.layers} x "
          f"[{args.hidden} -> {4 * args.hidden} -> {args.hidden}], global batch {args.batch} rows, fp32, AdamW; "
          f"{args.warmup} warm-up + {args.steps} timed rounds, variants interleaved; {machine()}\n")
    t0 = time.time()
    res = run_ranks(args.world, worker, args, timeout=args.timeout, pg_timeout=args.pg_timeout)[0]
    summary = report(res, args)
    print(f"\nwall time {time.time() - t0:.0f} s")
    bad = summary.pop("_loss_mismatch")
    write_json(args.json, {"args": vars(args), "variants": summary})
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
