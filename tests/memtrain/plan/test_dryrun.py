"""`memtrain plan --validate`: the trainer's own step on a fake process group and fake tensors, against cost.py.

- At 64 ranks, small named models (sharded bf16 with activation checkpointing and two micro-batches; easy
  fp32 GPT-2): every ledger record, and the per-rank parameter, gradient and AdamW bytes, equal the planner's;
  the activation estimate is reported as a ratio to the saved-tensor measurement (bounded loosely, it is one).
- It can fail: a planner one byte off on one collective, or on the gradients, is flagged (exit 1, DIFFERENT),
  through the command line; the JSON it writes says so.
- The `paper` preset's 405B grid (x=4, y=8, z=16) at 4,096 ranks (data=8): its batch of 64 does not split over
  data*z = 128 there, so one sequence per (z, data) group: batch 128, micro-batch 1, bf16, recomputation.
Each dry run starts and ends its own fake process group in this process.
"""

import json
import math
import time

import pytest
import torch.distributed as dist

from memtrain.cli import main
from memtrain.plan import cost, dryrun
from memtrain.plan.search import PlanConfig
from parallel import Grid

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


@pytest.mark.parametrize("case", CASES)
def test_dry_run_equals_the_planner_record_for_record(case):
    cfg, grid = CASES[case]
    run = dryrun.dry_run(cfg, grid, rank=37)
    _check(run)
    assert run.world_size == 64 and run.micro_batches == cfg.batch // cost.rows_split(Grid(*grid), run.mode) // 2 ** (
        cfg.micro_batch == 2)
    if cfg.activation_checkpointing:  # kept at the peak: outside the blocks, their inputs, one block recomputed
        a = run.activations
        assert a["blocks"] == 6 and a["largest_block"] > 0 and a["block_inputs"] > 0
        assert a["total"] == a["saved_outside_blocks"] + a["block_inputs"] + a["largest_block"]


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
