"""bench.planner's accounts of blocking collectives in a step against the probe (experiments/bench/planner.py), on
records and times made by hand: calls counted once per grid, in-step seconds averaged over ranks, the probed
seconds taken from the series the prediction charges (an easy-mode re-layout's chained one); per op over the grids
and per grid over its calls."""

import pytest

import parallel
from experiments.bench.planner import blocking_totals, in_step_table
from memtrain.plan.network import Network
from parallel.comm import Record

CURVE = {"bytes": [64, 4096], "isolated": [2e-3, 4e-3], "chained": [1e-3, 3e-3]}
NET = Network(gpus_per_node=8, collective_curves={"all_to_all": {"intra": {"2": CURVE}},
                                                   "all_reduce": {"intra": {"2": CURVE}}})
A2A, AR = Record("all_to_all", "x", 2, 64), Record("all_reduce", "x", 2, 4096)
RANK0 = {"easy": [(A2A, 0.010), (A2A, 0.020)], "sharded": [(AR, 0.004)]}
RANK1 = {"easy": [(A2A, 0.030), (A2A, 0.040)], "sharded": [(AR, 0.008)]}


def test_in_step_table_counts_calls_once_averages_ranks_and_charges_the_chained_series():
    rows = {(r["mode"], r["op"], r["group_size"]): r for r in in_step_table({(4, 2, 1, 1): [RANK0, RANK1]}, NET)}
    assert set(rows) == {("easy", "all_to_all", 2), ("sharded", "all_reduce", 2)}
    easy, sharded = rows["easy", "all_to_all", 2], rows["sharded", "all_reduce", 2]
    assert easy["calls"] == 2 and easy["in_step_s"] == pytest.approx((0.03 + 0.07) / 2)
    assert easy["probed_s"] == pytest.approx(2 * 1e-3)  # chained: a re-layout follows another
    assert sharded["calls"] == 1 and sharded["in_step_s"] == pytest.approx(0.006)
    assert sharded["probed_s"] == pytest.approx(4e-3)  # isolated: an all-reduce follows compute


def test_a_grids_blocking_total_is_the_mean_ranks_sum_against_every_calls_probe():
    grid = parallel.Grid(4, 2, 1, 1)
    assert blocking_totals([RANK0, RANK1], "easy", grid, NET) == pytest.approx(((0.03 + 0.07) / 2, 2 * 1e-3))
    assert blocking_totals([RANK0, RANK1], "sharded", grid, NET) == pytest.approx((0.006, 4e-3))
