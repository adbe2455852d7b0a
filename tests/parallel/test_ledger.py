"""parallel.LEDGER records exactly the bytes linear.py's and embedding.py's docstrings predict.

One forward + backward + sync_gradients of a parallel.Linear(IN -> OUT) on every 8-rank grid, both modes,
normal and transposed, with and without bias, overlap off and on (overlap moves when communication happens,
never how much). The expected records are derived here from the formulas, not read from the ledger
(A = the layer's in-feature axis, B = its out-feature axis, block = OUT*IN/(x*y) values, fp32 = 4 bytes,
groups of one member record nothing):

sharded (rows = N/(z*data)):
    fwd: all-gather Z (block), all-reduce A (rows*OUT/|B|)
    bwd: all-gather Z (block), all-reduce B (rows*IN/|A|), reduce-scatter Z (block)
easy (rows = N/world, R = rows*|A|*|B|, the rows of the x*y plane):
    fwd: all-to-all A (rows*IN), all-gather B (R*IN/|A|), all-gather Z (block), reduce-scatter A (R*OUT/|B|),
         all-to-all B (rows*OUT)
    bwd: all-to-all B (rows*OUT), all-gather A (R*OUT/|B|), all-gather Z (block), reduce-scatter B (R*IN/|A|),
         reduce-scatter Z (block), all-to-all A (rows*IN)
sync_gradients: one all-reduce per distinct set of live reduce axes: the weight shard (block/z) over data;
    the bias (OUT/|B|) over (z, data) in sharded mode, (A, z, data) in easy mode (one bucket when they coincide).

Byte counts are integers, so they are compared exactly; moved bytes (ring model: all-reduce 2(p-1)/p*M,
all-gather, reduce-scatter and all-to-all (p-1)/p*M) are compared to 1e-9 relative (float division).
"""

from collections import Counter, defaultdict
from contextlib import nullcontext

import pytest
import torch

import parallel
from parallel.comm import Record
from parallel.forked import run_ranks
from tests._helpers import GRIDS, LINEAR_OPTIONS, MODES, built_grids, grid_id, once_per_session

IN, OUT, N = 64, 96, 32
FP32 = 4
LIVE_ORDER = ("x", "y", "z", "data")


def _sizes(degrees):
    return dict(zip(("data", "x", "y", "z"), degrees))


def _label(axes, size):
    return "+".join(a for a in LIVE_ORDER if a in axes and size[a] > 1) or "none"


def _group_size(axes, size):
    p = 1
    for a in set(axes):
        p *= size[a]
    return p


def expected_records(degrees, mode, transpose, bias):
    """(op, axes label, group size, payload bytes) of every collective, from linear.py's formulas."""
    size = _sizes(degrees)
    A, B = ("y", "x") if transpose else ("x", "y")
    a, b = size[A], size[B]
    block = OUT * IN // (size["x"] * size["y"])
    shard = block // size["z"]
    out = []

    def add(op, axes, elems):
        axes = (axes,) if isinstance(axes, str) else axes
        p = _group_size(axes, size)
        if p > 1:
            out.append((op, _label(axes, size), p, FP32 * elems))

    if mode == "sharded":
        rows = N // (size["z"] * size["data"])
        add("all_gather", "z", block)
        add("all_reduce", A, rows * OUT // b)
        add("all_gather", "z", block)
        add("all_reduce", B, rows * IN // a)
        add("reduce_scatter", "z", block)
        bias_axes = ("z", "data")
    else:
        rows = N // (size["data"] * size["x"] * size["y"] * size["z"])
        R = rows * a * b
        add("all_to_all", A, rows * IN)
        add("all_gather", B, R * IN // a)
        add("all_gather", "z", block)
        add("reduce_scatter", A, R * OUT // b)
        add("all_to_all", B, rows * OUT)
        add("all_to_all", B, rows * OUT)
        add("all_gather", A, R * OUT // b)
        add("all_gather", "z", block)
        add("reduce_scatter", B, R * IN // a)
        add("reduce_scatter", "z", block)
        add("all_to_all", A, rows * IN)
        bias_axes = (A, "z", "data")
    buckets = defaultdict(int)
    buckets[_label(("data",), size)] += shard
    if bias:
        buckets[_label(bias_axes, size)] += OUT // b
    for label, elems in buckets.items():
        if label != "none":
            add("all_reduce", tuple(label.split("+")), elems)
    return out


def ring_factor(op, p):
    return 2 * (p - 1) / p if op == "all_reduce" else (p - 1) / p


def _case(grid, mode, transpose, bias, overlap_on):
    lin = parallel.Linear(IN, OUT, bias=bias, transpose=transpose, mode=mode, grid=grid, seed=1, name="fc")
    rows = N // (grid.world_size if mode == "easy" else grid.size(("z", "data")))
    x = torch.randn(rows, lin.local_in_features, generator=torch.Generator().manual_seed(2), requires_grad=True)
    for _ in range(2 if overlap_on else 1):  # with overlap, measure the pass that uses the recorded prefetch order
        lin.zero_grad(set_to_none=True)
        parallel.LEDGER.reset()
        with parallel.overlap(lin) if overlap_on else nullcontext():
            y = lin(x)
            (y * y).sum().backward()
        parallel.sync_gradients(lin, grid)
    recs = parallel.LEDGER.records
    return {"records": [(r.op, r.axes, r.group_size, r.nbytes) for r in recs],
            "moved": [r.moved_bytes for r in recs],
            "moved_by_axes": parallel.LEDGER.moved_by_axes()}


def _worker(rank, world):
    results = {}
    for degrees, grid in built_grids(rank):
        for mode in MODES:
            for transpose, bias, ov in LINEAR_OPTIONS:
                results[(degrees, mode, transpose, bias, ov)] = _case(grid, mode, transpose, bias, ov)
    return results


@pytest.fixture(scope="module")
def results(request):
    return once_per_session(request, lambda: run_ranks(8, _worker))


@pytest.mark.parametrize("ov", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("transpose", [False, True], ids=["normal", "transposed"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_ledger_bytes_match_formula(results, degrees, mode, transpose, bias, ov):
    expected = expected_records(degrees, mode, transpose, bias)
    assert expected, "every grid of GRIDS has a non-trivial axis"
    exp_moved = defaultdict(float)
    for op, label, p, nbytes in expected:
        exp_moved[label] += ring_factor(op, p) * nbytes
    for rank, per_case in enumerate(results):
        got = per_case[(degrees, mode, transpose, bias, ov)]
        assert Counter(got["records"]) == Counter(expected), (rank, got["records"], expected)
        for (op, _, p, nbytes), moved in zip(got["records"], got["moved"]):
            assert moved == pytest.approx(ring_factor(op, p) * nbytes, rel=1e-9)
        assert got["moved_by_axes"] == pytest.approx(dict(exp_moved), rel=1e-9)


@pytest.mark.parametrize("op, p, nbytes, moved", [
    ("all_reduce", 4, 1000, 1500.0),
    ("all_reduce", 2, 1000, 1000.0),
    ("all_reduce", 8, 800, 1400.0),
    ("all_gather", 4, 1000, 750.0),
    ("reduce_scatter", 4, 1000, 750.0),
    ("all_to_all", 4, 1000, 750.0),
    ("all_gather", 8, 800, 700.0),
])
def test_record_moved_bytes_ring_factors(op, p, nbytes, moved):
    assert Record(op, "x", p, nbytes).moved_bytes == pytest.approx(moved, rel=1e-12)


def test_single_member_groups_record_nothing():
    grid = parallel.Grid(1, 1, 1, 1, rank=0)  # no process group needed: every collective is a no-op
    parallel.LEDGER.reset()
    t = torch.ones(4)
    parallel.comm.all_reduce(t, grid, ("x", "y", "z", "data"))
    parallel.comm.all_gather(t, grid, "z")
    parallel.comm.reduce_scatter(t, grid, "z")
    parallel.comm.all_to_all(t, grid, "x")
    assert parallel.LEDGER.records == []


def _timed_calls(rank, world):
    grid = parallel.Grid(1, world, 1, 1, rank=rank)
    grid.build_groups()
    t = torch.ones(8)
    parallel.LEDGER.reset()
    parallel.comm.all_reduce(t, grid, "x")  # not timed: `blocked` stays empty
    untimed = list(parallel.LEDGER.blocked)
    parallel.LEDGER.reset()
    parallel.LEDGER.timed = True
    parallel.comm.all_reduce(t, grid, "x")
    _, work = parallel.comm.all_gather(t, grid, "x", async_op=True)
    work.wait()
    parallel.comm.all_to_all(t, grid, "x")
    parallel.LEDGER.timed = False
    return untimed, [r.op for r in parallel.LEDGER.records], list(parallel.LEDGER.blocked)


def test_a_timed_ledger_notes_each_blocking_calls_seconds_and_none_for_async():
    for untimed, ops, blocked in run_ranks(2, _timed_calls):
        assert untimed == []
        assert ops == ["all_reduce", "all_gather", "all_to_all"]
        assert len(blocked) == 3 and blocked[1] is None and blocked[0] > 0 and blocked[2] > 0, blocked
