"""Match metrics between generated and true token-id sequences, and ROUGE-L on text.

The metrics work on token ids: the memorization question is whether the model reproduces the training
tokens, and ids avoid any dependence on detokenization. For comparison with papers that score decoded text
(the Goldfish paper's ROUGE-L), `rouge_l_text` scores two strings after the `rouge_score` package's default
tokenization (lower case, every run of characters other than a-z and 0-9 a separator, no stemming).
ROUGE-L is computed here from a local longest-common-subsequence (the `evaluate` package's rouge fetches
its script from the Hub).

The batched functions take equal-length rows (the extraction case: every suffix has n tokens) as
[N, n] arrays and vectorize over N; the scalar functions accept any two sequences.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np


def _as_2d(x) -> np.ndarray:
    a = np.asarray(x.cpu() if hasattr(x, "cpu") else x, dtype=np.int64)
    return a[None] if a.ndim == 1 else a


def exact_match(generated, reference) -> np.ndarray:
    """1.0 where every generated token equals the reference, per row."""
    g, r = _as_2d(generated), _as_2d(reference)
    return (g == r).all(axis=1).astype(np.float64)


def token_match_fraction(generated, reference) -> np.ndarray:
    """Fraction of positions where the generated token equals the reference, per row."""
    g, r = _as_2d(generated), _as_2d(reference)
    return (g == r).mean(axis=1)


def longest_matching_prefix(generated, reference) -> np.ndarray:
    """Number of leading tokens generated correctly before the first mistake, per row."""
    g, r = _as_2d(generated), _as_2d(reference)
    # cumprod of the match indicator stays 1 up to the first mismatch, then 0
    return np.cumprod(g == r, axis=1).sum(axis=1).astype(np.int64)


def lcs_length_batch(a, b) -> np.ndarray:
    """Longest-common-subsequence length of each row pair of a [N, n] and b [N, m].

    Row-by-row dynamic programme vectorized over N and over the columns: with prev = dp[i-1, :],
        t[j] = prev[j-1] + 1 if a_i == b_j else prev[j]
        dp[i, j] = max(t[j], dp[i, j-1])  ==  running maximum of t along j,
    which holds because prev[j] <= prev[j-1] + 1 always, so a match never loses to the cell above.
    """
    a, b = _as_2d(a), _as_2d(b)
    n_rows, m = b.shape
    prev = np.zeros((n_rows, m + 1), dtype=np.int64)  # column 0 is the empty prefix of b
    for i in range(a.shape[1]):
        t = np.where(a[:, i:i + 1] == b, prev[:, :-1] + 1, prev[:, 1:])
        prev[:, 1:] = np.maximum.accumulate(t, axis=1)
    return prev[:, -1]


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """LCS length of two sequences of any lengths."""
    if len(a) == 0 or len(b) == 0:
        return 0
    return int(lcs_length_batch(np.asarray([a]), np.asarray([b]))[0])


def _f1(lcs, len_gen, len_ref) -> np.ndarray:
    lcs = np.asarray(lcs, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = lcs / len_gen
        recall = lcs / len_ref
        f = 2 * precision * recall / (precision + recall)
    return np.where(lcs > 0, f, 0.0)


def rouge_l_batch(generated, reference) -> np.ndarray:
    """ROUGE-L F1 per row: precision = LCS/len(generated), recall = LCS/len(reference), harmonic mean."""
    g, r = _as_2d(generated), _as_2d(reference)
    return _f1(lcs_length_batch(g, r), g.shape[1], r.shape[1])


def rouge_l(generated: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F1 of two sequences of any lengths (0 when either is empty)."""
    return float(_f1(lcs_length(generated, reference), max(len(generated), 1), max(len(reference), 1)))


def text_tokens(text: str) -> list[str]:
    """rouge_score's default tokenizer: lower case, split on anything but letters a-z and digits."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def rouge_l_text(generated: str, reference: str) -> float:
    """ROUGE-L F1 of two texts over `text_tokens` words (0 when either has no word)."""
    g, r = text_tokens(generated), text_tokens(reference)
    vocab = {w: i for i, w in enumerate(dict.fromkeys(g + r))}
    return rouge_l([vocab[w] for w in g], [vocab[w] for w in r])


def match_metrics(generated, reference) -> dict[str, np.ndarray]:
    """All per-row metrics for equal-length [N, n] generated and reference ids."""
    g, r = _as_2d(generated), _as_2d(reference)
    if g.shape != r.shape:
        raise ValueError(f"shape mismatch: generated {g.shape} vs reference {r.shape}")
    return {
        "exact_match": exact_match(g, r),
        "token_match": token_match_fraction(g, r),
        "longest_prefix": longest_matching_prefix(g, r),
        "rouge_l": rouge_l_batch(g, r),
    }
