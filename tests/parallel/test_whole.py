"""Without tensor parallelism (x = y = z = 1) a Linear and the LM head's product are torch's F.linear
(parallel/linear.py's module docstring): bitwise the engine's own path, which the same layer takes with GEMM tuning
on (forced to the `given` layout, the untuned call itself). One process: the engine path's collectives are over
groups of one. Bitwise, no tolerance: both paths make the same casts and call the same matmul kernels, and the
bias is added apart on both, as a sharded grid adds it after its reduction. The embedding there is F.embedding,
whose CPU backward adds each row's gradients in the order the engine's index_add_ does."""

from contextlib import contextmanager, nullcontext

import pytest
import torch

import parallel
from parallel.embedding import Embedding, LMHead
from parallel.linear import Linear

GRID = parallel.Grid(1, 1, 1, 1, rank=0)


@contextmanager
def engine_path():
    """Layers go through MatmulFn inside: tuning on, with the untuned call as its only layout."""
    parallel.tune_matmul(True, layouts=("given",))
    try:
        yield
    finally:
        parallel.tune_matmul(None, layouts=None)


def _graph(fn) -> list:
    """Every node of the autograd graph from `fn`."""
    nodes, todo = [], [fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in nodes:
            nodes.append(node)
            todo.extend(next_fn for next_fn, _ in node.next_functions)
    return nodes


def _run(layer, x, amp, path):
    """Output, input gradient and parameter gradients of one forward and backward, and whether the engine's
    MatmulFn computed it."""
    layer.zero_grad()
    x = x.detach().requires_grad_()
    with path, torch.autocast("cpu", dtype=torch.bfloat16) if amp else nullcontext():
        y = layer(x) if isinstance(layer, Linear) else layer.logits(x)
    engine = any("MatmulFn" in node.name() for node in _graph(y.grad_fn))
    y.float().square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()], engine


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mode", ["easy", "sharded"])
def test_linear_is_bitwise_the_engine_path(mode, bias, amp):
    layer = Linear(64, 96, bias=bias, mode=mode, grid=GRID, seed=3, init_std=0.5)
    if bias:
        with torch.no_grad():
            layer.bias.normal_(generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    (whole, through_engine), (engine, through_engine_too) = (_run(layer, x, amp, path)
                                                             for path in (nullcontext(), engine_path()))
    assert not through_engine and through_engine_too
    assert all(torch.equal(a, b) for a, b in zip(whole, engine))


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_lm_head_logits_are_bitwise_the_engine_path(amp):
    head = LMHead(32, 128, mode="sharded", grid=GRID, seed=4, init_std=0.5)
    h = torch.randn(24, 32, generator=torch.Generator().manual_seed(5))
    (whole, through_engine), (engine, through_engine_too) = (_run(head, h, amp, path)
                                                             for path in (nullcontext(), engine_path()))
    assert not through_engine and through_engine_too
    assert all(torch.equal(a, b) for a, b in zip(whole, engine))


def test_at_z_1_backward_reuses_the_forwards_cast_weight():
    """The engine path at z = 1 keeps the bf16 weight its forward cast (no second cast in backward); z > 1 gathers
    again, in tests/parallel/test_layers.py's grids."""
    layer = Linear(64, 96, bias=False, mode="sharded", grid=GRID, seed=3)
    x = torch.randn(16, 64, requires_grad=True)
    with engine_path(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    (matmul,) = [node for node in _graph(y.grad_fn) if "MatmulFn" in node.name()]
    saved = matmul.saved_tensors
    assert len(saved) == 2 and saved[1].dtype == torch.bfloat16
    assert torch.equal(saved[1], layer.weight.detach().view(96, 64).bfloat16())


@pytest.mark.parametrize("padding_idx", [None, 5])
def test_embedding_is_bitwise_the_engine_lookup(monkeypatch, padding_idx):
    emb = Embedding(128, 32, padding_idx=padding_idx, mode="sharded", grid=GRID, seed=6)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 40, (4, 64), generator=gen)  # many repeats: each row's gradient is a long sum
    ids[0, :3] = 5
    g = torch.randn(4, 64, 32, generator=gen)

    def run():
        emb.zero_grad()
        out = emb(ids)
        out.backward(g)
        engine = any("EmbedFn" in node.name() for node in _graph(out.grad_fn))
        return out.detach(), emb.weight.grad.clone(), engine

    out, grad, through_engine = run()
    monkeypatch.setattr(Embedding, "whole", property(lambda self: False))
    engine_out, engine_grad, through_engine_too = run()
    assert not through_engine and through_engine_too
    assert torch.equal(out, engine_out) and torch.equal(grad, engine_grad)
    if padding_idx is not None:
        assert not grad.view(128, 32)[padding_idx].any()  # the padding row learns nothing from the lookup
