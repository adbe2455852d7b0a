"""Secret-Sharer exposure of random canaries (Carlini et al., USENIX Security 2019).

A random canary is a template prefix followed by a secret r drawn from a space R (e.g. 9 digit slots,
|R| = 10^9). Its log-perplexity under the model, given the prefix, is

    Px(r) = - sum over the secret's tokens of log2 p(token | prefix, earlier secret tokens)

and its rank is #{r' in R : Px(r') <= Px(r_true)} (1 = the model prefers the true secret to every
other candidate; ties count against the secret). Then

    exposure = log2 |R| - log2 rank,        between 0 and log2 |R|.

Two methods, chosen by |R| against `exact_limit`:
  - "exact": every candidate is scored and the rank counted;
  - "skewnorm" (or "normal"): `n_samples` candidates are drawn uniformly from R, a skew-normal (normal)
    distribution is fitted to their log-perplexities, and exposure = -log2 CDF(Px(r_true)), i.e. the
    rank is extrapolated as |R| * CDF. This is the paper's estimator; it reaches far beyond the
    resolution of the sample (log2 n_samples bits), which the plain empirical estimate
    -log2((#{sampled <= true} + 1) / (n_samples + 1)) cannot; the latter is reported alongside.
The estimate is capped at log2 |R| (rank >= 1).

The interface is generic: `candidates_fn(indices) -> token lists` renders secrets from indices in
[0, |R|); `SlotSpace` is the usual digit-slot instance.

Cost: the candidates of one secret share its prefix and usually more (a template's fixed words; a BPE
secret "The secret code of <name> is dddd-..." differs only from its digits on). That common head is
scored once and its KV cache serves every candidate (`continuation_logprobs`), so each candidate computes
only its own tokens; the true secret is scored in the same batches as its candidates. Px still counts the
head's tokens, so the numbers are those of scoring every whole candidate, up to float rounding.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .decode import continuation_logprobs

LN2 = math.log(2.0)


@dataclass
class SlotSpace:
    """Secrets made of `n_slots` symbols, each symbol rendered as a token-id list from `alphabet`.

    Index i is read as a mixed-radix number (first slot most significant), so index and secret are in
    one-to-one correspondence and |R| = len(alphabet) ** n_slots.
    """

    n_slots: int
    alphabet: Sequence[Sequence[int]]  # e.g. the token ids of "0".."9", one list per symbol

    @property
    def size(self) -> int:
        return len(self.alphabet) ** self.n_slots

    def symbols(self, index: int) -> list[int]:
        base, out = len(self.alphabet), []
        for _ in range(self.n_slots):
            index, s = divmod(index, base)
            out.append(s)
        return out[::-1]

    def index(self, symbols: Sequence[int]) -> int:
        i = 0
        for s in symbols:
            i = i * len(self.alphabet) + int(s)
        return i

    def render(self, indices: Sequence[int]) -> list[list[int]]:
        return [[t for s in self.symbols(int(i)) for t in self.alphabet[s]] for i in indices]


@dataclass
class ExposureResult:
    exposure: float
    method: str  # "exact", "skewnorm", "normal", or "empirical" (a sample without spread: nothing to fit)
    log_perplexity: float  # Px of the true secret, bits
    space_size: int
    n_scored: int  # candidates scored (all of R when exact)
    rank: int | None = None  # exact rank (exact method only)
    empirical_exposure: float | None = None  # sampled methods: from the sample's own counts
    fit_params: tuple | None = None

    @property
    def ceiling_bits(self) -> float:
        """log2 |R|: no exposure exceeds it (rank >= 1)."""
        return math.log2(self.space_size)

    @property
    def resolution_bits(self) -> float:
        """The most exposure that counting can show: log2 |R| when exact, log2(n_scored + 1) when sampled (the
        empirical estimate's cap; the fitted estimate extrapolates past it, up to the ceiling)."""
        return self.ceiling_bits if self.method == "exact" else min(math.log2(self.n_scored + 1), self.ceiling_bits)


def secret_log_perplexities(model, prefix: Sequence[int], secrets: Sequence[Sequence[int]],
                            batch_size: int = 128, batch_tokens: int = 0) -> np.ndarray:
    """Px in bits of each secret after `prefix` (only the secret's tokens are counted).

    The secrets' common head joins the prefix as context, run once (see the module docstring). A batch holds
    `batch_size` secrets, or more while it stays within `batch_tokens` tokens: fewer, larger forward passes,
    which on a grid are fewer rounds of collectives.
    """
    if len(prefix) == 0:
        raise ValueError("exposure needs a non-empty template prefix (the first secret token needs context)")
    if len(secrets) == 0:
        return np.zeros(0)
    secrets = [list(s) for s in secrets]
    head = _common_head(secrets)
    rest = [s[head:] for s in secrets]
    rows = max(batch_size, batch_tokens // (1 + max(map(len, rest))))  # a row is [last context token, *rest]
    context_lp, lps = continuation_logprobs(model, [*prefix, *secrets[0][:head]], rest, batch_size=rows)
    fixed = context_lp[len(prefix) - 1:].sum()  # the head's tokens, the same for every secret
    return np.array([-(fixed + lp.sum()) / LN2 for lp in lps])


def _common_head(seqs: list[list[int]]) -> int:
    """Length of the longest common prefix of the token lists."""
    first, n = seqs[0], min(map(len, seqs))
    for s in seqs[1:]:
        n = next((j for j in range(n) if s[j] != first[j]), n)
    return n


def exposure(model, prefix: Sequence[int], candidates_fn: Callable[[Sequence[int]], list[list[int]]],
             space_size: int, true_index: int | None = None, true_tokens: Sequence[int] | None = None, *,
             exact_limit: int = 10_000, n_samples: int = 5_000, fit: str = "skewnorm",
             batch_size: int = 128, batch_tokens: int = 0, chunk: int = 4096, seed: int = 0) -> ExposureResult:
    """Exposure of the true secret (given by index in R, or by its tokens) among all candidates in R.

    Exact when space_size <= exact_limit, otherwise estimated from `n_samples` sampled candidates with
    a fitted `fit` ("skewnorm" or "normal") distribution; see the module docstring. Candidates are rendered
    and scored `chunk` at a time, in batches of `batch_size` or up to `batch_tokens` tokens.
    """
    if true_index is None and true_tokens is None:
        raise ValueError("give the true secret as true_index or true_tokens")
    if space_size < 1:
        raise ValueError("space_size must be >= 1")
    max_bits = math.log2(space_size)

    if space_size <= exact_limit:
        scores, found = [], None
        for start in range(0, space_size, chunk):
            idx = list(range(start, min(start + chunk, space_size)))
            cands = candidates_fn(idx)
            if true_index is None:
                found = next((i for i, c in zip(idx, cands) if list(c) == list(true_tokens)), found)
            scores.append(secret_log_perplexities(model, prefix, cands, batch_size, batch_tokens))
        scores = np.concatenate(scores)
        true_index = true_index if true_index is not None else found
        if true_index is None:
            raise ValueError("true_tokens is not among the rendered candidates")
        # Use the enumerated score of the true secret itself, so it ties with nothing but itself.
        px = float(scores[true_index])
        rank = int((scores <= px).sum())
        return ExposureResult(max_bits - math.log2(rank), "exact", px, space_size, space_size, rank=rank)

    if n_samples < 1:
        raise ValueError(f"n_samples={n_samples}: the estimate needs sampled candidates, at least 1")
    if fit not in ("skewnorm", "normal"):
        raise ValueError(f"unknown fit {fit!r} (skewnorm or normal)")
    if true_tokens is None:
        true_tokens = candidates_fn([true_index])[0]
    rng = random.Random(seed)  # Python ints: spaces larger than 2^63 are fine
    idx = [rng.randrange(space_size) for _ in range(n_samples)]
    scores = []
    for s in range(0, n_samples, chunk):
        cands = candidates_fn(idx[s:s + chunk])
        if s == 0:  # the true secret rides with the first chunk: one more row, not a forward pass of its own
            cands = [list(true_tokens), *cands]
        scores.append(secret_log_perplexities(model, prefix, cands, batch_size, batch_tokens))
    scores = np.concatenate(scores)
    px, sample = float(scores[0]), scores[1:]
    from scipy import stats  # here, not at the top: scipy.stats adds ~0.4 s to every process importing eval

    empirical = min(abs(-math.log2((int((sample <= px).sum()) + 1) / (n_samples + 1))), max_bits)  # abs: not -0.0
    if sample.min() == sample.max():  # every candidate equally likely: no spread to fit, the counts alone
        return ExposureResult(empirical, "empirical", px, space_size, n_samples, empirical_exposure=empirical)
    if fit == "skewnorm":
        params = stats.skewnorm.fit(sample)
        log_cdf = float(stats.skewnorm.logcdf(px, *params))
    elif fit == "normal":
        params = stats.norm.fit(sample)
        log_cdf = float(stats.norm.logcdf(px, *params))
    est = min(max(-log_cdf / LN2, 0.0), max_bits)  # -inf log_cdf (far tail) -> cap
    return ExposureResult(est, fit, px, space_size, n_samples, empirical_exposure=empirical,
                          fit_params=tuple(float(p) for p in params))
