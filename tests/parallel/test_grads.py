"""parallel.grad_norm and clip_grad_norm_ on one process, against the norm taken in float64 over every entry.

The multi-rank cases (each shard counted once) are in test_mlp_training.py and tests/memtrain/hf/test_parallelize.py;
here the arithmetic: gradients of mixed dtypes, parameters without a gradient, and clipping's conditions.
Tolerance 1e-7 relative: on a CPU grad_norm sums each tensor's squares in fp32 (torch's cascade summation, measured
1e-8 relative on a 5M-parameter model's gradients), off one it takes each tensor's norm in fp32 with torch's
multi-tensor kernel (one rounding of the norm: 6e-8 relative at most, then squared in float64); the per-tensor
terms are added in float64. A bf16 gradient is exact in fp32, so it adds no error of its own. Both ways run here: the
multi-tensor one is torch's own code on a CPU too, as on a GPU.
"""

import math

import pytest
import torch

import parallel
from parallel.grads import _squared_norms

TOL = 1e-7
MULTI_TOL = 5e-7  # 4 ulps of fp32 (2^-23 = 1.2e-7); measured at most 2.1e-7 (bf16 at this size)


def _params(dtypes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, dtype in enumerate(dtypes):
        p = torch.nn.Parameter(torch.zeros(64 + i, 33, dtype=dtype))
        p.grad = (torch.randn(p.shape, generator=gen) * (i + 1)).to(dtype)
        params.append(p)
    return params


def _reference(params) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params if p.grad is not None))


@pytest.fixture(scope="module")
def grid():
    return parallel.Grid(1, 1, 1, 1, rank=0)


def test_norm_of_mixed_dtypes_equals_the_float64_norm(grid):
    params = _params([torch.float32, torch.float64, torch.bfloat16, torch.float16])
    params.append(torch.nn.Parameter(torch.ones(3)))  # no gradient: not counted
    norm = parallel.grad_norm(params, grid)
    assert norm.dtype == torch.float64
    assert float(norm) == pytest.approx(_reference(params), rel=TOL)


def test_the_multi_tensor_norms_are_within_a_few_fp32_ulps_of_float64():
    """The arithmetic grad_norm uses off a CPU, run on one (torch's multi-tensor norm is torch's own code here too):
    each tensor's norm within MULTI_TOL of its float64 norm. Fails if fp16 norms are taken in fp16 (no dtype
    passed to torch's kernel: ~5e-4 off) or float64 gradients narrowed to fp32 (the float64 norm is then ~1e-8 off)."""
    params = _params([torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32])
    wide = params[1].grad.pow(2).sum()
    grads = [p.grad for p in params]
    squares = _squared_norms(grads, torch.device("cpu"), multi_tensor=True)
    by_dtype = [g for dtype in dict.fromkeys(g.dtype for g in grads) for g in grads if g.dtype == dtype]
    for s, g in zip(squares, by_dtype):
        assert s.dtype == torch.float64
        exact = g.double().pow(2).sum()
        assert float(s.sqrt() / exact.sqrt() - 1) == pytest.approx(0.0, abs=MULTI_TOL), g.dtype
    assert float(squares[2] / wide - 1) == pytest.approx(0.0, abs=1e-12)  # float64 all the way (fp32: ~1e-8)


def test_no_gradient_at_all_is_a_zero_norm(grid):
    assert float(parallel.grad_norm([torch.nn.Parameter(torch.ones(3))], grid)) == 0.0


def test_clipping_scales_to_max_norm_and_leaves_small_gradients_bitwise(grid):
    params = _params([torch.float32, torch.float32])
    before = [p.grad.clone() for p in params]
    norm = parallel.clip_grad_norm_(params, 1e9, grid)  # far above the norm: nothing clipped
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    assert float(norm) == pytest.approx(_reference(params), rel=TOL)
    parallel.clip_grad_norm_(params, 1.0, grid)
    assert _reference(params) == pytest.approx(1.0, rel=1e-5)  # max_norm / (norm + 1e-6), in fp32


def test_clipping_multiplies_each_dtype_by_the_float64_coefficient_as_torch_does(grid):
    """fp32 gradients are scaled by the coefficient cast to fp32 (torch's multi-tensor path): bitwise the product
    with the float64 coefficient itself, which torch computes in fp32 as well; other dtypes get the float64 one."""
    params = _params([torch.float32, torch.bfloat16, torch.float64, torch.float32])
    before = [p.grad.clone() for p in params]
    coef = 0.5 / (parallel.grad_norm(params, grid) + 1e-6)  # float64, as clipping computes it
    assert coef.dtype == torch.float64 and float(coef) < 1.0
    parallel.clip_grad_norm_(params, 0.5, grid)
    for p, b in zip(params, before):
        assert p.grad.dtype == b.dtype and torch.equal(p.grad, b * coef), p.grad.dtype


def test_a_nan_gradient_is_not_spread_by_clipping(grid):
    params = _params([torch.float32, torch.float32])
    params[0].grad[0, 0] = float("nan")
    finite = params[1].grad.clone()
    norm = parallel.clip_grad_norm_(params, 1.0, grid)
    assert math.isnan(float(norm))
    assert torch.equal(params[1].grad, finite)  # a NaN coefficient would have made every gradient NaN


def test_an_infinite_norm_clips_every_finite_gradient_to_zero(grid):
    """max_norm / (inf + 1e-6) = 0 < 1: the coefficient clips; as before it stayed on the device."""
    params = _params([torch.float32, torch.float32])
    params[0].grad[0, 0] = float("inf")
    norm = parallel.clip_grad_norm_(params, 1.0, grid)
    assert math.isinf(float(norm))
    assert torch.equal(params[1].grad, torch.zeros_like(params[1].grad))
