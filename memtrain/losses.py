"""Standard and Goldfish next-token losses, split so they work with any LM head.

Goldfish (Hans et al., NeurIPS'24) removes a pseudo-random 1-in-k subset of targets from the loss. The
subset must be a function of the text only, so that every copy of a passage, wherever it sits in a
sequence, on whichever rank or device, loses the same tokens: then no copy ever supervises the tokens
another copy dropped, and a verbatim chain is broken at the same places every time.

Drop rule ("hashed" mask). For the target at document position p >= h, with the h preceding tokens of
its document x[p-h], ..., x[p-1] (oldest first), all arithmetic modulo 2**64:

    key   = mix64(seed + GOLDEN)                    # seed selects an independent mask
    v(x)  = mix64(x XOR key)                        # per-token value; id 0 maps to a random value
    acc   = key;  acc = acc * P + v(x[t]) for each t in order   # order-sensitive polynomial
    hash  = mix64(acc)
    drop  iff hash < ceil(2**64 / k)                # probability 1/k

mix64 is the splitmix64 finalizer. This fixes the weaknesses of the reference implementation (the
goldfish-loss repository's `apply_goldfish`, hash-table mode): the window excludes the target itself,
permutations hash differently, token id 0 is an ordinary token, nothing overflows, and there is no
device-dependent random table.

A target with fewer than h tokens of document context (p < h) is always kept, as in the reference
implementation. The window is read from the same row's labels (labels[j-h..j-1] are exactly the h tokens
before target j), so a target whose document context starts in the previous row (j < h <= p) is also
kept. Canaries never hit that case (each copy lies inside one row, after its EOS), so all their copies
are masked identically.

The "reference" hash reproduces the Goldfish paper's code (`apply_goldfish`, hash-table mode) for
side-by-side comparisons, weaknesses included: for the target at row position j >= h-1, key = the product
of the h targets labels[j-h+1..j] (the target itself included) in wrapping int64 arithmetic, modulo
1,000,003; the target is dropped iff table[key] < 1/k, where the table is 1,000,003 uniform floats from
torch's CPU generator seeded 2,971,215,073. It is row-relative (the first h-1 targets of every row are kept,
windows cross document boundaries), order-blind, and every window holding id 0 shares key 0.

The "static" mask drops document positions p with p % k == k - 1 (the k-th, 2k-th, ... token of every
document): deterministic, but unlike the paper's block-relative static mask it is also document-relative.

Sharded LM heads: the mask depends on labels and doc_pos only, never on logits, so a vocabulary-parallel
head computes per-token losses its own way and then calls `loss_sums` with the same mask on every rank.
The trainer must divide the kept-loss sum by the GLOBAL kept count (summed over micro-batches and
data-parallel ranks), not average per micro-batch: micro-batches keep different numbers of tokens, and a
mean of means would weight them unequally.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from parallel import IGNORE_INDEX

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# The polynomial base is below 2**31 so that multiplying a 32-bit half by it stays below 2**63.
_P = 0x5BD1E995
_BLOCK_TOKENS = 1 << 16
REFERENCE_TABLE_SIZE = 1_000_003
REFERENCE_TABLE_SEED = 2_971_215_073
HASHES = ("memtrain", "reference")


@dataclass
class LossConfig:
    kind: str = "standard"
    """'standard' (every target supervised) or 'goldfish' (drop a hashed 1-in-k of targets)."""
    k: int = 4
    """Goldfish drop rate 1/k (k >= 2; the paper uses 4; a huge k approaches the standard loss)."""
    h: int = 13
    """Goldfish context width: the drop decision hashes the h tokens before the target (paper: 13)."""
    mask: str = "hashed"
    """'hashed' (a hash of the preceding h tokens decides) or 'static' (every k-th document position)."""
    hash_seed: int = 0
    """Seed of the hash (0 <= seed < 2**64): a different seed drops a different, independent 1-in-k subset."""
    hash: str = "memtrain"
    """'memtrain' (an order-sensitive seeded 64-bit hash of the h tokens before the target, document-relative)
    or 'reference' (the Goldfish paper's code: a random table indexed by the product of the h targets ending
    at the target, row-relative; for side-by-side comparisons with the paper)."""

    def __post_init__(self):
        if self.kind not in ("standard", "goldfish"):
            raise ValueError(f"loss.kind={self.kind!r} is invalid: use 'standard' or 'goldfish'")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 2:
            raise ValueError(f"loss.k={self.k!r} is invalid: k must be an integer >= 2 (drop 1 in k tokens)")
        if isinstance(self.h, bool) or not isinstance(self.h, int) or self.h < 1:
            raise ValueError(f"loss.h={self.h!r} is invalid: h must be an integer >= 1 (tokens of context)")
        if self.mask not in ("hashed", "static"):
            raise ValueError(f"loss.mask={self.mask!r} is invalid: use 'hashed' or 'static'")
        if self.hash not in HASHES:
            raise ValueError(f"loss.hash={self.hash!r} is invalid: use 'memtrain' or 'reference'")
        if not isinstance(self.hash_seed, int) or not 0 <= self.hash_seed <= _M64:
            raise ValueError(f"loss.hash_seed={self.hash_seed!r} is invalid: use an integer in [0, 2**64)")


# ---------------------------------------------------------------------------------------------------
# Pure-Python reference: the definition the vectorized version must match bit for bit.


def _mix64_py(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def reference_hash(window: list[int], seed: int = 0) -> int:
    """64-bit hash of an h-gram (oldest token first), in plain Python integers."""
    key = _mix64_py(seed + _GOLDEN)
    acc = key
    for x in window:
        acc = (acc * _P + _mix64_py((x & _M64) ^ key)) & _M64
    return _mix64_py(acc)


def drop_threshold(k: int) -> int:
    """Hashes below this are dropped: ceil(2**64 / k), so P(drop) is 1/k up to 2**-64."""
    return -(-(1 << 64) // k)


def reference_drop(tokens: list[int], doc_pos: list[int], cfg: LossConfig) -> list[bool]:
    """Drop decision for every target of one row (labels `tokens`), in plain Python."""
    if cfg.kind == "standard":
        return [False] * len(tokens)
    if cfg.mask == "static":
        return [t != IGNORE_INDEX and p % cfg.k == cfg.k - 1 for t, p in zip(tokens, doc_pos)]
    thr = drop_threshold(cfg.k)
    out = []
    for j, (t, p) in enumerate(zip(tokens, doc_pos)):
        hashed = t != IGNORE_INDEX and p >= cfg.h and j >= cfg.h
        out.append(hashed and reference_hash(tokens[j - cfg.h:j], cfg.hash_seed) < thr)
    return out


# ---------------------------------------------------------------------------------------------------
# Vectorized torch version. A 64-bit value is a pair (hi, lo) of int64 tensors holding 32-bit halves,
# so every intermediate stays below 2**63: no signed overflow, whose wrapping torch does not promise,
# and the same integers on any device.


def _split(c: int) -> tuple[int, int]:
    return c >> 32, c & _M32


def _mul_const(hi: torch.Tensor, lo: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) * c mod 2**64 for a 64-bit constant c, using 16-bit pieces of c (products < 2**48)."""
    c_hi, c_lo = _split(c)
    c0, c1 = c_lo & 0xFFFF, c_lo >> 16
    t0 = lo * c0
    t1 = lo * c1
    s = t0 + ((t1 & 0xFFFF) << 16)            # low 49 bits of lo * c_lo
    new_lo = s & _M32
    carry = (s >> 32) + (t1 >> 16)            # lo * c_lo >> 32
    cross = hi * c0 + (((hi * c1) & 0xFFFF) << 16)               # hi * c_lo mod 2**32 (+ junk above)
    cross = cross + lo * (c_hi & 0xFFFF) + (((lo * (c_hi >> 16)) & 0xFFFF) << 16)  # + lo * c_hi
    new_hi = (carry + cross) & _M32
    return new_hi, new_lo


def _xorshift(hi: torch.Tensor, lo: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x ^ (x >> r) for 0 < r < 32."""
    lo = lo ^ (((lo >> r) | (hi << (32 - r))) & _M32)
    hi = hi ^ (hi >> r)
    return hi, lo


def _mix64(hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi, lo = _xorshift(hi, lo, 30)
    hi, lo = _mul_const(hi, lo, _MIX1)
    hi, lo = _xorshift(hi, lo, 27)
    hi, lo = _mul_const(hi, lo, _MIX2)
    return _xorshift(hi, lo, 31)


def hash_windows(tokens: torch.Tensor, h: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash of every h-gram tokens[..., j-h:j] for j in [h, S); returns (hi, lo) halves [..., S-h].

    Equals `reference_hash(tokens[..., j-h:j], seed)` == hi * 2**32 + lo at index j - h.
    """
    if tokens.shape[-1] < h:
        raise ValueError(f"hash_windows needs at least h={h} tokens per row, got {tokens.shape[-1]}")
    tokens = tokens.to(torch.int64)
    key = _mix64_py(seed + _GOLDEN)
    k_hi, k_lo = _split(key)
    # Per-token values: (x mod 2**64) ^ key, then mixed. Negative ids (-100 padding) are well defined
    # too, via the arithmetic shift, though their hashes are never used.
    v_hi, v_lo = _mix64(((tokens >> 32) & _M32) ^ k_hi, (tokens & _M32) ^ k_lo)
    S = tokens.shape[-1]
    n = S - h
    acc_hi = torch.full(tokens.shape[:-1] + (n,), k_hi, dtype=torch.int64, device=tokens.device)
    acc_lo = torch.full_like(acc_hi, k_lo)
    for t in range(h):  # loop over the window width only; every step covers all positions at once
        # acc * P with P < 2**31: each half times P is < 2**63.
        p_lo = acc_lo * _P
        acc_hi = acc_hi * _P + (p_lo >> 32)
        acc_lo = (p_lo & _M32) + v_lo[..., t:t + n]
        acc_hi = (acc_hi + v_hi[..., t:t + n] + (acc_lo >> 32)) & _M32
        acc_lo = acc_lo & _M32
    return _mix64(acc_hi, acc_lo)


def drop_mask(labels: torch.Tensor, doc_pos: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Bool [B, S]: supervised targets the Goldfish rule removes from the loss (all False for 'standard')."""
    supervised = labels != IGNORE_INDEX
    if cfg.kind == "standard":
        return torch.zeros_like(supervised)
    if cfg.mask == "static":
        return supervised & (doc_pos % cfg.k == cfg.k - 1)
    if cfg.hash == "reference":
        return supervised & reference_code_drop(labels, cfg.k, cfg.h)
    drop = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    S = labels.shape[-1]
    if S <= cfg.h:
        return drop
    t_hi, t_lo = _split(drop_threshold(cfg.k))
    flat_labels, flat_drop = labels.reshape(-1, S), drop.view(-1, S)
    hashed = (supervised & (doc_pos >= cfg.h)).reshape(-1, S)
    # Blocks of rows of ~64k targets: the ~30 temporaries of the hash then stay in cache, which is
    # several times faster on large batches than whole-tensor passes through memory.
    step = max(1, _BLOCK_TOKENS // S)
    for r in range(0, flat_labels.shape[0], step):
        hi, lo = hash_windows(flat_labels[r:r + step], cfg.h, cfg.hash_seed)
        below = (hi < t_hi) | ((hi == t_hi) & (lo < t_lo))
        flat_drop[r:r + step, cfg.h:] = below & hashed[r:r + step, cfg.h:]
    return drop


@functools.cache
def reference_code_table() -> torch.Tensor:
    """The Goldfish code's table of uniform floats (on the CPU generator; theirs is drawn on the training
    device, so on a GPU their table, and mask, differ from this one)."""
    return torch.rand(REFERENCE_TABLE_SIZE, generator=torch.Generator().manual_seed(REFERENCE_TABLE_SEED))


def reference_code_drop(labels: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """Bool [B, S]: the Goldfish code's hash-table drop decision for every target of each row (module docstring)."""
    drop = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    if labels.shape[-1] >= h:
        keys = labels.long().unfold(-1, h, 1).prod(dim=-1) % REFERENCE_TABLE_SIZE
        drop[..., h - 1:] = reference_code_table().to(labels.device)[keys] < 1 / k
    return drop


def keep_mask(labels: torch.Tensor, doc_pos: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Bool [B, S]: targets that enter the loss (supervised and not dropped)."""
    return (labels != IGNORE_INDEX) & ~drop_mask(labels, doc_pos, cfg)


class LossSums(NamedTuple):
    """Sums over one micro-batch; add them up across micro-batches and ranks before dividing."""

    kept_sum: torch.Tensor
    kept_count: torch.Tensor
    dropped_sum: torch.Tensor
    dropped_count: torch.Tensor

    def kept_mean(self) -> float:
        """The loss trained on: mean over the kept targets."""
        return float(self.kept_sum / max(float(self.kept_count), 1))

    def dropped_mean(self) -> float | None:
        """Mean loss over the targets the Goldfish mask dropped (None when it dropped none)."""
        return float(self.dropped_sum / self.dropped_count) if self.dropped_count > 0 else None

    def kept_fraction(self) -> float:
        """Share of the supervised targets that entered the loss."""
        return float(self.kept_count / max(float(self.kept_count + self.dropped_count), 1))


def loss_sums(token_losses: torch.Tensor, keep: torch.Tensor, labels: torch.Tensor) -> LossSums:
    """Split per-token losses [B, S] into kept and dropped sums and counts.

    `labels` tells which positions are supervised at all (padding is neither kept nor dropped). Losses at
    unsupervised positions are ignored even if they are NaN or garbage.
    """
    supervised = labels != IGNORE_INDEX
    dropped = supervised & ~keep
    keep = keep & supervised
    zero = token_losses.new_zeros(())
    return LossSums(
        kept_sum=torch.where(keep, token_losses, zero).sum(),
        kept_count=keep.sum(),
        dropped_sum=torch.where(dropped, token_losses.detach(), zero).sum(),
        dropped_count=dropped.sum(),
    )


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [B, S] from full-vocabulary logits [B, S, V] (0 where label is ignored)."""
    B, S, V = logits.shape
    flat = F.cross_entropy(logits.reshape(B * S, V).float(), labels.reshape(B * S),
                           ignore_index=IGNORE_INDEX, reduction="none")
    return flat.view(B, S)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, doc_pos: torch.Tensor,
            cfg: LossConfig) -> torch.Tensor:
    """Single-process convenience: mean loss over the kept targets of this batch.

    Not for data-parallel or gradient-accumulation training, where the mean must be taken over the
    global kept count (see the module docstring).
    """
    sums = loss_sums(token_losses(logits, labels), keep_mask(labels, doc_pos, cfg), labels)
    return sums.kept_sum / sums.kept_count.clamp(min=1)
