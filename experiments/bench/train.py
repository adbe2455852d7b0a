"""Benchmark: memtrain's training step (single process) vs a plain PyTorch loop on the same HF model.

    python -m experiments.bench.train [--models ladder-10m,ladder-30m] [--steps 10] [--warmup 2]
                                      [--batch 8] [--seq 256] [--threads N] [--json out.json]

memtrain side: `memtrain.training.train` itself (the function `memtrain train` runs), on grid (1,1,1,1):
build_model on meta + parallelize, global-token normalization, sync_gradients, clip, AdamW, with
max_steps = warmup + steps. Its per-step time is the `step_time_s` it writes to metrics.jsonl.
Plain side: the identical transformers model (same config, loaded with memtrain's initial weights)
trained by `model(input_ids, labels=..., shift_labels=labels).loss.backward()`,
`torch.nn.utils.clip_grad_norm_`, `torch.optim.AdamW` (same groups, hyper-parameters and LR
schedule), fp32, on the same batches of the same stream (`stream.batch(step)`, fetched inside the
timed step on both sides). memtrain's labels are already shifted (labels[:, j] is the target of
position j), so the plain loop passes them as HF's `shift_labels` (and use_cache=False, as memtrain).

The two loops run interleaved, step by step (A B A B ...), through train()'s callbacks: `on_setup`
snapshots the initial weights for the plain model, `on_step` runs the plain loop's step of the same index
right after memtrain's (train() has measured its step by then). Reported per model, over the steps after `--warmup`:
median tokens/s of each side, the ratio of medians, the median of the per-step paired ratios (which
cancels load drifting between steps), the same paired ratio on process CPU seconds, MFU = 6 * params *
tokens/s / peak with peak = memtrain.training.perf.matmul_peak_flops (fp32, at the torch thread count in use;
the best of re-measurements at the start, between steps and after each model), and the step-1 and step-2
losses of both sides (step 2 follows one clipped AdamW update, so it checks gradients, clipping and the
optimizer too) with their relative difference (above 1e-4 fails the run). Target: paired ratio >= 0.95.

On a shared, loaded machine absolute figures drift; the paired ratio is the figure to read. With more
runnable processes than cores, multi-threaded steps stall at OpenMP barriers whenever one thread is
descheduled (steps vary 20x); `--threads 1` then gives far steadier ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from experiments.bench.common import load_average, machine, paired_ratio, rel_diff, write_json  # noqa: E402
from memtrain.config import RunConfig  # noqa: E402
from memtrain.models import build_model  # noqa: E402
from memtrain.training import build_schedule, train  # noqa: E402
from memtrain.training.perf import matmul_peak_flops  # noqa: E402

TARGET = 0.95
LOSS_TOL = 1e-4


def measure_peak(reps: int = 20) -> float:
    """matmul_peak_flops, re-measured (uncached) and kept as the best seen in this process:
    on a loaded machine one short measurement reads low, so it is also sampled between steps."""
    global _PEAK
    now = matmul_peak_flops.__wrapped__(torch.device("cpu"), torch.float32, 1024, reps)
    _PEAK = max(_PEAK, now)
    return _PEAK


_PEAK = 0.0


def make_config(name: str, args, out_steps: int) -> RunConfig:
    cfg = RunConfig()
    cfg.model.name = name
    cfg.train.batch_size = args.batch
    cfg.train.max_steps = out_steps
    cfg.train.precision = "fp32"
    cfg.data.seq_len = args.seq
    cfg.data.max_docs = args.max_docs
    if args.cache_dir:
        cfg.data.cache_dir = args.cache_dir
    cfg.parallel.data = 1
    cfg.wandb.mode = "disabled"
    cfg.eval.enabled = False
    return cfg


class PlainLoop:
    """The plain PyTorch loop on the HF model, with memtrain's initial weights and LR schedule."""

    def __init__(self, cfg: RunConfig, stream, init_state: dict, total: int):
        t = cfg.train
        self.cfg, self.stream = cfg, stream
        self.model = build_model(cfg.model.name, vocab_size=stream.vocab_size, device="cpu")
        missing, unexpected = self.model.load_state_dict(init_state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if unexpected or [k for k in missing if k not in tied]:
            raise RuntimeError(f"weights do not fit the plain model: missing {missing}, unexpected {unexpected}")
        self.model.train()
        params = list(self.model.parameters())
        self.params = params
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
        self.sched = build_schedule(self.opt, cfg, total)
        self.steps_per_epoch = len(stream) // t.batch_size

    def step(self, step: int) -> dict:
        t = self.cfg.train
        t0, c0 = time.perf_counter(), time.process_time()
        batch = self.stream.batch(step % self.steps_per_epoch, t.batch_size)
        self.opt.zero_grad(set_to_none=True)
        labels = batch["labels"]
        loss = self.model(batch["input_ids"], labels=labels, shift_labels=labels, use_cache=False).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip)
        self.opt.step()
        self.sched.step()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"step": step + 1, "loss": loss.item(), "grad_norm": float(norm), "step_time_s": dt,
                "tokens_per_s": labels.numel() / dt, "tokens_per_cpu_s": labels.numel() / cpu}


def run_model(name: str, args) -> dict:
    total = args.warmup + args.steps
    cfg = make_config(name, args, total)
    state: dict = {"mt": [], "plain": []}

    def on_setup(stream, plm):
        init = {k: v.detach().clone() for k, v in plm.full_state_dict().items()}
        state["plain_loop"] = PlainLoop(cfg, stream, init, total)
        state["params"] = plm.num_params()
        del init
        state["cpu_mark"] = time.process_time()

    def on_step(record):
        # memtrain's CPU seconds: everything since the previous plain step ended (its step, plus
        # train()'s few lines of bookkeeping after it; step 1 also holds the optimizer's setup).
        cpu = time.process_time() - state["cpu_mark"]
        state["mt"].append(dict(record, tokens_per_cpu_s=args.batch * args.seq / cpu))
        state["plain"].append(state["plain_loop"].step(record["step"] - 1))
        measure_peak(3)
        state["cpu_mark"] = time.process_time()
        mt, pl = state["mt"][-1], state["plain"][-1]
        if args.verbose:
            print(f"  step {mt['step']:3d}  memtrain {mt['tokens_per_s']:8.0f} tok/s  "
                  f"plain {pl['tokens_per_s']:8.0f} tok/s  loss {mt['loss']:.5f} / {pl['loss']:.5f}", flush=True)

    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as out:
        train(cfg, out, on_setup=on_setup, on_step=on_step)
    mt, pl = state["mt"], state["plain"]
    timed = range(args.warmup, total)
    mt_tps = [mt[i]["tokens_per_s"] for i in timed]
    pl_tps = [pl[i]["tokens_per_s"] for i in timed]
    paired = [a / b for a, b in zip(mt_tps, pl_tps)]
    cpu_paired = [mt[i]["tokens_per_cpu_s"] for i in timed], [pl[i]["tokens_per_cpu_s"] for i in timed]
    measure_peak()
    params = state["params"]

    res = {
        "model": name, "params": params, "tokens_per_step": args.batch * args.seq,
        "memtrain_tok_s": statistics.median(mt_tps), "plain_tok_s": statistics.median(pl_tps),
        "paired_ratio": statistics.median(paired),
        "paired_ratio_min": min(paired), "paired_ratio_max": max(paired),
        "cpu_paired_ratio": paired_ratio(*cpu_paired),
        "loss1": (mt[0]["loss"], pl[0]["loss"]), "loss1_rel": rel_diff(mt[0]["loss"], pl[0]["loss"]),
        "loss2": (mt[1]["loss"], pl[1]["loss"]) if total > 1 else None,
        "loss2_rel": rel_diff(mt[1]["loss"], pl[1]["loss"]) if total > 1 else None,
        "gnorm1_rel": rel_diff(mt[0]["grad_norm"], pl[0]["grad_norm"]),
        "load_before": load_before, "load_after": load_average(),
        "memtrain_steps_tok_s": [r["tokens_per_s"] for r in mt], "plain_steps_tok_s": [r["tokens_per_s"] for r in pl],
    }
    res["ratio"] = res["memtrain_tok_s"] / res["plain_tok_s"]
    return res


def print_table(results: list[dict], args) -> None:
    peak = _PEAK
    for r in results:
        r["peak_flops"] = peak
        r["memtrain_mfu"] = 6 * r["params"] * r["memtrain_tok_s"] / peak
        r["plain_mfu"] = 6 * r["params"] * r["plain_tok_s"] / peak
    print(f"\nbatch {args.batch} x seq {args.seq} = {args.batch * args.seq} tokens/step, fp32, "
          f"{torch.get_num_threads()} torch threads, {args.steps} timed steps after {args.warmup} warm-up, "
          f"interleaved A B A B; matmul peak {peak / 1e9:.1f} GFLOP/s; {machine()}")
    head = (f"{'model':<11}{'params':>7}{'memtrain tok/s':>15}{'plain tok/s':>12}{'ratio':>7}{'paired':>7}"
            f"{'[min, max]':>13}{'cpu-time':>9}{'MFU mt':>8}{'MFU plain':>10}{'loss1 rel':>10}{'loss2 rel':>10}"
            f"{'gnorm rel':>10}  target")
    print(head)
    print("-" * len(head))
    for r in results:
        ok = "ok" if r["paired_ratio"] >= TARGET else "BELOW"
        loss2 = r["loss2_rel"] if r["loss2_rel"] is not None else float("nan")
        print(f"{r['model']:<11}{r['params'] / 1e6:6.1f}M{r['memtrain_tok_s']:15.0f}{r['plain_tok_s']:12.0f}"
              f"{r['ratio']:7.3f}{r['paired_ratio']:7.3f}   [{r['paired_ratio_min']:.2f}, {r['paired_ratio_max']:.2f}]"
              f"{r['cpu_paired_ratio']:9.3f}{100 * r['memtrain_mfu']:7.1f}%{100 * r['plain_mfu']:9.1f}%"
              f"{r['loss1_rel']:10.1e}{loss2:10.1e}{r['gnorm1_rel']:10.1e}  {ok} (>= {TARGET})")
    print("ratio = median memtrain tok/s / median plain tok/s; paired = median of per-step ratios [range]; "
          "cpu-time = the same paired ratio on process CPU seconds (insensitive to descheduling)")
    for r in results:
        print(f"{r['model']}: step-1 loss memtrain {r['loss1'][0]:.6f} plain {r['loss1'][1]:.6f}; step-2 loss "
              f"{r['loss2'][0]:.6f} / {r['loss2'][1]:.6f}; load average {r['load_before']} -> {r['load_after']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="ladder-10m,ladder-30m")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps excluded from the timing")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--max-docs", type=int, default=600, help="corpus documents (the stream must hold "
                    "batch * (warmup + steps) sequences)")
    ap.add_argument("--cache-dir", default=None, help="memtrain data cache (default: memtrain's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--verbose", action="store_true", help="print every step")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    measure_peak()
    results = []
    for name in args.models.split(","):
        print(f"[{name}] {args.warmup} + {args.steps} steps ...", flush=True)
        results.append(run_model(name.strip(), args))
    print_table(results, args)
    bad = [r["model"] for r in results if r["loss1_rel"] > LOSS_TOL or (r["loss2_rel"] or 0) > LOSS_TOL]
    write_json(args.json, {"results": results})
    if bad:
        raise SystemExit(f"loss mismatch above {LOSS_TOL} for {', '.join(bad)}")


if __name__ == "__main__":
    main()
