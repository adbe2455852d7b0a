"""Validation loss and perplexity on held-out token sequences.

Token-weighted: the loss is the total NLL over all predicted tokens divided by their count, so long and
short sequences weigh by their tokens (the usual LM validation loss), not one vote per sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .decode import sequence_logprobs


def validation_loss(model, sequences: Sequence[Sequence[int]], batch_size: int = 32) -> dict:
    """{"loss": mean NLL per predicted token (nats), "perplexity": exp(loss), "tokens": count}."""
    seqs = [s for s in sequences if len(s) >= 2]
    if not seqs:
        raise ValueError("no sequence has two or more tokens")
    lps = sequence_logprobs(model, seqs, batch_size=batch_size).logprobs
    total = -sum(float(lp.sum()) for lp in lps)
    count = sum(lp.size for lp in lps)
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "sequences": len(seqs)}
