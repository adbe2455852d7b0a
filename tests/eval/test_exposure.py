import math

import numpy as np
import pytest
import torch

from eval.exposure import SlotSpace, exposure
from tests.eval._models import tiny_model, train_to_memorize

PREFIX = [17, 42, 99, 5, 63]
SPACE = SlotSpace(n_slots=2, alphabet=[[200 + d] for d in range(10)])  # two "digits": |R| = 100


def _brute_force_px(model, prefix, secret):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prefix + secret])).logits[0].double(), -1)
    return -sum(float(logp[len(prefix) - 1 + j, t]) for j, t in enumerate(secret)) / math.log(2)


def test_slot_space_roundtrip():
    s = SlotSpace(3, [[1], [2, 3], [4]])
    assert s.size == 27
    assert s.symbols(5) == [0, 1, 2] and s.index([0, 1, 2]) == 5
    assert s.render([5]) == [[1, 2, 3, 4]]


@pytest.mark.parametrize("true_index", [0, 37, 99])
def test_exact_exposure_equals_brute_force_rank(true_index):
    model = tiny_model("llama", seed=9)
    px = np.array([_brute_force_px(model, PREFIX, c) for c in SPACE.render(range(SPACE.size))])
    rank = int((px <= px[true_index]).sum())
    res = exposure(model, PREFIX, SPACE.render, SPACE.size, true_index=true_index, batch_size=16, chunk=30)
    assert res.method == "exact" and res.rank == rank
    assert res.exposure == pytest.approx(math.log2(100) - math.log2(rank))
    assert res.log_perplexity == pytest.approx(px[true_index], abs=1e-3)
    by_tokens = exposure(model, PREFIX, SPACE.render, SPACE.size, true_tokens=SPACE.render([true_index])[0])
    assert by_tokens.rank == rank


def test_memorized_secret_has_maximal_exposure_and_sampling_agrees():
    space = SlotSpace(n_slots=3, alphabet=[[200 + d] for d in range(10)])  # |R| = 1000
    secret = 123
    model = tiny_model("llama", seed=10, init_std=0.02)
    train_to_memorize(model, [PREFIX + space.render([secret])[0]] * 2, steps=60)
    exact = exposure(model, PREFIX, space.render, space.size, true_index=secret, batch_size=250)
    assert exact.rank == 1 and exact.exposure == pytest.approx(math.log2(1000))
    # Sampled estimate: far in the tail, capped at log2 |R|; the empirical count saturates at log2(n+1).
    est = exposure(model, PREFIX, space.render, space.size, true_index=secret, exact_limit=0, n_samples=300,
                   batch_size=150)
    assert est.method == "skewnorm" and est.n_scored == 300
    assert est.exposure > 8.0
    assert est.empirical_exposure == pytest.approx(math.log2(301))


def test_sampled_estimate_tracks_exact_on_an_untrained_model():
    space = SlotSpace(n_slots=3, alphabet=[[200 + d] for d in range(10)])
    model = tiny_model("llama", seed=11)
    for secret in (7, 512):
        exact = exposure(model, PREFIX, space.render, space.size, true_index=secret, batch_size=250)
        est = exposure(model, PREFIX, space.render, space.size, true_index=secret, exact_limit=0,
                       n_samples=400, fit="normal", batch_size=200, seed=1)
        assert abs(est.exposure - exact.exposure) < 1.5, (secret, exact.exposure, est.exposure)


def test_candidates_all_equally_likely_give_the_counts_alone():
    """A model that does not tell the candidates apart (uniform logits) leaves no spread to fit: the estimate is
    the sample's count (0 bits here, every candidate ties with the secret), not a failed or nan fit."""
    space = SlotSpace(n_slots=3, alphabet=[[200 + d] for d in range(10)])
    for fit in ("skewnorm", "normal"):
        est = exposure(lambda ids: torch.zeros(*ids.shape, 256), PREFIX, space.render, space.size, true_index=5,
                       exact_limit=0, n_samples=50, fit=fit)
        assert (est.method, est.exposure, est.empirical_exposure, est.fit_params) == ("empirical", 0.0, 0.0, None)


def test_needs_true_secret():
    with pytest.raises(ValueError):
        exposure(tiny_model(), PREFIX, SPACE.render, SPACE.size)
