"""Layer parity on 8 gloo ranks: parallel.Linear / Embedding / LMHead vs torch on one process.

Tolerance: fp32, relative to the largest reference magnitude, 1e-5. The sharded layers compute the
same dot products as torch but sum partial products in another order (per-shard matmuls, then a
reduction over the group); with at most 96 terms per dot product the rounding difference stays near
1e-7 relative (measured ~1e-7), so 1e-5 leaves margin without hiding a wrong shard (which gives O(1)).
Every rank returns measured errors and the parent asserts, so one bad case cannot hang the others.
"""

from contextlib import nullcontext

import pytest
import torch

import parallel
from parallel.forked import run_ranks
from parallel.sharding import full_normal
from tests._helpers import GRIDS, LINEAR_OPTIONS, MODES, built_grids, grid_id, once_per_session
from tests.parallel._helpers import local_rows

TOL = 1e-5
IN, OUT, N = 64, 96, 32
VOCAB, HID = 128, 32


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel(a, b):
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))


def local_cols(grid, mode, axis, features):
    if mode == "easy":
        return slice(None)
    k = features // grid.size(axis)
    i = grid.coord(axis)
    return slice(i * k, (i + 1) * k)


def _linear_case(grid, mode, transpose, bias, overlap_on):
    lin = parallel.Linear(IN, OUT, bias=bias, transpose=transpose, mode=mode, grid=grid, seed=3, name="fc")
    ref = torch.nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(full_normal(OUT, IN, 0.02, 3, "fc"))
        if bias:
            ref.bias.copy_(torch.randn(OUT, generator=_gen(7)))
            lin.load_full(ref.weight, ref.bias)
    X, G = torch.randn(N, IN, generator=_gen(5)), torch.randn(N, OUT, generator=_gen(6))
    xr = X.clone().requires_grad_()
    (ref(xr) * G).sum().backward()
    rows = local_rows(grid, mode, N)
    cin, cout = local_cols(grid, mode, lin.in_axis, IN), local_cols(grid, mode, lin.out_axis, OUT)
    for _ in range(2 if overlap_on else 1):  # the second pass uses the recorded prefetch order
        lin.zero_grad(set_to_none=True)
        x = X[rows, cin].clone().requires_grad_()
        with parallel.overlap(lin) if overlap_on else nullcontext():
            y = lin(x)
            (y * G[rows, cout]).sum().backward()
        parallel.sync_gradients(lin, grid)
    out = {
        "output": _rel(y, ref(X)[rows, cout]),
        "input_grad": _rel(x.grad, xr.grad[rows, cin]),
        "weight_grad": _rel(lin.layout.gather_full(lin.weight.grad, grid), ref.weight.grad),
    }
    if bias:
        out["bias_grad"] = _rel(parallel.comm.all_gather(lin.bias.grad, grid, lin.out_axis), ref.bias.grad)
    return out


def _embedding_case(grid, mode):
    emb = parallel.Embedding(VOCAB, HID, mode=mode, grid=grid, seed=4, name="emb")
    ref = torch.nn.Embedding(VOCAB, HID)
    with torch.no_grad():
        ref.weight.copy_(full_normal(VOCAB, HID, 0.02, 4, "emb"))
    ids = torch.randint(0, VOCAB, (N,), generator=_gen(8))
    G = torch.randn(N, HID, generator=_gen(9))
    (ref(ids) * G).sum().backward()
    rows, cols = local_rows(grid, mode, N), local_cols(grid, mode, "x", HID)
    y = emb(ids[rows])
    (y * G[rows, cols]).sum().backward()
    parallel.sync_gradients(emb, grid)
    return {"output": _rel(y, ref(ids)[rows, cols]),
            "weight_grad": _rel(emb.layout.gather_full(emb.weight.grad, grid), ref.weight.grad)}


def _lm_head_case(grid, mode, tied):
    emb = parallel.Embedding(VOCAB, HID, mode=mode, grid=grid, seed=4, name="emb")
    head = parallel.LMHead(HID, VOCAB, tie_to=emb if tied else None, mode=mode, grid=grid, seed=5, name="head")
    w = full_normal(VOCAB, HID, 0.02, 4 if tied else 5, "emb" if tied else "head").requires_grad_()
    H = torch.randn(N, HID, generator=_gen(10))
    labels = torch.randint(0, VOCAB, (N,), generator=_gen(11))
    labels[::5] = -100
    hr = H.clone().requires_grad_()
    ref_loss = torch.nn.functional.cross_entropy(hr @ w.t(), labels, reduction="none")
    ref_loss.sum().backward()
    rows, cols = local_rows(grid, mode, N), local_cols(grid, mode, "x", HID)
    h = H[rows, cols].clone().requires_grad_()
    loss = head.loss(h, labels[rows])
    loss.sum().backward()
    parallel.sync_gradients(head, grid)
    return {"loss": _rel(loss, ref_loss[rows]), "hidden_grad": _rel(h.grad, hr.grad[rows, cols]),
            "weight_grad": _rel(head.layout.gather_full(head.weight.grad, grid), w.grad)}


def _worker(rank, world):
    results = {}
    for degrees, grid in built_grids(rank):
        for mode in MODES:
            for transpose, bias, ov in LINEAR_OPTIONS:
                results[("linear", degrees, mode, transpose, bias, ov)] = _linear_case(grid, mode, transpose, bias, ov)
            results[("embedding", degrees, mode)] = _embedding_case(grid, mode)
            for tied in (False, True):
                results[("lm_head", degrees, mode, tied)] = _lm_head_case(grid, mode, tied)
    return results


@pytest.fixture(scope="module")
def results(request):
    per_rank = once_per_session(request, lambda: run_ranks(8, _worker))
    merged = {}
    for r in per_rank:
        for case, errors in r.items():
            slot = merged.setdefault(case, {})
            for k, v in errors.items():
                slot[k] = max(slot.get(k, 0.0), v)
    return merged


@pytest.mark.parametrize("ov", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("transpose", [False, True], ids=["normal", "transposed"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_linear_matches_torch(results, degrees, mode, transpose, bias, ov):
    errors = results[("linear", degrees, mode, transpose, bias, ov)]
    assert set(errors) >= {"output", "input_grad", "weight_grad"}
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_embedding_matches_torch(results, degrees, mode):
    errors = results[("embedding", degrees, mode)]
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_lm_head_loss_matches_torch(results, degrees, mode, tied):
    errors = results[("lm_head", degrees, mode, tied)]
    assert max(errors.values()) < TOL, errors


# ---------------------------------------------------------------- frozen weights and padding rows (2 ranks)


def _frozen_worker(rank, world):
    """Per ORS setting: (frozen weight's .grad, reduce-scatters recorded, input gradient equal to a trainable
    layer's), on z=2 where the weight gradient is reduce-scattered (deferred into .grad under ORS)."""
    grid = parallel.Grid(1, 1, 1, 2, rank=rank)
    grid.build_groups()
    out = {}
    for ors in (False, True):
        grads = []
        for frozen in (False, True):
            lin = parallel.Linear(8, 8, bias=False, mode="sharded", grid=grid, seed=1, name="fc")
            lin.weight.requires_grad_(not frozen)
            x = torch.randn(4, 8, generator=_gen(rank)).requires_grad_()
            parallel.LEDGER.reset()
            with parallel.overlap(lin, all_reduce=False, reduce_scatter=ors, all_gather=False):
                lin(x).square().sum().backward()
            grads.append(x.grad)
        scatters = sum(r.op == "reduce_scatter" for r in parallel.LEDGER.records)
        out[ors] = (lin.weight.grad, scatters, torch.equal(*grads))
    grid.release_groups()
    return out


def test_a_frozen_weight_gets_no_gradient_and_costs_no_weight_gradient():
    """A weight with requires_grad=False: its gradient GEMM and reduce-scatter were run anyway, and under
    overlap(reduce_scatter=True) the deferred result was set as its .grad, so an optimizer updated a frozen layer."""
    for res in run_ranks(2, _frozen_worker, timeout=60):
        for ors, (grad, scatters, input_grad_equal) in res.items():
            assert grad is None and scatters == 0 and input_grad_equal, (ors, grad, scatters)


def _padding_worker(rank, world):
    """Per mode: the full table gradient with padding_idx=-1 and with padding_idx=VOCAB-1, the same row."""
    grid = parallel.Grid(1, 1, 2, 1, rank=rank)
    grid.build_groups()
    ids = torch.tensor([[1, VOCAB - 1, VOCAB - 1, 3]])
    out = {}
    for mode in MODES:
        grads = []
        for padding_idx in (-1, VOCAB - 1):
            emb = parallel.Embedding(VOCAB, HID, padding_idx=padding_idx, mode=mode, grid=grid, seed=4, name="emb")
            emb(ids).sum().backward()
            grads.append(emb.layout.gather_full(emb.weight.grad, grid))
        out[mode] = grads
    grid.release_groups()
    return out


def test_a_negative_padding_idx_counts_from_the_end_on_a_sharded_grid():
    """torch (and one rank's F.embedding) read padding_idx=-1 as the last row; the sharded lookup compared token ids
    with -1 itself, so the last row kept learning from the lookup on a vocabulary split over Y."""
    for res in run_ranks(2, _padding_worker, timeout=60):
        for mode, (negative, positive) in res.items():
            assert not negative[VOCAB - 1].any() and torch.equal(negative, positive), mode
    with pytest.raises(ValueError, match=r"emb: padding_idx=128 is outside a table of 128 rows: use -128\.\.127"):
        parallel.Embedding(VOCAB, HID, padding_idx=VOCAB, grid=parallel.Grid(1, 1, 1, 1), name="emb")


def _range_worker(rank, world):
    """Per mode: the error of an embedding lookup and of the loss, given an id or a label outside [0, VOCAB)."""
    grid = parallel.Grid(1, 1, 2, 1, rank=rank)  # the vocabulary split over Y
    grid.build_groups()
    out = {}
    for mode in MODES:
        emb = parallel.Embedding(VOCAB, HID, mode=mode, grid=grid, seed=4, name="emb")
        padded = parallel.Embedding(VOCAB, HID, valid=VOCAB - 8, mode=mode, grid=grid, seed=4, name="padded")
        head = parallel.LMHead(HID, VOCAB, valid=VOCAB - 8, mode=mode, grid=grid, seed=5, name="head")
        hidden = torch.zeros(2, HID if mode == "easy" else HID // grid.x)
        errors = []
        for call, *args in ((emb, torch.tensor([[1, VOCAB]])), (emb, torch.tensor([[-2, 1]])),
                            (padded, torch.tensor([[1, VOCAB - 8]])),
                            (head.loss, hidden, torch.tensor([1, VOCAB - 8])),
                            (head.scores, hidden, torch.tensor([1, VOCAB + 5]))):
            try:
                call(*args)
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        head.loss(hidden, torch.tensor([VOCAB - 9, parallel.embedding.IGNORE_INDEX]))  # the edges are fine
        padded(torch.tensor([[0, VOCAB - 9]]))
        out[mode] = errors
    grid.release_groups()
    return out


def test_ids_and_labels_outside_the_vocabulary_are_refused_as_torch_refuses_them():
    """One rank's F.embedding and F.cross_entropy refuse an id or label outside the vocabulary; on a vocabulary split
    over Y no shard holds it, and the lookup gave zeros and the loss scored it as a logit of 0, without a word.
    Ids and labels in the padding rows (valid <= id < padded vocabulary) are refused too."""
    ids = f"a token id outside the model's vocabulary [0, {VOCAB}): use a tokenizer that fits the model"
    pad = f"a token id outside the model's vocabulary [0, {VOCAB - 8}): use a tokenizer that fits the model"
    labels = f"a label outside the model's vocabulary [0, {VOCAB - 8}): use labels below {VOCAB - 8} or -100 (ignored)"
    for res in run_ranks(2, _range_worker, timeout=60):
        assert res == {mode: [ids, ids, pad, labels, labels] for mode in MODES}
