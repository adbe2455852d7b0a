"""The vocabulary-parallel loss (parallel/embedding.py) computes in fp32 whatever the logits' dtype. It reads bf16
logits as they are, without an fp32 copy first: bitwise, no tolerance, the loss and gradient of that copy, since
every step makes the same fp32 operations on the same values (the max of bf16 values is one of them, and a bf16
minus an fp32 is computed in fp32). fp64 logits are taken to fp32 first. One process: the loss's all-reduces are
over a group of one; tests/parallel/test_layers.py checks it against torch on every 8-rank grid."""

import pytest
import torch

import parallel
from parallel.embedding import vocab_parallel_cross_entropy

GRID = parallel.Grid(1, 1, 1, 1, rank=0)


def _loss_and_grad(logits, labels):
    logits = logits.detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, labels, GRID, "y")
    # uneven weights per token, as a Goldfish mask or a loss normalization gives the backward
    (loss * torch.linspace(0.5, 2.0, loss.numel())).sum().backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_loss_of_any_logits_is_bitwise_the_loss_of_their_fp32_copy(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(24, 301, generator=g)).to(dtype)
    labels = torch.randint(0, 301, (24,), generator=g)
    labels[::5] = -100  # ignored tokens: zero loss and gradient
    loss, grad = _loss_and_grad(logits, labels)
    ref_loss, ref_grad = _loss_and_grad(logits.float(), labels)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad, ref_grad.to(dtype))
    assert float(loss[::5].abs().max()) == 0.0 and float(grad[::5].abs().max()) == 0.0


def test_masked_logits_give_the_loss_torch_gives_and_no_nan():
    """A logit of -inf (a token masked out) in column 0: an ignored label, which reads that column, costs 0 and no
    nan; every other token's loss and gradient are torch's cross-entropy's (1e-6: another summation order)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 9, generator=g)
    logits[:, 0] = float("-inf")
    labels = torch.tensor([1, -100, 3, 8, -100, 2])
    loss, grad = _loss_and_grad(logits, labels)
    ref = logits.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(ref, labels, reduction="none")
    (want * torch.linspace(0.5, 2.0, want.numel())).sum().backward()
    torch.testing.assert_close(loss, want.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, ref.grad, atol=1e-6, rtol=0)
