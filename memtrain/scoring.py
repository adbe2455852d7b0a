"""Score canaries on a model: greedy extraction and membership inference, one row per canary and twin, and the
summaries every door reports (overall, by copies, by kind and copies, twins).

Three doors share it: the evaluation of a memtrain run (memtrain/evaluate.py adds what only a run has: exposure
over a secret's candidate space, in-row contexts, held-out loss, training order), `memtrain eval --model DIR
--canaries FILE` (memtrain/audit.py) and the Python API (memtrain/api.py). `model` is an HF causal LM on one
process or a `memtrain.hf.GridModel` on a grid (collective: every rank calls, every rank gets the result).

Each canary is scored after a start token, as a model sees a text's first token: memtrain's runs train every
canary after the EOS that opens it; a model from elsewhere gets its tokenizer's BOS when the tokenizer adds one,
else its EOS (lm-evaluation-harness scores an empty context the same way).
"""

from __future__ import annotations

import numpy as np

import eval as ev
from memtrain.data import Canary
from memtrain.data.canaries import secret_prefix_len
from memtrain.progress import stage


def added_bos(tok) -> list[int]:
    """[BOS] when the tokenizer starts every text with it, else []."""
    added = tok("a")["input_ids"]
    return [int(tok.bos_token_id)] if tok.bos_token_id is not None and added and added[0] == tok.bos_token_id else []


def start_ids(tok) -> list[int]:
    """The token a model from elsewhere reads before a canary: its BOS when its tokenizer adds one, else EOS."""
    if bos := added_bos(tok):
        return bos
    if tok.eos_token_id is not None:
        return [int(tok.eos_token_id)]
    raise ValueError("the tokenizer has neither a BOS it adds nor an EOS: a canary's first token would have no "
                     "context; give the tokenizer an eos_token")


def prefix_lens(c: Canary, tok, suffix_len: int) -> tuple[int | None, int | None]:
    """The prompt lengths of a canary and of its twin (None: the evaluation asks for the last `suffix_len` tokens):
    a user file's split, else for a secret too short for `suffix_len` its digits. Its twin is then asked for its
    own digits too (the twin's made-up name has its own length), so the control answers the same question. A
    twin without a split of its own beside a canary with one (a manifest from before canary_file split such twins)
    is asked for as many last tokens as the canary's suffix has, not `suffix_len`: same-length targets."""
    prefix, twin = c.prefix_len, c.twin_prefix_len
    if c.format == "secret":
        if prefix is None and len(c.token_ids) <= suffix_len:
            prefix = secret_prefix_len(c, tok)
        if twin is None and c.twin_token_ids and (prefix is not None or len(c.twin_token_ids) <= suffix_len):
            twin = secret_prefix_len(c, tok, twin=True)
    if twin is None and prefix is not None and c.twin_token_ids:
        twin = max(len(c.twin_token_ids) - (len(c.token_ids) - prefix), 0)
    return prefix, twin


def as_scored(canaries: list[Canary], start: list[int], tok, suffix_len: int,
              copies_seen: dict | None = None) -> list[ev.Canary]:
    """Each canary and (when it has one) its twin as the evaluation scores them: after `start`, with their own
    prompt lengths (`prefix_lens`)."""
    out = []
    for c in canaries:
        seen = (copies_seen or {}).get(c.id, c.copies)
        prefix, twin_prefix = prefix_lens(c, tok, suffix_len)
        out.append(ev.Canary(tokens=[*start, *c.token_ids], id=c.id, kind=c.kind, copies=seen, inserted=True,
                             text=c.text, prefix_len=None if prefix is None else len(start) + prefix))
        if c.twin_token_ids:
            out.append(ev.Canary(tokens=[*start, *c.twin_token_ids], id=f"{c.id}-twin", kind=c.kind, copies=seen,
                                 inserted=False, text=c.twin_text,
                                 prefix_len=None if twin_prefix is None else len(start) + twin_prefix))
    return out


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def summary(rows: list[dict]) -> dict:
    """The members' aggregates of some rows (twins are counted as members by the caller that wants them)."""
    members = [r for r in rows if r["inserted"]]
    done = [r for r in members if r["exact_match"] is not None]
    py = [r for r in members if r["pythia_score"] is not None]
    return {
        "n": len(members),
        "n_evaluated": len(done),
        "exact_count": sum(bool(r["exact_match"]) for r in done),
        "exact_match_rate": _mean([float(r["exact_match"]) for r in done]),
        "token_match": _mean([r["token_match"] for r in done]),
        "rougeL": _mean([r["rouge_l"] for r in done]),
        "rougeL_text": _mean([r.get("rouge_l_text") for r in done]),
        "longest_prefix": _mean([r["longest_prefix"] for r in done]),
        "pythia_32_score": _mean([r["pythia_score"] for r in py]),
        "exposure_mean": _mean([r.get("exposure") for r in members]),
    }


def score(model, canaries: list[ev.Canary], tok, *, suffix_len: int, batch_size: int, pythia: bool,
          exposures: dict | None = None) -> dict:
    """Extraction and membership inference of `canaries` (from `as_scored`); `exposures` ({id: bits}) joins
    the rows when the caller measured it. Returns the aggregates and "rows"."""
    with stage(f"eval: extraction of {sum(c.inserted for c in canaries)} canaries and their twins (greedy, last "
               f"{suffix_len} tokens or the canary's own suffix{'; Pythia 32/32' if pythia else ''})"):
        ext = ev.extraction_eval(model, canaries, suffix_len=suffix_len, batch_size=batch_size, pythia=pythia)
    twins = any(not c.inserted for c in canaries)
    with stage("eval: membership inference (canaries vs twins)"):
        mia = ev.mia_eval(model, canaries, batch_size=batch_size) if canaries and twins else None
    mia_rows = {r["id"]: r for r in mia["rows"]} if mia else {}
    rows = []
    for c, r in zip(canaries, ext.rows):
        row = dict(r, **{k: v for k, v in mia_rows.get(c.id, {}).items() if k not in r})
        row["exposure"] = (exposures or {}).get(c.id)
        row["generated_text"] = tok.decode(r["generated"]) if r["generated"] else None
        if r["generated"]:  # ROUGE-L on decoded text, as the Goldfish paper scores it
            row["rouge_l_text"] = ev.rouge_l_text(row["generated_text"], tok.decode(c.tokens[-len(r["generated"]):]))
        rows.append(row)
    by_copies = {}
    for cp in sorted({r["copies"] for r in rows}):
        by_copies[str(cp)] = summary([r for r in rows if r["copies"] == cp])
        m = mia["by_copies"].get(cp) if mia else None
        by_copies[str(cp)]["mia_auc_loss"] = m["loss"]["auc"] if m else None
    cells = {f"{kind}/{cp}": summary([r for r in rows if r["kind"] == kind and r["copies"] == cp])
             for kind, cp in sorted({(r["kind"], r["copies"]) for r in rows})}
    return dict(summary(rows),
                mia_auc_loss=mia["metrics"]["loss"]["auc"] if mia else None,
                mia=dict(mia["metrics"]) if mia else {},
                twins=summary([dict(r, inserted=True) for r in rows if not r["inserted"]]),
                by_copies=by_copies, cells=cells, skipped=ext.skipped, suffix_len=suffix_len,
                not_scored=[r["id"] for r in rows if r["inserted"] and r["exact_match"] is None],
                rows=rows)


def by_kind(rows: list[dict]) -> dict:
    """Per kind: members, exact matches among those scored, mean token match, twins' exact matches, and the loss
    attack's AUC and TPR at 1% FPR (members vs that kind's twins)."""
    out = {}
    for kind in sorted({r["kind"] for r in rows}, key=str):
        own = [r for r in rows if r["kind"] == kind]
        members, twins = summary(own), summary([dict(r, inserted=True) for r in own if not r["inserted"]])
        mia = ev.roc_metrics([r["loss"] for r in own if r["inserted"] and "loss" in r],
                             [r["loss"] for r in own if not r["inserted"] and "loss" in r])
        out[kind] = {**{k: members[k] for k in ("n", "n_evaluated", "exact_count", "token_match")},
                     "twins": twins["n"], "twins_evaluated": twins["n_evaluated"],
                     "twins_exact_count": twins["exact_count"],
                     "mia_auc_loss": mia["auc"], "mia_tpr_at_1pct_fpr": mia["tpr_at_1pct_fpr"]}
    return out
