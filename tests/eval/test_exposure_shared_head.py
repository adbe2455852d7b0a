"""Exposure from the candidates' common head run once equals the per-canary computation it replaced.

The old computation (kept here as `_old`) scored every candidate whole, prefix + candidate through
`sequence_logprobs`, and the true secret in a forward pass of its own. The new one runs prefix + common head once
and scores the candidates' remaining tokens from its KV cache, the true secret among them, optionally in larger
batches (`batch_tokens`, as on a grid). Candidates here are shaped like memtrain's secrets: a fixed 9-token
template, then 12 slots whose symbols are 1 or 2 tokens (so rows differ in length and batches in padding), on a
real memtrain model (width-32): untrained (the true secret ~6 bits into its sample, so the counts matter) and
trained a little on the true secret (~22 bits, past the sample's reach: the fit extrapolates).

Tolerances, and why: Px is a sum of about 25 fp32 log-probs; the two computations round differently (the head's
keys and values come from a batch of one, the rows from other batches and paddings), by up to ~2e-6 nats per
sequence as measured, so Px must agree within 1e-4 bits. The fitted estimate is a smooth function of those Px
(the skew-normal MLE of 400 samples and its log-CDF at the true Px): within 1e-4 bits as well (measured: 2e-5
at 22 bits, where the log-CDF is steepest; 1e-7 at 7). The empirical
estimate and the exact rank count Px at or below the true one: equal, once no candidate lies within the
tolerance of the true Px (asserted, so a tie within rounding cannot flip a count silently).
"""

import math
import random

import numpy as np
import pytest
import torch
from scipy import stats

from eval.decode import sequence_logprobs
from eval.exposure import SlotSpace, exposure, secret_log_perplexities
from memtrain.models import build_model
from tests.eval._models import train_to_memorize

VOCAB = 128
PREFIX = [2]  # the EOS that opens a canary
HEAD = [40, 41, 42, 43, 44, 45, 46, 47, 48]  # "The secret code of <name> is"
DIGITS = [[100 + d] if d % 3 else [100 + d, 110 + d] for d in range(10)]  # 1- and 2-token symbols
PX_TOL = EXPOSURE_TOL = 1e-4  # bits


def _space(n_slots):
    space = SlotSpace(n_slots, DIGITS)
    return space, (lambda idx: [HEAD + s for s in space.render(idx)])


def _old(model, fn, size, true_tokens, n_samples, batch_size, seed=0):
    """Exposure as it was computed before: every candidate whole, the true secret on its own."""
    def px(secrets):
        lp = sequence_logprobs(model, [PREFIX + list(s) for s in secrets], batch_size=batch_size).logprobs
        return np.array([-x[len(PREFIX) - 1:].sum() / math.log(2) for x in lp])

    true_px = float(px([true_tokens])[0])
    rng = random.Random(seed)
    sample = px(fn([rng.randrange(size) for _ in range(n_samples)]))
    params = stats.skewnorm.fit(sample)
    est = min(max(-float(stats.skewnorm.logcdf(true_px, *params)) / math.log(2), 0.0), math.log2(size))
    empirical = -math.log2((int((sample <= true_px).sum()) + 1) / (n_samples + 1))
    return true_px, sample, est, empirical


@pytest.fixture(scope="module", params=[0, 8], ids=["untrained", "trained"])
def model_and_secret(request):
    torch.manual_seed(0)
    model = build_model("width-32", vocab_size=VOCAB, initializer_range=0.1).eval()
    _, fn = _space(12)
    secret = fn([271828182845])[0]
    if request.param:
        train_to_memorize(model, [PREFIX + secret] * 2, steps=request.param, lr=3e-3)
    return model, secret


@pytest.mark.parametrize("batch_tokens", [0, 4000])
def test_sampled_exposure_equals_the_per_candidate_computation(model_and_secret, batch_tokens):
    model, secret = model_and_secret
    space, fn = _space(12)
    n, bs = 400, 32
    true_px, sample, est, empirical = _old(model, fn, space.size, secret, n, bs)
    assert 3.0 < est < 40.0 and len(np.unique(sample.round(3))) > n // 2  # a real tail, varied candidates

    rng = random.Random(0)
    new_px = secret_log_perplexities(model, PREFIX, [secret] + fn([rng.randrange(space.size) for _ in range(n)]),
                                     batch_size=bs, batch_tokens=batch_tokens)
    np.testing.assert_allclose(new_px, [true_px, *sample], rtol=0, atol=PX_TOL)
    assert np.abs(sample - true_px).min() > PX_TOL  # no tie within rounding: the counts below must be equal

    r = exposure(model, PREFIX, fn, space.size, true_tokens=secret, n_samples=n, batch_size=bs,
                 batch_tokens=batch_tokens, chunk=150)  # three chunks: the true secret rides with the first
    assert r.method == "skewnorm" and r.n_scored == n
    assert r.log_perplexity == pytest.approx(true_px, abs=PX_TOL)
    assert r.exposure == pytest.approx(est, abs=EXPOSURE_TOL)
    assert r.empirical_exposure == empirical
    assert r.resolution_bits == pytest.approx(math.log2(n + 1)) and r.ceiling_bits == pytest.approx(12 * math.log2(10))


def test_exact_rank_equals_the_per_candidate_computation(model_and_secret):
    model, _ = model_and_secret
    space, fn = _space(3)
    whole = sequence_logprobs(model, [PREFIX + c for c in fn(range(space.size))], batch_size=64).logprobs
    px = np.array([-x.sum() / math.log(2) for x in whole])
    for true_index in (0, 314, 999):
        r = exposure(model, PREFIX, fn, space.size, true_index=true_index, batch_size=64, chunk=300)
        assert r.method == "exact" and r.rank == int((px <= px[true_index]).sum())
        assert r.log_perplexity == pytest.approx(px[true_index], abs=PX_TOL)
        assert r.resolution_bits == r.ceiling_bits == pytest.approx(math.log2(1000))
