"""Evaluation on the grid: batched greedy decoding with a KV cache and teacher-forced scoring of a parallelized
model (any grid, sharded and easy mode).

    tokens = parallel_greedy_decode(plm, prefixes, n_new=50, batch_size=16)   # [N, n_new], every rank

Every rank passes the same prefixes. They are sorted by length (as `eval.greedy_decode` does), cut into
global batches of `batch_size` rows per rank, left-padded to the batch's longest prefix, and split over
the data-parallel rows like training batches (`plm.local_rows`: over (z, data) in sharded mode, over all
ranks in easy mode). Each local batch is decoded by eval's own loop (`eval.decode.greedy_decode_batch`,
the positions and masks of `generate`) through a `ParallelStepper`, and the tokens are all-gathered back
into input order on every rank.

Lockstep: the engine's layers issue collectives in every forward (weight all-gathers over Z, reductions
over X and Y, and in easy mode row exchanges over the plane), so every rank must run the same number of
forward passes with the same shapes. Hence every global batch has the same width on every rank, and its
row count is rounded up to a multiple of the row groups with dummy rows (copies of a real prefix whose
tokens are dropped).

`parallel_sequence_logprobs` is `eval.sequence_logprobs` on the grid (vocabulary-parallel softmax statistics),
`parallel_continuation_logprobs` is `eval.continuation_logprobs` (one context's KV cache serving every batch),
and `GridModel` hands them to eval's metrics, so extraction, exposure and MIA run unchanged on a sharded model.

Vocabulary-parallel argmax (`parallel.vocab_parallel_argmax`): the LM head's logits stay split over its
vocabulary axis (Y); one all-gather of each member's (max, first index) over Y picks the winner, ties going
to the lowest index as in `torch.argmax`. The HF modules inside the ParallelLM handle the KV cache,
attention masks and position ids themselves; the KV cache holds this rank's heads only (sharded mode) or all
heads (easy).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from eval.decode import (
    Evaluable,
    HFStepper,
    SeqLogprobs,
    cache_name,
    greedy_decode_batch,
    pad_left,
    scored_whole,
    stateful,
)
from parallel import IGNORE_INDEX, comm, vocab_parallel_argmax


class ShardedLogits:
    """The last position's logits, split over the LM head's vocabulary axis; never whole on one rank.

    Stands in for the [B, V] tensor a stepper returns: `argmax(-1)` (all `greedy_decode_batch` asks of
    it) is the vocabulary-parallel argmax, a collective over the vocabulary axis.
    `local`: sharded mode [B, V/y] (this rank's rows); easy mode [y*B, V/y] (the rows of the Y members
    sharing this rank's X column, member j's rows at chunk j, as `LMHead.logits` returns them).
    """

    def __init__(self, local: torch.Tensor, head, rows: int):
        self.local, self.head, self.rows = local, head, rows

    def argmax(self, dim: int = -1) -> torch.Tensor:
        if dim not in (-1, 1):
            raise ValueError("sharded logits only support argmax over the vocabulary (dim=-1)")
        head = self.head
        tokens = vocab_parallel_argmax(self.local, head.grid, head.out_axis, head.valid)
        if head.mode == "easy":  # every Y member got the whole column's rows: keep this rank's chunk
            i = head.grid.coord(head.out_axis)
            tokens = tokens[i * self.rows:(i + 1) * self.rows]
        return tokens


class ParallelStepper(HFStepper):
    """`eval.decode` stepper for a ParallelLM: returns `ShardedLogits` of the last position.

    Collective: every rank of the grid must call it in lockstep with same-shaped inputs (easy mode), or
    at least the same number of times (sharded mode: ranks of one X x Y plane share rows). Usable with
    `eval.greedy_decode` / `extraction_eval` directly when every rank passes the same prefixes (each
    rank then decodes all of them); `parallel_greedy_decode` splits the rows over data parallelism.
    """

    def __init__(self, plm):
        super().__init__(plm.model)  # new_cache: eval's preallocated KV cache, sized by the local heads
        self.plm = plm

    def __call__(self, input_ids, attention_mask, position_ids, cache):
        out = self.plm.model.base_model(input_ids=input_ids,
                                        attention_mask=self.step_mask(input_ids, attention_mask, cache),
                                        position_ids=position_ids, use_cache=True, **{self._cache: cache})
        hidden = out[0][:, -1]  # [B, H/x] (sharded) or [B, H] (easy)
        return ShardedLogits(self.plm.head.logits(hidden), self.plm.head, input_ids.shape[0]), out[self._cache]


@contextmanager
def _eval_mode(module):
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


def _row_batches(plm, seqs: Sequence[Sequence[int]], batch_size: int):
    """Global batches of `batch_size` rows per row group, shortest sequences first: (their input indices, the
    sequences plus dummies, copies of the first, up to a multiple of the row groups so every group gets the
    same count)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: use at least one row per rank")
    groups = plm.grid.size(plm.row_axes)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for start in range(0, len(order), batch_size * groups):
        idx = order[start:start + batch_size * groups]
        rows = -(-len(idx) // groups) * groups
        yield idx, [seqs[i] for i in idx] + [seqs[idx[0]]] * (rows - len(idx))


@torch.inference_mode()
def parallel_greedy_decode(plm, prefixes: Sequence[Sequence[int]], n_new: int, batch_size: int = 64,
                           pad_id: int = 0) -> torch.Tensor:
    """Greedy continuations [len(prefixes), n_new] int64 on CPU, input order, on every rank.

    Collective over the whole grid; every rank passes the same prefixes. `batch_size`: rows per rank per
    forward pass (a global batch is batch_size times the number of row groups). Equals
    `model.generate(do_sample=False, max_new_tokens=n_new)` token for token up to ties within rounding
    (no EOS stopping). The model runs in eval mode (dropout off) and is put back as it was.
    """
    if n_new < 1:
        raise ValueError(f"n_new={n_new}: decode at least one token")
    device = next(plm.parameters()).device
    step = ParallelStepper(plm)
    result = torch.empty((len(prefixes), n_new), dtype=torch.long)
    with _eval_mode(plm):
        for idx, seqs in _row_batches(plm, prefixes, batch_size):
            ids, mask = pad_left(seqs, pad_id)
            local = plm.local_rows(len(seqs))
            padded = not bool(mask.all())  # the whole batch's: every rank passes its mask, or none does
            gen = greedy_decode_batch(step, ids[local].to(device), mask[local].to(device), n_new, padded)
            gen = comm.all_gather(gen.contiguous(), plm.grid, plm.row_axes)  # [rows, n_new] in row order
            result[torch.as_tensor(idx)] = gen[:len(idx)].cpu()
    return result


def _teacher_batches(plm, sequences: Sequence[Sequence[int]], batch_size: int, pad_id: int):
    """Right-padded global batches: (input indices, this rank's ids and labels [b, width] on the model's device,
    a gather of [b, k, width] rows of per-token results back into [rows, k, width] in batch order)."""
    device = next(plm.parameters()).device
    for idx, seqs in _row_batches(plm, sequences, batch_size):
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
        for r, seq in enumerate(seqs):  # right-padded: causal attention never lets padding reach a token
            ids[r, :len(seq)] = torch.as_tensor(list(seq))
            labels[r, :len(seq) - 1] = ids[r, 1:len(seq)]
        local = plm.local_rows(len(seqs))

        def gather(rows: torch.Tensor) -> np.ndarray:
            return comm.all_gather(rows.contiguous(), plm.grid, plm.row_axes).cpu().numpy()

        yield idx, ids[local].to(device), labels[local].to(device), gather


@torch.inference_mode()
def teacher_forced(plm, sequences: Sequence[Sequence[int]], batch_size: int = 64,
                   pad_id: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Teacher-forced scores of every sequence, in input order, on every rank: for tokens 1..L-1 of each, its
    natural-log loss and whether it is the model's greedy choice given the true tokens before it.

    Collective over the whole grid; every rank passes the same sequences. Greedy decoding reproduces a suffix
    exactly when every token of it is the greedy choice here (decoding feeds back its own tokens, which are
    the true ones as long as none was wrong), so exact match takes one forward pass instead of one per token.
    """
    out: list = [None] * len(sequences)
    with _eval_mode(plm):
        for idx, ids, labels, gather in _teacher_batches(plm, sequences, batch_size, pad_id):
            loss, top = plm.token_scores(ids, labels)
            both = gather(torch.stack([loss.double(), (top == labels).double()], dim=1))  # [rows, 2, width]
            for r, i in enumerate(idx):
                n = len(sequences[i]) - 1
                out[i] = (both[r, 0, :n], both[r, 1, :n].astype(bool))
    return out


@torch.inference_mode()
def parallel_sequence_logprobs(plm, token_lists: Sequence[Sequence[int]], batch_size: int = 32,
                               with_stats: bool = False, pad_id: int = 0) -> SeqLogprobs:
    """`eval.sequence_logprobs` on the grid: the same arrays, in input order, on every rank.

    Collective over the whole grid; every rank passes the same sequences. `batch_size`: rows per rank. The
    softmax and its statistics are computed where the logits are, split over the vocabulary
    (`parallel.vocab_parallel_log_probs`); only [rows, width] results are gathered.
    """
    if any(len(s) < 1 for s in token_lists):
        raise ValueError("empty sequence")
    n = len(token_lists)
    lps, means, stds = [None] * n, [None] * n if with_stats else None, [None] * n if with_stats else None
    with _eval_mode(plm):
        for idx, ids, labels, gather in _teacher_batches(plm, token_lists, batch_size, pad_id):
            rows = gather(torch.stack(plm.token_log_probs(ids, labels, with_stats), dim=1).double())
            for r, i in enumerate(idx):
                k = len(token_lists[i]) - 1
                lps[i] = rows[r, 0, :k]
                if with_stats:
                    means[i], stds[i] = rows[r, 1, :k], rows[r, 2, :k]
    return SeqLogprobs(lps, means, stds)


@torch.inference_mode()
def parallel_continuation_logprobs(plm, context: Sequence[int], continuations: Sequence[Sequence[int]],
                                   batch_size: int = 32, pad_id: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """`eval.continuation_logprobs` on the grid: the same arrays, in input order, on every rank.

    Collective over the whole grid; every rank passes the same context and continuations. Every rank runs the
    context (but its last token) as its one row, so each holds the cache of its own heads (sharded) or of the
    whole model (easy), and copies it to the rows of each batch (`batch_size` per rank, as
    `parallel_sequence_logprobs`); the rows are [last context token, *continuation], placed after the cache.
    """
    if len(context) == 0:
        raise ValueError("continuations need a non-empty context (their first token needs one)")
    if stateful(plm.model):
        return scored_whole(partial(parallel_sequence_logprobs, plm), context, continuations, batch_size, pad_id)
    device, last, name = next(plm.parameters()).device, len(context) - 1, cache_name(plm.model.base_model)

    def log_probs(ids, labels, past, start):  # -> (log p(labels) [b, width], the cache after ids)
        pos = torch.arange(start, start + ids.shape[1], device=device).expand(ids.shape[0], -1)
        out = plm.model.base_model(input_ids=ids, position_ids=pos, use_cache=True, **{name: past})
        return plm.head.log_probs(out[0], labels)[0], out[name]

    past, context_lp = None, np.zeros(0)
    rows = [i for i, c in enumerate(continuations) if len(c)]
    out = [np.zeros(0) for _ in continuations]
    with _eval_mode(plm):
        if last:
            ids = torch.as_tensor([list(context)], dtype=torch.long, device=device)
            lp, past = log_probs(ids[:, :-1], ids[:, 1:], None, 0)
            context_lp = lp[0].double().cpu().numpy()
        seqs = [[context[-1], *continuations[i]] for i in rows]
        for idx, ids, labels, gather in _teacher_batches(plm, seqs, batch_size, pad_id):
            cache = copy.deepcopy(past)  # a fresh copy per batch: the forward appends to it
            if cache is not None:
                cache.batch_repeat_interleave(ids.shape[0])
            lp = gather(log_probs(ids, labels, cache, last)[0].double()[:, None])  # [rows, 1, width]
            for r, i in enumerate(idx):
                out[rows[i]] = lp[r, 0, :len(seqs[i]) - 1]
    return context_lp, out


class GridModel(Evaluable):
    """A ParallelLM as `eval` sees a model: every metric of `eval` (extraction, exposure, MIA, validation loss)
    runs on the grid through it, each rank decoding and scoring its share of the rows.

    Collective: every rank calls every metric with the same arguments and gets the whole result.
    """

    def __init__(self, plm):
        self.plm = plm

    def greedy_decode(self, prefixes, n_new, batch_size=64, pad_id=0):
        return parallel_greedy_decode(self.plm, prefixes, n_new, batch_size=batch_size, pad_id=pad_id)

    def sequence_logprobs(self, token_lists, batch_size=32, with_stats=False, pad_id=0):
        return parallel_sequence_logprobs(self.plm, token_lists, batch_size, with_stats, pad_id)

    def continuation_logprobs(self, context, continuations, batch_size=32, pad_id=0):
        return parallel_continuation_logprobs(self.plm, context, continuations, batch_size, pad_id)


__all__ = ["GridModel", "ParallelStepper", "ShardedLogits", "parallel_continuation_logprobs", "parallel_greedy_decode",
           "parallel_sequence_logprobs", "teacher_forced"]
