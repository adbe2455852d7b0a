"""The per-pass probe: what the trainer measures before training and after every pass (`eval.every_pass`).

A part of training that the trainer calls, as torchtitan's trainer calls its validator: teacher-forced on the
grid, so it costs one forward pass over the canaries, their never-trained twins and the validation documents
(exact match of a greedy suffix is the same as every suffix position's argmax being right: see
memtrain.hf.teacher_forced). Pass 0, before the first step, scores the starting model (the base): with it, a
canary's memorization is measured as the drop of its suffix loss from the base minus its twin's drop over the
same training, which removes what the run learned about text like it in general. Under a Goldfish loss each
canary's suffix is also split into the positions the loss drops and those it keeps (the mask of its own tokens,
identical for every copy). The full evaluation (greedy decoding, exposure, MIA) runs after training, in
memtrain.evaluate.
"""

from __future__ import annotations

import torch

from memtrain.config import RunConfig
from memtrain.data import TrainStream
from memtrain.hf import teacher_forced
from memtrain.losses import drop_mask


def suffix_drops(seq: list[int], n_suffix: int, cfg: RunConfig) -> torch.Tensor:
    """Bool [n_suffix]: the suffix targets the run's loss drops, for a sequence [EOS, canary] as trained (the
    stream numbers a document's targets from 0: its first token after the EOS)."""
    labels = torch.tensor(seq[1:]).unsqueeze(0)
    doc_pos = torch.arange(len(seq) - 1).unsqueeze(0)
    return drop_mask(labels, doc_pos, cfg.loss)[0, -n_suffix:]


def _mean(values, where=None) -> float | None:
    v = values if where is None else values[where]
    return round(float(v.mean()), 5) if v.size else None


def pass_scores(model, stream: TrainStream, cfg: RunConfig) -> dict:
    """Teacher-forced memorization and utility of a parallelized model (collective).

    members: per (kind, copies) cell of the inserted canaries, k exact of n (the whole suffix of
    cfg.eval.suffix_len tokens greedily reproduced: identical to greedy extraction) and token accuracy; overall
    token accuracy and mean suffix loss. canaries: one column per measure over every canary and its twin (id,
    inserted, kind, copies, exact, suffix_loss, the suffix loss at dropped and kept positions, and how many of
    its suffix_tokens targets the loss drops: suffix_dropped). val_loss:
    token-weighted, over up to eval.val_tokens of whole held-out documents (val_tokens: how many).
    """
    def suffix_of(ids, prefix_len):  # a user file's own split, else the last eval.suffix_len tokens
        return len(ids) - prefix_len if prefix_len is not None else cfg.eval.suffix_len

    usable = [c for c in stream.canaries if len(c.token_ids) > suffix_of(c.token_ids, c.prefix_len)]
    scored = [(c, True) for c in usable] + [(c, False) for c in usable if c.twin_token_ids]
    seqs = [[stream.eos_id, *(c.token_ids if member else c.twin_token_ids)] for c, member in scored]
    val = stream.val_sequences(cfg.eval.val_docs, cfg.eval.val_tokens)
    scores = teacher_forced(model, seqs + val, batch_size=cfg.eval.batch_size)
    cols: dict[str, list] = {k: [] for k in ("id", "inserted", "kind", "copies", "exact", "suffix_loss",
                                             "suffix_loss_dropped", "suffix_loss_kept", "suffix_tokens",
                                             "suffix_dropped")}
    cells: dict = {}
    for (c, member), seq, (loss, right) in zip(scored, seqs, scores):
        n_suffix = suffix_of(seq[1:], c.prefix_len if member else c.twin_prefix_len)
        loss, right = loss[-n_suffix:], right[-n_suffix:]
        dropped = suffix_drops(seq, n_suffix, cfg).numpy()
        for key, value in (("id", c.id if member else f"{c.id}-twin"), ("inserted", member), ("kind", c.kind),
                           ("copies", c.copies), ("exact", bool(right.all())), ("suffix_loss", _mean(loss)),
                           ("suffix_loss_dropped", _mean(loss, dropped)), ("suffix_loss_kept", _mean(loss, ~dropped)),
                           ("suffix_tokens", n_suffix), ("suffix_dropped", int(dropped.sum()))):
            cols[key].append(value)
        if member:
            cell = cells.setdefault(f"{c.kind}/{c.copies}", [0, 0, 0.0, 0.0])
            cell[0] += bool(right.all())
            cell[1] += 1
            cell[2] += float(right.mean())
            cell[3] += float(loss.mean())
    k, n = sum(v[0] for v in cells.values()), sum(v[1] for v in cells.values())
    out = {"members": {
        "k": k, "n": n, "exact_match_rate": k / n if n else None,
        "token_accuracy": sum(v[2] for v in cells.values()) / n if n else None,
        "suffix_loss": sum(v[3] for v in cells.values()) / n if n else None,
        "cells": {key: {"k": v[0], "n": v[1], "token_accuracy": v[2] / v[1]} for key, v in cells.items()}},
        "canaries": cols}
    val_scores = scores[len(seqs):]
    tokens = sum(loss.size for loss, _ in val_scores)
    out["val_loss"] = sum(float(loss.sum()) for loss, _ in val_scores) / tokens if tokens else None
    out["val_tokens"] = tokens
    return out
