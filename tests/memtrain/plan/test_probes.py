"""How memtrain/plan/probes.py times what it probes: windows that last until their deadlines (so that ranks sharing
a CPU's cores all stay busy to the end), and matmuls that take distinct operands in turn (so that no cache holds
them, as in a step). Its rates themselves are checked in test_network.py and test_compute.py."""

import time

from memtrain.plan import probes


def test_timing_windows_last_until_their_deadlines():
    """A call slow at first (20 ms twice, then 1 ms): the three windows still last min_seconds each, and the figure
    is the later calls' time. Windows of a count of calls sized from one call (the old timing) ended after 5 calls,
    35 ms in all: on a shared CPU the ranks done early then left the others the cores."""
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.02 if len(calls) <= 2 else 0.001)

    start = time.perf_counter()
    seconds = probes._timed(fn, cuda=False, min_seconds=0.1)
    assert time.perf_counter() - start >= 0.3
    assert 0.001 <= seconds < 0.005, seconds


def test_matmul_probe_takes_distinct_operands_in_turn(monkeypatch):
    """Each shape's calls take up to MATMUL_OPERAND_BYTES of operand pairs, one after another, no two sharing
    memory: here 3 pairs of the largest shape's size, 12 of the smallest's."""
    budget = 4 * 3 * (16 * 16 + 16 * 16)
    monkeypatch.setattr(probes, "MATMUL_DIMS", (8, 16))
    monkeypatch.setattr(probes, "MATMUL_OPERAND_BYTES", {"cpu": budget})
    seen, in_turn = {}, probes._in_turn

    def spy(fn, operands):
        a, b = operands[0]
        seen[(*a.shape, b.shape[1])] = operands
        return in_turn(fn, operands)

    monkeypatch.setattr(probes, "_in_turn", spy)
    probes.measure_matmuls(("fp32",), min_seconds=0.0)
    assert len(seen) == 8 and len(seen[(16, 16, 16)]) == 3 and len(seen[(8, 8, 8)]) == 12
    for (m, k, n), pairs in seen.items():
        assert len(pairs) == budget // (4 * (m * k + k * n))
        assert all(a.shape == (m, k) and b.shape == (k, n) for a, b in pairs)
        starts = [t.data_ptr() for pair in pairs for t in pair]
        assert len(set(starts)) == len(starts)
    taken = []
    turn = in_turn(taken.append, [(1,), (2,), (3,)])
    for _ in range(7):
        turn()
    assert taken == [1, 2, 3, 1, 2, 3, 1]
