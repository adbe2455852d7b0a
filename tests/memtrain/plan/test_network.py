"""The measured table's rates of what a step spends besides matmuls (memtrain/plan/network.py, probes.py).

- A table written before these rates were measured still loads, and counts no non-matmul time and full overlap;
  a table with them round-trips through JSON; a damaged entry is one error naming it.
- Attention's rate per score interpolates in log head size and holds the edges.
- A collective's measured curve: piecewise linear between payloads, the smallest's time below them, the last
  segment's rate above them (the whole range's where noise made it fall); the streamed series for a queued call,
  the chained one for a call back to back with others, the isolated one where a curve lacks the series asked for;
  the latency + bandwidth entry where an op has no curve; a damaged curve is one error naming it.
- The probes, on one process at small sizes: every rate finite and positive, in a table `--bandwidth` reads.
- The collective probe files a group size where the planner looks it up (network.inside_node), on 4 ranks, and
  every rank returns the same overlap: the hidden share of the shorter of compute and a stream, within [0, 1].
"""

import json
import math

import pytest
import torch

from memtrain.plan import cli as plan_cli
from memtrain.plan import collectives, compute, cost, network, probes, search
from parallel import Grid
from parallel.comm import Record
from parallel.forked import run_ranks

OTHER = {"op_overhead_s": 5e-6, "elementwise": {"norm": 2e-9, "loss": 3e-9}, "optimizer": [4e-9, 2e-5],
         "attention": {"fp32": {"head_dims": [8, 32], "seconds": [[1e-9, 2e-9], [4e-9, 8e-9]]}}}


def _load(tmp_path, doc) -> network.Network:
    path = tmp_path / "bw.json"
    path.write_text(json.dumps(doc))
    return network.load_network(bandwidth=str(path))


def _step(net):
    """One step of ladder-1m on a 2 x 2 x 2 sharded grid."""
    shape = cost.shape_of(search.load_config("ladder-1m"))
    return compute.step_compute(shape, Grid(2, 2, 2, 1), "sharded", 16, 64, None, net)


def test_a_table_without_the_rates_loads_and_counts_no_other_time(tmp_path):
    older = {"gpus_per_node": 8, "matmuls": {"fp32": {"dims": [8, 32], "gflops": [[[2.0] * 2] * 2] * 2}}}
    net = _load(tmp_path, older)
    assert (net.op_overhead_s, net.elementwise, net.optimizer, net.attention, net.overlap) == (0.0, {}, [], {}, 1.0)
    work = _step(net)
    assert work.other_seconds == work.optimizer_seconds == 0.0
    assert work.seconds == pytest.approx(work.flops / 2e9)  # matmuls and attention, all at the one rate
    assert net.attention_seconds(8, "fp32") is None


def test_a_table_with_the_rates_round_trips(tmp_path):
    net = _load(tmp_path, {"gpus_per_node": 8, **OTHER})
    assert (net.op_overhead_s, net.elementwise, net.optimizer) == (5e-6, OTHER["elementwise"], [4e-9, 2e-5])
    assert _step(net).other_seconds > 0


@pytest.mark.parametrize("key, value", [
    ("op_overhead_s", -1e-6), ("op_overhead_s", math.inf), ("elementwise", {"gelu": 1e-9}),
    ("elementwise", {"norm": -1.0}), ("optimizer", [1e-9]), ("optimizer", [1e-9, "fast"]),
    ("attention", {"fp32": {"head_dims": [32, 8], "seconds": [[1e-9, 1e-9]] * 2}}),
    ("attention", {"fp32": {"head_dims": [8], "seconds": [[1e-9, 0.0]]}}),
    ("overlap", 1.5), ("overlap", -0.1), ("overlap", "full"),
])
def test_a_damaged_rate_is_one_error_naming_it(tmp_path, key, value):
    with pytest.raises(ValueError, match=f"bandwidth table .*: {key}"):
        _load(tmp_path, {key: value})


def test_attention_rate_interpolates_in_log_head_size():
    net = network.Network(attention=OTHER["attention"])
    assert net.attention_seconds(8, "fp32") == pytest.approx((1e-9, 2e-9))
    assert net.attention_seconds(16, "fp32") == pytest.approx((2e-9, 4e-9))  # halfway in log2: geometric mean
    assert net.attention_seconds(4, "fp32") == pytest.approx((1e-9, 2e-9))  # edges held
    assert net.attention_seconds(128, "fp32") == pytest.approx((4e-9, 8e-9))
    assert net.attention_seconds(16, "bf16") is None


CURVE = {"bytes": [64, 4096, 65536], "isolated": [2e-3, 3e-3, 5e-3], "streamed": [1e-3, 1.5e-3, 4e-3],
         "chained": [1.2e-3, 2e-3, 4.5e-3]}


def test_a_collective_curve_interpolates_and_extends_at_the_last_segments_rate(tmp_path):
    net = _load(tmp_path, {"collective_curves": {"all_reduce": {"intra": {"4": CURVE}}},
                           "collectives": {"all_gather": {"intra": {"4": [1.0, 100.0]}}}})

    def seconds(nbytes, series="isolated", op="all_reduce", p=4):
        return net.seconds(Record(op, "x", p, nbytes), True, series)

    assert seconds(8) == seconds(64) == pytest.approx(2e-3)
    assert seconds(2080) == pytest.approx(2.5e-3)  # halfway between 64 and 4096 bytes
    assert seconds(4096, "streamed") == pytest.approx(1.5e-3)
    assert seconds(4096, "chained") == pytest.approx(2e-3)
    net.collective_curves["all_reduce"]["intra"]["4"].pop("chained")
    assert seconds(4096, "chained") == pytest.approx(3e-3)  # no chained series: the isolated one
    with pytest.raises(ValueError, match="unknown series 'chain': use one of isolated, streamed, chained"):
        seconds(4096, "chain")  # a misspelt series is an error, never the isolated curve in silence
    rate = 2e-3 / (65536 - 4096)  # the last segment's
    assert seconds(65536 + 10**6) == pytest.approx(5e-3 + 10**6 * rate)
    assert seconds(4096, p=8) == seconds(4096, p=3) == pytest.approx(3e-3)  # the nearest measured group size
    # An op without a curve: latency + ring-moved bytes / bandwidth (all_gather moves (p - 1) / p of its payload).
    assert seconds(4 * 10**6, op="all_gather") == pytest.approx(1e-4 + 3e6 / 1e9)
    falling = dict(CURVE, isolated=[2e-3, 6e-3, 5e-3])
    net = network.Network(collective_curves={"all_reduce": {"intra": {"4": falling}}})
    assert net.seconds(Record("all_reduce", "x", 4, 65536 + 10**6), True) == pytest.approx(
        5e-3 + 10**6 * 3e-3 / (65536 - 64))


@pytest.mark.parametrize("curve", [
    dict(CURVE, bytes=[64]), dict(CURVE, bytes=[4096, 64, 65536]), dict(CURVE, isolated=[1e-3, 0.0, 1e-3]),
    dict(CURVE, streamed=[1e-3]), {"bytes": [64, 128], "streamed": [1e-3, 2e-3]}, dict(CURVE, slow=[1.0] * 3),
    dict(CURVE, chained=[1e-3, 2e-3, -1.0]),
])
def test_a_damaged_collective_curve_is_one_error_naming_it(tmp_path, curve):
    with pytest.raises(ValueError, match="bandwidth table .*: collective_curves.all_reduce.intra entry '4'"):
        _load(tmp_path, {"collective_curves": {"all_reduce": {"intra": {"4": curve}}}})


def test_probed_rates_are_positive_and_load(monkeypatch, tmp_path):
    monkeypatch.setattr(probes, "ELEMENTS", {"cpu": (2**12, 2**14)})
    monkeypatch.setattr(probes, "OPTIMIZER_ELEMENTS", {"cpu": 2**14})
    monkeypatch.setattr(probes, "ATTENTION_SHAPE", {"cpu": (2, 32)})
    other = probes.measure_other(("fp32",), min_seconds=0.0)
    rates = [other["op_overhead_s"], *other["elementwise"].values(), *other["optimizer"]]
    rates += [r for pair in other["attention"]["fp32"]["seconds"] for r in pair]
    assert set(other["elementwise"]) == set(network.ELEMENTWISE)
    assert all(math.isfinite(r) and r > 0 for r in rates), other
    net = _load(tmp_path, other)
    assert net.attention_seconds(64, "fp32") is not None and _step(net).other_seconds > 0


def _probe_places(rank, world):
    """Where the collective probe files groups of 2 consecutive ranks of 4, at 2, 3 and 4 ranks per node; and the
    overlap each probe measured."""
    grid = Grid(2, 2, 1, 1, rank=rank)
    grid.build_groups()
    try:
        tables = {gpn: collectives.measure_collectives(rank, world, gpn, sizes_mb=(0.01,), iters=1, grids={2: grid})
                  for gpn in (2, 3, 4)}
        return {gpn: sorted(t["collective_curves"]["all_reduce"]) for gpn, t in tables.items()}, \
            [t["overlap"] for t in tables.values()]
    finally:
        grid.release_groups()


def test_the_probe_files_group_sizes_where_the_planner_looks_them_up():
    """With 3 ranks per node, groups of 2 consecutive ranks of 4 straddle nodes (ranks 2-3 sit on two): the probe
    filed them "intra" (2 <= 3) while network.inside_node, which picks the curve for a step, reads them "inter",
    so the planner took a curve the probe never measured there. Each probe's overlap: the same on every rank, a
    fraction."""
    places, overlaps = zip(*run_ranks(4, _probe_places))
    expected = {gpn: ["intra" if network.inside_node(Grid(2, 2, 1, 1), ("x",), gpn) else "inter"] for gpn in (2, 3, 4)}
    assert expected == {2: ["intra"], 3: ["inter"], 4: ["intra"]}
    assert all(p == expected for p in places), places
    assert all(o == overlaps[0] for o in overlaps) and all(0 <= f <= 1 for f in overlaps[0]), overlaps  # every rank


def _across(rank, world):
    # rank r's medians: isolated (r + 1) ms, streamed (10 - r) ms, chained (r + 1)^2 ms, for two figures
    mine = torch.tensor([[rank + 1.0, 10.0 - rank, (rank + 1.0) ** 2]] * 2, dtype=torch.float64) / 1e3
    return collectives.across_ranks(mine).tolist()


def test_the_table_keeps_the_mean_rank_in_an_isolated_call_and_the_slowest_in_a_stream():
    """After the lead, the first member to reach a blocking call waits in it for the last, who then waits least:
    a rank spends the members' mean there over a step's many calls (the slowest rank's time overshot a step's by
    1.2-1.8x on 8 gloo ranks sharing 2 cores). A queued or chained call ends when its last member does: the
    slowest rank's."""
    for got in run_ranks(4, _across):
        assert got == [pytest.approx([2.5e-3, 10e-3, 16e-3])] * 2, got


@pytest.mark.parametrize("compute_s, stream_s, both_s, want", [
    (10.0, 4.0, 10.0, 1.0), (10.0, 4.0, 14.0, 0.0), (10.0, 4.0, 12.0, 0.5), (4.0, 10.0, 12.0, 0.5),
    (10.0, 4.0, 16.0, 0.0), (10.0, 4.0, 9.0, 1.0),
])
def test_the_overlap_probe_counts_the_hidden_share_of_the_shorter(compute_s, stream_s, both_s, want):
    """Clipped to [0, 1]: together slower than one after the other (a busy machine) hides nothing; faster than
    the longer alone (noise) hides all."""
    assert collectives.hidden_fraction(compute_s, stream_s, both_s) == pytest.approx(want)


def test_what_a_table_leaves_out_is_named_where_the_plan_relies_on_it(tmp_path, capsys):
    """A one-node `--measure` writes inter_node_gbps null and no device memory: the preset's figures stand in, and
    the plan's header says so; grids that communicate across nodes get a note that their time rests on that guess
    (60x the measured in-node rate ranked them first)."""
    table = tmp_path / "bw.json"
    table.write_text(json.dumps({"name": "vm", "gpus_per_node": 2, "intra_node_gbps": 0.4, "inter_node_gbps": None}))
    net = network.load_network(bandwidth=str(table))
    assert net.unmeasured == ("inter_node_gbps", "gpu_memory_gb")
    assert network.load_network(bandwidth=str(table), gpu_memory_gb=16).unmeasured == ("inter_node_gbps",)
    assert network.load_network().unmeasured == ()  # a preset's figures are what it says
    assert not plan_cli.main(["--model", "ladder-1m", "--gpus", "8", "--bandwidth", str(table)])
    out = capsys.readouterr().out
    assert "80 GB (not in the table: the preset's)" in out and "25 GB/s across (not in the table: the preset's)" in out
    assert "note: the grids marked * communicate across nodes, which the bandwidth table does not measure" in out
    plan_cli.main(["--model", "ladder-1m", "--gpus", "8", "--bandwidth", str(table), "--gpus-per-node", "8",
                   "--gpu-memory-gb", "16"])
    out = capsys.readouterr().out
    assert "16 GB," in out and "not in the table" in out and "note:" not in out  # one node: nothing crosses


def test_a_measured_overlap_slows_the_grids_whose_collectives_could_hide(tmp_path, capsys):
    """A machine that hides a quarter of what could hide: the data-parallel grid's gradient all-reduce, hidden
    behind backward at full overlap, now mostly lands on its step; the plan's header says how much this machine
    hides."""
    doc = {"name": "cpu", "gpus_per_node": 8, "intra_node_gbps": 1.0}
    steps = {}
    for overlap in (1.0, 0.25):
        net = _load(tmp_path, {**doc, "overlap": overlap})
        plans, _ = search.plan(search.PlanConfig("ladder-1m", 8, batch=16, seq=64, mode="sharded"), net)
        steps[overlap] = {p.grid: p for p in plans}[(8, 1, 1, 1)]
    full, quarter = steps[1.0], steps[0.25]
    assert full.step_seconds < full.compute_seconds + full.comm_seconds  # something hides at full overlap
    hidden = full.compute_seconds + full.comm_seconds - full.step_seconds
    assert quarter.step_seconds == pytest.approx(full.step_seconds + 0.75 * hidden)
    plan_cli.main(["--model", "ladder-1m", "--gpus", "8", "--bandwidth", str(tmp_path / "bw.json")])
    assert "this machine hides 25% of what could" in capsys.readouterr().out
