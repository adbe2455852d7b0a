"""The planner's optimizer offload against what OffloadAdamW (memtrain/training/offload.py) holds and moves.

- Memory, as test_cost.py measures the on-device optimizer: after one step of the trainer's train_step on the
  tiny Llama, the bytes on the device (parameters and gradients: the optimizer keeps nothing there; the
  overlapped gradient sync's bucket buffers, which offload streams from, on 2-rank grids with data = 1 too) and on the
  host (fp32 masters, moments and step scalars in the optimizer's state, gradient staging buffers), counted from
  the optimizer's own tensors, equal cost.state_bytes(offload=True) and cost.host_bytes exactly; fp32 and bf16
  (bf16 parameters and gradients on the device), on one process and on 2-rank grids of both modes. The host
  tensors share no memory with the parameters or gradients (separate state, even where host is device memory).
- Traffic: the bytes a step copied between them equal cost.offload_traffic (zero for CPU ranks, --host-gbps 0).
- `memtrain plan --offload`: a 70B model fits fewer GPUs with offload, the table shows host memory, the
  step pays the copies; --offload with --validate and a negative --host-gbps are one-line errors.
"""

import dataclasses
import json
import re

import pytest
import torch

import parallel
from memtrain.cli import main as cli_main
from memtrain.config import RunConfig
from memtrain.hf import parallelize
from memtrain.plan import cost, search
from memtrain.training import build_optimizer, train_step
from parallel.forked import run_ranks
from tests.memtrain.plan._helpers import B, S, step_model

CASES = [((1, 1, 1, 1), "sharded", "fp32"), ((1, 1, 1, 1), "sharded", "bf16"), ((2, 1, 1, 1), "sharded", "fp32"),
         ((1, 2, 1, 1), "sharded", "bf16"), ((1, 1, 1, 2), "sharded", "fp32"), ((1, 1, 2, 1), "easy", "bf16")]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _tensors(obj, seen: set) -> list:
    """Every tensor reachable from `obj` through dicts (keys and values), lists, tuples and sets."""
    if torch.is_tensor(obj):
        return [obj]
    if id(obj) in seen or not isinstance(obj, (dict, list, tuple, set)):
        return []
    seen.add(id(obj))
    items = [*obj.keys(), *obj.values()] if isinstance(obj, dict) else list(obj)
    return [t for x in items for t in _tensors(x, seen)]


def _measure(grid, mode: str, precision: str) -> dict:
    """One offloaded step of train_step (two micro-batches, overlapped sync, clipping), then what is where."""
    plm = parallelize(step_model("llama", (), "meta"), grid, mode, seed=1, device="cpu")
    cfg = RunConfig()
    cfg.train.optimizer_offload = True
    amp = torch.bfloat16 if precision == "bf16" else None
    opt = build_optimizer(plm, cfg, amp)
    # The GradSync train_step takes (kept on the model; built after the optimizer, which sets the gradients'
    # dtype). Its buckets are read before the step: a run's first step re-cuts them at its end.
    buckets = list(parallel.grad_sync(plm, grid).buckets)
    split = grid.world_size if mode == "easy" else grid.size(("z", "data"))
    g = torch.Generator().manual_seed(7)
    ids, labels = torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g)
    train_step(plm, grid, opt, ids, labels, labels != -100, B // split // 2, amp=amp, grad_clip=1.0)
    params = parallel.unique_parameters(plm)
    grads = [p.grad for p in params if p.grad is not None]
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    host = [*opt.masters.values(), *state, *opt.staged.values()]
    known = {id(t) for t in params + grads + host}
    elsewhere = {id(t): t for t in _tensors(vars(opt), set()) if id(t) not in known}  # any other the optimizer keeps
    shared = {t.untyped_storage().data_ptr() for t in params + grads} & {t.untyped_storage().data_ptr() for t in host}
    return {"device": {"params": _nbytes(params), "grads": _nbytes(grads), "optimizer": _nbytes(elsewhere.values()),
                       "grad_buckets": _nbytes(b.buf for b in buckets if b.buf is not None)},
            "host": {"masters": _nbytes(opt.masters.values()),
                     "moments": _nbytes(st[k] for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")),
                     "steps": _nbytes(st["step"] for st in opt.state.values()),
                     "grads": _nbytes(opt.staged.values())},
            "host_total": _nbytes(host), "shared": len(shared), "traffic": opt.transfer_bytes,
            "dtypes": {p.dtype for p in params} | {g.dtype for g in grads}}


def _worker(rank, world):
    out = {}
    for degrees, mode, precision in CASES:
        if degrees == (1, 1, 1, 1):
            continue
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        out[(degrees, mode, precision)] = _measure(grid, mode, precision)
        grid.release_groups()
    return out


@pytest.fixture(scope="module")
def measured():
    out = {case: [_measure(parallel.Grid(1, 1, 1, 1), *case[1:])] for case in CASES if case[0] == (1, 1, 1, 1)}
    ranks = run_ranks(2, _worker)
    for case in ranks[0]:
        out[case] = [r[case] for r in ranks]
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "d{}x{}y{}z{}".format(*c[0]) + f"-{c[1]}-{c[2]}")
def test_offload_memory_and_traffic_equal_the_optimizers_tensors(measured, case):
    degrees, mode, precision = case
    shape = cost.shape_of(step_model("llama", (), "meta").config)
    grid = parallel.Grid(*degrees)
    pb = 2 if precision == "bf16" else 4
    for got in measured[case]:
        assert got["device"] == cost.state_bytes(shape, grid, mode, pb, offload=True)
        assert got["host"] == cost.host_bytes(shape, grid, mode, pb)
        assert got["host_total"] == sum(got["host"].values()) and got["shared"] == 0
        assert got["traffic"] == cost.offload_traffic(shape, grid, mode, pb)
        assert got["dtypes"] == {torch.bfloat16 if precision == "bf16" else torch.float32}
    assert cost.offload_traffic(shape, grid, mode, pb, host_is_device=True) == 0


def test_plan_offload_fits_a_70b_model_on_fewer_gpus(tmp_path, capsys):
    args = ["plan", "--model", "llama-3.1-70b", "--gpus", "64", "--top", "3"]
    cli_main([*args, "--json", str(tmp_path / "on.json"), "--offload"])
    text = capsys.readouterr().out
    cli_main([*args, "--json", str(tmp_path / "off.json")])
    on, off = (json.loads((tmp_path / f).read_text())["plans"] for f in ("on.json", "off.json"))
    line = next(x for x in text.splitlines() if x.startswith("fewest GPUs"))
    without, with_ = map(int, re.search(r": (\d+) GPUs? without optimizer offload, (\d+) GPUs? with$", line).groups())
    assert with_ < without, line
    assert "host GB" in text
    best = {(p["data"], p["x"], p["y"], p["z"], p["micro_batch"]): p for p in off}
    for p in on:
        assert p["memory"]["optimizer"] == 0 and p["host_memory"] > 0 and p["host_traffic"] > 0
        twin = best.get((p["data"], p["x"], p["y"], p["z"], p["micro_batch"]))
        assert p["host_traffic"] == 2 * p["memory"]["params"]  # every gradient down, every weight up, in bf16
        if twin:  # the same grid: bf16 parameters on the device, fp32 without offload
            assert p["memory"]["params"] * 2 == twin["memory"]["params"]


def test_offload_traffic_is_zero_on_cpu_ranks():
    cfg = search.PlanConfig("ladder-1m", 8, offload=True, host_gbps=0, precision="fp32")
    plans, _ = search.plan(cfg, search.Network())
    assert plans and all(p.host_traffic == 0 and p.host_memory > 0 for p in plans)


@pytest.mark.parametrize("args, message", [
    (["--offload", "--validate"], "--offload applies to planning only"),
    (["--offload", "--host-gbps", "-1"], "--host-gbps"),
    (["--offload", "--host-gbps=-1"], "-1.0 is invalid: use a finite number >= 0 (0: CPU ranks)"),
    (["--offload", "--host-gbps=nan"], "nan is invalid: use a finite number >= 0 (0: CPU ranks)"),
])
def test_offload_bad_input_is_one_line_and_exit_2(args, message, capsys):
    try:
        code = cli_main(["plan", "--model", "ladder-1m", "--gpus", "8", *args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cpu_ranks_hold_the_offloaded_state_and_run_adamw_in_their_step():
    """--host-gbps 0: the ranks are CPUs, whose host memory is the device memory the limit bounds and whose cores
    run the offloaded AdamW. The planner dropped both: a grid the memory does not hold was ranked, fewest_gpus
    came out too low, and the step lacked AdamW's time."""
    net = search.Network(optimizer=[1e-8, 1e-5])
    base = dict(model="ladder-1m", gpus=1, seq=16, precision="fp32")
    cpu = search.PlanConfig(**base, offload=True, host_gbps=0)
    (p,), _ = search.plan(dataclasses.replace(cpu), net)
    (plain,), _ = search.plan(search.PlanConfig(**base), net)
    (gpu,), _ = search.plan(search.PlanConfig(**base, offload=True), net)
    assert p.memory["offloaded"] == p.host_memory > 0 and "offloaded" not in gpu.memory
    assert p.memory["total"] == sum(v for k, v in p.memory.items() if k != "total")
    assert p.other_seconds == pytest.approx(plain.other_seconds) and gpu.other_seconds < plain.other_seconds
    # Memory for the rank's own bytes but not the host's too: GPU ranks fit, CPU ranks need a second one.
    small = dataclasses.replace(net, gpu_memory_gb=(p.memory["total"] - 1) / 1e9)
    assert search.plan(search.PlanConfig(**base, offload=True), small)[0]
    with pytest.raises(ValueError, match="needs more than"):
        search.plan(dataclasses.replace(cpu), small)
    assert search.fewest_gpus(cpu, small, None)[0] == 2


def test_fewest_gpus_names_the_batch_no_larger_power_of_two_divides(capsys):
    """Easy mode splits a batch of 3 over every rank, so past 1 GPU no power of two runs it at all: the reason is the
    batch, not memory, where the line said "more than 65,536 GPUs". That stays the reason when every count runs
    the model and none holds it."""
    cli_main(["plan", "--model", "width-384", "--gpus", "3", "--batch", "3", "--seq", "512", "--offload", "--mode",
              "easy", "--gpu-memory-gb", "0.05"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fewest GPUs"))
    why = "none (too little memory on 1 GPU, and no larger power of two runs it: batch 3 is not divisible by " \
          "data*x*y*z=2)"
    assert line.endswith(f": {why} without optimizer offload, {why} with"), line
    cfg = search.PlanConfig("ladder-1m", 1, seq=16)
    assert search.fewest_gpus(cfg, search.Network(gpu_memory_gb=1e-6), None, most=4) == (None, "more than 4 GPUs")


@pytest.mark.parametrize("value", ["0", "0.0", "-0", "0e0"])
def test_host_gbps_zero_in_any_spelling_means_cpu_ranks(value, capsys):
    """0 GB/s (CPU ranks) is the one value below the positive rates --host-gbps takes; "0.0" was refused with a
    message that ruled 0 out."""
    assert cli_main(["plan", "--model", "ladder-1m", "--gpus", "1", "--offload", f"--host-gbps={value}", "--top",
                     "1"]) in (0, None)
    assert "optimizer offload (0 GB/s to the host)" in capsys.readouterr().out
