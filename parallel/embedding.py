"""Vocabulary-parallel embedding, LM head and cross-entropy.

The embedding table E [V, H] uses the same block as a normal Linear(H -> V): vocabulary rows over Y,
hidden columns over X, split over Z. So an LM head can share (tie) the embedding's parameter, and
neither the table nor the logits are ever whole on one rank: the loss reduces max, sum-exp and the
target logit over Y, never the [tokens, V] logits.

Layouts match the Linear's: the embedding acts like a transposed layer with the vocabulary as its
in-features (A = Y) and the hidden size as its out-features (B = X). Sharded mode returns
[rows, H/x] replicated over Y (the input of a normal layer); easy mode returns [rows, H].

Vocabulary padding: a table whose vocabulary does not split over Y (and Z) is padded to `padded_vocab`
rows. Padded rows are zero and their logits are set to -1e30 before the softmax (`LMHead(valid=...)`),
so they take exactly zero probability and the loss equals the unpadded model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .grid import Grid
from .linear import FeaturesToRows, MatmulFn, RowsToFeatures, ShardedWeight, whole_linear
from .sharding import BlockLayout, check_sizes, tag

IGNORE_INDEX = -100


def check_in_range(ids: torch.Tensor, high: int, what: str, fix: str, ignored: int | None = None) -> None:
    """Refuse ids outside [0, high) but `ignored` (a label's IGNORE_INDEX), as torch's own lookup and loss do: a
    sharded table would embed an id no shard holds (or a padding row's) as zeros, and the vocabulary-parallel loss
    would score such a label as if its logit were 0, both silently. Asynchronous on a GPU, so it costs no host
    sync: there, as with torch's own lookup, it is a device-side assert (the message goes to the kernel's output and
    Python sees the assert at its next sync). A backstop for the engine's callers: memtrain checks that a tokenizer
    fits its model before training."""
    ok = (ids >= 0) & (ids < high)
    if ignored is not None:
        ok |= ids == ignored
    torch._assert_async(ok.all(), f"a {what} outside the model's vocabulary [0, {high}): {fix}")


class _EmbedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, layer):
        if layer.mode == "easy":
            ids = comm.all_gather(ids, layer.grid, layer.out_axis)
        # The lookup stays in the table's dtype under autocast (torch's embedding is no autocast op), so the
        # gather does too: a bf16 gather would round the output.
        w = layer.weight_for("fwd", layer.weight.dtype)
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


def padded_vocab(vocab: int, hidden: int, grid: Grid) -> int:
    """Smallest V' >= vocab whose [V', hidden] table splits into Y row blocks, each split over Z."""
    v = vocab
    while v % grid.y or (v // grid.y * (hidden // grid.x)) % grid.z:
        v += 1
    return v


class Embedding(ShardedWeight):
    """Token embedding with the table sharded over (Y: vocabulary, X: hidden, Z: flat).

    `padding_idx` has torch's meaning: that row gets no gradient from the lookup (a tied LM head still
    trains it, as in HF). `valid`: ids >= valid are vocabulary padding (see `padded_vocab`), refused as input.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx: int | None = None,
                 valid: int | None = None, mode: str = "easy", grid: Grid | None = None, init_std: float = 0.02,
                 seed: int = 0, name: str = "embedding", device=None, dtype=None):
        super().__init__()
        check_sizes(name, num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"{name}: padding_idx={padding_idx} is outside a table of {num_embeddings} rows: "
                                 f"use {-num_embeddings}..{num_embeddings - 1}, or None")
            # As torch's nn.Embedding: the sharded path compares ids with it, where -1 would match no token id
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.valid = num_embeddings if valid is None else valid
        layout = BlockLayout(num_embeddings, embedding_dim, row_axis="y", col_axis="x")
        self._init_weight(layout, in_axis="y", out_axis="x", mode=mode, grid=grid, init_std=init_std, seed=seed,
                          name=name, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.whole:  # torch's lookup: on a CPU its backward adds each row's gradients in _EmbedFn's order
            return F.embedding(ids, self.weight.view(self.num_embeddings, self.embedding_dim), self.padding_idx)
        lead = ids.shape
        flat = ids.reshape(-1)
        check_in_range(flat, self.valid, "token id", "use a tokenizer that fits the model")
        if self.mode == "easy":
            flat = comm.all_gather(flat, self.grid, self.in_axis)
        out = _EmbedFn.apply(flat, self.weight, self)
        if self.mode == "easy":
            out = RowsToFeatures.apply(out, self.grid, self.out_axis)
        out = out.view(*lead, out.shape[-1])
        if self.padding_idx is None:
            return out
        return torch.where((ids == self.padding_idx).unsqueeze(-1), out.detach(), out)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        self.load_full_weight(weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode}, shard={tuple(self.weight.shape)}"


class ColumnEmbedding(nn.Module):
    """A small table [rows, H] kept whole in rows and split over X in columns (GPT-2's learned positions):
    the lookup needs no communication, and its output is the [rows, H/x] residual slice of sharded mode."""

    def __init__(self, rows: int, hidden: int, grid: Grid, device=None, dtype=None):
        super().__init__()
        check_sizes("ColumnEmbedding", rows=rows, hidden=hidden)
        if hidden % grid.x:
            raise ValueError(f"ColumnEmbedding: hidden size {hidden} is not divisible by parallel.x={grid.x}: "
                             f"choose a degree that divides {hidden}")
        self.weight = tag(nn.Parameter(torch.empty(rows, hidden // grid.x, device=device, dtype=dtype)),
                          ("x",), ("z", "data"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from logits sharded over the vocabulary along `axis`."""

    @staticmethod
    def forward(ctx, logits, labels, grid, axis):
        if logits.dtype.itemsize > 4:
            logits = logits.float()
        n_local = logits.shape[-1]
        start = grid.coord(axis) * n_local
        # Narrower logits are read as they are, with no [tokens, V] fp32 copy first: their max is one of them,
        # exact in fp32, and `bf16 - fp32` computes in fp32 what the copy then the subtraction did, bit for bit.
        m = logits.max(dim=-1).values.float()
        comm.all_reduce(m, grid, axis, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        local = labels - start
        hit = (local >= 0) & (local < n_local)
        local = torch.where(hit, local, torch.zeros_like(local))
        # where, not a product with `hit`: a miss reads column 0, maybe -inf (a masked logit), and 0 * -inf is nan
        target = torch.where(hit, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
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
        grad = softmax.mul_(g.unsqueeze(-1))  # the saved softmax is used once: no second [tokens, V] buffer
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
    `valid`: rows >= valid are vocabulary padding (see `padded_vocab`) and can never win the softmax.
    `logits_fn`: an elementwise transform of the logits before the loss, argmax and log-probabilities (a model's
    logit scaling or soft-capping); elementwise, so each vocabulary shard applies it to its own logits.
    """

    def __init__(self, hidden: int, vocab: int, *, valid: int | None = None, tie_to: Embedding | None = None,
                 mode: str = "easy", grid: Grid | None = None, init_std: float = 0.02, seed: int = 0,
                 name: str = "lm_head", device=None, dtype=None):
        super().__init__()
        check_sizes(name, hidden=hidden, vocab=vocab)
        self.hidden, self.vocab, self.valid = hidden, vocab, vocab if valid is None else valid
        self.logits_fn = None
        layout = BlockLayout(vocab, hidden, row_axis="y", col_axis="x")
        if tie_to is not None:
            if (tie_to.num_embeddings, tie_to.embedding_dim) != (vocab, hidden) or tie_to.mode != mode:
                raise ValueError(f"{name}: cannot tie to {tie_to.name}: shapes or modes differ")
            self.grid, self.layout, self.in_axis, self.out_axis = tie_to.grid, layout, "x", "y"
            self.mode, self.name = mode, name
            self.weight = tie_to.weight
        else:
            self._init_weight(layout, in_axis="x", out_axis="y", mode=mode, grid=grid, init_std=init_std,
                              seed=seed, name=name, device=device, dtype=dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary-sharded logits [plane rows, V/y]; in easy mode rows are this X-column's plane rows."""
        h = hidden.reshape(-1, hidden.shape[-1])
        if self.torch_product(h.device):
            logits = whole_linear(h, self.weight.view(self.vocab, self.hidden))
        else:
            if self.mode == "easy":
                h = FeaturesToRows.apply(h, self.grid, self.in_axis)
            logits = MatmulFn.apply(h, self.weight, self)
        if self.logits_fn is not None:
            logits = self.logits_fn(logits)
        if self.valid < self.vocab:  # after logits_fn: a soft-cap would lift the -1e30 to -cap
            n = logits.shape[-1]
            start = self.grid.coord(self.out_axis) * n
            pad = torch.arange(start, start + n, device=logits.device) >= self.valid
            logits = logits.float().masked_fill(pad, -1e30)  # exp() underflows to exactly 0; stays finite
        return logits

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lead, logits, labels = self._logits_and_labels(hidden, labels)
        loss = vocab_parallel_cross_entropy(logits, labels, self.grid, self.out_axis)
        if self.mode == "easy":
            loss = _TakeChunk.apply(loss, self.grid, self.out_axis)
        return loss.view(lead)

    @torch.no_grad()
    def scores(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token loss and greedy (argmax) token, both in the caller's row layout like `loss`, from one
        logits computation (evaluation: no gradient)."""
        def both(logits, labels):
            return (vocab_parallel_cross_entropy(logits, labels, self.grid, self.out_axis),
                    vocab_parallel_argmax(logits, self.grid, self.out_axis, self.valid))

        return self._per_token(hidden, labels, both)

    @torch.no_grad()
    def log_probs(self, hidden: torch.Tensor, labels: torch.Tensor,
                  with_stats: bool = False) -> tuple[torch.Tensor, ...]:
        """`vocab_parallel_log_probs` of `hidden`'s logits, each output in the caller's row layout like `loss`
        (evaluation: no gradient)."""
        return self._per_token(hidden, labels, lambda logits, labels: vocab_parallel_log_probs(
            logits, labels, self.grid, self.out_axis, self.valid, with_stats))

    def _per_token(self, hidden: torch.Tensor, labels: torch.Tensor, fn) -> tuple[torch.Tensor, ...]:
        """fn(logits, labels) -> per-token tensors [N] of the logits' rows, returned in the caller's row layout."""
        lead, logits, labels = self._logits_and_labels(hidden, labels)
        out = fn(logits, labels)
        if self.mode == "easy":  # every Y member computed the whole column's rows: keep this rank's chunk
            n, i = labels.shape[0] // self.grid.size(self.out_axis), self.grid.coord(self.out_axis)
            out = tuple(t[i * n:(i + 1) * n] for t in out)
        return tuple(t.view(lead) for t in out)

    def _logits_and_labels(self, hidden: torch.Tensor, labels: torch.Tensor):
        """(labels' shape, this rank's logits, labels flat and range-checked: in easy mode gathered over Y, as the
        rows of the logits are)."""
        lead = labels.shape
        labels = labels.reshape(-1)
        check_in_range(labels, self.valid, "label", f"use labels below {self.valid} or {IGNORE_INDEX} (ignored)",
                       IGNORE_INDEX)
        logits = self.logits(hidden)
        if self.mode == "easy":
            labels = comm.all_gather(labels, self.grid, self.out_axis)
        return lead, logits, labels

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        self.load_full_weight(weight)


@torch.no_grad()
def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, grid: Grid, axis, valid: int | None = None,
                             with_stats: bool = False) -> tuple[torch.Tensor, ...]:
    """Natural-log p(label) [N] (0 where labels == -100) from logits [N, V/|axis|] split over `axis`; with_stats
    also the mean and standard deviation of log p(v) over the vocabulary under p [N] each (Min-K%++'s
    normalizers), as `eval.sequence_logprobs` computes them from whole logits.

    Columns >= `valid` are vocabulary padding: outside the softmax and the statistics. Collective over `axis`:
    three all-reduces of [N] or [2, N] (four with the statistics); the [N, V] logits never leave their member.
    """
    logits = logits.float()
    n_local = logits.shape[-1]
    start = grid.coord(axis) * n_local
    real = None
    if valid is not None and start + n_local > valid:
        real = torch.arange(start, start + n_local, device=logits.device) < valid
        logits = logits.masked_fill(~real, float("-inf"))
    m = logits.max(dim=-1).values
    comm.all_reduce(m, grid, axis, op=torch.distributed.ReduceOp.MAX)
    total = (logits - m.unsqueeze(-1)).exp().sum(-1)
    comm.all_reduce(total, grid, axis)
    logp = logits - (m + total.log()).unsqueeze(-1)  # -inf on padding
    local = labels - start
    hit = (local >= 0) & (local < n_local)
    target = logp.gather(-1, torch.where(hit, local, 0).unsqueeze(-1)).squeeze(-1)
    target = torch.where(hit, target, 0.0)  # a miss may have gathered padding's -inf: never multiply it
    if not with_stats:
        comm.all_reduce(target, grid, axis)
        return (target * (labels != IGNORE_INDEX),)
    p = logp.exp()

    def only_real(t):  # padding has p = 0 and log p = -inf: 0 * inf would be nan
        return t if real is None else torch.where(real, t, 0.0)

    sums = torch.stack([target, only_real(p * logp).sum(-1)])
    comm.all_reduce(sums, grid, axis)
    target, mean = sums[0], sums[1]
    var = only_real(p * (logp - mean.unsqueeze(-1)).square()).sum(-1)
    comm.all_reduce(var, grid, axis)
    return target * (labels != IGNORE_INDEX), mean, var.sqrt()


def vocab_parallel_argmax(logits: torch.Tensor, grid: Grid, axis, valid: int | None = None) -> torch.Tensor:
    """Global argmax [N] of logits [N, V/|axis|] split over `axis` (member j holds columns j*V/|axis|...).

    The twin of `vocab_parallel_cross_entropy` for greedy decoding. Columns >= `valid` (vocabulary padding)
    are never chosen; ties go to the lowest global index, as in `torch.argmax`. Collective over `axis`: one
    all-gather of N (value, index) pairs per member.
    """
    n_local = logits.shape[-1]
    start = grid.coord(axis) * n_local
    logits = logits.double()  # exact for float32/bf16 values, and for indices below 2**53
    if valid is not None and start + n_local > valid:
        pad = torch.arange(start, start + n_local, device=logits.device) >= valid
        logits = logits.masked_fill(pad, float("-inf"))
    value, index = logits.max(dim=-1)  # first maximal index on this member
    pairs = torch.stack([value, (index + start).double()])  # [2, N]
    pairs = comm.all_gather(pairs.unsqueeze(0), grid, axis)  # [members, 2, N], member order = index order
    best = pairs[:, 0].argmax(dim=0)  # first member holding the maximum = lowest global index
    return pairs[:, 1].gather(0, best.unsqueeze(0)).squeeze(0).long()
