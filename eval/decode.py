"""Batched greedy decoding with a KV cache, and teacher-forced per-token log-probs.

The decoder talks to the model through a *stepper*: a callable

    step(input_ids, attention_mask, position_ids, cache) -> (logits_last [B, V], cache)

called once for the prefill (the whole left-padded prefix) and then once per generated token. The
stepper owns the cache format, so a sharded model from `parallel/` only has to provide its own stepper;
the loop here never looks inside the cache. A stepper may also define `new_cache(batch_size, max_len)`
to hand the first call a pre-sized cache (otherwise the first call receives `cache=None`).

A model that must run these loops itself (a sharded model whose ranks act in lockstep, each decoding its
share of the rows) subclasses `Evaluable`; `greedy_decode`, `sequence_logprobs` and `continuation_logprobs`
(which it may leave to a default built on `sequence_logprobs`), and so every metric of this package, hand it the
whole request.

`HFStepper` adapts any transformers causal LM. Its output equals `model.generate(do_sample=False,
max_new_tokens=n)` token for token when generation does not stop early (no EOS stopping: memorization
checks always need all n tokens). It is faster than `generate` because:
  - the KV cache is preallocated to prefix + n tokens and filled in place; transformers' DynamicCache
    concatenates the whole cache every step, which on CPU costs more than the decode matmuls themselves;
  - no logits processors, stopping criteria or per-step kwargs bookkeeping;
  - only the last position's logits are computed (`logits_to_keep=1`), in prefill and every step.
The attention inputs are the same values and lengths as in `generate` (only strides differ), which is
why the tokens come out bit-identical rather than merely close.
"""

from __future__ import annotations

import abc
import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch

try:  # transformers >= 5 has per-layer cache objects we can replace with preallocated ones
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - older transformers: plain dynamic cache, still correct
    from transformers import DynamicCache

    DynamicLayer = None


class Stepper(Protocol):
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]: ...


if DynamicLayer is not None:

    class _PreallocatedLayer(DynamicLayer):
        """A DynamicLayer whose storage is allocated once at full length and written in place.

        `keys`/`values` are views of the filled part, so mask sizes and `get_seq_length` behave exactly
        as for DynamicLayer.
        """

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self._filled = 0

        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            b, h, _, dk = key_states.shape
            self._kbuf = key_states.new_empty(b, h, self.capacity, dk)
            hv, dv = value_states.shape[1], value_states.shape[-1]
            self._vbuf = value_states.new_empty(b, hv, self.capacity, dv)
            self._filled = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, end = self._filled, self._filled + key_states.shape[-2]
            if end > self.capacity:
                raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({end} tokens)")
            self._kbuf[:, :, start:end].copy_(key_states)
            self._vbuf[:, :, start:end].copy_(value_states)
            self._filled = end
            self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
            return self.keys, self.values


class Evaluable(abc.ABC):
    """A model that runs eval's two primitives itself, with their signatures and results; every metric here
    accepts one where it accepts a causal LM."""

    @abc.abstractmethod
    def greedy_decode(self, prefixes: Sequence[Sequence[int]], n_new: int, batch_size: int = 64,
                      pad_id: int = 0) -> torch.Tensor: ...

    @abc.abstractmethod
    def sequence_logprobs(self, token_lists: Sequence[Sequence[int]], batch_size: int = 32,
                          with_stats: bool = False, pad_id: int = 0) -> SeqLogprobs: ...

    def continuation_logprobs(self, context: Sequence[int], continuations: Sequence[Sequence[int]],
                              batch_size: int = 32, pad_id: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
        """`continuation_logprobs`; this default scores every context + continuation whole (no cache)."""
        return scored_whole(self.sequence_logprobs, context, continuations, batch_size, pad_id)


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def cache_name(model) -> str:
    """The keyword a transformers model takes its KV cache by, and the output field it returns it in: `cache` from
    transformers 5.24 on (where the old name still works but logs a deprecation warning into the output),
    `past_key_values` before."""
    return "cache" if _accepts(model.forward, "cache") else "past_key_values"


def stateful(model) -> bool:
    """Whether the model's cache holds recurrent states (transformers' `_is_stateful`: Mamba, Jamba, Falcon-H1,
    Zamba...), which one row's cache cannot share with a batch: their continuations are scored whole."""
    return bool(getattr(model, "_is_stateful", False))


class HFStepper:
    """Stepper for transformers causal LMs (Llama, GPT-NeoX, GPT-2, ... anything with a KV cache)."""

    def __init__(self, model: torch.nn.Module, preallocate: bool = True):
        self.model = model
        self.preallocate = preallocate and DynamicLayer is not None
        if _accepts(model.forward, "logits_to_keep"):
            self._keep = {"logits_to_keep": 1}
        elif _accepts(model.forward, "num_logits_to_keep"):  # transformers 4.45-4.49 spelling
            self._keep = {"num_logits_to_keep": 1}
        else:
            self._keep = {}
        self._cache = cache_name(model)
        self._steps_masked: bool | None = None  # step_mask's answer, once asked

    def new_cache(self, batch_size: int, max_len: int):
        config = self.model.config
        cache = DynamicCache(config=config)
        layers = getattr(cache, "layers", None)
        # Only plain full-attention layers are swapped; sliding-window and other special layers keep
        # transformers' own implementation (correct, just slower).
        if self.preallocate and layers is not None and all(type(x) is DynamicLayer for x in layers):
            n_layers = len(layers) or config.get_text_config().num_hidden_layers
            cache.layers = [_PreallocatedLayer(max_len) for _ in range(n_layers)]
            cache.layer_class_to_replicate = None
        return cache

    def __call__(self, input_ids, attention_mask, position_ids, cache):
        out = self.model(input_ids=input_ids, attention_mask=self.step_mask(input_ids, attention_mask, cache),
                         position_ids=position_ids, use_cache=True, **{self._cache: cache}, **self._keep)
        return out.logits[:, -1], out[self._cache]

    def step_mask(self, input_ids, attention_mask, cache):
        """The mask to pass: none on a cached step (a mask longer than the input) of a model whose generation takes
        none there, as `generate` asks each model (Mamba multiplies its input by the 2-D mask, and zeroed the
        padding into its state at the prefill already)."""
        if attention_mask is None or attention_mask.shape[1] == input_ids.shape[1]:
            return attention_mask
        if self._steps_masked is None:
            ids = input_ids.new_zeros(attention_mask.shape)
            width = ids.shape[1]  # what generate passes on a cached step, in the spellings of transformers 4 and 5
            step = {"is_first_iteration": False, "cache_position": torch.arange(width - 1, width, device=ids.device)}
            try:
                prepare = self.model.prepare_inputs_for_generation
                step = {k: v for k, v in step.items() if _accepts(prepare, k)}
                kept = prepare(ids, attention_mask=attention_mask, use_cache=True, **{self._cache: cache}, **step)
                self._steps_masked = kept.get("attention_mask") is not None
            except Exception:  # noqa: BLE001 - a model's own hook with other needs: keep the mask, as before
                self._steps_masked = True
        return attention_mask if self._steps_masked else None


def as_stepper(model_or_step) -> Stepper:
    """A torch module is wrapped in HFStepper; any other callable is taken to be a stepper already."""
    if isinstance(model_or_step, torch.nn.Module):
        return HFStepper(model_or_step)
    if callable(model_or_step):
        return model_or_step
    raise TypeError(f"expected a causal LM or a stepper callable, got {type(model_or_step).__name__}")


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (input_ids, attention_mask), both [B, max_len] int64."""
    if any(len(s) == 0 for s in seqs):
        raise ValueError("every prefix needs at least one token")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


@torch.inference_mode()
def greedy_decode_batch(step: Stepper, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                        n_new: int, padded: bool | None = None) -> torch.Tensor:
    """Greedy-decode `n_new` tokens for one left-padded batch; returns [B, n_new] int64.

    Position ids follow `generate`: the count of real tokens before each position, so a left-padded row
    sees the same positions as it would unpadded. A mask of all ones is dropped (as `generate` does) so the
    model can take its unmasked causal fast path. `padded` overrides that choice: ranks decoding their shares of
    one batch must all pass the mask or none (a model may take another path with one, with other collectives).
    """
    b, p = input_ids.shape
    device = input_ids.device
    if padded is None:
        padded = attention_mask is not None and not bool(attention_mask.all())
    if padded:
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        # One buffer for the whole run; each step sees a prefix of it instead of a fresh concatenation.
        full_mask = torch.ones((b, p + n_new), dtype=attention_mask.dtype, device=device)
        full_mask[:, :p] = attention_mask
        mask = full_mask[:, :p]
    else:
        position_ids = torch.arange(p, device=device).unsqueeze(0).expand(b, -1)
        full_mask = mask = None
    new_cache = getattr(step, "new_cache", None)
    cache = new_cache(b, p + n_new) if new_cache is not None else None
    out = torch.empty((b, n_new), dtype=torch.long, device=device)
    ids = input_ids
    for t in range(n_new):
        logits, cache = step(ids, mask, position_ids, cache)
        out[:, t] = logits.argmax(-1)
        if t + 1 == n_new:
            break  # the last token needs no forward pass of its own
        ids = out[:, t:t + 1]
        position_ids = position_ids[:, -1:] + 1
        if padded:
            mask = full_mask[:, :p + t + 1]
    return out


def _device_of(model_or_step) -> torch.device:
    """Where inputs go: the module's device, else the callable's `device` (or `model`) attribute, else CPU."""
    if isinstance(model_or_step, torch.nn.Module):
        return next(model_or_step.parameters()).device
    if getattr(model_or_step, "device", None) is not None:
        return torch.device(model_or_step.device)
    model = getattr(model_or_step, "model", None)
    return next(model.parameters()).device if isinstance(model, torch.nn.Module) else torch.device("cpu")


def greedy_decode(model_or_step, prefixes: Sequence[Sequence[int]], n_new: int, batch_size: int = 64,
                  pad_id: int = 0) -> torch.Tensor:
    """Greedy continuations of many prefixes; returns [len(prefixes), n_new] int64 on CPU, input order.

    Prefixes are grouped by length (stable sort) so batches carry little padding; equal-length inputs
    keep their order, so batches are exactly consecutive slices of the input.
    """
    if isinstance(model_or_step, Evaluable):
        return model_or_step.greedy_decode(prefixes, n_new, batch_size=batch_size, pad_id=pad_id)
    step = as_stepper(model_or_step)
    device = _device_of(model_or_step)
    order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))
    result = torch.empty((len(prefixes), n_new), dtype=torch.long)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        ids, mask = pad_left([prefixes[i] for i in idx], pad_id)
        gen = greedy_decode_batch(step, ids.to(device), mask.to(device), n_new)
        result[torch.as_tensor(idx)] = gen.cpu()
    return result


# ---------------------------------------------------------------------------------------------------
# Teacher-forced log-probs (MIA, exposure, validation loss)


@dataclass
class SeqLogprobs:
    """Per sequence of length L, arrays of length L-1 for tokens 1..L-1 (token 0 has no context).

    `logprobs` are natural-log probabilities of the true next tokens; `mean`/`std` (only when asked
    for) are the mean and standard deviation of log p(v) over the vocabulary v under the model's
    next-token distribution at that position, the normalizers of Min-K%++.
    """

    logprobs: list[np.ndarray]
    mean: list[np.ndarray] | None = None
    std: list[np.ndarray] | None = None


def as_logits_fn(model_or_fn) -> Callable[[torch.Tensor], torch.Tensor]:
    """input_ids [B, L] -> logits [B, L, V]. Causal attention without a mask: inputs are right-padded,
    so padding only ever follows the real tokens and cannot influence them."""
    if isinstance(model_or_fn, torch.nn.Module):
        model = model_or_fn
        return lambda ids: model(input_ids=ids, use_cache=False).logits
    if callable(model_or_fn):
        return model_or_fn
    raise TypeError(f"expected a causal LM or a logits callable, got {type(model_or_fn).__name__}")


@torch.inference_mode()
def sequence_logprobs(model_or_fn, token_lists: Sequence[Sequence[int]], batch_size: int = 32,
                      with_stats: bool = False, pad_id: int = 0) -> SeqLogprobs:
    """Teacher-forced log p(x_t | x_<t) for every sequence, batched by similar length.

    Memory per batch is a few [batch, max_len, vocab] float tensors; lower batch_size for big vocabularies.
    """
    if isinstance(model_or_fn, Evaluable):
        return model_or_fn.sequence_logprobs(token_lists, batch_size=batch_size, with_stats=with_stats,
                                             pad_id=pad_id)
    return _scored(as_logits_fn(model_or_fn), _device_of(model_or_fn), token_lists, batch_size, with_stats, pad_id)


def _scored(logits_fn, device, token_lists, batch_size, with_stats, pad_id) -> SeqLogprobs:
    n = len(token_lists)
    lps: list = [None] * n
    means: list | None = [None] * n if with_stats else None
    stds: list | None = [None] * n if with_stats else None
    order = sorted(range(n), key=lambda i: len(token_lists[i]))
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        lengths = [len(token_lists[i]) for i in idx]
        if min(lengths) < 1:
            raise ValueError("empty sequence")
        width = max(lengths)
        ids = torch.tensor([[*token_lists[i], *[pad_id] * (width - m)] for i, m in zip(idx, lengths)],
                           dtype=torch.long, device=device)
        logp = torch.log_softmax(logits_fn(ids)[:, :-1].float(), dim=-1)  # [B, L-1, V]
        target = logp.gather(-1, ids[:, 1:, None]).squeeze(-1).double().cpu().numpy()
        if with_stats:
            p = logp.exp()
            real = logp > float("-inf")  # a token the model rules out (-inf logit): p = 0, and 0 * inf is nan
            mu = torch.where(real, p * logp, 0.0).sum(-1)
            sigma = torch.where(real, p * (logp - mu[..., None]).square(), 0.0).sum(-1).sqrt()
            mu, sigma = mu.double().cpu().numpy(), sigma.double().cpu().numpy()
        for row, i in enumerate(idx):  # one copy to the host per batch, not per row
            k = lengths[row] - 1
            lps[i] = target[row, :k]
            if with_stats:
                means[i], stds[i] = mu[row, :k], sigma[row, :k]
    return SeqLogprobs(lps, means, stds)


@torch.inference_mode()
def continuation_logprobs(model_or_fn, context: Sequence[int], continuations: Sequence[Sequence[int]],
                          batch_size: int = 32, pad_id: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """Teacher-forced log-probs of many continuations of one context: (the context's own, for its tokens
    1.., as `sequence_logprobs` gives them; per continuation one per token, its first given the context).

    The numbers of `sequence_logprobs` on every context + continuation, within float rounding, for less work
    when the context is long (a template every candidate secret shares): the context runs once, in a batch
    of one, and its KV cache serves every batch of continuations, which compute only their own tokens. Each
    continuation row opens with the context's last token (kept out of the cache), which predicts the first
    token. A logits callable has no cache, and a stateful model's serves one row only: they score the whole
    sequences.
    """
    if len(context) == 0:
        raise ValueError("continuations need a non-empty context (their first token needs one)")
    if isinstance(model_or_fn, Evaluable):
        return model_or_fn.continuation_logprobs(context, continuations, batch_size=batch_size, pad_id=pad_id)
    if not isinstance(model_or_fn, torch.nn.Module) or stateful(model_or_fn):
        return scored_whole(partial(sequence_logprobs, model_or_fn), context, continuations, batch_size, pad_id)
    model, device, p = model_or_fn, _device_of(model_or_fn), len(context)
    past, context_lp, name = None, np.zeros(0), cache_name(model)
    if p > 1:
        ids = torch.as_tensor([list(context)], dtype=torch.long, device=device)
        out = model(input_ids=ids[:, :-1], use_cache=True)
        logp = torch.log_softmax(out.logits.float(), dim=-1)
        context_lp = logp.gather(-1, ids[:, 1:, None])[0, :, 0].double().cpu().numpy()
        past = out[name]

    def logits_fn(ids):  # a fresh copy of the context's cache per batch: the forward appends to it
        cache = copy.deepcopy(past)
        if cache is not None:
            cache.batch_repeat_interleave(ids.shape[0])
        pos = torch.arange(p - 1, p - 1 + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        return model(input_ids=ids, position_ids=pos, use_cache=cache is not None, **{name: cache}).logits

    rows = [i for i, c in enumerate(continuations) if len(c)]
    lps = _scored(logits_fn, device, [[context[-1], *continuations[i]] for i in rows], batch_size, False,
                  pad_id).logprobs
    out = [np.zeros(0) for _ in continuations]
    for i, lp in zip(rows, lps):
        out[i] = lp
    return context_lp, out


def scored_whole(logprobs_fn, context, continuations, batch_size, pad_id) -> tuple[np.ndarray, list[np.ndarray]]:
    """`continuation_logprobs` from `logprobs_fn` (a `sequence_logprobs`) of the whole sequences."""
    seqs = [[*context, *c] for c in continuations] or [list(context)]
    lps = logprobs_fn(seqs, batch_size=batch_size, pad_id=pad_id).logprobs
    k = len(context) - 1
    return lps[0][:k], [lp[k:] for lp in lps[:len(continuations)]]
