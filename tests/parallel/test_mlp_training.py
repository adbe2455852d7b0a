"""Ten SGD steps of a two-layer MLP on every 8-rank grid equal the same MLP trained by torch on one process.

Model: parallel.Linear(D -> HD, bias) -> GELU -> parallel.Linear(HD -> D, bias, transpose=True); loss =
sum of squared error / global N; each step: backward, sync_gradients, clip_grad_norm_(MAX_NORM), p -= LR * grad.
The reference is torch.nn.Linear with the weights `full_normal` defines (the engine's grid-independent init,
so step 0 also checks the init) and torch.nn.utils.clip_grad_norm_. MAX_NORM clips the first steps and not
the last ones (asserted from the reference norms), so both branches of clipping are exercised.

Layouts: sharded mode feeds [rows, D/x] (rows = the batch split over z and data) and each rank's loss covers
its rows and its column slice of the [rows, D/x] output (replicated over y); easy mode gives each rank N/world
consecutive rows with all features.

Tolerances (fp32):
- parameters, relative to the largest reference magnitude of each tensor, 1e-5 after every step: the sharded
  matmuls sum partial products in another order; after ten steps of SGD the worst case over every grid,
  mode and step measured 1.5e-7, while a wrong shard, a missing reduction or a wrong clip coefficient
  gives errors of 1e-3 or more;
- the global gradient norm, relative, 1e-5 (measured 1.4e-7; the engine sums squared shard norms in float64);
- overlap on vs off: bitwise (max abs diff == 0) - overlap only moves when communication happens.
Each rank returns measured numbers and the parent asserts, so one bad case cannot hang the others.
"""

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import parallel
from parallel.forked import run_ranks
from parallel.sharding import full_normal
from tests._helpers import GRIDS, MODES, grid_id, once_per_session

D, HD, N = 32, 64, 32
STD, SEED = 0.2, 11
LR, MAX_NORM, STEPS = 0.03, 12.0, 10
TOL = 1e-5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _data():
    bias1, bias2 = 0.1 * torch.randn(HD, generator=_gen(2)), 0.1 * torch.randn(D, generator=_gen(3))
    return bias1, bias2, torch.randn(N, D, generator=_gen(4)), torch.randn(N, D, generator=_gen(5))


def _rel(a, b):
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))


def _reference():
    """Per step: (weight1, bias1, weight2, bias2) after the update, and the pre-clip grad norm."""
    bias1, bias2, X, T = _data()
    fc1, fc2 = torch.nn.Linear(D, HD), torch.nn.Linear(HD, D)
    with torch.no_grad():
        fc1.weight.copy_(full_normal(HD, D, STD, SEED, "fc1"))
        fc2.weight.copy_(full_normal(D, HD, STD, SEED, "fc2"))
        fc1.bias.copy_(bias1)
        fc2.bias.copy_(bias2)
    params = [fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    states, norms = [], []
    for _ in range(STEPS):
        for p in params:
            p.grad = None
        loss = ((fc2(F.gelu(fc1(X))) - T) ** 2).sum() / N
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
        states.append([p.detach().clone() for p in params])
    return states, norms


class MLP(torch.nn.Module):
    def __init__(self, grid, mode):
        super().__init__()
        self.fc1 = parallel.Linear(D, HD, mode=mode, grid=grid, init_std=STD, seed=SEED, name="fc1")
        self.fc2 = parallel.Linear(HD, D, transpose=True, mode=mode, grid=grid, init_std=STD, seed=SEED, name="fc2")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _slice(grid, mode, n, axes):
    """This rank's part of n: rows (axes=None: all ranks in easy mode, z x data in sharded) or columns."""
    if mode == "easy":
        if axes is not None:
            return slice(None)
        k = n // grid.world_size
        return slice(grid.rank * k, (grid.rank + 1) * k)
    axes = axes or ("z", "data")
    k = n // grid.size(axes)
    i = grid.coord(axes)
    return slice(i * k, (i + 1) * k)


@torch.no_grad()
def _load_bias(lin, full):
    nb = lin.bias.numel()
    start = lin.grid.coords[lin.out_axis] * nb
    lin.bias.copy_(full[start:start + nb])


def _train(grid, mode, overlap_on, ref_states, ref_norms):
    bias1, bias2, X, T = _data()
    model = MLP(grid, mode)
    _load_bias(model.fc1, bias1)
    _load_bias(model.fc2, bias2)
    rows = _slice(grid, mode, N, None)
    cols = _slice(grid, mode, D, "x")  # fc1's in-axis and fc2's out-axis are both X
    x, t = X[rows, cols].clone(), T[rows, cols].clone()
    params = list(model.parameters())
    param_err, norm_err, clipped, snapshots = [], [], [], []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        with parallel.overlap(model) if overlap_on else nullcontext():
            loss = ((model(x) - t) ** 2).sum() / N
            loss.backward()
        parallel.sync_gradients(model, grid)
        norm = float(parallel.clip_grad_norm_(model, MAX_NORM, grid))
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
        snapshots.append([p.detach().clone() for p in params])
        full = [model.fc1.full_weight(), model.fc1.full_bias(), model.fc2.full_weight(), model.fc2.full_bias()]
        param_err.append(max(_rel(a, b) for a, b in zip(full, ref_states[step])))
        norm_err.append(abs(norm - ref_norms[step]) / ref_norms[step])
        clipped.append(float(norm > MAX_NORM))
    return {"param_err": param_err, "norm_err": norm_err, "clipped": clipped}, snapshots


def _worker(rank, world):
    ref_states, ref_norms = _reference()
    results = {"ref_norms": ref_norms}
    for degrees in GRIDS:
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        for mode in MODES:
            runs = {}
            for ov in (False, True):
                results[(degrees, mode, ov)], runs[ov] = _train(grid, mode, ov, ref_states, ref_norms)
            results[(degrees, mode, "overlap_diff")] = [
                max(float((a - b).abs().max()) for a, b in zip(off, on)) for off, on in zip(runs[False], runs[True])
            ]
    return results


@pytest.fixture(scope="module")
def results(request):
    per_rank = once_per_session(request, lambda: run_ranks(8, _worker))
    merged = {"ref_norms": per_rank[0]["ref_norms"]}
    for r in per_rank:
        for case, value in r.items():
            if case == "ref_norms":
                continue
            if isinstance(value, dict):
                slot = merged.setdefault(case, {})
                for k, v in value.items():
                    slot[k] = [max(a, b) for a, b in zip(slot.get(k, v), v)]
            else:
                merged[case] = [max(a, b) for a, b in zip(merged.get(case, value), value)]
    return merged


def test_max_norm_clips_some_steps_but_not_all(results):
    clipped = [n > MAX_NORM for n in results["ref_norms"]]
    assert any(clipped) and not all(clipped), results["ref_norms"]


ids = dict(ids=grid_id)


@pytest.mark.parametrize("ov", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("degrees", GRIDS, **ids)
def test_mlp_training_matches_torch_every_step(results, degrees, mode, ov):
    r = results[(degrees, mode, ov)]
    assert len(r["param_err"]) == STEPS
    assert max(r["param_err"]) < TOL, r["param_err"]
    assert max(r["norm_err"]) < TOL, r["norm_err"]
    # every rank clipped exactly on the steps torch clipped
    assert r["clipped"] == [float(n > MAX_NORM) for n in results["ref_norms"]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("degrees", GRIDS, **ids)
def test_overlap_is_bitwise_identical(results, degrees, mode):
    diffs = results[(degrees, mode, "overlap_diff")]
    assert len(diffs) == STEPS
    assert max(diffs) == 0.0, diffs
