"""The 3D tensor-parallel Linear of AxoNN (Singh et al., arXiv 2305.13525), in two activation contracts.

Weight W [out, in]. For a normal layer the in-features split over X (axis A) and the out-features
over Y (axis B); `transpose=True` swaps them. The [out/|B|, in/|A|] block is flattened and split over
Z, so a rank stores out*in/(x*y*z) values.

Sharded mode (activations stay sharded; a normal layer followed by a transposed one needs no
re-layout): input [rows, in/|A|] replicated over B, output [rows, out/|B|] replicated over A.
    forward : W = all-gather_Z(shard);  y = x W^T;  all-reduce_A(y)
    backward: W = all-gather_Z(shard);  dx = dy W -> all-reduce_B (async with OAR, while dW computes)
              dW = dy^T x -> reduce-scatter_Z (async with ORS)
Rows are the batch split over data and Z.
Under autocast the Z all-gathers (forward and backward) move the shard already cast to the matmul dtype:
gathering is concatenation, so gather(cast(shards)) == cast(gather(shards)) bit for bit, at half the bytes
for bf16 over fp32 parameters. The gradient reduce-scatter over Z stays in the parameter dtype.

Easy mode (any model runs unmodified): input and output are plain data-parallel activations, each
rank its own rows and all features. The edges move rows instead of reducing twice:
    in : all-to-all_A (features -> rows), all-gather_B (rows)     [backward: reduce-scatter_B]
    out: reduce-scatter_A (rows), all-to-all_B (rows -> features) [backward: all-gather_A]
so the plane of x*y ranks multiplies the same rows as in sharded mode, and each reduction over A
or B is a reduce-scatter (half an all-reduce's traffic).

The three local products (x W^T, dy W, dy^T x) go through gemm_tuning.matmul: `a @ b` as written here
unless parallel.tune_matmul picks another memory layout for the shape, the same one on every rank.

Backward needs the forward's block again. With z > 1 it is gathered again (AxoNN's choice: a gathered block is
never kept between the passes); with z = 1 the block is this rank's shard, or its bf16 cast under autocast,
and that copy is kept for backward, as torch's autocast keeps the cast weight of its own linear.
Without tensor parallelism (x = y = z = 1: one device, or data parallelism alone) and with GEMM tuning off, a
layer (and the LM head's product) is torch's own F.linear on its weight viewed [out, in]: the same products,
bit for bit, without the engine's per-call work in Python, which is what a launch-bound single-GPU step spent
beyond a plain PyTorch loop. (The embedding there is F.embedding, bitwise the engine's lookup on a CPU; the loss
keeps the engine's code: torch's own rounds otherwise, and a run resumed on another grid drifted 2x further from
an uninterrupted one, tests/memtrain/training/test_run_dir.py.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import comm, gemm_tuning, overlap
from .grid import Grid, current
from .sharding import BlockLayout, check_sizes, tag

MODES = ("easy", "sharded")


def _autocast_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


class ShardedWeight(nn.Module):
    """Base of every layer whose weight is a block over (A, B) split over Z."""

    grid: Grid
    layout: BlockLayout

    def _init_weight(self, layout: BlockLayout, *, in_axis: str, out_axis: str, mode: str, grid: Grid | None,
                     init_std: float, seed: int, name: str, device, dtype) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: use 'easy' or 'sharded'")
        self.grid = grid or current()
        self.layout, self.in_axis, self.out_axis, self.mode = layout, in_axis, out_axis, mode
        self.name = name
        layout.check(self.grid, name)
        if torch.device(device or "cpu").type == "meta":
            shard = torch.empty(layout.shard_numel(self.grid), device="meta", dtype=dtype or torch.float32)
        else:
            shard = layout.seeded_normal_shard(self.grid, init_std, seed, name, dtype=dtype or torch.float32,
                                               device=device)
        self.weight = tag(nn.Parameter(shard), ("x", "y", "z"), ("data",))

    @property
    def whole(self) -> bool:
        """No tensor parallelism (x = y = z = 1): this rank's shard is the whole matrix (a Linear's and the LM
        head's product are then F.linear on it, module docstring)."""
        return self.grid.tensor_parallel_size == 1

    def torch_product(self, device: torch.device) -> bool:
        """Whether this layer's product is F.linear on the whole matrix: no tensor parallelism and no GEMM tuning
        (module docstring)."""
        return self.whole and not gemm_tuning.active(device)

    @property
    def block_shape(self) -> tuple[int, int]:
        return self.layout.block_rows(self.grid), self.layout.block_cols(self.grid)

    def view_gathered(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.block_shape)

    def gather_dtype(self, compute: torch.dtype | None) -> torch.dtype:
        """The dtype the Z all-gather moves for a matmul in `compute`: `compute` when it is narrower than the
        parameter (bf16 autocast over fp32 weights), else the parameter dtype (the cast then follows the gather)."""
        p = self.weight.dtype
        return compute if compute is not None and compute.itemsize < p.itemsize else p

    def _local_shard(self, dtype: torch.dtype | None) -> torch.Tensor:
        w = self.weight.detach()
        return w if dtype is None or dtype == w.dtype else w.to(dtype)

    def gather_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [rows, cols] block, all-gathered over Z in `dtype` (None: the parameter dtype)."""
        return self.view_gathered(comm.all_gather(self._local_shard(dtype), self.grid, "z"))

    def gather_weight_async(self, dtype: torch.dtype | None = None):
        return comm.all_gather(self._local_shard(dtype), self.grid, "z", async_op=True)

    def weight_for(self, phase: str, compute: torch.dtype | None = None) -> torch.Tensor:
        """The gathered block for a `phase` ('fwd'/'bwd') computing in `compute`, in `gather_dtype(compute)`."""
        dtype = self.gather_dtype(compute)
        if self.grid.z == 1:  # nothing to gather, so nothing to prefetch
            return self.view_gathered(self._local_shard(dtype))
        st = overlap.state()
        if st is not None and st.prefetcher is not None:
            return st.prefetcher.take(self, phase, dtype)
        return self.gather_weight(dtype)

    def weight_grad(self, block_grad: torch.Tensor):
        """Reduce-scatter the block gradient over Z; deferred into .grad under ORS (returns None)."""
        flat = block_grad.reshape(-1).to(self.weight.dtype)
        st = overlap.state()
        if st is not None and st.reduce_scatter and self.grid.z > 1:
            out, work = comm.reduce_scatter(flat, self.grid, "z", async_op=True)
            st.defer_grad(self.weight, out, work)
            return None
        return comm.reduce_scatter(flat, self.grid, "z")

    # The forward output reduction over A. Easy mode reduce-scatters rows instead of all-reducing:
    # plane rows are ordered (b, a, i); each A-member keeps the rows that originated on its column.
    def reduce_out(self, y: torch.Tensor) -> torch.Tensor:
        if self.mode == "sharded":
            comm.all_reduce(y, self.grid, self.in_axis)
            return y
        na, nb = self.grid.size(self.in_axis), self.grid.size(self.out_axis)
        if na == 1:
            return y
        f = y.shape[-1]
        y = y.view(nb, na, -1, f).transpose(0, 1).reshape(-1, f)
        return comm.reduce_scatter(y, self.grid, self.in_axis)

    def reduce_out_backward(self, g: torch.Tensor) -> torch.Tensor:
        if self.mode == "sharded":
            return g
        na, nb = self.grid.size(self.in_axis), self.grid.size(self.out_axis)
        if na == 1:
            return g
        f = g.shape[-1]
        g = comm.all_gather(g.contiguous(), self.grid, self.in_axis)
        return g.view(na, nb, -1, f).transpose(0, 1).reshape(-1, f)

    def full_weight(self) -> torch.Tensor:
        """Collective over the tensor-parallel group: the full [rows, cols] weight."""
        return self.layout.gather_full(self.weight, self.grid)

    @torch.no_grad()
    def load_full_weight(self, full: torch.Tensor) -> None:
        self.weight.copy_(self.layout.shard_of(full.to(self.weight.dtype), self.grid))


def whole_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T by F.linear, with MatmulFn's dtype rule outside autocast: the weight cast to the input's dtype."""
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        weight = weight.to(x.dtype)
    return F.linear(x, weight)


class MatmulFn(torch.autograd.Function):
    """y = x W^T over the layer's block (gathered over Z), reduced over its in-feature axis; see the module
    docstring for the collectives of each direction."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        if layer.mode == "easy":
            x = comm.all_gather(x, layer.grid, layer.out_axis)
        dtype = _autocast_dtype(x)
        x = x.to(dtype)
        w = layer.weight_for("fwd", dtype).to(dtype)
        y = layer.reduce_out(gemm_tuning.matmul(x, w.t(), "fwd", layer.grid))
        ctx.layer = layer
        ctx.save_for_backward(x, w if layer.grid.z == 1 else None)  # z > 1: gathered again (module docstring)
        return y

    @staticmethod
    def backward(ctx, g):
        layer = ctx.layer
        x, w = ctx.saved_tensors
        grid, b_axis = layer.grid, layer.out_axis
        dy = layer.reduce_out_backward(g.contiguous())
        if w is None:  # dy is in the forward's matmul dtype (autograd casts it to y's): backward runs outside autocast
            w = layer.weight_for("bwd", dy.dtype)
        st = overlap.state()
        oar = st is not None and st.all_reduce
        dx, work = None, None
        if ctx.needs_input_grad[0]:
            dx = gemm_tuning.matmul(dy, w.to(dy.dtype), "dgrad", grid)
            if layer.mode == "easy":
                if oar:
                    dx, work = comm.reduce_scatter(dx, grid, b_axis, async_op=True)
                else:
                    dx = comm.reduce_scatter(dx, grid, b_axis)
            else:
                work = comm.all_reduce(dx, grid, b_axis, async_op=oar)
        gw = None
        if ctx.needs_input_grad[1]:  # a frozen weight: no GEMM, no reduce-scatter, and no .grad deferred under ORS
            gw = layer.weight_grad(gemm_tuning.matmul(dy.t(), x, "wgrad", grid))
        if work is not None:
            work.wait()
        return dx, gw, None


def features_to_rows(x: torch.Tensor, grid: Grid, axis) -> torch.Tensor:
    """[rows, F] -> [p*rows, F/p]: member j receives every member's rows, feature slice j."""
    p = grid.size(axis)
    if p == 1:
        return x
    rows, f = x.shape
    t = x.reshape(rows, p, f // p).transpose(0, 1).reshape(p * rows, f // p)
    return comm.all_to_all(t, grid, axis)


def rows_to_features(y: torch.Tensor, grid: Grid, axis) -> torch.Tensor:
    """Inverse of features_to_rows: [p*rows, F] (chunk j belongs to member j) -> [rows, p*F]."""
    p = grid.size(axis)
    if p == 1:
        return y
    f = y.shape[-1]
    out = comm.all_to_all(y.contiguous(), grid, axis)
    return out.view(p, -1, f).transpose(0, 1).reshape(-1, p * f)


class FeaturesToRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, axis):
        ctx.grid, ctx.axis = grid, axis
        return features_to_rows(x, grid, axis)

    @staticmethod
    def backward(ctx, g):
        return rows_to_features(g, ctx.grid, ctx.axis), None, None


class RowsToFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, grid, axis):
        ctx.grid, ctx.axis = grid, axis
        return rows_to_features(y, grid, axis)

    @staticmethod
    def backward(ctx, g):
        return features_to_rows(g.contiguous(), ctx.grid, ctx.axis), None, None


class Linear(ShardedWeight):
    """y = x W^T + b with W sharded over the grid. See the module docstring for the two modes.

    `name` and `seed` define the initial weights (N(0, init_std^2)) independently of the grid.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, transpose: bool = False,
                 mode: str = "easy", grid: Grid | None = None, init_std: float = 0.02, seed: int = 0,
                 name: str = "linear", device=None, dtype=None):
        super().__init__()
        check_sizes(name, in_features=in_features, out_features=out_features)
        in_axis, out_axis = ("y", "x") if transpose else ("x", "y")
        self.in_features, self.out_features, self.transpose = in_features, out_features, transpose
        layout = BlockLayout(out_features, in_features, row_axis=out_axis, col_axis=in_axis)
        self._init_weight(layout, in_axis=in_axis, out_axis=out_axis, mode=mode, grid=grid, init_std=init_std,
                          seed=seed, name=name, device=device, dtype=dtype)
        if bias:
            nb = out_features // self.grid.size(out_axis)
            b = torch.zeros(nb, device=device, dtype=dtype or torch.float32)
            # Sharded mode: rows differ over (z, data) and dy is identical over A. Easy mode: after
            # the row reduce-scatter over A the rows differ over A as well.
            reduce = ("z", "data") if mode == "sharded" else (in_axis, "z", "data")
            self.bias = tag(nn.Parameter(b), (out_axis,), reduce)
        else:
            self.register_parameter("bias", None)

    @property
    def local_in_features(self) -> int:
        return self.in_features if self.mode == "easy" else self.in_features // self.grid.size(self.in_axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.local_in_features:
            raise ValueError(
                f"{self.name}: input has {x.shape[-1]} features, expected {self.local_in_features} "
                f"({self.mode} mode, in_features={self.in_features}, {self.in_axis}={self.grid.size(self.in_axis)})"
            )
        if self.torch_product(x.device):  # the bias added apart, as on a sharded grid
            y = whole_linear(x, self.weight.view(self.out_features, self.in_features))
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return self._grid_forward(x)

    # torch.compile cannot trace collectives that autograd Functions run in place, nor GEMMs timed in Python: a
    # model compiled around this layer runs it eagerly, a graph break on either side (0.3 us per call when eager).
    @comm.eager_under_compile
    def _grid_forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.mode == "easy":
            x2 = FeaturesToRows.apply(x2, self.grid, self.in_axis)
        y = MatmulFn.apply(x2, self.weight, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if self.mode == "easy":
            y = RowsToFeatures.apply(y, self.grid, self.out_axis)
        return y.view(*lead, y.shape[-1])

    def full_bias(self) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return comm.all_gather(self.bias.detach(), self.grid, self.out_axis)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if bias is not None and self.bias is None:
            raise ValueError(f"{self.name}: load_full got a bias for a layer built with bias=False: pass bias=None, "
                             f"or build it with bias=True")
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"{self.name}: load_full got a bias of shape {tuple(bias.shape)}: the full bias has "
                             f"shape ({self.out_features},), one value per out-feature")
        self.load_full_weight(weight)
        if bias is not None:
            nb = self.bias.numel()
            start = self.grid.coords[self.out_axis] * nb
            self.bias.copy_(bias[start:start + nb])

    def extra_repr(self) -> str:
        return (f"{self.in_features} -> {self.out_features}, mode={self.mode}, transpose={self.transpose}, "
                f"shard={tuple(self.weight.shape)}")
