"""Membership-inference scores and their ROC summaries.

Every score is oriented so that HIGHER means "more likely a member" (trained on):
  - loss:      -mean NLL of the sequence (Yeom et al.);
  - zlib:      -(mean NLL / zlib-compressed length of the text in bytes): loss normalised by how
               compressible the text is, so repetitive-but-unseen text is not flagged (Carlini et al. 2021;
               the Goldfish code's form);
  - min_k:     mean of the lowest k% token log-probs (Shi et al., k = 20%);
  - min_k_pp:  mean of the lowest k% of z_t = (log p(x_t) - mu_t) / sigma_t, where mu_t and sigma_t are the
               mean and std of log p(v) under the model's next-token distribution (Zhang et al., Min-K%++);
  - ref:       loss_reference - loss_target, when a reference model is given (a member's loss drops
               more under the fine-tuned model than under the reference).
Lowest-k% uses max(1, floor(k * T)) of the T scored tokens, as in the Min-K% reference code except that a
short sequence still gets one token instead of an empty mean.

For canaries, members are the inserted canaries and non-members their held-out twins. ROC-AUC and TPR at
1% and 0.1% FPR come from scikit-learn; TPR at FPR x is the best TPR among thresholds whose FPR <= x
(with fewer than 1/x non-members that means FPR = 0).
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from .decode import sequence_logprobs
from .extraction import as_canary


def lowest_k_mean(values: np.ndarray, k: float = 0.2) -> float:
    """Mean of the lowest max(1, floor(k * len)) values."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if v.size == 0:
        return float("nan")
    return float(v[:max(1, int(k * v.size))].mean())


def min_k_score(logprobs: np.ndarray, k: float = 0.2) -> float:
    """Min-K% Prob: the mean of the lowest k% token log-probs."""
    return lowest_k_mean(logprobs, k)


def min_k_pp_score(logprobs: np.ndarray, mean: np.ndarray, std: np.ndarray, k: float = 0.2) -> float:
    """Min-K%++: the mean of the lowest k% standardized token log-probs."""
    z = (np.asarray(logprobs) - np.asarray(mean)) / np.maximum(np.asarray(std), 1e-12)
    return lowest_k_mean(z, k)


def zlib_length(text: str | bytes) -> int:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return len(zlib.compress(data))


def _text_of(tokens: Sequence[int]) -> str:
    # Without the rendered text, the ids written out stand in for it: zlib still measures repetitiveness.
    return " ".join(map(str, tokens))


def mia_scores(model, sequences: Sequence[Sequence[int]], *, texts: Sequence[str | None] | None = None,
               ref_model=None, k: float = 0.2, batch_size: int = 32) -> dict[str, np.ndarray]:
    """Per-sequence attack scores (higher = more likely member): loss, zlib, min_k, min_k_pp [, ref]."""
    out = sequence_logprobs(model, sequences, batch_size=batch_size, with_stats=True)
    loss = np.array([-lp.mean() for lp in out.logprobs])
    if texts is None:
        texts = [None] * len(sequences)
    zlen = np.array([zlib_length(t if t is not None else _text_of(s)) for t, s in zip(texts, sequences)])
    scores = {
        "loss": -loss,
        "zlib": -loss / zlen,
        "min_k": np.array([min_k_score(lp, k) for lp in out.logprobs]),
        "min_k_pp": np.array([min_k_pp_score(lp, mu, sd, k)
                              for lp, mu, sd in zip(out.logprobs, out.mean, out.std)]),
    }
    if ref_model is not None:
        ref = sequence_logprobs(ref_model, sequences, batch_size=batch_size).logprobs
        scores["ref"] = np.array([-lp.mean() for lp in ref]) - loss
    return scores


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    ok = fpr <= target
    return float(tpr[ok].max()) if ok.any() else 0.0


def roc_metrics(member_scores, nonmember_scores) -> dict:
    """ROC-AUC and TPR at 1% / 0.1% FPR for members (label 1) vs non-members (label 0)."""
    m = np.asarray(member_scores, dtype=np.float64)
    n = np.asarray(nonmember_scores, dtype=np.float64)
    if m.size == 0 or n.size == 0:
        return {"auc": None, "tpr_at_1pct_fpr": None, "tpr_at_0.1pct_fpr": None,
                "n_members": int(m.size), "n_nonmembers": int(n.size)}
    # Imported here, not at the top: scikit-learn (with the scipy and pandas it loads) adds ~0.5 s to the start of
    # every process that imports the eval package, including training runs that never score.
    from sklearn.metrics import roc_auc_score, roc_curve

    y = np.r_[np.ones(m.size), np.zeros(n.size)]
    s = np.r_[m, n]
    # Every threshold: scikit-learn's default drops corners that lie on a line between others, and a corner below a
    # target FPR can be the best TPR there (members tied with non-members make such lines).
    fpr, tpr, _ = roc_curve(y, s, drop_intermediate=False)
    return {"auc": float(roc_auc_score(y, s)), "tpr_at_1pct_fpr": tpr_at_fpr(fpr, tpr, 0.01),
            "tpr_at_0.1pct_fpr": tpr_at_fpr(fpr, tpr, 0.001), "n_members": int(m.size),
            "n_nonmembers": int(n.size)}


def mia_eval(model, canaries: Iterable, *, ref_model=None, k: float = 0.2, batch_size: int = 32) -> dict:
    """Score inserted canaries (members) against their held-out twins (non-members).

    Returns {"rows": per-canary scores, "metrics": {attack: roc_metrics},
             "by_copies": {copies: {attack: roc_metrics of members with that many copies vs all twins}}}.
    """
    canaries = [as_canary(c, i) for i, c in enumerate(canaries)]
    usable = [c for c in canaries if len(c.tokens) >= 2]  # one scored token at least
    scores = mia_scores(model, [c.tokens for c in usable], texts=[c.text for c in usable],
                        ref_model=ref_model, k=k, batch_size=batch_size)
    member = np.array([c.inserted for c in usable], dtype=bool)
    rows = [{"id": c.id, "kind": c.kind, "copies": c.copies, "inserted": c.inserted,
             **{name: float(v[i]) for name, v in scores.items()}} for i, c in enumerate(usable)]
    metrics = {name: roc_metrics(v[member], v[~member]) for name, v in scores.items()}
    groups = defaultdict(list)
    for i, c in enumerate(usable):
        if c.inserted:
            groups[c.copies].append(i)
    by_copies = {cp: {name: roc_metrics(v[idx], v[~member]) for name, v in scores.items()}
                 for cp, idx in sorted(groups.items())}
    return {"rows": rows, "metrics": metrics, "by_copies": by_copies,
            "skipped": len(canaries) - len(usable)}
