"""`memtrain plan --validate`: the trainer's own step on a fake process group and fake tensors, against cost.py.

- At 64 ranks, small named models (sharded bf16 with activation checkpointing and two micro-batches; easy
  fp32 GPT-2): every ledger record, and the per-rank parameter, gradient and AdamW bytes, equal the planner's,
  with the trainer's overlapped gradient sync (the dry run's default) and with the blocking one; the activation
  estimate is reported as a ratio to the saved-tensor measurement (bounded loosely, it is one).
- GradSync's buckets: with small buckets (1 KiB, then 4 KiB) on six grids of the three families, in both modes
  (data > 1; x, y > 1; z > 1), on a run's first step and on a later one, the ledger equals the planner's records
  exactly: every bucket's all-reduce (op, group, bytes), as many as GradSync launches (11 to 44 per step), and
  each group's in the planner's order. Each case also tells apart what the planner could get wrong: the flat
  messages, and where it changes the messages (five of the six) the other step's parameter order. At
  GradSync's own sizes ladder-30m (120 MB of gradients per rank at data=2) is cut into 5 buckets, and the 405B
  run below into 107 + 2.
- It can fail: a planner one byte off on one collective, or on the gradients, is flagged (exit 1, DIFFERENT),
  through the command line; the JSON it writes says so.
- The `paper` preset's 405B grid (x=4, y=8, z=16) at 4,096 ranks (data=8): its batch of 64 does not split over
  data*z = 128 there, so one sequence per (z, data) group: batch 128, micro-batch 1, bf16, recomputation.
Each dry run starts and ends its own fake process group in this process.
"""

import dataclasses
import functools
import json
import math
import time

import pytest
import torch.distributed as dist

import parallel
from memtrain.cli import main
from memtrain.config import ParallelConfig
from memtrain.hf.architectures import Matrix
from memtrain.plan import cost, dryrun
from memtrain.plan.search import PlanConfig, load_config
from parallel import Grid
from parallel.bucketed import BUCKET_BYTES, FIRST_BUCKET_BYTES

CASES = {  # id: (config, (data, x, y, z))
    "ladder-1m-sharded-bf16-recompute": (
        PlanConfig("ladder-1m", 64, batch=64, seq=32, micro_batch=2, mode="sharded", precision="bf16",
                   activation_checkpointing=True), (2, 2, 2, 8)),
    "gpt2-tiny-easy-fp32": (PlanConfig("gpt2-tiny", 64, batch=64, seq=16, micro_batch=1, mode="easy",
                                       precision="fp32"), (4, 2, 2, 4)),
}


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized(), "another test left torch.distributed running"
    yield
    assert not dist.is_initialized(), "the dry run must end its fake process group"


def _check(run: dryrun.DryRun) -> None:
    print(dryrun.header(run))
    print(dryrun.table(run))
    extra, missing = run.record_differences()
    assert not extra and not missing, (list(extra.items())[:5], list(missing.items())[:5])
    assert sum(run.measured.values()) > 0
    for c in run.memory:
        if c.exact:
            assert c.planner == c.measured, c
        else:  # an estimate: say how far, never claim equality
            assert c.what == "activations" and 0.5 < c.ratio < 2, c
    assert run.ok


@pytest.mark.parametrize("grad_sync", [None, "blocking"])
@pytest.mark.parametrize("case", CASES)
def test_dry_run_equals_the_planner_record_for_record(case, grad_sync):
    cfg, grid = CASES[case]
    run = dryrun.dry_run(cfg, grid, rank=37, grad_sync=grad_sync)
    _check(run)
    assert run.options["grad_sync"] == (grad_sync or ParallelConfig().grad_sync) == (grad_sync or "overlap")
    assert run.world_size == 64 and run.micro_batches == cfg.batch // cost.rows_split(Grid(*grid), run.mode) // 2 ** (
        cfg.micro_batch == 2)
    if cfg.activation_checkpointing:  # kept at the peak: outside the blocks, their inputs, one block recomputed
        a = run.activations
        assert a["blocks"] == 6 and a["largest_block"] > 0 and a["block_inputs"] > 0
        assert a["total"] == a["saved_outside_blocks"] + a["block_inputs"] + a["largest_block"]


SMALL = {"first_bucket_bytes": 1024, "bucket_bytes": 4096}


def _cfg(model: str, mode: str, grid: tuple[int, ...]) -> PlanConfig:
    """Two micro-batches of one sequence per rank: the first only accumulates (parallel.no_sync)."""
    split = grid[0] * grid[3] if mode == "sharded" else math.prod(grid)
    return PlanConfig(model, math.prod(grid), batch=2 * split, seq=8, micro_batch=1, mode=mode, precision="fp32")


BUCKETS = {  # id: (config, (data, x, y, z), steps measured, whether the other step's parameter order cuts otherwise)
    "ladder-1m-sharded-d2x2y2-later": (_cfg("ladder-1m", "sharded", (2, 2, 2, 1)), (2, 2, 2, 1), 2, True),
    "ladder-1m-easy-d2-first": (_cfg("ladder-1m", "easy", (2, 1, 1, 1)), (2, 1, 1, 1), 1, True),
    "pythia-14m-sharded-d4x2y2z4-first": (_cfg("pythia-14m", "sharded", (4, 2, 2, 4)), (4, 2, 2, 4), 1, True),
    "pythia-14m-sharded-d2x2y2z2-later": (_cfg("pythia-14m", "sharded", (2, 2, 2, 2)), (2, 2, 2, 2), 2, True),
    "pythia-14m-easy-d2x2z2-later": (_cfg("pythia-14m", "easy", (2, 2, 1, 2)), (2, 2, 1, 2), 2, True),
    "gpt2-tiny-easy-d2x2y2z2-later": (_cfg("gpt2-tiny", "easy", (2, 2, 2, 2)), (2, 2, 2, 2), 2, False),
}


@pytest.mark.parametrize("case", BUCKETS)
def test_gradient_buckets_equal_grad_syncs(case, monkeypatch):
    """The engine's GradSync with small buckets (train_step takes the one kept on the model): the ledger is the
    planner's step, every bucket's all-reduce included, record for record."""
    cfg, grid, steps, order_matters = BUCKETS[case]
    monkeypatch.setattr(parallel, "grad_sync", functools.partial(parallel.grad_sync, **SMALL))
    issued = []  # the ledger in issue order, as the dry run resets it after each step

    def reset():
        issued.append(list(parallel.LEDGER.records))
        parallel.LEDGER.records.clear()

    monkeypatch.setattr(parallel.LEDGER, "reset", reset)
    run = dryrun.dry_run(cfg, grid, steps=steps)
    shape, g = cost.shape_of(load_config(cfg.model)), Grid(*grid)
    sync = dict(SMALL, first_step=steps == 1)

    def predict(**kw):
        return cost.step_records(shape, g, run.mode, cfg.batch, cfg.seq, cfg.micro_batch, **kw)

    want = predict(**sync)
    assert run.measured == want, (sorted((run.measured - want).items(), key=str)[:5],
                                  sorted((want - run.measured).items(), key=str)[:5])
    buckets = cost.gradient_buckets(shape, g, run.mode, **sync)
    print(case, {g.label(a): len(b) for a, b in buckets.items()}, "buckets")
    # In launch order too: a group's buckets go one after the other, and on these grids no other all-reduce over
    # a group's axes comes before them (the gradient norm's and the loss's come after the sync).
    for axes, b in buckets.items():
        launched = [r.nbytes for r in issued[-1] if r.op == "all_reduce" and r.axes == g.label(axes)]
        assert launched[:len(b)] == b, axes
    assert min(map(len, buckets.values())) >= 2 and max(map(len, buckets.values())) >= 3  # both sizes cut
    assert predict(grad_sync="blocking") != run.measured
    assert (predict(**dict(sync, first_step=steps != 1)) != run.measured) == order_matters


def test_default_buckets_cut_a_model_bigger_than_one():
    """GradSync's own sizes: ladder-30m's 120 MB of gradients per rank at data=2 in 5 buckets (1 MiB, then 25 MiB;
    a bucket closes at the parameter that fills it), on a later step, whose order cuts other bytes than the first's:
    the dry run's own prediction follows its steps."""
    cfg = _cfg("ladder-30m", "sharded", (2, 1, 1, 1))
    run = dryrun.dry_run(cfg, (2, 1, 1, 1), steps=2)
    _check(run)
    (data,) = run.gradients.values()
    assert len(data) == 5 and data[0] >= FIRST_BUCKET_BYTES and min(data[1:-1]) >= BUCKET_BYTES
    text = dryrun.table(run)
    assert "(grad_sync=overlap, buckets in the first backward's gradient order):\n" \
           "  data                5 all-reduces      119,572,480 bytes" in text, text


def test_a_wrong_planner_figure_is_flagged(monkeypatch, tmp_path, capsys):
    real_records, real_state = cost.step_records, cost.state_bytes

    def off_by_one(*a, **kw):
        records = real_records(*a, **kw)
        r = next(r for r in records if r.op == "all_reduce" and r.axes == "x")
        records[r] -= 1
        records[type(r)(r.op, r.axes, r.group_size, r.nbytes + 1)] += 1
        return records

    monkeypatch.setattr(cost, "step_records", off_by_one)
    def four_bytes_more_grads(*a, **kw):
        state = real_state(*a, **kw)
        return dict(state, grads=state["grads"] + 4)

    monkeypatch.setattr(cost, "state_bytes", four_bytes_more_grads)
    out = tmp_path / "dry.json"
    code = main(["plan", "--validate", "--model", "ladder-1m", "--gpus", "64", "--grid", "2,2,-1,8", "--batch", "16",
                 "--seq", "16", "--micro-batch", "1", "--json", str(out)])
    text = capsys.readouterr().out
    print(text)
    assert code == 1 and "MISMATCH" in text
    assert "grads" in text and "DIFFERENT" in text
    assert "1 issued but not predicted, 1 predicted but not issued" in text
    got = json.loads(out.read_text())
    assert got["ok"] is False and got["grid"] == {"data": 2, "x": 2, "y": 2, "z": 8}
    assert [c["what"] for c in got["memory"] if not c["ok"]] == ["grads"]
    assert [c["what"] for c in got["collectives"] if not c["ok"]] == ["all_reduce x bytes"]
    assert len(got["records"]["issued_not_predicted"]) == len(got["records"]["predicted_not_issued"]) == 1


@pytest.mark.parametrize("argv, message", [
    (["--grid", "2,2,2"], "give DATA,X,Y,Z"),
    (["--grid", "3,2,2,-1"], "cannot infer"),
    (["--grid", "1,2,2,16", "--batch", "8"], "batch 8 is not divisible by data*z=16"),
    (["--grid", "1,2,2,16", "--rank", "64"], "outside a grid of 64 ranks"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    code = main(["plan", "--validate", "--model", "ladder-1m", "--gpus", "64", "--seq", "16", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_grid_without_validate_is_refused(capsys):
    assert main(["plan", "--model", "ladder-1m", "--gpus", "8", "--grid", "8,1,1,1"]) == 2
    assert "applies to --validate only" in capsys.readouterr().err


def test_paper_405b_at_4096_ranks():
    from experiments.sweep import spec as specs

    point = next(p for p in specs.expand(specs.load_spec("paper")) if p.cfg.model.name == "llama-3.1-405b")
    par, train = point.cfg.parallel, point.cfg.train
    gpus = 4096
    data = gpus // (par.x * par.y * par.z)
    batch = math.lcm(train.batch_size, data * par.z)  # the preset's 64 does not split over data*z = 128
    cfg = PlanConfig("llama-3.1-405b", gpus, batch=batch, seq=point.cfg.data.seq_len,
                     micro_batch=train.micro_batch_size, mode=par.mode, precision="bf16",
                     activation_checkpointing=train.activation_checkpointing)
    start = time.perf_counter()
    run = dryrun.dry_run(cfg, (data, par.x, par.y, par.z))
    _check(run)
    print(f"405B at {gpus} ranks: {time.perf_counter() - start:.1f} s ({run.seconds})")
    assert run.grid == (8, 4, 8, 16) and run.batch == 128 and run.checkpointing and run.precision == "bf16"
    # 3.2 GB of weight gradients per rank: 1 MiB, then 25 MiB buckets; the norms' 4 MB: two
    assert {axes: len(b) for axes, b in run.gradients.items()} == {"data": 107, "z+data": 2}


@pytest.mark.parametrize("mode, grid, steps, grad_sync", [
    ("sharded", (2, 1, 1, 1), 1, None), ("sharded", (2, 1, 1, 1), 2, None), ("sharded", (1, 1, 1, 2), 1, None),
    ("easy", (1, 1, 2, 1), 2, None), ("sharded", (2, 1, 1, 1), 1, "blocking"), ("sharded", (1, 2, 1, 1), 1, None),
])
def test_grad_sync_bucket_buffers_are_counted(mode, grid, steps, grad_sync):
    """GradSync keeps one flat buffer per bucket on the device, every synced gradient again: the planner's
    per-rank memory must count them and the dry run measure them, or --validate calls "equal" a total short by
    the gradients. Synced means a live reduce axis, not data > 1: with data = 1, z = 2 syncs the norms and so
    does easy mode on y = 2 (HF's untagged norms); sharded x = 2 syncs nothing. On a run's first step the
    buffers are those the step allocated (GradSync re-cuts its buckets at its end; the next step keeps buffers
    of the same bytes)."""
    cfg = _cfg("ladder-1m", mode, grid)
    run = dryrun.dry_run(cfg, grid, steps=steps, grad_sync=grad_sync)
    _check(run)
    (c,) = [c for c in run.memory if c.what == "grad_buckets"]
    synced = sum(map(sum, run.gradients.values()))
    assert c.planner == c.measured == (0 if grad_sync == "blocking" or grid == (1, 2, 1, 1) else synced)
    if grad_sync is None and grid != (1, 2, 1, 1):
        assert c.measured > 0


@pytest.mark.parametrize("model, grid", [("pythia-14m", (1, 1, 2, 1)), ("ladder-1m", (1, 2, 2, 1)),
                                         ("gpt2-tiny", (1, 1, 2, 1))])
def test_easy_recomputation_stops_after_the_last_saved_tensor(model, grid):
    """Non-reentrant checkpointing stops recomputing a block once its last saved tensor is rebuilt, so the block's
    last Linear's output re-layout (an all_to_all over y, after its MatmulFn saved) runs in the forward only: the
    planner counted it once more per layer and micro-batch, and --validate failed on every family."""
    cfg = dataclasses.replace(_cfg(model, "easy", grid), activation_checkpointing=True)
    run = dryrun.dry_run(cfg, grid)
    _check(run)
    shape = cost.shape_of(load_config(model))
    to_all = sum(n for r, n in run.measured.items() if r.op == "all_to_all" and r.axes == "y")
    linears = sum(1 for m in shape.block if isinstance(m, Matrix))
    # Each Linear's output edge (its only all_to_all over y: the ends' are over x): forward twice and backward
    # once, but the last Linear's forward once; per layer and micro-batch.
    assert to_all == run.micro_batches * shape.layers * (3 * linears - 1), to_all
