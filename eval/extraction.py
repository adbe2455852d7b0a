"""Extraction of canaries by greedy decoding (discoverable memorization).

Two protocols on the same canaries:
  - suffix protocol (Carlini et al. 2023, Goldfish): prefix = all but the last n tokens (n = 50),
    greedy-decode n tokens, compare with the true suffix: exact match, token-match fraction, longest
    correct prefix, ROUGE-L F1;
  - Pythia protocol (Biderman et al. 2023): first 32 tokens in, 32 out; score = fraction matched,
    memorized iff the score is 1.0.
A canary too short for a protocol is skipped for that protocol and counted, never an error: canary sets
mix lengths (natural documents) and one short item must not sink a whole evaluation.

Canaries are read by duck typing (`as_canary`) so this module does not depend on how memtrain.data
stores them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .decode import greedy_decode
from .metrics import match_metrics


@dataclass
class Canary:
    """The evaluation's view of a canary: its tokens and the metadata results are grouped by."""

    tokens: list[int]
    id: Any = None
    kind: str = "random"
    copies: int = 0
    inserted: bool = True  # False for a held-out twin (never trained on)
    text: str | None = None  # the rendered text, when known (zlib MIA score)
    prefix_len: int | None = None  # the prompt's length when the canary fixes its own split (else suffix_len)


_TOKEN_KEYS = ("tokens", "token_ids", "input_ids", "ids")
_TWIN_ROLES = {"twin", "heldout", "held_out", "holdout", "nonmember", "non_member"}


def _get(obj, key, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def as_canary(obj, index: int = 0) -> Canary:
    """Read a canary from a Canary, dict or object with: tokens (or token_ids / input_ids / ids), id,
    kind, copies, and membership as `inserted` (bool) or `role`/`split` ('inserted' vs 'twin'/'heldout').
    A bare token list (or 1-D tensor/array) is an inserted canary with default metadata."""
    if isinstance(obj, Canary):
        return obj
    if hasattr(obj, "tolist") and not isinstance(obj, dict):
        obj = obj.tolist()
    if isinstance(obj, (list, tuple)):
        return Canary(tokens=[int(t) for t in obj], id=index)
    tokens = next((_get(obj, k) for k in _TOKEN_KEYS if _get(obj, k) is not None), None)
    if tokens is None:
        raise ValueError(f"canary {index} has no tokens (looked for {', '.join(_TOKEN_KEYS)})")
    tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    inserted = _get(obj, "inserted")
    if inserted is None:
        role = _get(obj, "role", _get(obj, "split"))
        inserted = role is None or str(role).lower() not in _TWIN_ROLES
    return Canary(tokens=[int(t) for t in tokens], id=_get(obj, "id", _get(obj, "canary_id", index)),
                  kind=str(_get(obj, "kind", "random")), copies=int(_get(obj, "copies", 0) or 0),
                  inserted=bool(inserted), text=_get(obj, "text"), prefix_len=_get(obj, "prefix_len"))


@dataclass
class ExtractionResult:
    rows: list[dict]  # one per canary, input order; protocol fields are None where it was skipped
    aggregates: dict  # {"overall": ..., "by_copies": {c: ...}, "by_membership": {"inserted"|"twin": ...}}
    skipped: dict = field(default_factory=dict)  # {"suffix": count, "pythia": count}


def _decode_protocol(model, canaries: Sequence[Canary], split_of, batch_size: int) -> dict[int, tuple]:
    """Decode each usable canary's suffix from its prefix; {index: (generated ids, {metric: value})}.
    `split_of(c) -> (prefix length, suffix length)`; canaries are decoded in groups of one suffix length."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, c in enumerate(canaries):
        p, n = split_of(c)
        if p >= 1 and n >= 1 and p + n <= len(c.tokens):
            groups[n].append(i)
    out = {}
    for n, idx in sorted(groups.items()):
        prefixes = [canaries[i].tokens[:split_of(canaries[i])[0]] for i in idx]
        truth = np.asarray([canaries[i].tokens[len(pre):len(pre) + n] for i, pre in zip(idx, prefixes)],
                           dtype=np.int64)
        generated = greedy_decode(model, prefixes, n, batch_size=batch_size).numpy()
        m = match_metrics(generated, truth)
        for j, i in enumerate(idx):
            out[i] = (generated[j].tolist(), {k: v[j] for k, v in m.items()})
    return out


def extraction_eval(model, canaries: Iterable, suffix_len: int = 50, batch_size: int = 64,
                    pythia: bool = True, pythia_len: int = 32) -> ExtractionResult:
    """Run the suffix protocol (and the Pythia 32/32 protocol unless pythia=False) on every canary.

    `model` is a transformers causal LM or a decode stepper (see eval.decode). The suffix protocol asks for the
    last `suffix_len` tokens (needs len >= suffix_len + 1), or for a canary with its own `prefix_len` for
    everything after it; the Pythia protocol needs len >= 2 * pythia_len.
    """
    canaries = [as_canary(c, i) for i, c in enumerate(canaries)]
    rows = [{"id": c.id, "kind": c.kind, "copies": c.copies, "inserted": c.inserted, "length": len(c.tokens),
             "suffix_len": None, "exact_match": None, "token_match": None, "longest_prefix": None, "rouge_l": None,
             "generated": None, "pythia_score": None, "pythia_memorized": None, "pythia_generated": None}
            for c in canaries]

    def split(c):
        p = c.prefix_len if c.prefix_len is not None else len(c.tokens) - suffix_len
        return p, len(c.tokens) - p

    done = _decode_protocol(model, canaries, split, batch_size)
    for i, (gen, m) in done.items():
        rows[i].update(suffix_len=len(gen), exact_match=bool(m["exact_match"]), token_match=float(m["token_match"]),
                       longest_prefix=int(m["longest_prefix"]), rouge_l=float(m["rouge_l"]), generated=gen)
    skipped = {"suffix": len(canaries) - len(done)}

    if pythia:
        done = _decode_protocol(model, canaries, lambda c: (pythia_len, pythia_len), batch_size)
        for i, (gen, m) in done.items():
            rows[i].update(pythia_score=float(m["token_match"]), pythia_memorized=bool(m["exact_match"]),
                           pythia_generated=gen)
        skipped["pythia"] = len(canaries) - len(done)

    return ExtractionResult(rows=rows, aggregates=aggregate(rows, skipped), skipped=skipped)


def _summary(rows: list[dict]) -> dict:
    done = [r for r in rows if r["exact_match"] is not None]
    py = [r for r in rows if r["pythia_score"] is not None]

    def mean(values):
        return float(np.mean(values)) if values else None

    return {
        "n": len(rows),
        "n_evaluated": len(done),
        "exact_match_rate": mean([r["exact_match"] for r in done]),
        "token_match_mean": mean([r["token_match"] for r in done]),
        "longest_prefix_mean": mean([r["longest_prefix"] for r in done]),
        "rouge_l_mean": mean([r["rouge_l"] for r in done]),
        "n_pythia": len(py),
        "pythia_score_mean": mean([r["pythia_score"] for r in py]),
        "pythia_memorized_rate": mean([r["pythia_memorized"] for r in py]),
    }


def aggregate(rows: list[dict], skipped: dict | None = None) -> dict:
    """Summaries overall, by number of copies and by membership (inserted vs twin)."""
    by_copies, by_member = defaultdict(list), defaultdict(list)
    for r in rows:
        by_copies[r["copies"]].append(r)
        by_member["inserted" if r["inserted"] else "twin"].append(r)
    return {
        "overall": _summary(rows),
        "by_copies": {c: _summary(rs) for c, rs in sorted(by_copies.items())},
        "by_membership": {k: _summary(rs) for k, rs in sorted(by_member.items())},
        "skipped": dict(skipped or {}),
    }
