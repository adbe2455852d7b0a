"""Benchmark: memtrain's training step (single process) vs a plain PyTorch loop on the same HF model.

    python -m experiments.bench.train [--device cpu|cuda] [--precision fp32|bf16] [--models ladder-10m,ladder-30m]
                                      [--steps 10] [--warmup 2] [--batch 8] [--seq 256] [--threads N] [--json out.json]
                                      [--profile DIR] [--compile]

--device defaults to cuda when torch sees a GPU (memtrain's trainer then uses it: `--device cpu` is refused there;
hide the GPU with CUDA_VISIBLE_DEVICES= instead). Defaults per device: on cpu fp32, ladder-10m and ladder-30m,
sequences of 256; on cuda bf16, llama-3.2-1b (Llama 3.2 1B's shape, 0.98B parameters at the stream's 4096-token
vocabulary), sequences of 1024; batch 8 on both.

memtrain side: `memtrain.training.train` itself (the function `memtrain train` runs), on grid (1,1,1,1):
build_model on meta + parallelize, global-token normalization, sync_gradients, clip, AdamW, with
max_steps = warmup + steps. Its per-step time is the `step_time_s` it writes to metrics.jsonl (on CUDA the
trainer synchronizes before reading the clock).
Plain side: the identical transformers model (same config, loaded with memtrain's initial weights)
trained by `model(input_ids, labels=..., shift_labels=labels, position_ids=...).loss.backward()`,
`torch.nn.utils.clip_grad_norm_`, `torch.optim.AdamW` (same groups, hyper-parameters, LR schedule and
implementation as memtrain's build_optimizer: torch's default on CPU, fused on CUDA), on the same batches of the
same stream (`stream.batch(step)`, fetched and moved to the device inside the timed step on both sides).
memtrain's labels are already shifted (labels[:, j] is the target of position j), so the plain loop passes them
as HF's `shift_labels` (and use_cache=False, as memtrain); the batch's position_ids (document attention:
positions restart at every packed document) go to both. --precision bf16 is autocast to bf16 around the forward
and loss on both sides, as the trainer applies it (weights, gradients and AdamW stay fp32); fp32 is no autocast.
On CUDA each plain step starts and ends with torch.cuda.synchronize.

The two loops run interleaved, step by step (A B A B ...), through train()'s callbacks: `on_setup` snapshots the
initial weights for the plain model, `on_step` runs the plain loop's step of the same index right after memtrain's
(train() has measured its step by then). Reported per model, over the steps after `--warmup`: median tokens/s of
each side, the ratio of medians, the median of the per-step paired ratios (which cancels load drifting between
steps), the same paired ratio on process CPU seconds, MFU = FLOPs per token (the trainer's and the planner's:
memtrain.training.perf.flops_per_token) * tokens/s / peak, and the step-1 and step-2 losses of both sides (step 2
follows one clipped AdamW update, so it checks gradients, clipping and the optimizer too) with their relative
difference (above LOSS_TOL fails the run: 1e-4 in fp32, 1e-3 in bf16, whose 8-bit significands turn any difference
in summation order into larger steps; measured on a CPU at ladder-1m, rows packing 2-3 documents: at most 6e-8 in
fp32, 5e-6 in bf16; on an H100 at llama-3.2-1b in bf16: 4.4e-6 and 2.4e-6, the step-1 gradient norm 1.0e-4). Target:
paired ratio >= 0.95.
The peak: on CPU memtrain.training.perf.matmul_peak_flops in the run's dtype (at the torch thread count in use;
the best of re-measurements at the start, between steps and after each model); on CUDA
memtrain.training.perf.mfu_peak, the one the trainer's MFU uses (the GPU's dense bf16 datasheet peak, or a
measured matmul for a GPU its table does not know), named in the output.
--profile DIR: the step of each side after the timed ones (every run has one, untimed, so that the LR schedule,
which spans the run, is the same with and without --profile) under torch.profiler, its ops by self time (device
time on a GPU) written to DIR/<model>_memtrain.txt and _plain.txt: where the two steps differ.
Peak memory, on CUDA only: torch.cuda.max_memory_allocated over each side's steps, its counter reset before
each (both models and optimizers stay resident throughout, so each side's peak holds the other's weights and
AdamW state too), and the step's own part of it: that peak above what was allocated when the step began
(activations, gradients, temporaries). On CPU these fields are None.

Measured first on one GPU on 2026-11-24 (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, transformers 5.23, the
defaults: llama-3.2-1b, bf16, batch 8 x 1024, 10 steps after 2): memtrain 40,236 tok/s, the plain loop 46,021;
ratio 0.874, paired 0.866 [0.64, 0.89]: BELOW the 0.95 target; MFU 24.0% vs 27.4% of the 989 TFLOP/s datasheet
peak (then counted as 6 x all parameters per token; today's count, with attention, gives 25.6% vs 29.3%); peak
memory 43,992 MiB vs 45,863 (both models resident), the step's own part 13,973 vs 15,845 MiB. That step was not
profiled on the GPU. A CPU stand-in for a launch-bound step, where a step's time is the host's
dispatch work (`--precision bf16 --batch 1 --seq 128 --threads 1`), gave 0.841 at ladder-1m and 0.907 at
ladder-10m (paired, 60 steps), as on the H100. The host's extra work was the engine's per Linear (its autograd
function, a prefetcher lookup and the weight cast again in backward) and embedding lookup, a gradient-sync lookup
on a grid of one rank, and clipping's host round trip and per-tensor scaling. Since 2026-11-27, without tensor
parallelism a Linear is F.linear itself and the embedding F.embedding (parallel/linear.py), backward at z = 1
reuses the forward's cast weight and clipping stays on the device: 0.905 and 0.947 in the same session (AMD EPYC,
2 cores, avx512_bf16), training bit for bit as before (the same step-2 losses); the defaults there read 1.011
(ladder-10m, bf16). The engine's vocabulary-parallel loss stays (torch's own rounds otherwise; parallel/linear.py
says why that matters), but since 2026-11-27 it reads bf16 logits without an fp32 copy of them and its backward
scales the saved softmax in place, bit for bit as before: two [tokens, vocabulary] fp32 allocations fewer a step
(128 MiB each at this bench's GPU defaults: 8 x 1024 tokens x the stream's 4096-token vocabulary); the defaults at
ladder-10m bf16 read 1.005 before, 1.026 and 1.019 after (paired, 30 steps, one session, same CPU).
On one NVIDIA H200 (2026-11-28, torch 2.11.0+cu130, transformers 5.24, the defaults; its 989 TFLOP/s datasheet peak
is the H100's): paired 0.943 [0.93, 0.95], MFU 30.8% vs 32.5%; the two profiled steps differed in gradient clipping:
grad_norm's two kernels per tensor (245 pow, 251 sum) against torch's one multi-tensor norm, and a float64
coefficient that sent torch's multi-tensor multiply down its per-tensor path (147 mul_). With torch's multi-tensor
norm off a CPU (parallel/grads.py: a CPU keeps its arithmetic) and an fp32 coefficient for fp32 gradients (bitwise
the same product): memtrain 50,470 tok/s, the plain loop 51,710; ratio 0.976, paired 0.976 [0.96, 0.98]: the 0.95
target met; MFU 32.1% vs 32.9%; step-2 losses within 1.4e-5; peak memory 45,783 vs 45,863 MiB (the step's own part
15,765 vs 15,845).

--compile: train.compile on memtrain's side (ParallelLM.compile_blocks) and nn.Module.compile on the plain loop's
blocks, the same regions; the warm-up steps then hold the compilations (the packed-document mask present or absent
is a graph each). On the same CPU, ladder-10m, 20 steps (2026-11-27), memtrain's tok/s and the paired ratio, eager
then compiled: bf16 4,613 (1.020) then 4,862 (1.045), a second pair 4,580 (1.022) then 4,679 (1.029); fp32 2,552
(1.004) then 2,489 (1.011). A matmul-bound CPU step gains little; the step-2 losses stayed within 7e-6 of the plain
loop's. On the H200 above (4 warm-up steps): before the clipping change 66,513 vs 71,084 tok/s, paired 0.933, MFU
42.3% vs 45.2%; after it 70,285 vs 72,468, paired 0.973 [0.95, 1.08], MFU 44.7% vs 46.1% (the issue's 40% met, with
compiled blocks; eager 32.1%), step-2 losses within 1.0e-5, peak memory 39,639 vs 39,719 MiB.

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
from contextlib import nullcontext

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

import parallel  # noqa: E402
from experiments.bench.common import load_average, machine, paired_ratio, rel_diff, write_json  # noqa: E402
from memtrain.config import RunConfig  # noqa: E402
from memtrain.hf.blocks import transformer_blocks  # noqa: E402
from memtrain.models import build_model  # noqa: E402
from memtrain.training import build_schedule, train  # noqa: E402
from memtrain.training.perf import Peak, flops_per_token, matmul_peak_flops, mfu_peak  # noqa: E402
from memtrain.training.step import adamw_kwargs  # noqa: E402

TARGET = 0.95
LOSS_TOL = {"fp32": 1e-4, "bf16": 1e-3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULTS = {"cpu": {"models": "ladder-10m,ladder-30m", "seq": 256, "precision": "fp32"},
            "cuda": {"models": "llama-3.2-1b", "seq": 1024, "precision": "bf16"}}
MB = 2**20


def measure_peak(dtype: torch.dtype, reps: int = 20) -> None:
    """CPU: matmul_peak_flops, re-measured (uncached) and kept as the best seen in this process: on a loaded
    machine one short measurement reads low, so it is also sampled between steps."""
    now = matmul_peak_flops.__wrapped__(torch.device("cpu"), dtype, 1024, reps)
    _PEAK[dtype] = max(_PEAK.get(dtype, 0.0), now)


_PEAK: dict[torch.dtype, float] = {}


def peak_of(args) -> Peak:
    """MFU's denominator: on CPU the best matmul seen (measure_peak), on CUDA the trainer's (perf.mfu_peak)."""
    if args.device == "cuda":
        return mfu_peak(torch.device("cuda", torch.cuda.current_device()), DTYPES[args.precision])
    return Peak(_PEAK[DTYPES[args.precision]], f"measured {args.precision} 1024^3 matmul on this CPU")


def make_config(name: str, args, out_steps: int) -> RunConfig:
    cfg = RunConfig()
    cfg.model.name = name
    cfg.train.batch_size = args.batch
    cfg.train.max_steps = out_steps
    cfg.train.precision = args.precision
    cfg.train.compile = args.compile
    cfg.data.seq_len = args.seq
    cfg.data.max_docs = args.max_docs
    if args.corpus:
        cfg.data.corpus = args.corpus
    if args.cache_dir:
        cfg.data.cache_dir = args.cache_dir
    cfg.parallel.data = 1
    cfg.wandb.mode = "disabled"
    cfg.eval.enabled = False
    return cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time the step, not its launch
        torch.cuda.synchronize(device)


def _memory_mark(device: torch.device) -> int | None:
    """Start a side's memory window: reset CUDA's peak counter and return the bytes allocated now."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _memory_read(device: torch.device, base: int | None) -> dict:
    """The window's peak allocation and its part above `base`, in MiB (None on CPU)."""
    if base is None:
        return {"peak_mb": None, "step_mb": None}
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_mb": peak / MB, "step_mb": (peak - base) / MB}


class PlainLoop:
    """The plain PyTorch loop on the HF model, with memtrain's initial weights and LR schedule."""

    def __init__(self, cfg: RunConfig, stream, init_state: dict, total: int, device: torch.device):
        t = cfg.train
        self.cfg, self.stream, self.device = cfg, stream, device
        self.amp = torch.bfloat16 if t.precision == "bf16" else None
        self.model = build_model(cfg.model.name, vocab_size=stream.vocab_size, device=device)
        missing, unexpected = self.model.load_state_dict(init_state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if unexpected or [k for k in missing if k not in tied]:
            raise RuntimeError(f"weights do not fit the plain model: missing {missing}, unexpected {unexpected}")
        self.model.train()
        if t.compile:  # the blocks memtrain compiles (ParallelLM.compile_blocks), by nn.Module.compile
            for block in transformer_blocks(self.model):
                block.compile()
        params = list(self.model.parameters())
        self.params = params
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                                     **adamw_kwargs(p.device.type for p in params))
        self.sched = build_schedule(self.opt, cfg, total)
        self.steps_per_epoch = len(stream) // t.batch_size

    def step(self, step: int) -> dict:
        t, dev = self.cfg.train, self.device
        _sync(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        batch = self.stream.batch(step % self.steps_per_epoch, t.batch_size)
        self.opt.zero_grad(set_to_none=True)
        labels = batch["labels"].to(dev)
        pos = batch["position_ids"].to(dev) if "position_ids" in batch else None
        with torch.autocast(dev.type, dtype=self.amp) if self.amp else nullcontext():
            loss = self.model(batch["input_ids"].to(dev), labels=labels, shift_labels=labels, position_ids=pos,
                              use_cache=False).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip)
        self.opt.step()
        self.sched.step()
        _sync(dev)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"step": step + 1, "loss": loss.item(), "grad_norm": float(norm), "step_time_s": dt,
                "tokens_per_s": labels.numel() / dt, "tokens_per_cpu_s": labels.numel() / cpu}


def _profiler(device: torch.device):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


def _write_profile(prof, device: torch.device, path: str) -> None:
    """The step's ops by self time (device time on a GPU: its kernels), and the totals that compare two sides."""
    events = prof.key_averages()
    on_gpu = device.type == "cuda"
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    total_us = sum(getattr(e, key) for e in events)
    calls = sum(e.count for e in events if not on_gpu or e.self_device_time_total > 0)
    with open(path, "w") as f:
        f.write(f"{'device' if on_gpu else 'CPU'} self time {total_us / 1e3:.2f} ms over {calls} "
                f"{'kernel-running ops' if on_gpu else 'op calls'}\n")
        f.write(events.table(sort_by=key, row_limit=60))
    print(f"  profile: {path} ({total_us / 1e3:.2f} ms, {calls} calls)")


def run_model(name: str, args) -> dict:
    total = args.warmup + args.steps + 1  # the last step, untimed, is the one --profile profiles
    cfg = make_config(name, args, total)
    state: dict = {"mt": [], "plain": []}

    def on_setup(stream, plm):
        device = next(plm.parameters()).device
        init = {k: v.detach().clone() for k, v in plm.full_state_dict().items()}
        state["plain_loop"] = PlainLoop(cfg, stream, init, total, device)
        state["params"], state["device"] = plm.num_params(), device
        state["flops_per_token"] = flops_per_token(plm.config, plm.num_params(), stream.seq_len)
        del init
        state["cpu_mark"] = time.process_time()
        state["mem_base"] = _memory_mark(device)

    def on_step(record):
        device = state["device"]
        if record["step"] == total:
            if args.profile:  # memtrain's step ran under the profiler: the plain one next
                state["profiler"].stop()
                _write_profile(state["profiler"], device, os.path.join(args.profile, f"{name}_memtrain.txt"))
                with _profiler(device) as prof:
                    state["plain_loop"].step(record["step"] - 1)
                _write_profile(prof, device, os.path.join(args.profile, f"{name}_plain.txt"))
            return
        # memtrain's CPU seconds: everything since the previous plain step ended (its step, plus
        # train()'s few lines of bookkeeping after it; step 1 also holds the optimizer's setup).
        cpu = time.process_time() - state["cpu_mark"]
        state["mt"].append(dict(record, tokens_per_cpu_s=args.batch * args.seq / cpu,
                                **_memory_read(device, state["mem_base"])))
        base = _memory_mark(device)
        state["plain"].append(dict(state["plain_loop"].step(record["step"] - 1), **_memory_read(device, base)))
        if device.type == "cpu":
            measure_peak(DTYPES[args.precision], 3)
        state["cpu_mark"] = time.process_time()
        state["mem_base"] = _memory_mark(device)
        if record["step"] == total - 1 and args.profile:
            state["profiler"] = _profiler(device)
            state["profiler"].start()
        mt, pl = state["mt"][-1], state["plain"][-1]
        if args.verbose:
            print(f"  step {mt['step']:3d}  memtrain {mt['tokens_per_s']:8.0f} tok/s  "
                  f"plain {pl['tokens_per_s']:8.0f} tok/s  loss {mt['loss']:.5f} / {pl['loss']:.5f}", flush=True)

    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as out:
        train(cfg, out, on_setup=on_setup, on_step=on_step)
    mt, pl = state["mt"], state["plain"]
    timed = range(args.warmup, args.warmup + args.steps)
    mt_tps = [mt[i]["tokens_per_s"] for i in timed]
    pl_tps = [pl[i]["tokens_per_s"] for i in timed]
    paired = [a / b for a, b in zip(mt_tps, pl_tps)]
    cpu_paired = [mt[i]["tokens_per_cpu_s"] for i in timed], [pl[i]["tokens_per_cpu_s"] for i in timed]
    if args.device == "cpu":
        measure_peak(DTYPES[args.precision])
    params = state["params"]

    def most(side, key):
        return max(side[i][key] for i in timed) if args.device == "cuda" else None

    res = {
        "model": name, "params": params, "flops_per_token": state["flops_per_token"],
        "tokens_per_step": args.batch * args.seq,
        "device": args.device, "precision": args.precision, "compile": args.compile,
        "memtrain_tok_s": statistics.median(mt_tps), "plain_tok_s": statistics.median(pl_tps),
        "paired_ratio": statistics.median(paired),
        "paired_ratio_min": min(paired), "paired_ratio_max": max(paired),
        "cpu_paired_ratio": paired_ratio(*cpu_paired),
        "loss1": (mt[0]["loss"], pl[0]["loss"]), "loss1_rel": rel_diff(mt[0]["loss"], pl[0]["loss"]),
        "loss2": (mt[1]["loss"], pl[1]["loss"]) if len(mt) > 1 else None,
        "loss2_rel": rel_diff(mt[1]["loss"], pl[1]["loss"]) if len(mt) > 1 else None,
        "gnorm1_rel": rel_diff(mt[0]["grad_norm"], pl[0]["grad_norm"]),
        "memtrain_peak_mb": most(mt, "peak_mb"), "plain_peak_mb": most(pl, "peak_mb"),
        "memtrain_step_mb": most(mt, "step_mb"), "plain_step_mb": most(pl, "step_mb"),
        "load_before": load_before, "load_after": load_average(),
        "memtrain_steps_tok_s": [r["tokens_per_s"] for r in mt], "plain_steps_tok_s": [r["tokens_per_s"] for r in pl],
    }
    res["ratio"] = res["memtrain_tok_s"] / res["plain_tok_s"]
    return res


def print_table(results: list[dict], args) -> None:
    peak = peak_of(args)
    for r in results:
        r["peak_flops"], r["peak_source"] = peak.flops, peak.source
        r["memtrain_mfu"] = r["flops_per_token"] * r["memtrain_tok_s"] / peak.flops
        r["plain_mfu"] = r["flops_per_token"] * r["plain_tok_s"] / peak.flops
    where = (f"{torch.get_num_threads()} torch threads" if args.device == "cpu"
             else torch.cuda.get_device_name(torch.cuda.current_device()))
    peak_line = (f"matmul peak {peak.flops / 1e9:.1f} GFLOP/s" if args.device == "cpu"
                 else f"MFU peak {peak.flops / 1e12:.0f} TFLOP/s: {peak.source}")
    print(f"\nbatch {args.batch} x seq {args.seq} = {args.batch * args.seq} tokens/step, {args.precision}"
          f"{', blocks compiled on both sides' if args.compile else ''}, "
          f"{where}, {args.steps} timed steps after {args.warmup} warm-up, "
          f"interleaved A B A B; {peak_line}; {machine()}")
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
        if r["memtrain_peak_mb"] is not None:
            print(f"{r['model']}: peak memory memtrain {r['memtrain_peak_mb']:.0f} MiB (its step "
                  f"{r['memtrain_step_mb']:.0f}), plain {r['plain_peak_mb']:.0f} MiB (its step "
                  f"{r['plain_step_mb']:.0f}); both models resident")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="default: cuda when torch sees a GPU, else cpu")
    ap.add_argument("--precision", choices=tuple(DTYPES), default=None, help="default: fp32 on cpu, bf16 on cuda")
    ap.add_argument("--models", default=None, help="default: ladder-10m,ladder-30m on cpu, llama-3.2-1b on cuda")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps excluded from the timing")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="default: 256 on cpu, 1024 on cuda")
    ap.add_argument("--max-docs", type=int, default=600, help="corpus documents (the stream must hold "
                    "batch * (warmup + steps) sequences)")
    ap.add_argument("--corpus", default=None, help="memtrain data.corpus (default: memtrain's, stdlib)")
    ap.add_argument("--cache-dir", default=None, help="memtrain data cache (default: memtrain's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each transformer block on both sides (memtrain's train.compile; the plain "
                         "loop's blocks by nn.Module.compile); the warm-up steps then hold the compilations")
    ap.add_argument("--verbose", action="store_true", help="print every step")
    ap.add_argument("--json", default=None, help="write the results to this file")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="the untimed step of each side after the timed ones under torch.profiler: its ops by "
                         "self time (on a GPU, device time) in DIR/<model>_memtrain.txt and DIR/<model>_plain.txt")
    args = ap.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA GPU (torch.cuda.is_available() is False): run "
                         "on a GPU machine with a CUDA build of torch, or use --device cpu")
    if args.device == "cpu" and torch.cuda.is_available():
        raise SystemExit("error: --device cpu but memtrain's trainer takes the GPU whenever torch sees one: hide it "
                         "with CUDA_VISIBLE_DEVICES= to benchmark the CPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    if args.device == "cpu":
        measure_peak(DTYPES[args.precision])
    results = []
    try:
        for name in args.models.split(","):
            print(f"[{name}] {args.warmup} + {args.steps} steps ...", flush=True)
            results.append(run_model(name.strip(), args))
    finally:
        parallel.shutdown()  # train() left its process group up for the next model
    print_table(results, args)
    tol = LOSS_TOL[args.precision]
    bad = [r["model"] for r in results if r["loss1_rel"] > tol or (r["loss2_rel"] or 0) > tol]
    write_json(args.json, {"results": results})
    if bad:
        raise SystemExit(f"loss mismatch above {tol} ({args.precision}) for {', '.join(bad)}")
    return results


if __name__ == "__main__":
    main()
