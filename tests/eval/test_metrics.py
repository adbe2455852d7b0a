import numpy as np
import pytest

from eval.metrics import (
    exact_match,
    lcs_length,
    lcs_length_batch,
    longest_matching_prefix,
    match_metrics,
    rouge_l,
    rouge_l_batch,
    rouge_l_text,
    token_match_fraction,
)

# Hand-computed LCS values (classic textbook pairs, letters mapped to ids).
A, B, C, D = 1, 2, 3, 4
CASES = [
    ([A, B, C, B, D, A, B], [B, D, C, A, B, A], 4),  # CLRS: BCBA
    ([A, B, C], [A, B, C], 3),
    ([A, B, C], [C, B, A], 1),
    ([A, A, A], [A], 1),
    ([A, B], [C, D], 0),
    ([A, C, B, D], [A, B, C, D], 3),
]


@pytest.mark.parametrize("a,b,want", CASES)
def test_lcs_hand_computed(a, b, want):
    assert lcs_length(a, b) == want
    assert lcs_length(b, a) == want


def test_lcs_batch_agrees_with_quadratic_reference():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 4, (50, 12))
    b = rng.integers(0, 4, (50, 12))

    def ref(x, y):
        dp = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
        for i in range(len(x)):
            for j in range(len(y)):
                dp[i + 1][j + 1] = dp[i][j] + 1 if x[i] == y[j] else max(dp[i][j + 1], dp[i + 1][j])
        return dp[-1][-1]

    assert lcs_length_batch(a, b).tolist() == [ref(x, y) for x, y in zip(a.tolist(), b.tolist())]


def test_rouge_l_hand_computed():
    # LCS 4, len 7 vs 6: P = 4/7, R = 4/6, F = 2PR/(P+R) = 8/13
    assert rouge_l([A, B, C, B, D, A, B], [B, D, C, A, B, A]) == pytest.approx(8 / 13)
    assert rouge_l([A, B], [C, D]) == 0.0
    assert rouge_l([], [A]) == 0.0
    # equal lengths: F = LCS / n
    assert rouge_l_batch([[A, C, B, D], [A, B, C, D]], [[A, B, C, D], [A, B, C, D]]).tolist() == \
        pytest.approx([0.75, 1.0])


def test_match_metrics():
    gen = [[1, 2, 3, 4], [1, 9, 3, 4], [9, 2, 3, 4], [5, 6, 7, 8]]
    ref = [[1, 2, 3, 4]] * 4
    assert exact_match(gen, ref).tolist() == [1, 0, 0, 0]
    assert token_match_fraction(gen, ref).tolist() == [1, 0.75, 0.75, 0]
    assert longest_matching_prefix(gen, ref).tolist() == [4, 1, 0, 0]
    m = match_metrics(np.array(gen), np.array(ref))
    assert m["rouge_l"].tolist() == pytest.approx([1, 0.75, 0.75, 0])
    with pytest.raises(ValueError):
        match_metrics([[1, 2]], [[1, 2, 3]])


def test_rouge_l_text_tokenizes_as_rouge_score():
    """rouge_score's default tokenizer: lower case, anything but a-z0-9 separates words, no stemming."""
    assert rouge_l_text("The cat, sat!", "the CAT sat") == 1.0
    assert rouge_l_text("a b c d", "a c") == pytest.approx(2 * 0.5 * 1.0 / 1.5)  # P 2/4, R 2/2
    assert rouge_l_text("1234-5678", "1234 5678") == 1.0
    assert rouge_l_text("", "x") == 0.0 and rouge_l_text("!!", "?") == 0.0
    assert rouge_l_text("cats", "cat") == 0.0  # no stemming
