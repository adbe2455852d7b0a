"""Z all-gathers in the matmul dtype under bf16 autocast: bitwise the old gather-then-cast results, half the bytes.

A tiny stack Embedding -> Linear(H -> F) -> Linear(F -> H, transposed) -> LMHead loss on 8 gloo ranks, on every
8-rank grid with z > 1, both modes, under torch.autocast("cpu", bfloat16) with backward outside it (as the
trainer runs it). Options: synchronous; overlap (OAR/ORS/OAG, the measured pass uses the recorded prefetch
order); overlap with the two Linears under non-reentrant activation checkpointing (their forward, gathers
included, reruns in backward under the replayed autocast); and a first pass in fp32 then one under autocast
(the dtypes the prefetcher recorded are wrong once: each such position gathers again, synchronously, in bf16).

The reference is the same model on the same rank with `ShardedWeight.gather_dtype` forced to the parameter
dtype: the fp32 shard is gathered and the matmul casts the gathered block (the engine before this change).
Per-token losses and every parameter and input gradient must be bitwise equal. The ledger must differ
only in the Z all-gathers, which follow from the formulas: Linear and LM head gather bf16 blocks (2 bytes a
value, half the reference's), the embedding keeps fp32 (its lookup output stays fp32 under autocast, as torch's
embedding), every reduce-scatter over Z stays fp32.
"""

from collections import Counter
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import parallel
from parallel.forked import run_ranks
from parallel.linear import ShardedWeight
from tests._helpers import GRIDS, MODES, grid_id, once_per_session
from tests.parallel._helpers import local_rows

H, F, V, N = 32, 64, 64, 16
ZGRIDS = [g for g in GRIDS if g[3] > 1]
OPTIONS = ("sync", "overlap", "overlap+recompute", "fp32-then-bf16")


@contextmanager
def gather_then_cast():
    """The reference path: every Z all-gather in the parameter dtype, the cast after it."""
    saved = ShardedWeight.gather_dtype
    ShardedWeight.gather_dtype = lambda self, compute: self.weight.dtype
    try:
        yield
    finally:
        ShardedWeight.gather_dtype = saved


class Stack(torch.nn.Module):
    def __init__(self, grid, mode, recompute):
        super().__init__()
        kw = dict(mode=mode, grid=grid)
        self.emb = parallel.Embedding(V, H, seed=1, name="emb", **kw)
        self.up = parallel.Linear(H, F, seed=2, name="up", **kw)
        self.down = parallel.Linear(F, H, transpose=mode == "sharded", seed=3, name="down", **kw)
        self.head = parallel.LMHead(H, V, seed=4, name="head", **kw)
        self.recompute = recompute
        with torch.no_grad():  # non-zero biases: their gradients are compared too
            for lin in (self.up, self.down):
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=torch.Generator().manual_seed(5)))

    def mlp(self, h):
        return self.down(torch.nn.functional.gelu(self.up(h)))

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = checkpoint(self.mlp, h, use_reentrant=False) if self.recompute else self.mlp(h)
        return self.head.loss(h, labels)


def _pass(model, ids, labels, weights, amp, overlap_on):
    model.zero_grad(set_to_none=True)
    parallel.LEDGER.reset()
    with parallel.overlap(model) if overlap_on else nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16) if amp else nullcontext():
            loss = model(ids, labels)
        (loss * weights).sum().backward()
    return loss.detach(), Counter(parallel.LEDGER.records)


def _run(grid, mode, option):
    model = Stack(grid, mode, recompute="recompute" in option)
    g = torch.Generator().manual_seed(6)
    rows = local_rows(grid, mode, N)
    ids, labels = torch.randint(0, V, (2, N), generator=g)[:, rows]
    weights = torch.rand(N, generator=g)[rows]
    overlap_on = option != "sync"
    # With overlap the measured pass is the second: it prefetches in the order (and dtypes) of the first.
    for amp in ((False, True) if option == "fp32-then-bf16" else (True, True) if overlap_on else (True,)):
        loss, records = _pass(model, ids, labels, weights, amp, overlap_on)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return loss, grads, records


def _z_gathers(degrees, mode, option, cb):
    """The Z all-gather records of one pass, from the layers' formulas (cb: bytes of a Linear's gathered value)."""
    _, x, y, z = degrees
    redo = 1 if "recompute" in option else 0  # the checkpointed Linears gather once more, forward again
    table = V // y * (H // x)  # embedding and LM head blocks: vocabulary over Y, hidden over X
    up = F // y * (H // x)
    down = up if mode == "sharded" else H // y * (F // x)  # transposed [H/x, F/y] | normal [H/y, F/x]
    out = Counter()
    out[("all_gather", "z", z, table * 4)] += 1  # embedding: forward only, fp32
    out[("all_gather", "z", z, up * cb)] += 2 + redo
    out[("all_gather", "z", z, down * cb)] += 2 + redo
    out[("all_gather", "z", z, table * cb)] += 2  # LM head, forward and backward
    return out


def _split(records):
    """(Z all-gathers, every other record) as Counters of plain tuples."""
    z, rest = Counter(), Counter()
    for r, n in records.items():
        (z if (r.op, r.axes) == ("all_gather", "z") else rest)[(r.op, r.axes, r.group_size, r.nbytes)] += n
    return z, rest


def _worker(rank, world):
    out = {}
    for degrees in ZGRIDS:
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        for mode in MODES:
            for option in OPTIONS:
                loss, grads, records = _run(grid, mode, option)
                with gather_then_cast():
                    ref_loss, ref_grads, ref_records = _run(grid, mode, option)
                z, rest = _split(records)
                ref_z, ref_rest = _split(ref_records)
                out[(degrees, mode, option)] = {
                    "loss_equal": torch.equal(loss, ref_loss),
                    "grads_unequal": sorted(k for k in ref_grads if not torch.equal(grads[k], ref_grads[k])),
                    "grad_dtypes": sorted({str(t.dtype) for t in grads.values()}),
                    "z_gathers": z, "ref_z_gathers": ref_z, "other_records_equal": rest == ref_rest,
                }
    return out


@pytest.fixture(scope="module")
def results(request):
    return once_per_session(request, lambda: run_ranks(8, _worker))


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("degrees", ZGRIDS, ids=grid_id)
def test_bf16_gather_is_bitwise_gather_then_cast(results, degrees, mode, option):
    for rank, per_case in enumerate(results):
        got = per_case[(degrees, mode, option)]
        assert got["loss_equal"], rank
        assert got["grads_unequal"] == [], (rank, got["grads_unequal"])
        assert got["grad_dtypes"] == ["torch.float32"], rank  # reduce-scatters and .grad stay fp32
        assert got["other_records_equal"], rank


@pytest.mark.parametrize("option", [o for o in OPTIONS if o != "fp32-then-bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("degrees", ZGRIDS, ids=grid_id)
def test_z_gather_bytes_halve(results, degrees, mode, option):
    """Exactly the formula's gathers (a prefetch in the wrong dtype would add records), Linear and LM head
    at 2 bytes a value against the reference's 4: half the bytes, the embedding's unchanged."""
    want, ref = _z_gathers(degrees, mode, option, 2), _z_gathers(degrees, mode, option, 4)
    table = V // degrees[2] * (H // degrees[1]) * 4  # the embedding's one fp32 gather
    for rank, per_case in enumerate(results):
        got = per_case[(degrees, mode, option)]
        assert got["z_gathers"] == want, (rank, got["z_gathers"], want)
        assert got["ref_z_gathers"] == ref, (rank, got["ref_z_gathers"], ref)
        nbytes = lambda c: sum(k[3] * n for k, n in c.items())  # noqa: E731
        assert nbytes(got["z_gathers"]) - table == (nbytes(got["ref_z_gathers"]) - table) // 2


def test_fallback_when_the_recorded_dtype_differs(results):
    """fp32 pass, then bf16: the prefetched fp32 gathers are not used for bf16 matmuls (each position gathers
    again, synchronously, in bf16) - results above stay bitwise equal, and the extra records show it."""
    degrees = ZGRIDS[0]
    got = results[0][(degrees, "sharded", "fp32-then-bf16")]
    steady = _z_gathers(degrees, "sharded", "overlap", 2)
    assert sum(got["z_gathers"].values()) > sum(steady.values())
