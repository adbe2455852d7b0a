"""Benchmark: our batched greedy decoder vs transformers `generate` on the extraction workload.

1,000 random-token canaries of 128 tokens, 50-token suffix (prefix 78), batch 64, on `ladder-10m` (the
ladder's Llama: hidden 256, 10 layers, 8 heads, vocab 4096) built from config with memtrain's seeded init.
Both decoders get the same batches in the same run, back to back per batch (alternating order),
repeated; medians are reported, and the generated tokens must be identical. `--ragged` draws canary
lengths in [length/2, length] to exercise left padding.

    python -m experiments.bench.eval [--model ladder-10m] [--canaries 1000] [--repeats 3] [--ragged]
                                     [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from eval.decode import HFStepper, greedy_decode_batch, pad_left  # noqa: E402
from eval.extraction import extraction_eval  # noqa: E402
from experiments.bench.common import machine, write_json  # noqa: E402


def build_model(name: str, vocab: int, seed: int = 0):
    from memtrain.models import build_model as build

    model = build(name, vocab_size=vocab, seed=seed).eval()
    model.generation_config.eos_token_id = None  # both decoders emit exactly n tokens
    model.generation_config.pad_token_id = 0
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ladder-10m", help="a named model of memtrain.models")
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--suffix", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ragged", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_model(args.model, args.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    if args.ragged:
        lengths = torch.randint(args.length // 2, args.length + 1, (args.canaries,), generator=g).tolist()
    else:
        lengths = [args.length] * args.canaries
    canaries = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]
    # Length-sorted up front, as greedy_decode does, so batches carry little padding.
    prefixes = sorted((c[:-args.suffix] for c in canaries), key=len)
    print(f"machine: {machine()}")
    print(f"model: {args.model} {n_params / 1e6:.2f}M params, threads {torch.get_num_threads()}; "
          f"{args.canaries} canaries, prefix {min(map(len, prefixes))}-{max(map(len, prefixes))}, "
          f"suffix {args.suffix}, batch {args.batch_size}")

    step = HFStepper(model)
    batches = [pad_left(prefixes[s:s + args.batch_size]) for s in range(0, len(prefixes), args.batch_size)]

    def run(name, ids, mask):
        if name == "ours":
            return greedy_decode_batch(step, ids, mask, args.suffix)
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=args.suffix)[:, ids.shape[1]:]

    for name in ("ours", "generate"):  # warm up allocator and kernels
        run(name, *batches[0])
    # The machine is shared: time the two decoders back to back on every batch, alternating which goes
    # first, so load changes hit both sides alike; per-repeat totals and per-batch ratios are reported.
    times = {"ours": [], "generate": []}
    batch_ratios = []
    outputs = {"ours": [], "generate": []}
    for r in range(args.repeats):
        total = {"ours": 0.0, "generate": 0.0}
        for b, (ids, mask) in enumerate(batches):
            pair = {}
            for name in (("ours", "generate") if (r + b) % 2 == 0 else ("generate", "ours")):
                t0 = time.perf_counter()
                out = run(name, ids, mask)
                pair[name] = time.perf_counter() - t0
                if r == 0:
                    outputs[name].append(out)
            total["ours"] += pair["ours"]
            total["generate"] += pair["generate"]
            batch_ratios.append(pair["generate"] / pair["ours"])
        for name in times:
            times[name].append(total[name])
        print(f"  repeat {r}: ours {total['ours']:7.2f} s, generate {total['generate']:7.2f} s")
    identical = torch.equal(torch.cat(outputs["ours"]), torch.cat(outputs["generate"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["generate"] / med["ours"]
    batch_ratio = statistics.median(batch_ratios)
    tokens = args.canaries * args.suffix
    print(f"median ours {med['ours']:.2f} s ({tokens / med['ours']:.0f} tok/s), "
          f"generate {med['generate']:.2f} s ({tokens / med['generate']:.0f} tok/s)")
    print(f"speed ratio (generate / ours): {ratio:.2f}x on median totals, "
          f"{batch_ratio:.2f}x median per batch; outputs identical: {identical}")

    t0 = time.perf_counter()
    res = extraction_eval(model, canaries, suffix_len=args.suffix, batch_size=args.batch_size, pythia=False)
    t_eval = time.perf_counter() - t0
    print(f"full extraction_eval (decode + metrics): {t_eval:.2f} s, "
          f"exact-match rate {res.aggregates['overall']['exact_match_rate']:.3f} (random model: ~0)")

    figures = {"params": n_params, "canaries": args.canaries, "batch_size": args.batch_size,
               "suffix": args.suffix, "ragged": args.ragged, "times": times, "median": med, "ratio": ratio,
               "median_batch_ratio": batch_ratio,
               "identical": identical, "extraction_eval_s": t_eval}
    write_json(args.json, figures)
    if not identical:
        raise SystemExit("outputs differ from transformers generate")
    return figures


if __name__ == "__main__":
    main()
