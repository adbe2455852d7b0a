"""Benchmark: memtrain's 4D engine (parallel/) vs torch DDP and FSDP2 on one MLP stack, in one run.

The model is `--layers` residual blocks x + Linear(4H -> H)(GELU(Linear(H -> 4H)(x))), H = `--hidden`,
trained with MSE against a fixed random target and AdamW (same hyper-parameters everywhere). A training
step is forward, backward, gradient sync and the AdamW step (+ zero_grad). `--world` ranks are forked
once (gloo, file:// rendezvous, one torch thread each) and every variant lives in every rank:

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
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

import parallel
from experiments.bench.common import (
    fsdp2,
    global_sum,
    machine,
    paired_ratio,
    param_opt_bytes,
    rel_diff,
    timed_rounds,
    write_json,
)
from parallel.forked import run_ranks
from parallel.sharding import full_normal

ALL_VARIANTS = ("ddp", "mt-data", "mt-data-blocking", "fsdp2", "mt-z", "mt-z+ov", "mt-x2y2-sh", "mt-x2z2-easy")
PEER = {"mt-data": "ddp", "mt-data-blocking": "ddp", "mt-z": "fsdp2", "mt-z+ov": "fsdp2", "mt-x2y2-sh": "ddp",
        "mt-x2z2-easy": "ddp", "fsdp2": "ddp"}
TARGET = {"mt-data": 1.05, "mt-z": 1.0, "mt-z+ov": 1.0}
SEED = 1234
LOSS_TOL = 1e-5


# ----------------------------------------------------------------------------------------------- model

def full_params(hidden: int, layers: int):
    """The full initial weights and biases every variant starts from: {name: (W [out, in], b [out])}."""
    out = {}
    g = torch.Generator().manual_seed(SEED + 1)
    for i in range(layers):
        for name, (fin, fout) in ((f"block{i}.fc1", (hidden, 4 * hidden)), (f"block{i}.fc2", (4 * hidden, hidden))):
            w = full_normal(fout, fin, fin ** -0.5, SEED, name)
            b = 0.02 * torch.randn(fout, generator=g)
            out[name] = (w, b)
    return out


class Block(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


def torch_mlp(hidden: int, layers: int, init) -> nn.Sequential:
    blocks = []
    for i in range(layers):
        fc1, fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        with torch.no_grad():
            for lin, name in ((fc1, f"block{i}.fc1"), (fc2, f"block{i}.fc2")):
                lin.weight.copy_(init[name][0])
                lin.bias.copy_(init[name][1])
        blocks.append(Block(fc1, fc2))
    return nn.Sequential(*blocks)


def memtrain_mlp(grid: parallel.Grid, hidden: int, layers: int, mode: str, init) -> nn.Sequential:
    blocks = []
    for i in range(layers):
        fc1 = parallel.Linear(hidden, 4 * hidden, mode=mode, grid=grid, seed=SEED, name=f"block{i}.fc1",
                              init_std=hidden ** -0.5)
        fc2 = parallel.Linear(4 * hidden, hidden, mode=mode, grid=grid, seed=SEED, name=f"block{i}.fc2",
                              transpose=(mode == "sharded"), init_std=(4 * hidden) ** -0.5)
        for lin in (fc1, fc2):
            lin.load_full(*init[lin.name])  # same values as the seeded init (checked), plus the biases
        blocks.append(Block(fc1, fc2))
    return nn.Sequential(*blocks)


# -------------------------------------------------------------------------------------------- variants

class Variant:
    """One model + optimizer + data slice; `step()` is the timed unit and returns this rank's loss term."""

    name = ""
    grid: parallel.Grid | None = None

    def __init__(self, rank, world, args, init, X, T):
        self.rank, self.world, self.args = rank, world, args
        self.n_rows, self.hidden = X.shape
        self.build(init, X, T)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)

    def loss_fn(self, y):
        raise NotImplementedError

    def step(self) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.model(self.x)
        loss = self.loss_fn(y)
        loss.backward()  # DDP/FSDP2 sync inside backward
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.phases = (t1 - t0, 0.0, time.perf_counter() - t1)
        return loss.detach() * self.report_weight

    def comm_model(self) -> dict:
        return {}


class DDPVariant(Variant):
    name = "ddp"

    def build(self, init, X, T):
        k = self.n_rows // self.world
        rows = slice(self.rank * k, (self.rank + 1) * k)
        self.x, self.t = X[rows].contiguous(), T[rows].contiguous()
        self.model = nn.parallel.DistributedDataParallel(torch_mlp(self.hidden, self.args.layers, init))
        self.report_weight = 1.0 / self.world

    def loss_fn(self, y):
        return nn.functional.mse_loss(y, self.t)  # DDP averages gradients over ranks -> global mean

    def comm_model(self):
        p = self.world
        m = param_opt_bytes(self.model, self.opt)[0]
        return {"all_reduce data (model)": (m, 2 * (p - 1) / p * m)}


class FSDP2Variant(DDPVariant):
    name = "fsdp2"

    def build(self, init, X, T):
        k = self.n_rows // self.world
        rows = slice(self.rank * k, (self.rank + 1) * k)
        self.x, self.t = X[rows].contiguous(), T[rows].contiguous()
        model = torch_mlp(self.hidden, self.args.layers, init)
        self.model = fsdp2(model, list(model), self.world)
        self.report_weight = 1.0 / self.world

    def comm_model(self):
        p = self.world
        m = param_opt_bytes(self.model, self.opt)[0] * p  # unsharded fp32 bytes
        return {"all_gather (fwd+bwd) (model)": (2 * m, 2 * (p - 1) / p * m),
                "reduce_scatter (model)": (m, (p - 1) / p * m)}


class MemtrainVariant(Variant):
    degrees = (1, 1, 1, 1)  # data, x, y, z
    mode = "easy"
    use_overlap = False
    grad_sync = "overlap"  # or "blocking"

    def build(self, init, X, T):
        self.grid = parallel.Grid(*self.degrees, rank=self.rank)
        self.grid.build_groups()
        g = self.grid
        self.model = memtrain_mlp(g, self.hidden, self.args.layers, self.mode, init)
        if self.mode == "easy":  # each rank its own rows, all features
            k = self.n_rows // g.world_size
            rows, cols = slice(g.rank * k, (g.rank + 1) * k), slice(None)
            self.report_weight = 1.0
        else:  # rows split over (z, data); a block's input/output is [rows, H/x] replicated over y
            k = self.n_rows // g.size(("z", "data"))
            i = g.coord(("z", "data"))
            rows = slice(i * k, (i + 1) * k)
            f = self.hidden // g.x
            cols = slice(g.coords["x"] * f, (g.coords["x"] + 1) * f)
            self.report_weight = 1.0 if g.coords["y"] == 0 else 0.0  # count each replica once
        self.x, self.t = X[rows, cols].contiguous(), T[rows, cols].contiguous()
        self.scale = 1.0 / (self.n_rows * self.hidden)  # grads are summed: normalize by the global count
        self.sync = parallel.grad_sync(self.model, g) if self.grad_sync == "overlap" else None

    def loss_fn(self, y):
        return (y - self.t).pow(2).sum() * self.scale

    def step(self):
        t0 = time.perf_counter()
        if self.sync is not None:
            self.sync.start()  # backward launches the bucket all-reduces
        with parallel.overlap(self.model) if self.use_overlap else nullcontext():
            loss = self.loss_fn(self.model(self.x))
            loss.backward()
        t1 = time.perf_counter()
        if self.sync is not None:
            self.sync.finish()  # the rest launched, all waited, sums copied into .grad
        else:
            parallel.sync_gradients(self.model, self.grid)
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.phases = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        return loss.detach() * self.report_weight


def _memtrain(name, degrees, mode="easy", use_overlap=False, grad_sync="overlap"):
    return type(name, (MemtrainVariant,), {"name": name, "degrees": degrees, "mode": mode,
                                           "use_overlap": use_overlap, "grad_sync": grad_sync})


def make_variants(world):
    return {
        "ddp": DDPVariant,
        "mt-data": _memtrain("mt-data", (world, 1, 1, 1)),
        "mt-data-blocking": _memtrain("mt-data-blocking", (world, 1, 1, 1), grad_sync="blocking"),
        "fsdp2": FSDP2Variant,
        "mt-z": _memtrain("mt-z", (1, 1, 1, world)),
        "mt-z+ov": _memtrain("mt-z+ov", (1, 1, 1, world), use_overlap=True),
        "mt-x2y2-sh": _memtrain("mt-x2y2-sh", (world // 4, 2, 2, 1), mode="sharded"),
        "mt-x2z2-easy": _memtrain("mt-x2z2-easy", (world // 4, 2, 1, 2)),
    }


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
