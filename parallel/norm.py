"""RMSNorm and LayerNorm over a hidden dimension sharded along one grid axis.

In sharded mode the residual stream is [rows, H/x]: each X member holds a slice of every row's
features, so a norm's statistics (mean, mean of squares) are partial sums finished by an all-reduce
over X. The all-reduce's backward is another all-reduce over X: every member's slice of the output
depends on the shared statistic, so its gradient is the sum of the members' contributions.

The weight and bias are sliced like the features (sharded over X). The rows of data differ over
(z, data) and are replicated over Y, where the incoming gradient is identical, so by default their
gradients are summed over (z, data) only.
"""

from __future__ import annotations

import torch
from torch import nn

from . import comm
from .grid import Grid, current
from .sharding import tag


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, grid, axis):
        ctx.grid, ctx.axis = grid, axis
        t = t.clone()
        comm.all_reduce(t, grid, axis)
        return t

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        comm.all_reduce(g, ctx.grid, ctx.axis)
        return g, None, None


@comm.eager_under_compile  # an in-place collective: eager inside compiled code, as parallel.Linear's grid path
def all_reduce_sum(t: torch.Tensor, grid: Grid, axis) -> torch.Tensor:
    """Autograd-aware sum over `axis` of partial results that every member goes on to use."""
    if grid.size(axis) == 1:
        return t
    return _AllReduceSum.apply(t, grid, axis)


class _ShardedNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, bias: bool, *, grid: Grid | None, axis: str,
                 reduce_axes, device, dtype, name: str):
        super().__init__()
        self.grid = grid or current()
        self.axis, self.hidden, self.eps, self.name = axis, hidden, eps, name
        p = self.grid.size(axis)
        if hidden % p:
            raise ValueError(f"{name}: hidden size {hidden} is not divisible by parallel.{axis}={p}: "
                             f"choose a degree that divides {hidden}")
        n = hidden // p
        self.weight = tag(nn.Parameter(torch.ones(n, device=device, dtype=dtype)), (axis,), reduce_axes)
        if bias:
            self.bias = tag(nn.Parameter(torch.zeros(n, device=device, dtype=dtype)), (axis,), reduce_axes)
        else:
            self.register_parameter("bias", None)

    def _mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.grid.size(self.axis) == 1:  # the same sum and division in one op (bitwise): one autograd node
            return t.mean(-1, keepdim=True)
        return all_reduce_sum(t.sum(-1, keepdim=True), self.grid, self.axis) / self.hidden

    def extra_repr(self) -> str:
        return f"{self.hidden} over {self.axis}, local={self.weight.shape[0]}, eps={self.eps}"


class RMSNorm(_ShardedNorm):
    """Llama's RMSNorm: statistics in float32, then weight * normalized (in the input dtype)."""

    def __init__(self, hidden: int, eps: float = 1e-6, *, grid: Grid | None = None, axis: str = "x",
                 reduce_axes=("z", "data"), device=None, dtype=None, name: str = "rmsnorm"):
        super().__init__(hidden, eps, False, grid=grid, axis=axis, reduce_axes=reduce_axes, device=device,
                         dtype=dtype, name=name)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.float()
        h = h * torch.rsqrt(self._mean(h.pow(2)) + self.eps)
        return self.weight * h.to(dtype)


class LayerNorm(_ShardedNorm):
    """torch.nn.LayerNorm (biased variance, affine) over the sharded last dimension."""

    def __init__(self, hidden: int, eps: float = 1e-5, *, bias: bool = True, grid: Grid | None = None,
                 axis: str = "x", reduce_axes=("z", "data"), device=None, dtype=None, name: str = "layernorm"):
        super().__init__(hidden, eps, bias, grid=grid, axis=axis, reduce_axes=reduce_axes, device=device,
                         dtype=dtype, name=name)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.float()  # as torch's layer_norm under autocast: statistics in float32
        centered = h - self._mean(h)
        out = centered * torch.rsqrt(self._mean(centered.pow(2)) + self.eps)
        out = out * self.weight.float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(dtype)
