"""The library API: `inject` places every copy where its manifest says, in a Dataset (text or tokenized) and in a
token stream, the same for the same seed."""

import numpy as np
import pytest
from datasets import Dataset

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


def test_tokenized_dataset_gets_ids(tok):
    ds = Dataset.from_dict({"input_ids": [[5, 6, 7]] * 10})
    out, manifest = inject(ds, ROWS, tok, copies=[1])
    for c in manifest:
        assert all(out[p["seq_index"]]["input_ids"] == c["token_ids"] for p in c["placements"])


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
