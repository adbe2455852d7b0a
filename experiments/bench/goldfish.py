"""How much does the Goldfish mask cost? Hashed tokens/s, and its share of a small model's training step.

    python -m experiments.bench.goldfish [--steps 7] [--batch 8] [--seq 256]

The mask is computed from labels alone, once per micro-batch; the target is < 1% of a training step of a
~10M-parameter Llama (hidden 256, 4 layers, vocab 4096) in fp32 with AdamW on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from experiments.bench.common import load_average, machine, median_time  # noqa: E402
from memtrain.losses import LossConfig, keep_mask, loss_sums, token_losses  # noqa: E402


def fake_batch(batch: int, seq: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tokens with documents of random lengths, so doc_pos restarts as in a packed stream."""
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    starts = torch.rand(batch, seq, generator=gen) < 1 / 200
    idx = torch.arange(seq).expand(batch, seq)
    doc_pos = idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return {"input_ids": labels.roll(1, dims=1), "labels": labels, "doc_pos": doc_pos}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=7, help="timed training steps (median reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import LlamaConfig, LlamaForCausalLM

    gen = torch.Generator().manual_seed(0)
    cfg = LossConfig(kind="goldfish", k=4, h=13)

    # 1. Raw mask throughput on ~1M targets.
    big = fake_batch(1024, 1024, args.vocab, gen)
    t_big = median_time(lambda: keep_mask(big["labels"], big["doc_pos"], cfg), reps=5, warmup=1)
    tokens_per_s = big["labels"].numel() / t_big

    # 2. Mask cost at the training batch shape.
    b = fake_batch(args.batch, args.seq, args.vocab, gen)
    t_mask = median_time(lambda: keep_mask(b["labels"], b["doc_pos"], cfg), reps=200, warmup=10)
    static = LossConfig("goldfish", mask="static")
    t_static = median_time(lambda: keep_mask(b["labels"], b["doc_pos"], static), reps=200, warmup=10)

    # 3. A full training step (forward, Goldfish loss including its mask, backward, AdamW).
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=args.seq, tie_word_embeddings=False)).float()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        logits = model(input_ids=b["input_ids"]).logits
        keep = keep_mask(b["labels"], b["doc_pos"], cfg)
        sums = loss_sums(token_losses(logits, b["labels"]), keep, b["labels"])
        (sums.kept_sum / sums.kept_count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_step = median_time(step, reps=args.steps, warmup=2)
    result = {
        "hashed_tokens_per_s": tokens_per_s, "mask_ms": t_mask * 1e3, "static_mask_ms": t_static * 1e3,
        "step_ms": t_step * 1e3, "mask_fraction_of_step": t_mask / t_step, "params": n_params,
        "batch": args.batch, "seq": args.seq, "threads": torch.get_num_threads(), "load_average": load_average(),
    }
    if args.json:
        print(json.dumps(dict(result, machine=machine())))
        return
    print(f"machine                : {machine()}")
    print(f"hashed mask throughput : {tokens_per_s / 1e6:.2f} M tokens/s (1024 x 1024 targets, k=4, h=13)")
    print(f"mask, batch {args.batch}x{args.seq}   : {t_mask * 1e3:.3f} ms hashed, "
          f"{t_static * 1e3:.3f} ms static")
    print(f"training step          : {t_step * 1e3:.1f} ms (Llama {n_params / 1e6:.1f}M params, fp32, AdamW, "
          f"{torch.get_num_threads()} threads, median of {args.steps}; load average {load_average()})")
    verdict = "OK" if t_mask / t_step < 0.01 else "ABOVE TARGET"
    print(f"mask / step            : {100 * t_mask / t_step:.3f}% (target < 1%: {verdict})")


if __name__ == "__main__":
    main()
