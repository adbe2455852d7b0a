"""Vocabulary-parallel embedding, LM head and cross-entropy.

The embedding table E [V, H] uses the same block as a normal Linear(H -> V): vocabulary rows over Y,
hidden columns over X, split over Z. So an LM head can share (tie) the embedding's parameter, and
neither the table nor the logits are ever whole on one rank: the loss reduces max, sum-exp and the
target logit over Y, never the [tokens, V] logits.

Layouts match the Linear's: the embedding acts like a transposed layer with the vocabulary as its
in-features (A = Y) and the hidden size as its out-features (B = X). Sharded mode returns
[rows, H/x] replicated over Y (the input of a normal layer); easy mode returns [rows, H].
"""

from __future__ import annotations

import torch

from . import comm
from .grid import Grid
from .linear import FeaturesToRows, RowsToFeatures, ShardedWeight, _MatmulFn
from .sharding import BlockLayout

IGNORE_INDEX = -100


class _EmbedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, layer):
        if layer.mode == "easy":
            ids = comm.all_gather(ids, layer.grid, layer.out_axis)
        w = layer.weight_for("fwd")
        n_local = w.shape[0]
        start = layer.grid.coord(layer.in_axis) * n_local
        local = ids - start
        hit = (local >= 0) & (local < n_local)
        local = torch.where(hit, local, torch.zeros_like(local))
        out = w[local] * hit.unsqueeze(-1).to(w.dtype)
        ctx.layer = layer
        ctx.save_for_backward(local, hit)
        return layer.reduce_out(out)

    @staticmethod
    def backward(ctx, g):
        layer = ctx.layer
        local, hit = ctx.saved_tensors
        dy = layer.reduce_out_backward(g.contiguous())
        grad = torch.zeros(layer.block_shape, dtype=dy.dtype, device=dy.device)
        grad.index_add_(0, local[hit], dy[hit])
        return None, layer.weight_grad(grad), None


class Embedding(ShardedWeight):
    """Token embedding with the table sharded over (Y: vocabulary, X: hidden, Z: flat)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mode: str = "easy", grid: Grid | None = None,
                 init_std: float = 0.02, seed: int = 0, name: str = "embedding", device=None, dtype=None,
                 cache_weights: bool = False):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        layout = BlockLayout(num_embeddings, embedding_dim, row_axis="y", col_axis="x")
        self._init_weight(layout, in_axis="y", out_axis="x", mode=mode, grid=grid, init_std=init_std, seed=seed,
                          name=name, device=device, dtype=dtype, cache_weights=cache_weights)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lead = ids.shape
        flat = ids.reshape(-1)
        if self.mode == "easy":
            flat = comm.all_gather(flat, self.grid, self.in_axis)
        out = _EmbedFn.apply(flat, self.weight, self)
        if self.mode == "easy":
            out = RowsToFeatures.apply(out, self.grid, self.out_axis)
        return out.view(*lead, out.shape[-1])

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        self.load_full_weight(weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode}, shard={tuple(self.weight.shape)}"


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from logits sharded over the vocabulary along `axis`."""

    @staticmethod
    def forward(ctx, logits, labels, grid, axis):
        logits = logits.float()
        n_local = logits.shape[-1]
        start = grid.coord(axis) * n_local
        m = logits.max(dim=-1).values
        comm.all_reduce(m, grid, axis, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        local = labels - start
        hit = (local >= 0) & (local < n_local)
        local = torch.where(hit, local, torch.zeros_like(local))
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * hit
        # In place from here (same values): two fewer [tokens, V] temporaries, each a fresh page-faulted
        # allocation on CPU (~25% of this loss's time at 2k tokens x 4k vocabulary).
        exp = shifted.exp_()
        sums = torch.stack([exp.sum(-1), target])
        comm.all_reduce(sums, grid, axis)
        valid = labels != IGNORE_INDEX
        loss = (sums[0].log() - sums[1]) * valid
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local, hit, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local, hit, valid = ctx.saved_tensors
        g = g * valid
        grad = softmax * g.unsqueeze(-1)
        grad.scatter_add_(-1, local.unsqueeze(-1), -(g * hit).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, grid: Grid, axis="y") -> torch.Tensor:
    """Per-token loss [N] (0 where labels == -100) from logits [N, V/|axis|] sharded over `axis`."""
    return _VocabParallelCE.apply(logits, labels, grid, axis)


class _TakeChunk(torch.autograd.Function):
    """Forward: keep this member's chunk of dim 0. Backward: all-gather the chunks' gradients."""

    @staticmethod
    def forward(ctx, t, grid, axis):
        ctx.grid, ctx.axis = grid, axis
        p = grid.size(axis)
        n = t.shape[0] // p
        i = grid.coord(axis)
        return t[i * n:(i + 1) * n].clone()

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g.contiguous(), ctx.grid, ctx.axis), None, None


class LMHead(ShardedWeight):
    """Output projection H -> V fused with the vocabulary-parallel loss; optionally tied to an Embedding.

    `loss(hidden, labels)` returns the per-token loss in the caller's own row layout: [rows] for easy
    mode (hidden [rows, H]), [rows] replicated over X and Y for sharded mode (hidden [rows, H/x]).
    """

    def __init__(self, hidden: int, vocab: int, *, tie_to: Embedding | None = None, mode: str = "easy",
                 grid: Grid | None = None, init_std: float = 0.02, seed: int = 0, name: str = "lm_head",
                 device=None, dtype=None, cache_weights: bool = False):
        super().__init__()
        self.hidden, self.vocab = hidden, vocab
        layout = BlockLayout(vocab, hidden, row_axis="y", col_axis="x")
        if tie_to is not None:
            if (tie_to.num_embeddings, tie_to.embedding_dim) != (vocab, hidden) or tie_to.mode != mode:
                raise ValueError(f"{name}: cannot tie to {tie_to.name}: shapes or modes differ")
            self.grid, self.layout, self.in_axis, self.out_axis = tie_to.grid, layout, "x", "y"
            self.mode, self.name, self.cache_weights = mode, name, cache_weights
            self.weight = tie_to.weight
        else:
            self._init_weight(layout, in_axis="x", out_axis="y", mode=mode, grid=grid, init_std=init_std,
                              seed=seed, name=name, device=device, dtype=dtype, cache_weights=cache_weights)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary-sharded logits [plane rows, V/y]; in easy mode rows are this X-column's plane rows."""
        h = hidden.reshape(-1, hidden.shape[-1])
        if self.mode == "easy":
            h = FeaturesToRows.apply(h, self.grid, self.in_axis)
        return _MatmulFn.apply(h, self.weight, self)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lead = labels.shape
        labels = labels.reshape(-1)
        logits = self.logits(hidden)
        if self.mode == "easy":
            labels = comm.all_gather(labels, self.grid, self.out_axis)
        loss = vocab_parallel_cross_entropy(logits, labels, self.grid, self.out_axis)
        if self.mode == "easy":
            loss = _TakeChunk.apply(loss, self.grid, self.out_axis)
        return loss.view(lead)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        self.load_full_weight(weight)
