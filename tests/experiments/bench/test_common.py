"""The rank-agreement figures the planner benchmark reports (experiments/bench/common.py), on cases worked by hand."""

import pytest

from experiments.bench.common import fastest, kendall_tau, top_k_recall


@pytest.mark.parametrize("a, b, want", [
    ([1, 2, 3, 4], [10, 20, 30, 40], 1.0),
    ([1, 2, 3, 4], [4, 3, 2, 1], -1.0),
    ([1, 2, 3], [1, 3, 2], 1 / 3),  # 2 concordant pairs, 1 discordant, of 3
    ([1, 1, 2], [1, 2, 3], 2 / 6**0.5),  # 2 concordant; 1 pair tied in a: sqrt((3 - 1) x (3 - 0))
    ([1, 1, 2, 3], [5, 5, 6, 4], -0.2),  # 2 concordant, 3 discordant; 1 pair tied in both: sqrt(5 x 5)
])
def test_kendall_tau_b(a, b, want):
    assert kendall_tau(a, b) == pytest.approx(want)


def test_fastest_keeps_ties_at_the_boundary():
    assert fastest([3, 1, 2], 1) == {1}
    assert fastest([3, 1, 2], 2) == {1, 2}
    assert fastest([1, 1, 1], 1) == {0, 1, 2}
    assert fastest([1, 2, 2, 2, 5], 2) == {0, 1, 2, 3}


@pytest.mark.parametrize("measured, predicted, want", [
    ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], 1.0),
    ([1, 2, 3, 4, 5], [5, 4, 3, 2, 1], 1 / 3),  # only item 2 is among both threes
    ([1, 2, 3, 4, 5], [1, 5, 2, 2, 2], 2 / 3),  # predicted fastest: 0 and the tie 2, 3, 4; item 1 is missed
    ([1, 2, 3, 4, 5], [1, 2, 4, 4, 4], 1.0),  # a predicted tie at the boundary: all of 2, 3, 4 count
    ([1, 1, 2, 2, 3], [1, 2, 3, 4, 5], 3 / 4),  # four measured fastest (a tie at the boundary), three predicted
])
def test_top_3_recall(measured, predicted, want):
    assert top_k_recall(measured, predicted, 3) == pytest.approx(want)
