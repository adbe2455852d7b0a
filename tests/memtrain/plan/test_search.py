"""The planner's search and command line, without ranks.

- Placement: which groups stay inside a node under the rank layout, and what a collective then costs.
- Llama 3.1 405B on a fake 4096-rank process group: the memory estimate equals the meta-device
  parallelization's parameter bytes per rank.
- The CLI: the 405B plan on 4096 GPUs (ranked by step time, valid, fitting grids, MFU within the matmul
  efficiency), a JSON table, and one-line errors (exit 2) for N < 1, an unknown model and a GPU count no grid can
  use (naming the divisibility that fails).
"""

import json
import multiprocessing as mp
import re

import pytest
import torch

import parallel
from memtrain.cli import main as cli_main
from memtrain.hf import parallelize
from memtrain.plan import cost, network, search
from parallel import Grid
from parallel.comm import Record

# --------------------------------------------------------------------------------------------------
# Placement and bandwidth, without ranks.


def test_group_placement_follows_the_rank_layout():
    grid = Grid(2, 2, 2, 1)  # rank = x + 2y + 4data; nodes of 4 ranks
    assert network.inside_node(grid, ("x",), 4) and network.inside_node(grid, ("x", "y"), 4)
    assert not network.inside_node(grid, ("data",), 4) and not network.inside_node(grid, ("y",), 2)
    assert network.inside_node(grid, ("data",), 8)  # the whole world is one node
    net = network.Network(intra_node_gbps=100, inter_node_gbps=10)
    assert net.seconds(Record("all_gather", "x+y", 4, 4 * 10**9), True) == pytest.approx(0.03)
    assert net.seconds(Record("all_reduce", "x+y", 4, 4 * 10**9), False) == pytest.approx(0.6)


# --------------------------------------------------------------------------------------------------
# Llama 3.1 405B: one rank of a fake 4096-rank grid, meta-device parallelization vs the estimate.


def _simulate(q, grids):
    try:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from memtrain.models import build_model

        dist.init_process_group("fake", store=FakeStore(), rank=1234, world_size=4096)
        out = {}
        for degrees, mode in grids:
            grid = parallel.Grid(*degrees, rank=1234)
            grid.build_groups()
            plm = parallelize(build_model("llama-3.1-405b", device="meta", dtype=torch.bfloat16), grid, mode,
                              device="meta")
            out[(degrees, mode)] = plm.param_bytes_per_rank()
        q.put(("ok", out))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        q.put(("error", repr(e)))


def test_llama_405b_memory_matches_meta_parallelization_on_4096_ranks():
    grids = [((8, 8, 8, 8), "sharded"), ((2, 16, 8, 16), "easy")]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_simulate, args=(q, grids))
    proc.start()
    try:
        status, got = q.get(timeout=240)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", got
    shape = cost.shape_of(search.load_config("llama-3.1-405b"))
    for (degrees, mode), measured in got.items():
        est = cost.state_bytes(shape, Grid(*degrees), mode, param_bytes=2)["params"]
        assert est == measured, (degrees, mode, est, measured)
    assert got[((8, 8, 8, 8), "sharded")] == 2 * ((405_853_388_800 - 253 * 16384) // 512 + 253 * 16384 // 8)


# --------------------------------------------------------------------------------------------------
# The CLI.


def test_405b_on_4096_gpus_plans_every_grid(tmp_path, capsys):
    out = tmp_path / "plan.json"
    cli_main(["plan", "--model", "llama-3.1-405b", "--gpus", "4096", "--json", str(out)])
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    plans = doc["plans"]
    assert len(text.splitlines()) >= 13 and plans and doc["summary"]["grids"] == 455  # C(15, 3) factorizations
    assert [p["step_seconds"] for p in plans] == sorted(p["step_seconds"] for p in plans)
    for p in plans:
        assert p["data"] * p["x"] * p["y"] * p["z"] == 4096 and p["memory"]["total"] <= 80e9
        assert 0 < p["mfu"] <= 0.87 and p["compute_seconds"] <= p["step_seconds"]  # never above dgx-a100's matmuls
        assert 128 % p["y"] == 0 and 8 % p["y"] == 0 and 16384 % p["x"] == 0 and 4096 % (p["data"] * p["z"]) == 0


def test_divisors_are_found_up_to_the_square_root_so_a_million_gpus_plan_in_seconds(capsys):
    assert all(search.divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 300))
    assert len(search.divisors(720720)) == 240 and search.divisors(2**20)[-2:] == [2**19, 2**20]
    cli_main(["plan", "--model", "ladder-1m", "--gpus", str(2**20), "--batch", str(2**24), "--top", "1"])
    planned = capsys.readouterr().out.splitlines()[-1]  # "planned in S s"
    assert float(planned.split()[2]) < 60, planned


@pytest.mark.parametrize("args, message", [
    (["--model", "ladder-1m", "--gpus", "0"], "--gpus: 0 is invalid"),
    (["--model", "ladder-7m", "--gpus", "8"], "unknown model 'ladder-7m'"),
    (["--model", "ladder-1m", "--gpus", "3", "--batch", "4"], "not divisible by parallel.x=3"),
    (["--model", "ladder-1m", "--gpus", "3", "--batch", "4"], "batch 4 is not divisible by data*z=3"),
    (["--model", "ladder-1m", "--gpus", "8", "--gpu-memory-gb", "0.001"], "needs more than 0.001 GB per GPU"),
    (["--model", "ladder-1m", "--gpus", "8", "--machine", "cray-1"], "unknown machine 'cray-1'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    try:
        code = cli_main(["plan", *args])
    except SystemExit as e:  # argparse's own checks exit from inside
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("memtrain: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_fit_check_counts_the_grad_sync_bucket_buffers(tmp_path):
    """The overlapped gradient sync (the trainer's default) keeps every synced gradient again in its buckets' flat
    buffers, for good: a grid that holds parameters, gradients, AdamW and activations but not those was ranked as
    fitting (405B on 1,024 A100s: 83 GB planned as 77). At data = 2 sharded, every gradient is synced; the
    blocking sync keeps no buffer."""
    cfg = dict(model="ladder-1m", gpus=2, batch=2, seq=16, micro_batch=1, mode="sharded", precision="fp32")
    (p,) = [p for p in search.plan(search.PlanConfig(**cfg), network.Network())[0] if p.grid == (2, 1, 1, 1)]
    shape = cost.shape_of(search.load_config("ladder-1m"))
    buffers = sum(map(sum, cost.gradient_buckets(shape, Grid(2, 1, 1, 1), "sharded").values()))
    assert p.memory["grad_buckets"] == buffers == p.memory["params"] > 0
    assert p.memory["total"] == sum(v for k, v in p.memory.items() if k != "total")
    net = network.Network(gpu_memory_gb=(p.memory["total"] - 1) / 1e9)
    grids = lambda **kw: [q.grid for q in search.plan(search.PlanConfig(**cfg, **kw), net)[0]]  # noqa: E731
    assert (2, 1, 1, 1) not in grids()
    assert (2, 1, 1, 1) in grids(grad_sync="blocking")
    out = tmp_path / "plan.json"  # the command line's --grad-sync reaches the planner, not only --validate
    cli_main(["plan", "--model", "ladder-1m", "--gpus", "2", "--seq", "16", "--grad-sync", "blocking", "--json",
              str(out)])
    assert {p["memory"]["grad_buckets"] for p in json.loads(out.read_text())["plans"]} == {0}


def test_the_smallest_need_over_the_limit_reads_in_its_unit(capsys):
    """Grids a few MB over a 2 MB limit: the hint said "the smallest needs 0.0 GB"."""
    assert cli_main(["plan", "--model", "ladder-1m", "--gpus", "8", "--gpu-memory-gb", "0.002", "--seq", "64"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"\(the smallest needs [1-9][0-9.]* MB\): use more GPUs", err), err
    assert [search.size_text(b) for b in (512, 2_794_000, 5e9, 1.234e11, 4e12)] == [
        "512 bytes", "2.79 MB", "5 GB", "123 GB", "4,000 GB"]
