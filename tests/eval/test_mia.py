import numpy as np
import pytest

from eval.mia import lowest_k_mean, mia_eval, min_k_pp_score, min_k_score, roc_metrics, zlib_length


def test_perfect_separation_gives_auc_one():
    r = roc_metrics([5.0, 6.0, 7.0], [1.0, 2.0, 3.0, 4.0])
    assert r["auc"] == 1.0 and r["tpr_at_1pct_fpr"] == 1.0 and r["tpr_at_0.1pct_fpr"] == 1.0
    # reversed orientation is the worst case, not silently flipped
    assert roc_metrics([1.0, 2.0], [5.0, 6.0])["auc"] == 0.0


def test_shuffled_labels_give_chance():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=4000)
    r = roc_metrics(scores[:2000], scores[2000:])
    assert abs(r["auc"] - 0.5) < 0.03
    assert r["tpr_at_1pct_fpr"] < 0.05


def test_tpr_at_low_fpr_hand_computed():
    # 1000 non-members 0..999; members at 999.5 (above all but one non-member) and 2000 (above all).
    nonmembers = np.arange(1000.0)
    r = roc_metrics([2000.0, 999.5, -1.0, -2.0], nonmembers)
    assert r["tpr_at_0.1pct_fpr"] == 0.5  # threshold 999.5 lets one non-member in: FPR 0.1%
    assert r["tpr_at_1pct_fpr"] == 0.5


def test_tpr_at_low_fpr_keeps_every_threshold_when_scores_tie():
    # Members tie with non-members at 3, 2 and 1: the ROC corners (0.5%, 25%), (1%, 50%), (1.5%, 75%) lie on one
    # line. At FPR <= 1% the best TPR is 50%; scikit-learn's default roc_curve drops the middle corner (25%).
    r = roc_metrics([3.0, 2.0, 1.0, -5.0], [3.0, 2.0, 1.0] + [0.0] * 197)
    assert r["tpr_at_1pct_fpr"] == 0.5 and r["tpr_at_0.1pct_fpr"] == 0.0


def test_min_k_on_hand_made_logprobs():
    lp = np.log([0.5, 0.1, 0.9, 0.2, 0.05, 0.6, 0.7, 0.8, 0.3, 0.4])
    # k = 20% of 10 tokens = the 2 lowest: 0.05 and 0.1
    assert min_k_score(lp, 0.2) == pytest.approx((np.log(0.05) + np.log(0.1)) / 2)
    assert min_k_score(lp, 1.0) == pytest.approx(lp.mean())
    assert lowest_k_mean([3.0, 1.0, 2.0], 0.2) == 1.0  # at least one token


def test_min_k_pp_on_hand_made_stats():
    lp = np.array([-1.0, -2.0, -3.0, -4.0, -5.0])
    mu = np.array([-1.0, -1.0, -5.0, -2.0, -5.0])
    sd = np.array([1.0, 0.5, 1.0, 1.0, 2.0])
    # z = [0, -2, 2, -2, 0]; lowest 40% (2 tokens) = -2, -2
    assert min_k_pp_score(lp, mu, sd, 0.4) == pytest.approx(-2.0)


def test_zlib_length_sees_repetition():
    assert zlib_length("abc" * 100) < zlib_length(bytes(range(256)) + bytes(range(44)))


def test_mia_eval_on_memorized_canaries(memorized):
    model, members, twins, _ = memorized
    canaries = [{"tokens": t, "id": i, "copies": 1 + i % 2, "inserted": True} for i, t in enumerate(members)]
    canaries += [{"tokens": t, "id": 10 + i, "role": "twin"} for i, t in enumerate(twins)]
    out = mia_eval(model, canaries, batch_size=3)
    for attack in ("loss", "zlib", "min_k", "min_k_pp"):
        assert out["metrics"][attack]["auc"] == 1.0, attack
        assert out["metrics"][attack]["n_members"] == 4
    assert set(out["by_copies"]) == {1, 2}
    assert out["by_copies"][1]["loss"]["n_members"] == 2
    # An untrained reference scores members no better than twins, so ref separates them too.
    ref = mia_eval(model, canaries, ref_model=_fresh(), batch_size=8)
    assert ref["metrics"]["ref"]["auc"] == 1.0


def _fresh():
    from tests.eval._models import tiny_model
    return tiny_model("llama", seed=1, init_std=0.02)
