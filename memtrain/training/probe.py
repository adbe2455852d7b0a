"""The per-pass probe: what the trainer measures after every pass over its data (`eval.every_pass`).

A part of training that the trainer calls, as torchtitan's trainer calls its validator: teacher-forced on the
grid, so it costs one forward pass over the canaries and the validation documents (exact match of a greedy
suffix is the same as every suffix position's argmax being right: see memtrain.hf.teacher_forced). The full
evaluation (greedy decoding, twins, exposure, MIA) runs after training, in memtrain.evaluate.
"""

from __future__ import annotations

from memtrain.config import RunConfig
from memtrain.data import TrainStream
from memtrain.hf import teacher_forced


def pass_scores(model, stream: TrainStream, cfg: RunConfig) -> dict:
    """Teacher-forced memorization and utility of a parallelized model after a pass (collective).

    Per (kind, copies) cell of the inserted canaries: k exact of n (the whole suffix of cfg.eval.suffix_len
    tokens greedily reproduced: identical to greedy extraction), token accuracy and mean loss of the suffix;
    and the validation loss (token-weighted). The never-trained twins are scored at the end only.
    """
    n_suffix = cfg.eval.suffix_len
    usable = [c for c in stream.canaries if len(c.token_ids) > n_suffix]
    seqs = [[stream.eos_id, *c.token_ids] for c in usable]
    val = stream.val_sequences(cfg.eval.val_docs)
    scores = teacher_forced(model, seqs + val, batch_size=cfg.eval.batch_size)
    cells: dict = {}
    for c, (loss, right) in zip(usable, scores):
        cell = cells.setdefault(f"{c.kind}/{c.copies}", [0, 0, 0.0, 0.0])
        cell[0] += bool(right[-n_suffix:].all())
        cell[1] += 1
        cell[2] += float(right[-n_suffix:].mean())
        cell[3] += float(loss[-n_suffix:].mean())
    k, n = sum(v[0] for v in cells.values()), sum(v[1] for v in cells.values())
    out = {"members": {
        "k": k, "n": n, "exact_match_rate": k / n if n else None,
        "token_accuracy": sum(v[2] for v in cells.values()) / n if n else None,
        "suffix_loss": sum(v[3] for v in cells.values()) / n if n else None,
        "cells": {key: {"k": v[0], "n": v[1], "token_accuracy": v[2] / v[1]} for key, v in cells.items()}}}
    val_scores = scores[len(seqs):]
    tokens = sum(loss.size for loss, _ in val_scores)
    out["val_loss"] = sum(float(loss.sum()) for loss, _ in val_scores) / tokens if tokens else None
    return out
