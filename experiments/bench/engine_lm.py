"""Benchmark: memtrain's 4D engine vs torch DDP and FSDP2 on a ladder language model, on every grid.

`python -m experiments.bench.engine` compares the engine with its peers on an MLP stack and a few grids; this
makes the same comparison on a language model (a Llama of memtrain.models.MODELS, built by transformers) and on
EVERY grid (data, x, y, z) of each world size, in both of memtrain's modes:

    ddp            torch DistributedDataParallel around the plain transformers model
    fsdp2          torch fully_shard per decoder layer + root, the same plain model
    d{}x{}y{}z{}   memtrain: parallelize(build_model(model, device="meta"), grid, mode, seed=0), sharded and easy

A step is the trainer's. memtrain: memtrain.training.train_step (forward, backward with the bucketed gradient
all-reduces, clip_grad_norm_, AdamW from build_optimizer). torch: model(ids, labels=, shift_labels=labels).loss
.backward() (memtrain's labels come shifted: labels[:, j] is the target of position j), torch's clip_grad_norm_
and AdamW with the same groups and hyper-parameters (RunConfig's defaults, no LR schedule on either side). Every
model starts from the same weights: memtrain's seeded init does not depend on the grid, and the plain models load
it under HF names (ParallelLM.full_state_dict). Every variant trains on the same global batch of `--batch` rows
of `--seq` tokens (DDP and FSDP2: batch / world rows per rank; memtrain: ParallelLM.local_rows).

Each world size is one fork of run_ranks (gloo, file:// rendezvous, one torch thread per rank) that holds every
variant. Parity comes first: the global losses and gradient norms (before clipping) of steps 1 and 2 of every variant
must match DDP's within LOSS_TOL (relative), or the run stops before timing and fails. Step 2 follows one AdamW
update, so its loss checks the gradients' direction, their sync and the optimizer; AdamW's first update is blind
to a gradient's scale, which the norms check. Then `--warmup` + `--rounds` rounds run every variant once,
the order rotated each round; a step starts after a barrier and lasts as long as its slowest rank
(common.timed_rounds). Reported per variant: the median step time, the paired ratios to DDP and to FSDP2 (median
over rounds of the per-round ratio, so load drifting between rounds hits both sides alike), parameters + AdamW
state per rank; and per world size the fastest grid.

    python -m experiments.bench.engine_lm [--model ladder-1m] [--worlds 4,8] [--batch 16] [--seq 64]
                                          [--rounds 5] [--warmup 1] [--set key=value ...] [--json out.json]

`--set` replaces a field of the model's transformers config (num_hidden_layers=1, vocab_size=512: a smaller model
for tests). On 2 shared cores 4 or 8 ranks oversubscribe the CPU: the figures compare implementations under the
same conditions; they are not a scaling measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import parallel  # noqa: E402
from experiments.bench.common import (  # noqa: E402
    fsdp2,
    global_sum,
    load_average,
    machine,
    paired_ratio,
    param_opt_bytes,
    rel_diff,
    table,
    timed_rounds,
    write_json,
)
from memtrain.config import RunConfig  # noqa: E402
from memtrain.hf import parallelize  # noqa: E402
from memtrain.models import build_model  # noqa: E402
from memtrain.plan.search import factorizations  # noqa: E402
from memtrain.training import build_optimizer, train_step  # noqa: E402
from memtrain.training.step import peak_lr  # noqa: E402
from parallel.forked import run_ranks  # noqa: E402

MODES = ("sharded", "easy")
PEERS = ("ddp", "fsdp2")
CFG = RunConfig()  # the trainer's defaults: AdamW's lr, betas and weight decay, the clip, overlap, gradient sync
SEED = 1234
# Every grid computes the same sums in another order (a K dimension split over x or y, partial sums all-reduced
# over other groups, DDP's bucketed average), and fp32 rounds each order differently. Measured on ladder-1m at 4 and
# 8 ranks: losses within 1e-7 of DDP's; gradient norms within 2e-6, DDP's being the odd one (one fp32 sum of squares
# over each whole tensor, 262k elements for the embedding, is ~1.5e-6 off float64; the sharded sides sum shorter
# pieces and agree with each other to 1e-7). 1e-5 is 5x above that and still fails when one MLP matrix of the plain
# model is scaled by 1.01 (the tests' check: gradient norms off by 5e-4, the step-2 loss by 2e-5).
LOSS_TOL = 1e-5


def grid_name(degrees) -> str:
    return "d{}x{}y{}z{}".format(*degrees)


def global_batch(vocab: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token rows as the trainer feeds them: ids and their next tokens (pre-shifted labels)."""
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(SEED))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def plain_model(args, init: dict) -> nn.Module:
    """The plain transformers model holding memtrain's initial weights."""
    model = build_model(args.model, device="cpu", **args.set)
    missing, unexpected = model.load_state_dict(init, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"memtrain's weights do not fit the plain model: missing {missing}, unexpected {unexpected}")
    return model


class TorchVariant:
    """DDP or FSDP2 around the plain model: this rank's batch / world rows, the trainer's clip and AdamW."""

    def __init__(self, kind: str, model: nn.Module, rank: int, world: int, ids, labels):
        k = ids.shape[0] // world
        self.ids, self.labels = ids[rank * k:(rank + 1) * k], labels[rank * k:(rank + 1) * k]
        self.world = world
        if kind == "ddp":
            self.model = nn.parallel.DistributedDataParallel(model)
        else:  # one FSDP unit per decoder layer (transformers' Llama, GPT-NeoX: base_model.layers)
            self.model = fsdp2(model, model.base_model.layers, world)
        params = list(self.model.parameters())
        t = CFG.train
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=peak_lr(CFG, model.config.hidden_size), betas=(t.beta1, t.beta2),
                                     eps=1e-8)

    def step(self) -> tuple[float, float]:
        """One training step; returns this rank's shares of the global loss and gradient norm (summed over ranks
        they are the global values; the mean loss of equal row counts is the global mean)."""
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(self.ids, labels=self.labels, shift_labels=self.labels, use_cache=False).loss
        loss.backward()  # DDP and FSDP2 average the gradients over ranks in here
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CFG.train.grad_clip)
        self.opt.step()
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP2: a norm of sharded gradients
        return loss.item() / self.world, norm.item() / self.world


class MemtrainVariant:
    """The model parallelized on one grid and mode, stepped by the trainer's train_step."""

    def __init__(self, args, grid: parallel.Grid, mode: str, ids, labels):
        self.model = parallelize(build_model(args.model, device="meta", **args.set), grid, mode, seed=0,
                                 device="cpu")
        self.grid, self.opt = grid, build_optimizer(self.model, CFG)
        self.ids, self.labels, self.keep = ids, labels, labels != parallel.IGNORE_INDEX

    def step(self) -> tuple[float, float]:
        p = CFG.parallel
        sums, norm = train_step(self.model, self.grid, self.opt, self.ids, self.labels, self.keep,
                                self.ids.shape[0], overlap=p.overlap, grad_sync=p.grad_sync,
                                grad_clip=CFG.train.grad_clip)
        return sums.kept_mean() / self.grid.world_size, norm.item() / self.grid.world_size  # both global already


def parity(first: dict) -> dict:
    """{variant: relative differences of its [loss, norm] at steps 1 and 2 to DDP's, as [loss 1, loss 2, norm 1,
    norm 2]}."""
    return {n: [rel_diff(v[i][k], first["ddp"][i][k]) for k in (0, 1) for i in (0, 1)] for n, v in first.items()}


def worker(rank: int, world: int, args) -> dict | None:
    vocab = build_model(args.model, device="meta", **args.set).config.vocab_size
    ids, labels = global_batch(vocab, args.batch, args.seq)
    engine = {}
    for degrees in sorted(factorizations(world)):
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        for mode in MODES:
            engine[f"{grid_name(degrees)} {mode}"] = MemtrainVariant(args, grid, mode, ids, labels)
    init = next(iter(engine.values())).model.full_state_dict()  # collective: every rank asks, in the same order
    variants = {kind: TorchVariant(kind, plain_model(args, init), rank, world, ids, labels) for kind in PEERS}
    variants.update(engine)
    # Steps 1 and 2, [loss, norm] each: all-reduced, so every rank holds the same figures and decides alike.
    first = {n: [[global_sum(x) for x in v.step()] for _ in range(2)] for n, v in variants.items()}
    out = {"first": first, "memory": {n: param_opt_bytes(v.model, v.opt) for n, v in variants.items()}}
    if max(max(d) for d in parity(first).values()) <= LOSS_TOL:
        out["times"], _ = timed_rounds({n: v.step for n, v in variants.items()}, args.warmup, args.rounds)
    return out if rank == 0 else None


def summarize(world: int, res: dict) -> list[dict]:
    """One row per variant: its step times, the ratios to the peers, parity and memory."""
    diffs, rows = parity(res["first"]), []
    for name, first in res["first"].items():
        grid, _, mode = name.partition(" ")
        row = {"world": world, "variant": name, "grid": grid, "mode": mode or "torch",
               "losses": [s[0] for s in first], "grad_norms": [s[1] for s in first], "rel_diffs": diffs[name],
               "param_bytes": res["memory"][name][0], "opt_bytes": res["memory"][name][1]}
        if "times" in res:
            times = res["times"][name]
            row.update(times_s=times, median_s=statistics.median(times))
            for peer in PEERS:
                row[f"ratio_{peer}"] = row["median_s"] / statistics.median(res["times"][peer])
                row[f"paired_{peer}"] = paired_ratio(times, res["times"][peer])
        rows.append(row)
    return rows


def print_rows(world: int, rows: list[dict]) -> None:
    timed = "median_s" in rows[0]
    head = ["grid", "mode"] + (["median step s", "vs DDP", "vs FSDP2"] if timed else []) + [
        "rel diff loss s1/s2, norm s1/s2", "MB/rank (params+AdamW)"]
    cells = []
    for r in rows:
        c = [r["grid"], r["mode"]]
        if timed:
            c += [f"{r['median_s']:.4f}", f"{r['paired_ddp']:.3f}", f"{r['paired_fsdp2']:.3f}"]
        c += ["{:.0e}/{:.0e}, {:.0e}/{:.0e}".format(*r["rel_diffs"]),
              f"{(r['param_bytes'] + r['opt_bytes']) / 2**20:.2f}"]
        cells.append(c)
    ddp = rows[0]
    print(f"\nworld {world}: DDP's global loss {ddp['losses'][0]:.6f} at step 1, {ddp['losses'][1]:.6f} at step 2; "
          f"gradient norm {ddp['grad_norms'][0]:.6f}, {ddp['grad_norms'][1]:.6f}")
    print(table(head, cells))
    if timed:
        best = min((r for r in rows if r["mode"] in MODES), key=lambda r: r["median_s"])
        print("vs DDP / vs FSDP2: median over rounds of the step time / the peer's in the same round")
        print(f"world {world}: fastest grid {best['grid']} {best['mode']}, {best['median_s']:.4f} s per step, "
              f"{best['paired_ddp']:.3f}x DDP, {best['paired_fsdp2']:.3f}x FSDP2 (paired medians)")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ladder-1m")
    ap.add_argument("--worlds", default="4,8", help="comma-separated world sizes, one fork each")
    ap.add_argument("--batch", type=int, default=16, help="global rows per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (one step of every variant each)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="replace a field of the model's config (a JSON value), e.g. num_hidden_layers=1")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.set = {k: json.loads(v) for k, _, v in (s.partition("=") for s in args.set)}
    for w in args.worlds:
        if args.batch % w:
            ap.error(f"--batch {args.batch} must be divisible by every world size ({w})")
    print(f"memtrain engine vs DDP / FSDP2 on {args.model} {args.set or ''}: global batch {args.batch} x {args.seq} "
          f"tokens, fp32, AdamW, grad clip {CFG.train.grad_clip}; worlds {args.worlds} (gloo, fork, 1 thread/rank); "
          f"{args.warmup} warm-up + {args.rounds} timed rounds, variants interleaved; parity tolerance {LOSS_TOL:g} "
          f"relative to DDP; {machine()}; load average {load_average()}")
    rows, t0 = [], time.time()
    for world in args.worlds:
        res = run_ranks(world, worker, args, timeout=args.timeout, pg_timeout=300)[0]
        rows += summarize(world, res)
        print_rows(world, [r for r in rows if r["world"] == world])
        if "times" not in res:  # parity failed: models that disagree are a bug to fix, not a thing to time
            break
    print(f"\nwall time {time.time() - t0:.0f} s, load average {load_average()}")
    write_json(args.json, {"args": vars(args), "loss_tol": LOSS_TOL, "rows": rows})
    bad = [f"world {r['world']} {r['variant']}" for r in rows if max(r["rel_diffs"]) > LOSS_TOL]
    if bad:
        raise SystemExit(f"PARITY FAILED (loss or gradient norm > {LOSS_TOL:g} relative to DDP's at step 1 or 2), "
                         f"not timed: {', '.join(bad)}")
    return rows


if __name__ == "__main__":
    main()
