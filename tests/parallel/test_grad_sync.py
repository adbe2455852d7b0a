"""parallel.grad_sync (all-reduces started during backward, in buckets) against sync_gradients (after backward).

On 4 forked gloo ranks, every case runs the same forward and backward twice, once synced by each path, and
compares the gradients: after one micro-batch, and after two (the first under parallel.no_sync, so only the
second's backward launches), the second overlapped run using the buckets rebuilt from the first's observed
order. Models: a stack of parallel.Linear blocks (with an unused layer: no gradient at all) in easy and sharded
mode, and a tiny Llama with tied embeddings through memtrain.hf.parallelize, once with activation
checkpointing; grids over data alone and with X or Z (a tensor axis in the reduce axes: easy-mode replicas
reduce over every axis, sharded biases and norms over (z, data)), with and without parallel.overlap (ORS
defers sharded weights' Z reduce-scatter into .grad until its context exits, after their post-accumulate-grad
hook has fired). Buckets are tiny (first 512 B, then 2 kB) so every model has several per group.

Tolerance: 1e-6 of each tensor's largest gradient. The ring all-reduce of gloo adds the members'
contributions in an order that depends on an element's offset in its message, so other bucket boundaries
change the last bits of sums over groups of 4 (measured: at most 1.4e-7 relative); when every group a bucket
reduces over has 2 members the sums are bitwise equal (a + b = b + a), and that is asserted. The ledger's
bytes per (operation, axes) are equal: buckets cut messages, they do not add bytes.

"Really overlapped" is observed, not timed: a gradient hook on the first layer's output (it runs before that
layer's backward, the last of the pass) counts the buckets whose all-reduce is already launched.
"""

from collections import defaultdict
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import parallel
from memtrain.hf import parallelize
from parallel.forked import run_ranks
from tests._helpers import GridCache, grid_id, once_per_session
from tests.memtrain._models import tiny

D, HD, N, LAYERS = 32, 64, 32, 3
B, S = 8, 8
CAPS = dict(first_bucket_bytes=512, bucket_bytes=2048)
TOL = 1e-6
# (model, grid (data, x, y, z), mode, ORS)
CASES = [("mlp", (4, 1, 1, 1), "easy", False), ("mlp", (2, 2, 1, 1), "sharded", True),
         ("mlp", (2, 2, 1, 1), "easy", False), ("mlp", (2, 1, 1, 2), "sharded", True),
         ("mlp", (2, 1, 1, 2), "easy", True), ("mlp", (1, 2, 1, 2), "sharded", True),
         ("llama", (4, 1, 1, 1), "sharded", False), ("llama", (2, 2, 1, 1), "easy", False),
         ("llama", (2, 1, 1, 2), "sharded", True), ("llama", (1, 2, 1, 2), "easy", True),
         ("llama-recompute", (2, 1, 1, 2), "sharded", True)]


class MLP(torch.nn.Module):
    def __init__(self, grid, mode):
        super().__init__()
        kw = dict(mode=mode, grid=grid, init_std=0.2, seed=1)
        self.unused = parallel.Linear(D, D, name="unused", **kw)  # never called: no gradient
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleList([
            parallel.Linear(D, HD, name=f"b{i}.fc1", **kw),
            parallel.Linear(HD, D, transpose=mode == "sharded", name=f"b{i}.fc2", **kw)]) for i in range(LAYERS))

    def forward(self, x, first_layer_hook=None):
        for i, (fc1, fc2) in enumerate(self.blocks):
            x = x + fc2(F.gelu(fc1(x)))
            if i == 0 and first_layer_hook is not None:
                x.register_hook(first_layer_hook)  # its gradient is complete before block 0's backward
        return x


def _mlp_case(grid, mode):
    model = MLP(grid, mode)
    g = torch.Generator().manual_seed(3)
    X, T = torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)
    if mode == "easy":
        k = N // grid.world_size
        rows, cols = slice(grid.rank * k, (grid.rank + 1) * k), slice(None)
    else:
        k, i, f = N // grid.size(("z", "data")), grid.coord(("z", "data")), D // grid.x
        rows, cols = slice(i * k, (i + 1) * k), slice(grid.coords["x"] * f, (grid.coords["x"] + 1) * f)
    x, t = X[rows, cols], T[rows, cols]

    def loss(sl, hook):
        return ((model(x[sl], hook) - t[sl]) ** 2).sum() / N

    return model, x.shape[0], loss


def _llama_case(grid, mode, recompute=False):
    plm = parallelize(tiny("llama", "meta", tie_word_embeddings=True, num_hidden_layers=2), grid, mode, seed=1,
                      device="cpu")
    if recompute:  # each block's forward (collectives included) runs again inside backward
        plm.enable_activation_checkpointing()
    g = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g)
    labels[:, :2] = -100
    n = (labels != -100).sum()
    rows = plm.local_rows(B)
    ids, labels = ids[rows], labels[rows]
    hooks = []

    def on_embedding(module, args, out):  # the embedding's backward is the last of the pass
        if hooks[0] is not None:
            out.register_hook(hooks[0])

    plm.model.get_input_embeddings().register_forward_hook(on_embedding)

    def loss(sl, hook):
        hooks[:] = [hook]
        return plm.token_losses(ids[sl], labels[sl]).sum() / n

    return plm, ids.shape[0], loss


def _watch(sync):
    """Count buckets found complete but not launched, by a post-accumulate-grad hook running after the sync's."""
    probe = {"on": False, "waited": 0}

    def late(p):
        b = sync._bucket_of[sync._pos[id(p)]]
        if probe["on"] and b.ready == len(b.index) and b.work is None:
            probe["waited"] += 1

    for p in sync.params:
        p.register_post_accumulate_grad_hook(late)
    return probe


def _grads(model, grid, rows, loss, path, ors, micro, probe=None):
    """Gradients after `micro` micro-batches synced by `path`; ledger totals; (buckets launched, buckets) when
    the first layer's backward starts; buckets that waited for an earlier one although complete."""
    model.zero_grad(set_to_none=True)
    parallel.LEDGER.reset()
    sync = parallel.grad_sync(model, grid, **CAPS) if path == "overlap" else None
    seen = []
    hook = (lambda g: seen.append((sum(b.work is not None for b in sync.buckets), len(sync.buckets)))) if sync \
        else None
    k = rows // micro
    if probe is not None:
        probe.update(on=sync is not None, waited=0)
    with sync or nullcontext():
        for m in range(micro):
            with parallel.no_sync() if m < micro - 1 else nullcontext(), \
                    parallel.overlap(model) if ors else nullcontext():
                loss(slice(m * k, (m + 1) * k), hook).backward()
    if sync is None:
        parallel.sync_gradients(model, grid)
    ledger = parallel.LEDGER.totals()
    grads = [None if p.grad is None else p.grad.clone() for p in parallel.unique_parameters(model)]
    return grads, ledger, seen[-1] if seen else (0, 0), probe["waited"] if probe else 0


def _compare(a, b):
    """(max error relative to each tensor's largest entry, bitwise equal) of two gradient lists."""
    assert [x is None for x in a] == [y is None for y in b]
    pairs = [(x, y) for x, y in zip(a, b) if y is not None]
    err = max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in pairs)
    return err, all(torch.equal(x, y) for x, y in pairs)


def _worker(rank, world):
    out, grids = {}, GridCache(rank)
    for case in CASES:
        name, degrees, mode, ors = case
        grid = grids[degrees]
        model, rows, loss = _mlp_case(grid, mode) if name == "mlp" else _llama_case(grid, mode, "recompute" in name)
        sync = parallel.grad_sync(model, grid, **CAPS)
        probe, r = _watch(sync), {}
        for micro in (1, 2):  # the second overlapped run uses the buckets re-cut after the first
            ref, ref_ledger, _, _ = _grads(model, grid, rows, loss, "blocking", ors, micro)
            got, ledger, (launched, buckets), waited = _grads(model, grid, rows, loss, "overlap", ors, micro, probe)
            r[micro] = dict(zip(("err", "bitwise"), _compare(got, ref)), ledger_equal=ledger == ref_ledger,
                            launched=launched, buckets=buckets, waited=waited, no_grad=sum(g is None for g in ref))
        r["plan"] = [(b.axes, b.index) for b in sync.buckets]
        r["pairs_only"] = all(grid.size(b.axes) == 2 for b in sync.buckets)
        out[case] = r
    # Misuse: two backwards of one step without no_sync would sum a bucket before its gradients are complete.
    grid = grids[(4, 1, 1, 1)]
    model, rows, loss = _mlp_case(grid, "easy")
    try:
        with parallel.grad_sync(model, grid, **CAPS):
            loss(slice(0, rows // 2), None).backward()
            loss(slice(rows // 2, rows), None).backward()
        out["misuse"] = "no error"
    except RuntimeError as e:
        out["misuse"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks(request):
    return once_per_session(request, lambda: run_ranks(4, _worker))


def _id(case):
    name, degrees, mode, ors = case
    return f"{name}-{grid_id(degrees)}-{mode}" + ("-ors" if ors else "")


@pytest.mark.parametrize("micro", [1, 2], ids=["one-micro-batch", "two-micro-batches"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_overlapped_sync_equals_blocking(ranks, case, micro):
    for rank, res in enumerate(ranks):
        r = res[case][micro]
        assert r["err"] < TOL, (rank, r)
        if res[case]["pairs_only"]:
            assert r["bitwise"], (rank, r)
        assert r["ledger_equal"], rank
        assert r["buckets"] > 1, "tiny buckets: several per model"
        assert r["no_grad"] == (2 if case[0] == "mlp" else 0)  # the unused layer's weight and bias


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_all_reduces_start_before_backward_ends(ranks, case):
    """When the first layer's backward starts, some buckets are in flight (and, in the MLP, the first block's not:
    the embedding of the Llama may be in no bucket, its gradient reduced over a dead axis)."""
    for res in ranks:
        for micro in (1, 2):
            r = res[case][micro]
            assert 0 < r["launched"], (micro, r)
            if case[0] == "mlp":
                assert r["launched"] < r["buckets"], (micro, r)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_rebuilt_buckets_follow_the_observed_order(ranks, case):
    """After the first synced step the buckets follow the order gradients became ready, so no complete bucket
    waits for an earlier one (reverse registration can hold one back: a norm registered after its layer's
    matrices but ready after them)."""
    for res in ranks:
        assert res[case][2]["waited"] == 0, res[case]


def test_every_rank_keeps_the_same_buckets(ranks):
    for case in CASES:
        plans = [res[case]["plan"] for res in ranks]
        assert all(p == plans[0] for p in plans), case


def test_two_backwards_in_one_synced_step_are_refused(ranks):
    for res in ranks:
        assert "accumulated twice" in res["misuse"], res["misuse"]


def test_post_accumulate_grad_hooks_fire_once_per_backward_tied_or_deferred():
    """What the buckets rely on: a tied weight's hook fires once per backward, after both uses are summed;
    a Function returning no gradient for a weight (ORS: deferred to the overlap exit) still fires its hook."""
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    fired = defaultdict(list)
    emb.weight.register_post_accumulate_grad_hook(lambda p: fired["tied"].append(p.grad.clone()))
    head(emb(torch.tensor([1, 2]))).sum().backward()
    assert len(fired["tied"]) == 1 and torch.equal(fired["tied"][0], emb.weight.grad)

    class NoWeightGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):
            return g, None

    w = torch.nn.Parameter(torch.randn(3, 3))
    w.register_post_accumulate_grad_hook(lambda p: fired["deferred"].append(p.grad))
    NoWeightGrad.apply(torch.randn(2, 3, requires_grad=True), w).sum().backward()
    assert fired["deferred"] == [None]
