"""`continuation_logprobs` (one context run once, its KV cache serving every batch of continuations) gives the
log-probs of `sequence_logprobs` on every whole context + continuation.

Within 1e-5 nats: the same fp32 forward, but the context's keys and values come from a batch of one and the
continuations from other batches and paddings, so the matmuls round differently (measured up to 2e-6). Checked
on Llama, GPT-NeoX and GPT-2 (each positions tokens its own way), with a one-token context (no cache), an empty
continuation, and batches smaller than the input (several batches of mixed lengths).
"""

import numpy as np
import pytest
import torch

from eval.decode import Evaluable, continuation_logprobs, sequence_logprobs
from tests.eval._models import VOCAB, tiny_model

TOL = 1e-5
LENGTHS = [3, 1, 0, 6, 2, 4, 4, 5]


def _case(seed=0, context_len=6):
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, VOCAB, (context_len,), generator=g).tolist()
    return context, [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _check(got, model, context, continuations):
    context_lp, lps = got
    whole = sequence_logprobs(model, [context + c for c in continuations], batch_size=3).logprobs
    k = len(context) - 1
    assert context_lp.shape == (k,)
    np.testing.assert_allclose(context_lp, whole[0][:k], rtol=0, atol=TOL)
    for lp, ref, c in zip(lps, whole, continuations):
        assert lp.shape == (len(c),)
        np.testing.assert_allclose(lp, ref[k:], rtol=0, atol=TOL)


@pytest.mark.parametrize("arch", ["llama", "neox", "gpt2"])
@pytest.mark.parametrize("context_len", [1, 6])
def test_cached_context_equals_whole_sequences(arch, context_len):
    model = tiny_model(arch, seed=4)
    context, continuations = _case(context_len=context_len)
    _check(continuation_logprobs(model, context, continuations, batch_size=3), model, context, continuations)


def test_logits_callables_and_evaluables_score_whole_sequences():
    model = tiny_model("llama", seed=5)
    context, continuations = _case(seed=1)

    class Plain(Evaluable):  # only the two primitives: continuations come from the default
        def greedy_decode(self, *a, **k):
            raise NotImplementedError

        def sequence_logprobs(self, token_lists, batch_size=32, with_stats=False, pad_id=0):
            return sequence_logprobs(model, token_lists, batch_size, with_stats, pad_id)

    for m in (Plain(), lambda ids: model(input_ids=ids).logits):
        _check(continuation_logprobs(m, context, continuations, batch_size=3), model, context, continuations)
    context_lp, lps = continuation_logprobs(model, context, [])
    assert lps == [] and context_lp.shape == (len(context) - 1,)
    with pytest.raises(ValueError, match="non-empty context"):
        continuation_logprobs(model, [], continuations)
