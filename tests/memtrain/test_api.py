"""The library API: `inject` places every copy where its manifest says, in a Dataset (text or tokenized) and in a
token stream, the same for the same seed."""

import copy

import numpy as np
import pytest
from datasets import Dataset
from tokenizers.processors import TemplateProcessing
from transformers import DataCollatorWithPadding

from memtrain.api import inject
from memtrain.data import train_bpe

ROWS = [{"id": "a", "text": "Jane Roe's card number is 4111 1111 1111 1111.", "copies": 3},
        {"id": 9, "kind": "qa", "prefix": "Q: vault code?\nA:", "suffix": " 7731-0042.", "twin": "Q: x?\nA: 1."}]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(["some text about things and stuff", *(r.get("text", "") for r in ROWS)] * 8, 300)


def test_dataset_rows_hold_their_canaries(tok):
    ds = Dataset.from_dict({"text": [f"document {i}" for i in range(20)], "n": list(range(20))})
    out, manifest = inject(ds, ROWS, tok, copies=[2], seed=1)
    assert len(out) == 20 + 3 + 2
    assert [r for r in out["text"] if r.startswith("document")] == ds["text"]  # the originals keep their order
    for c in manifest:
        assert len(c["placements"]) == c["copies"]
        for p in c["placements"]:
            assert out[p["seq_index"]]["text"] == c["text"] and out[p["seq_index"]]["n"] is None
    again, manifest2 = inject(ds, ROWS, tok, copies=[2], seed=1)
    assert again["text"] == out["text"] and manifest2 == manifest
    assert inject(ds, ROWS, tok, copies=[2], seed=2)[0]["text"] != out["text"]


def test_copies_of_different_canaries_are_interleaved(tok):
    """Which copy goes to which drawn row is random too: otherwise every copy of the first canary would precede
    every copy of the second, and the training order would stand for the canary (measured as an order effect)."""
    ds = Dataset.from_dict({"text": [f"document {i}" for i in range(50)]})
    grouped = []
    for seed in range(10):  # 3 copies of "a" all before 2 of 9: 1 draw in 10 by chance, 10 seeds 1 in 10^10
        out, manifest = inject(ds, ROWS, tok, copies=[2], seed=seed)
        rows = {c["id"]: [p["seq_index"] for p in c["placements"]] for c in manifest}
        grouped.append(max(rows["a"]) < min(rows[9]))
    assert not all(grouped)


def _adds_bos(tok):
    tok = copy.deepcopy(tok)
    tok.add_special_tokens({"bos_token": "<s>"})
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    return tok


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_tokenized_dataset_gets_rows_as_the_tokenizer_makes_them(tok, bos):
    """A copy's row is what tokenizing its text gives (the BOS first when the tokenizer adds one) with an attention
    mask of ones and labels, so a standard collator pads it with the others."""
    tok = _adds_bos(tok) if bos else tok
    ds = Dataset.from_dict({"text_ids": [0] * 10, "input_ids": [tok("some text")["input_ids"]] * 10,
                            "attention_mask": [[1] * len(tok("some text")["input_ids"])] * 10,
                            "labels": [tok("some text")["input_ids"]] * 10})
    out, manifest = inject(ds, ROWS, tok, copies=[1])
    start = [tok.bos_token_id] if bos else []
    for c in manifest:
        for p in c["placements"]:
            row = out[p["seq_index"]]
            assert row["input_ids"] == row["labels"] == [*start, *c["token_ids"]] and p["offset"] == len(start)
            assert row["attention_mask"] == [1] * len(row["input_ids"]) and row["text_ids"] is None
    tok = copy.deepcopy(tok)
    tok.pad_token = tok.eos_token
    batch = DataCollatorWithPadding(tok)([{k: r[k] for k in ("input_ids", "attention_mask")} for r in out])
    assert batch["attention_mask"].sum() == sum(len(r) for r in out["input_ids"])  # None would not collate


def test_stream_copies_start_after_an_eos(tok):
    eos = tok.eos_token_id
    stream = np.array([3, 4, eos, 5, 6, 7, eos, 8, eos] * 5, dtype=np.int64)
    out, manifest = inject(stream, ROWS, tok, copies=[2], seed=0)
    assert len(out) == len(stream) + sum(c["copies"] * (len(c["token_ids"]) + 1) for c in manifest)
    for c in manifest:
        for p in c["placements"]:
            at = p["offset"]
            assert out[at:at + len(c["token_ids"]) + 1].tolist() == [*c["token_ids"], eos]
            assert at == 0 or out[at - 1] == eos
    kept = np.ones(len(out), dtype=bool)
    for c in manifest:
        for p in c["placements"]:
            kept[p["offset"]:p["offset"] + len(c["token_ids"]) + 1] = False
    assert out[kept].tolist() == stream.tolist()  # the stream itself is untouched
