"""Memorization evaluation: greedy extraction, exposure, membership inference, validation loss.

Models are transformers causal LMs, for decoding any "stepper" callable, or an `Evaluable` that runs decoding
and scoring itself (see eval.decode), so a sharded model is evaluated by the same code.
"""

from .decode import (
    Evaluable,
    HFStepper,
    SeqLogprobs,
    Stepper,
    greedy_decode,
    greedy_decode_batch,
    pad_left,
    sequence_logprobs,
)
from .exposure import ExposureResult, SlotSpace, exposure, secret_log_perplexities
from .extraction import Canary, ExtractionResult, as_canary, extraction_eval
from .metrics import (
    exact_match,
    lcs_length,
    longest_matching_prefix,
    match_metrics,
    rouge_l,
    rouge_l_batch,
    rouge_l_text,
    token_match_fraction,
)
from .mia import mia_eval, mia_scores, min_k_pp_score, min_k_score, roc_metrics
from .perplexity import validation_loss

__all__ = [
    "Canary", "Evaluable", "ExposureResult", "ExtractionResult", "HFStepper", "SeqLogprobs", "SlotSpace", "Stepper",
    "as_canary", "exact_match", "exposure", "extraction_eval", "greedy_decode", "greedy_decode_batch",
    "lcs_length", "longest_matching_prefix", "match_metrics", "mia_eval", "mia_scores", "min_k_pp_score",
    "min_k_score", "pad_left", "roc_metrics", "rouge_l", "rouge_l_batch", "rouge_l_text", "secret_log_perplexities",
    "sequence_logprobs", "token_match_fraction", "validation_loss",
]
