"""The planner's cost model against what the engine really does.

- Bytes: one optimizer step of memtrain's trainer (memtrain.training.train_step itself: micro-batches under
  parallel.overlap, loss sums, the overlapped gradient sync (parallel.GradSync), clip_grad_norm_, AdamW, the loss
  all-reduce) on 8 forked gloo ranks records parallel.LEDGER; cost.step_records must predict that multiset of
  records (op, axes label, group size, payload bytes) exactly, for the tiny Llama of tests/memtrain/_models.py
  on every 8-rank grid in easy and sharded mode, plus bf16 autocast, tied embeddings, GPT-NeoX and GPT-2 (padded
  vocabulary) on some grids. Integers: compared exactly. (Overlap moves when bytes move, never how many:
  tests/parallel/test_ledger.py.) At GradSync's own sizes each tiny model's group is one bucket; with buckets of
  256 B / 1 KiB, two steps on three grids: the first step's buckets (reverse registration order) and the second's
  (re-cut in the order the first backward made gradients final, which cuts other buckets there) equal
  cost.gradient_buckets', message for message. Planner only: the cut is GradSync.plan's on every grid.
  The bf16 cases with z > 1 pin the Z weight all-gathers of Linear and LM head in bf16 (the embedding's and
  every reduce-scatter stay fp32), also with a tied head and with activation checkpointing, whose recomputed
  forward gathers again under the replayed autocast (the OAG prefetcher must gather each in the dtype taken).
- Async calls: the step's async all-reduces are exactly cost.gradient_records' buckets and cost.Log.oar (sharded
  mode's OAR), the ones the planner charges apart from blocking calls.
- Memory: the estimate of parameter + gradient + AdamW bytes per rank within 10% of the tensors the ranks
  hold after the step (it is exact by construction; 10% is the issue's bound).
- The measured collectives (`plan --measure`) of the same ranks: a curve per op and group size at every payload,
  streamed for the async ops, and a latency + bandwidth summary; the planner reads both back.
One fork of 8 ranks runs every case.
"""

import json
import os
import time
from collections import Counter

import pytest
import torch

import parallel
from memtrain.config import RunConfig
from memtrain.hf import parallelize
from memtrain.plan import collectives, cost, network
from memtrain.training import build_optimizer, train_step
from parallel import Grid
from parallel.bucketed import GradSync
from parallel.comm import Record, totals
from parallel.forked import run_ranks
from parallel.sharding import tag
from tests._helpers import GRIDS, MODES, GridCache, grid_id, once_per_session
from tests.memtrain.plan._helpers import B, S, micro_batch, step_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (grid, family, mode, precision, extra config): every grid x both modes for Llama, then the other paths.
CASES = [(g, "llama", m, "fp32", ()) for g in GRIDS for m in ("sharded", "easy")] + [
    ((2, 2, 2, 1), "llama", "sharded", "bf16", ()), ((1, 2, 2, 2), "llama", "easy", "bf16", ()),
    ((2, 1, 2, 2), "llama", "sharded", "bf16", (("tie_word_embeddings", True),)),
    ((1, 2, 2, 2), "llama", "sharded", "bf16", (("recompute", True),)),
    ((2, 1, 2, 2), "llama", "sharded", "fp32", (("tie_word_embeddings", True),)),
    ((1, 2, 2, 2), "neox", "sharded", "fp32", ()), ((2, 2, 1, 2), "neox", "easy", "fp32", ()),
    ((1, 1, 8, 1), "gpt2", "sharded", "fp32", ()), ((2, 2, 2, 1), "gpt2", "easy", "fp32", ()),
]
# (grid, family, mode): GradSync with small buckets, two steps; grids where the two steps cut differently.
BUCKET_CASES = [((2, 2, 2, 1), "llama", "sharded"), ((2, 2, 1, 2), "neox", "sharded"), ((2, 2, 1, 2), "neox", "easy")]
SMALL = {"first_bucket_bytes": 256, "bucket_bytes": 1024}


def run_step(plm, grid, opt, precision, micro, vocab):
    """One step of the trainer's own train_step (overlap on, clipping on) on a seeded batch."""
    g = torch.Generator().manual_seed(7)
    ids, labels = torch.randint(0, vocab, (B, S), generator=g), torch.randint(0, vocab, (B, S), generator=g)
    labels[:, :2] = -100
    amp = torch.bfloat16 if precision == "bf16" else None
    train_step(plm, grid, opt, ids, labels, labels != -100, micro, amp=amp, overlap=True, grad_clip=1.0)


def _worker(rank, world):
    out, grids = {}, GridCache(rank)
    for case in CASES:
        degrees, family, mode, precision, extra = case
        grid = grids[degrees]
        plm = parallelize(step_model(family, extra, "meta"), grid, mode, seed=1, device="cpu")
        if ("recompute", True) in extra:
            plm.enable_activation_checkpointing()
        opt = build_optimizer(plm, RunConfig())
        parallel.LEDGER.reset()
        parallel.LEDGER.timed = True  # which calls were async: the planner charges them apart
        try:
            run_step(plm, grid, opt, precision, micro_batch(degrees, mode), plm.config.vocab_size)
        finally:
            parallel.LEDGER.timed = False
        params = parallel.unique_parameters(plm)
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        out[case] = {"records": Counter(parallel.LEDGER.records),
                     "async_all_reduces": Counter(r for r, s in zip(parallel.LEDGER.records, parallel.LEDGER.blocked,
                                                                    strict=True) if s is None and r.op == "all_reduce"),
                     "memory": {"params": nbytes(params), "grads": nbytes(p.grad for p in params),
                                "optimizer": nbytes(state)}}
    for case in BUCKET_CASES:
        degrees, family, mode = case
        grid = grids[degrees]
        plm = parallelize(step_model(family, (), "meta"), grid, mode, seed=1, device="cpu")
        parallel.grad_sync(plm, grid, **SMALL)  # kept on the model: train_step's own call returns it
        opt = build_optimizer(plm, RunConfig())
        out[case] = []
        for _ in range(2):
            parallel.LEDGER.reset()
            run_step(plm, grid, opt, "fp32", micro_batch(degrees, mode), plm.config.vocab_size)
            out[case].append(Counter(parallel.LEDGER.records))
    probe_grids = collectives.probe_grids(rank, world)
    assert {p: (g.data, g.x, g.y, g.z) for p, g in probe_grids.items()} == {
        2: (4, 2, 1, 1), 4: (2, 4, 1, 1), 8: (1, 8, 1, 1)}
    out["measure"] = collectives.measure_collectives(rank, world, 8, sizes_mb=(0.01, 0.04), iters=2, grids=probe_grids)
    return out


@pytest.fixture(scope="module")
def ranks(request):
    t = time.perf_counter()
    res = once_per_session(request, lambda: run_ranks(8, _worker))
    print(f"8 ranks, {len(CASES)} cases: {time.perf_counter() - t:.1f} s")
    return res


def _predict(case):
    degrees, family, mode, precision, extra = case
    shape = cost.shape_of(step_model(family, extra, "meta").config)
    # Each case's step is its new model's first: GradSync cuts in reverse registration order.
    return shape, cost.step_records(shape, Grid(*degrees), mode, B, S, micro_batch(degrees, mode), precision=precision,
                                    checkpointing=("recompute", True) in extra, first_step=True)


def _id(case):
    degrees, family, mode, precision, extra = case
    tags = "".join("-tied" if k == "tie_word_embeddings" else f"-{k}" for k, _ in extra)
    return grid_id(degrees) + f"-{family}-{mode}-{precision}" + tags


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_predicted_bytes_equal_ledger(ranks, case):
    _, want = _predict(case)
    assert want, "every grid has a non-trivial axis"
    for rank, got in enumerate(ranks):
        got = got[case]["records"]
        assert got == want, (rank, sorted((got - want).items(), key=str), sorted((want - got).items(), key=str))
        assert totals(got) == totals(want)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_async_all_reduces_are_the_gradient_buckets_and_oar(ranks, case):
    """The planner charges an async all-reduce apart from a blocking one: a gradient bucket may hide behind
    backward, and sharded mode's input-gradient all-reduces (OAR: cost.Log.oar) take their streamed time. The
    ledger's async all-reduces of the step are exactly those two kinds (easy mode's OAR reduce-scatters instead)."""
    degrees, family, mode, precision, extra = case
    shape = cost.shape_of(step_model(family, extra, "meta").config)
    log = cost.step_log(shape, Grid(*degrees), mode, B, S, micro_batch(degrees, mode), precision=precision,
                        checkpointing=("recompute", True) in extra, first_step=True)
    want = log.oar + cost.gradient_records(shape, Grid(*degrees), mode, first_step=True)
    assert bool(log.oar) == (mode == "sharded" and degrees[1] * degrees[2] > 1), log.oar
    for rank, got in enumerate(ranks):
        got = got[case]["async_all_reduces"]
        assert got == want, (rank, sorted((got - want).items(), key=str), sorted((want - got).items(), key=str))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_memory_estimate_within_10_percent(ranks, case):
    degrees, family, mode, precision, extra = case
    shape, _ = _predict(case)
    est = cost.state_bytes(shape, Grid(*degrees), mode, param_bytes=4)
    for got in ranks:
        for key, measured in got[case]["memory"].items():
            assert abs(est[key] - measured) <= 0.1 * measured, (key, est[key], measured)


@pytest.mark.parametrize("case", BUCKET_CASES, ids=lambda c: f"{grid_id(c[0])}-{c[1]}-{c[2]}")
def test_gradient_buckets_equal_grad_sync(ranks, case):
    """Small buckets, two steps: each step's ledger, record for record, with the planner's buckets of that step."""
    degrees, family, mode = case
    shape, grid = cost.shape_of(step_model(family, (), "meta").config), Grid(*degrees)
    for step, first in enumerate((True, False)):
        want = cost.step_records(shape, grid, mode, B, S, micro_batch(degrees, mode), first_step=first, **SMALL)
        for rank, got in enumerate(ranks):
            got = got[case][step]
            assert got == want, (rank, step, sorted((got - want).items(), key=str),
                                 sorted((want - got).items(), key=str))
    first, later = (cost.gradient_buckets(shape, grid, mode, first_step=f, **SMALL) for f in (True, False))
    assert all(len(b) > 1 for b in later.values()) and first != later  # cut, and re-cut into other messages
    print({grid.label(a): len(b) for a, b in later.items()}, "buckets")


def _cuts(sync: GradSync) -> dict[tuple[str, ...], list[int]]:
    """Bytes of each of a GradSync's buckets, in order, per group's live axes (fp32 parameters)."""
    return {axes: [sum(sync.params[i].numel() * 4 for i in b.index) for b in q] for (axes, _), q in sync.queues.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "neox", "gpt2"])
def test_buckets_are_grad_sync_cuts(family, mode):
    """GradSync itself, on meta tensors of the planner's parameters (sizes, reduce tags, registration order), cuts
    the buckets cost.gradient_buckets gives, on every 8-rank grid: its first plan, and its plan in the planner's
    backward order; small sizes and its own. The flat messages carry the same bytes."""
    shape = cost.shape_of(step_model(family, (), "meta").config)
    for degrees in GRIDS:
        grid = Grid(*degrees)
        params, ready = cost.ordered_parameters(shape, grid, mode)
        tensors = [tag(torch.nn.Parameter(torch.empty(p.numel, device="meta")), reduce_axes=p.reduce_axes)
                   for p in params]
        flat = cost.gradient_buckets(shape, grid, mode, grad_sync="blocking")
        for sizes in (SMALL, {}):
            sync = GradSync(tensors, grid, **sizes)
            pos = {id(t): i for i, t in enumerate(sync.params)}
            first = _cuts(sync)
            sync.plan([pos[id(tensors[i])] for i in ready if id(tensors[i]) in pos])
            later = _cuts(sync)
            sync.remove()
            assert first == cost.gradient_buckets(shape, grid, mode, first_step=True, **sizes), (degrees, sizes)
            assert later == cost.gradient_buckets(shape, grid, mode, **sizes), (degrees, sizes)
            assert {a: [sum(b)] for a, b in later.items()} == flat


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "neox", "gpt2"])
def test_z_sharded_weights_finish_in_reverse_registration_order(family, mode):
    """With z > 1 under ORS their gradients are not final in backward, so GradSync re-cuts them in reverse
    registration order; cost.gradient_buckets cuts them in backward order, which must be that same order."""
    shape = cost.shape_of(step_model(family, (), "meta").config)
    params, ready = cost.ordered_parameters(shape, Grid(2, 2, 2, 2), mode)
    weights = [i for i in ready if params[i].reduce_axes == ("data",)]
    assert len(weights) > 2 and weights == sorted(weights, reverse=True)


def test_measured_table_is_read_by_the_planner(ranks, tmp_path):
    measured = ranks[0]["measure"]
    assert all(r["measure"] == measured for r in ranks)  # every rank returns the slowest rank's figures
    curves, table = measured["collective_curves"], measured["collectives"]
    assert set(curves) == set(table) == set(network.OPS)
    payloads = (*collectives.SMALL_MESSAGES, int(0.01 * 2**20), int(0.04 * 2**20))  # and --sizes-mb 0.01,0.04
    for op in network.OPS:
        assert set(curves[op]["intra"]) == set(table[op]["intra"]) == {"2", "4", "8"}
        for p, curve in curves[op]["intra"].items():
            fp32_values = sorted({b // 4 // int(p) * int(p) for b in payloads})  # divisible by the group
            assert curve["bytes"] == [4 * n for n in fp32_values], (op, p)
            assert ("streamed" in curve) == (op in network.ASYNC_OPS), (op, p)
            assert ("chained" in curve) == (op in network.CHAINED_OPS), (op, p)
            assert all(len(curve[s]) == len(curve["bytes"]) and min(curve[s]) > 0
                       for s in network.SERIES if s in curve), (op, p)
            gbps, lat = table[op]["intra"][p]
            assert gbps > 0 and lat == pytest.approx(curve["isolated"][0] * 1e6)
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"gpus_per_node": 8, **measured}))
    net = network.load_network(bandwidth=str(path))
    curve = curves["all_reduce"]["intra"]["4"]
    record = Record("all_reduce", "x", 4, curve["bytes"][2])
    assert net.seconds(record, True) == curve["isolated"][2]
    assert net.seconds(record, True, "streamed") == curve["streamed"][2]
    assert net.seconds(record, True, "chained") == curve["isolated"][2]  # an all-reduce has no chained series
    curve = curves["all_to_all"]["intra"]["4"]
    assert net.seconds(Record("all_to_all", "x", 4, curve["bytes"][2]), True, "chained") == curve["chained"][2]
