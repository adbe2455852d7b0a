"""memtrain as a library: put canaries into your own training data, then ask your model for them back.

    from memtrain.api import inject, evaluate

    train_ds, manifest = inject(dataset, "secrets.jsonl", tokenizer, copies=[1, 4, 16], seed=0)
    ...                                   # train on train_ds with any loop: HF Trainer, accelerate, torchtitan
    result = evaluate(model, tokenizer, manifest, suffix_len=16)
    result["exact_count"], result["by_kind"], result["rows"]

`inject` takes a `datasets.Dataset` (a text column, or a tokenized "input_ids" column) or a 1-D token stream,
and returns it with every canary copy inserted at seeded places, and the manifest: one dict per canary with its
token ids and where each copy went. `evaluate` scores a (model, tokenizer, manifest) triple with the code every
memtrain evaluation runs (memtrain/scoring.py: `memtrain eval` and the trainer's evaluation call it too):
greedy extraction of each suffix, membership inference against the twins, the aggregates of eval.json.
Canaries are a JSONL file or a list of dicts in its format (memtrain/data/canary_file.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, concatenate_datasets

from memtrain.data import Canary, Placement, canary_file
from memtrain.scoring import added_bos, as_scored, by_kind, score, start_ids


def _canaries(canaries, tokenizer, copies) -> list[Canary]:
    if isinstance(canaries, (str, Path)):
        return canary_file.to_canaries(canary_file.read(canaries), tokenizer, str(canaries), list(copies))
    return canary_file.to_canaries(canary_file.checked(list(canaries)), tokenizer, "python", list(copies))


def inject(data, canaries, tokenizer, *, copies=(1,), seed: int = 0, text_field: str = "text"):
    """(data with the canaries' copies inserted, manifest). A canary gives its own `copies` or takes the next of
    `copies`, cycled. In a Dataset each copy is a row of its own, rows placed uniformly at random by `seed` among
    the originals, whose order is kept: its text, or in a tokenized Dataset its ids in "input_ids" as the tokenizer
    would give them (after its BOS when it adds one), "attention_mask" ones and "labels" the ids where the Dataset
    has those columns, other columns None. In a 1-D token stream each copy is [ids..., EOS] after a document's EOS
    (score it with `evaluate(..., start=[tokenizer.eos_token_id])`, the context it was trained in). The manifest's
    placements give each copy's row (seq_index) and where in it the canary's first token is (offset)."""
    cans = _canaries(canaries, tokenizer, copies)
    rng = np.random.default_rng(seed)
    if isinstance(data, (np.ndarray, torch.Tensor, list)):
        return _into_stream(np.asarray(data), cans, int(tokenizer.eos_token_id), rng), [c.to_dict() for c in cans]
    return _into_dataset(data, cans, text_field, tokenizer, rng), [c.to_dict() for c in cans]


def _into_dataset(ds, cans: list[Canary], text_field: str, tokenizer, rng):
    tokenized = text_field not in ds.column_names
    if tokenized and "input_ids" not in ds.column_names:
        raise ValueError(f"the dataset has neither a {text_field!r} column nor 'input_ids': pass text_field=<the "
                         "column with the text>")
    copies = [c for c in cans for _ in range(c.copies)]
    n, m = len(ds), len(copies)
    at = np.sort(rng.choice(n + m, size=m, replace=False))
    copies = [copies[k] for k in rng.permutation(m)]  # which copy goes where: not grouped by canary
    if tokenized:
        start = added_bos(tokenizer)  # a row starts as the tokenizer starts a text
        ids = [[*start, *c.token_ids] for c in copies]
        filled = {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids], "labels": ids,
                  "token_type_ids": [[0] * len(x) for x in ids]}
        columns = {name: filled.get(name, [None] * m) for name in ds.column_names}
    else:
        start = []
        columns = {name: [None] * m for name in ds.column_names} | {text_field: [c.text for c in copies]}
    extra = Dataset.from_dict(columns, features=ds.features)
    order = np.empty(n + m, dtype=np.int64)
    original = np.ones(n + m, dtype=bool)
    original[at] = False
    order[original] = np.arange(n)
    order[at] = n + np.arange(m)
    for row, c in zip(at, copies):
        c.placements.append(Placement(seq_index=int(row), offset=len(start)))
    return concatenate_datasets([ds, extra]).select(order)


def _into_stream(tokens: np.ndarray, cans: list[Canary], eos: int, rng) -> np.ndarray:
    if tokens.ndim != 1:
        raise ValueError(f"a token stream is 1-D, got shape {tuple(tokens.shape)}: pass one array of ids")
    starts = np.concatenate([[0], np.flatnonzero(tokens == eos) + 1])  # where a document may begin
    copies = [c for c in cans for _ in range(c.copies)]
    at = np.sort(rng.choice(starts, size=len(copies)))
    order = rng.permutation(len(copies))  # which copy goes where: not grouped by canary
    pieces, last, shift = [], 0, 0
    for pos, k in zip(at, order):
        c = copies[k]
        pieces += [tokens[last:pos], np.asarray([*c.token_ids, eos], dtype=tokens.dtype)]
        c.placements.append(Placement(seq_index=0, offset=int(pos) + shift))
        shift += len(c.token_ids) + 1
        last = pos
    pieces.append(tokens[last:])
    return np.concatenate(pieces)


def evaluate(model, tokenizer, manifest, *, suffix_len: int = 50, batch_size: int = 64, pythia: bool = False,
             start: list[int] | None = None, copies_seen: dict | None = None, exposures: dict | None = None) -> dict:
    """Score the manifest's canaries (dicts or Canary records) on `model` (an HF causal LM, or a
    `memtrain.hf.GridModel` on a grid: collective). Each is read after `start` (default: the tokenizer's BOS when
    it adds one, else its EOS). Returns eval.json's aggregates, "by_kind", and "rows" (one per canary and twin).
    `copies_seen` ({id: copies}) and `exposures` ({id: bits}) are what a memtrain run adds."""
    cans = [c if isinstance(c, Canary) else Canary.from_dict(c) for c in manifest]
    if isinstance(model, torch.nn.Module):
        model.eval()
    scored = as_scored(cans, start_ids(tokenizer) if start is None else start, tokenizer, suffix_len, copies_seen)
    with torch.inference_mode():
        result = score(model, scored, tokenizer, suffix_len=suffix_len, batch_size=batch_size, pythia=pythia,
                       exposures=exposures)
    return result | {"by_kind": by_kind(result["rows"])}
