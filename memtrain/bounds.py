"""The largest value each number memtrain reads may take: config keys (checked in memtrain.config before a section
is built), command-line flags and what files say (bandwidth tables, sweep specs).

Every bound lies far past any real run (Llama 3.1's 131,072-token context, a 16,384-GPU job, a study's thousands
of canaries) and far short of what overflows an integer in C or makes a search or the data preparation run for
minutes: a value past one is a typo or a unit slip, refused before any work with a line naming the key, the
value and the bound.
"""

from __future__ import annotations

import math

DEFAULT = 10**12
"""The bound of a numeric key without its own below (step counts, intervals, token caps)."""

DEGREE = 2**20
"""GPUs of a job, and each parallel degree: 1,048,576."""
SEQUENCES = 2**24
"""Sequences in a batch or a micro-batch."""
POSITIONS = 2**20
"""Tokens in a sequence, a canary or a vocabulary."""
GPU_MEMORY_GB = 100_000.0
"""Memory of one device, in GB."""
SEED = 2**32 - 1
"""Seeds of data order, initialization and canaries (numpy's and torch's generators take any of these)."""

LIMITS = {
    **dict.fromkeys(("parallel.data", "parallel.x", "parallel.y", "parallel.z", "train.lr_width"), DEGREE),
    "parallel.timeout_s": 7 * 24 * 3600.0,  # a week; torch's timeout is milliseconds in a C int (24.8 days)
    **dict.fromkeys(("train.seed", "canaries.seed"), SEED),
    "loss.hash_seed": 2**64 - 1,  # the hash's own key space
    **dict.fromkeys(("train.batch_size", "train.micro_batch_size", "eval.batch_size"), SEQUENCES),
    "train.epochs": 10**7,  # a base model's pretraining asks for 1,000,000 and stops at its step count
    "train.lr": 10.0, "train.min_lr": 10.0, "train.lr_width_exponent": 10.0, "train.lr_scale": 1e6,
    "train.weight_decay": 100.0, "train.checkpoint_every_min": 525_600.0,  # a year
    **dict.fromkeys(("data.seq_len", "data.vocab_size", "canaries.length", "canaries.placement", "eval.suffix_len",
                     "loss.h"), POSITIONS),
    "loss.k": 2**32,
    "canaries.number": 10_000, "canaries.copies": 100_000, "canaries.pools": 100_000, "canaries.secret_groups": 64,
    "eval.exposure_samples": 10**8, "eval.val_docs": 10**7,
}
"""Config keys' own bounds ("section.key"; a list's bound holds for each of its items)."""

CANARY_COPIES = 10**6
"""Canary copies in a stream, over every kind (each gets a row of its own in the stream)."""
CANARY_TOKENS = 2**30
"""Tokens of the rows those copies take (copies x data.seq_len): the stream is built in memory."""


def limit(key: str) -> float:
    return LIMITS.get(key, DEFAULT)


def shown(bound: float) -> str:
    return f"{bound:,}" if isinstance(bound, int) else f"{bound:g}"


def check(key: str, value) -> None:
    """ValueError naming `key` unless every number in `value` (a number, or a list of them) is finite and at most
    the key's bound; anything else passes (types and lower bounds are the caller's)."""
    bound = limit(key)
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{key}={value!r} is not a finite number: use a finite value of at most {shown(bound)}")
        if v > bound:
            each = " each" if isinstance(value, list) else ""
            raise ValueError(f"{key}={value!r} is too large: use at most {shown(bound)}{each}")


def check_canary_rows(number: int, copies: list[int], kinds: int, seq_len: int) -> None:
    """Every canary copy takes a row of the stream, which is built in memory: its rows bounded before any work."""
    per_kind = number // len(copies) * sum(copies) + sum(copies[:number % len(copies)])
    total = per_kind * kinds
    what = f"canaries.number={number} with canaries.copies={copies} over {kinds} kind(s) is {total:,} copies"
    if total > CANARY_COPIES:
        raise ValueError(f"{what}: use at most {shown(CANARY_COPIES)} (lower canaries.number or canaries.copies)")
    if total * seq_len > CANARY_TOKENS:
        raise ValueError(f"{what}, rows of {total * seq_len:,} tokens at data.seq_len={seq_len}: use at most "
                         f"{shown(CANARY_TOKENS)} (lower canaries.number, canaries.copies or data.seq_len)")
