"""parallel.tune_matmul: every GEMM layout gives the untuned results, every rank runs the same choice, and the choices
round-trip through the cache file.

One forked world of 8 gloo ranks computes every case (every 8-rank grid, both modes) on a stack
Linear(H -> F) -> GELU -> Linear(F -> H, transposed in sharded mode), biases non-zero:
- untuned (tune_matmul(False)) as the reference, then each layout of LAYOUTS forced alone: the forward output, the
  input gradient and every parameter gradient must equal the reference's, bitwise for `given` and within
  gemm_tuning.NUMERICS for the others (MKL sums products this small in another order per layout), and the ledger
  must be identical (the agreement broadcasts stay out of it);
- tuned by timing (rank 0 times every key, broadcasts its choice) into a cache file: the choices gathered from
  every rank must be equal, and the results within NUMERICS of the untuned ones;
- a second run (a new forked world) reading that file, its timing replaced by an error: the same choices, nothing
  timed, the file unchanged.
"""

import json
from collections import Counter

import pytest
import torch

import parallel
from parallel import gemm_tuning
from parallel.forked import run_ranks
from tests._helpers import GRIDS, MODES, GridCache, grid_id, once_per_session
from tests.parallel._helpers import local_rows

H, F, N = 32, 64, 16
FORCED = tuple(gemm_tuning.LAYOUTS)


class Stack(torch.nn.Module):
    def __init__(self, grid, mode):
        super().__init__()
        self.up = parallel.Linear(H, F, mode=mode, grid=grid, seed=2, name="up")
        self.down = parallel.Linear(F, H, transpose=mode == "sharded", mode=mode, grid=grid, seed=3, name="down")
        with torch.no_grad():
            for i, lin in enumerate((self.up, self.down)):
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=torch.Generator().manual_seed(5 + i)))

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _pass(model, grid, mode):
    """(output, {name: gradient}, ledger) of one forward and backward on this rank's share of a fixed batch."""
    g = torch.Generator().manual_seed(7)
    X = torch.randn(N, H, generator=g)
    k, i = H // grid.x, grid.coords["x"]
    cols = slice(None) if mode == "easy" else slice(i * k, (i + 1) * k)  # `up` splits its in-features over X
    x = X[local_rows(grid, mode, N), cols].clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    parallel.LEDGER.reset()
    y = model(x)
    (y * torch.randn(y.shape, generator=g)).sum().backward()
    grads = {"input": x.grad, **{k: p.grad for k, p in model.named_parameters()}}
    return y.detach(), grads, Counter(parallel.LEDGER.records)


def _errors(got, ref):
    """{tensor: largest difference relative to the reference's largest magnitude} of the output and gradients."""
    (y, grads, _), (ref_y, ref_grads, _) = got, ref
    pairs = {"output": (y, ref_y), **{k: (grads[k], ref_grads[k]) for k in ref_grads}}
    return {k: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for k, (a, b) in pairs.items()}


def _cases(grids, models):
    """Every (grid, mode) case's _pass."""
    return {(d, m): _pass(models[(d, m)], grids[d], m) for d in GRIDS for m in MODES}


def _first_run(rank, world, cache_file):
    grids = GridCache(rank)
    models = {(d, m): Stack(grids[d], m) for d in GRIDS for m in MODES}
    parallel.tune_matmul(False)
    ref = _cases(grids, models)
    out = {"forced": {}, "forced_choices": {}}
    for layout in FORCED:
        parallel.tune_matmul(True, layouts=(layout,))
        for key, got in _cases(grids, models).items():
            out["forced"][(*key, layout)] = {"errors": _errors(got, ref[key]), "ledger_equal": got[2] == ref[key][2]}
        out["forced_choices"][layout] = set(gemm_tuning.choices().values())
    parallel.tune_matmul(True, cache_file=cache_file)
    out["timed_errors"] = {key: _errors(got, ref[key]) for key, got in _cases(grids, models).items()}
    out["choices"] = gemm_tuning.choices()
    out["file"] = open(cache_file).read() if rank == 0 else None
    return out


def _second_run(rank, world, cache_file):
    """A new world of processes reading the first run's file: timing would raise."""
    def no_timing(*args):
        raise AssertionError("timed although the cache file holds the key")

    gemm_tuning._time_layouts = no_timing  # in this forked rank only
    grids = GridCache(rank)
    parallel.tune_matmul(True, cache_file=cache_file)
    _cases(grids, {(d, m): Stack(grids[d], m) for d in GRIDS for m in MODES})
    return {"choices": gemm_tuning.choices(), "file": open(cache_file).read() if rank == 0 else None}


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    def compute():
        cache_file = str(tmp_path_factory.mktemp("tune-matmul") / "gemm.json")
        return run_ranks(8, _first_run, cache_file), run_ranks(8, _second_run, cache_file)

    return once_per_session(request, compute)


@pytest.mark.parametrize("layout", FORCED)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_every_layout_gives_the_untuned_results(results, degrees, mode, layout):
    """`given` bitwise; the others within gemm_tuning.NUMERICS (MKL sums these small products in another order)."""
    tol = 0.0 if layout == "given" else gemm_tuning.NUMERICS[torch.float32]
    for rank, res in enumerate(results[0]):
        got = res["forced"][(degrees, mode, layout)]
        assert max(got["errors"].values()) <= tol, (rank, got["errors"])
        assert got["ledger_equal"], rank  # the agreement broadcasts are not a step's traffic
        assert res["forced_choices"][layout] == {layout}, rank


def test_ranks_agree_on_every_timed_choice(results):
    first = results[0]
    choices = first[0]["choices"]
    assert {k.split("|")[2] for k in choices} == set(gemm_tuning.GEMMS)
    for rank, res in enumerate(first):
        assert res["choices"] == choices, rank
        worst = max(max(e.values()) for e in res["timed_errors"].values())
        assert worst <= gemm_tuning.NUMERICS[torch.float32], (rank, worst)


def test_cache_file_round_trips_without_timing(results):
    first, second = results
    entries = json.loads(first[0]["file"])
    assert {k: v["layout"] for k, v in entries.items()} == first[0]["choices"]
    assert all(set(v["seconds"]) == set(gemm_tuning.LAYOUTS) for v in entries.values())
    assert second[0]["file"] == first[0]["file"]  # nothing new timed, nothing rewritten
    for rank, res in enumerate(second):
        assert res["choices"] == first[0]["choices"], rank


def _mismatch(rank, world):
    grid = parallel.Grid(2, 1, 1, 1, rank=rank)
    grid.build_groups()
    parallel.tune_matmul(True)
    a = torch.ones(4 + rank, 8)  # rank 1 has more rows than rank 0
    gemm_tuning.matmul(a, torch.ones(8, 8), "fwd", grid)


def test_ranks_with_different_shapes_fail_in_one_line():
    with pytest.raises(RuntimeError, match="every rank must run the same shapes"):
        run_ranks(2, _mismatch, timeout=60)


def _other_threads(rank, world):
    grid = parallel.Grid(2, 1, 1, 1, rank=rank)
    grid.build_groups()
    torch.set_num_threads(1 + rank)  # nodes with other core counts, or another OMP_NUM_THREADS
    parallel.tune_matmul(True, layouts=("given", "flip_a"))
    gemm_tuning.matmul(torch.ones(4, 8), torch.ones(8, 8), "fwd", grid)
    return set(gemm_tuning.choices().values())


def test_ranks_with_other_thread_counts_take_rank_0s_choice():
    """The thread count is in the cache key (it changes the fastest kernel), but not in what the ranks must agree
    on: the checksum once covered it, and a rank with two threads failed, blaming its shapes."""
    choices = run_ranks(2, _other_threads, timeout=60)
    assert choices[0] == choices[1] and len(choices[0]) == 1, choices


def test_bad_arguments_and_cache_files(tmp_path):
    with pytest.raises(ValueError, match="unknown GEMM layout 'column'"):
        parallel.tune_matmul(True, layouts=("given", "column"))
    bad = tmp_path / "gemm.json"
    bad.write_text('{"k": {"layout": "sideways"}}')
    with pytest.raises(ValueError, match="unreadable .*delete it"):
        parallel.tune_matmul(True, cache_file=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layouts_within_the_stated_numerics(dtype):
    """gemm_tuning.NUMERICS on the ladder's three products with a long reduction (ladder-1m's LM head: 2048 rows,
    hidden 64, vocab 4096), where bf16 layouts measured unequal."""
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(shape, generator=g).to(dtype) for shape in ((2048, 64), (4096, 64), (2048, 4096)))
    for a, b in ((x, w.t()), (dy, w), (dy.t(), x)):
        ref = a @ b
        for name, layout in gemm_tuning.LAYOUTS.items():
            out = layout(a, b)
            assert out.is_contiguous(), name
            err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
            assert err <= gemm_tuning.NUMERICS[dtype], (name, tuple(a.shape), tuple(b.shape), err)
