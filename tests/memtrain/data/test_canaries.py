"""Canary bookkeeping: copies, twins, candidate spaces, held-out documents, and bad configurations."""

import math
import os
import re
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from memtrain.data import CanaryConfig, DataConfig, build_stream, occurrences, render_secret  # noqa: E402
from memtrain.data.corpus import load_corpus  # noqa: E402


@pytest.fixture(scope="module")
def data_cfg(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for p in files[1::4][:40]:
        (root / f"{p.stem}.txt").write_text(p.read_text("utf-8")[:8000])
    return DataConfig(corpus=str(root), vocab_size=512, seq_len=128, val_fraction=0.1,
                      cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module", params=["secret", "tokens"])
def stream(request, data_cfg):
    cfg = CanaryConfig(number=6, copies=[1, 2, 4], length=20, random_format=request.param)
    return build_stream(data_cfg, cfg, seed=0)


def test_copies_in_manifest_equal_copies_in_stream(stream):
    assert [c.copies for c in stream.canaries] == [1, 2, 4] * 4  # split evenly over the levels, per kind
    manifest = stream.manifest(batch_size=4)
    assert sum(len(c["placements"]) for c in manifest) == sum(c.copies for c in stream.canaries)
    for c in stream.canaries:
        assert len(c.placements) == c.copies
        starts = occurrences(stream.tokens, c.token_ids)
        assert sorted(starts) == sorted(p.seq_index * stream.seq_len + p.offset for p in c.placements)
    rows = [p.seq_index for c in stream.canaries for p in c.placements]
    assert len(rows) == len(set(rows))  # at most one copy per sequence


def test_twins_never_appear_in_the_training_stream(stream, data_cfg):
    trained = stream.tokenizer.decode(stream.tokens[stream.tokens >= 0])
    for c in stream.canaries:
        assert c.twin_token_ids != c.token_ids
        assert occurrences(stream.tokens, c.twin_token_ids) == []
        if c.format != "tokens":  # random token ids need not decode to the same text in context
            assert c.twin_text not in trained and c.text in trained
    # document canaries: the rest of their source documents (and their twins') is not trained on either
    docs = [d.text for d in load_corpus(data_cfg).docs]
    by_name = {d.name: d.text for d in load_corpus(data_cfg).docs}
    unique_lines = []
    for c in (c for c in stream.canaries if c.kind == "document"):
        for name, chunk in ((c.source, c.text), (c.twin_source, c.twin_text)):
            assert chunk in by_name[name]
            unique_lines += [ln for ln in by_name[name].splitlines() if len(ln) > 30 and ln not in chunk
                             and sum(ln in d for d in docs) == 1]
    assert len(unique_lines) > 20 and not any(ln in trained for ln in unique_lines)


def test_random_canaries_record_their_candidate_space(stream):
    rnd = [c for c in stream.canaries if c.kind == "random"]
    assert len(rnd) == 6
    for c in rnd:
        space = c.candidate_space
        assert space["size"] > 1 and math.isclose(space["log2_size"], math.log2(space["size"]), rel_tol=1e-9)
        if c.format == "secret":
            slots = space["slots"]
            assert c.text == render_secret(slots["name"], slots["secret"])
            assert re.fullmatch(r"\d{4}-\d{4}-\d{4}-\d{4}", slots["secret"]) and space["size"] == 10**16
            assert c.twin_text == render_secret(space["twin_slots"]["name"], space["twin_slots"]["secret"])
            assert stream.tokenizer(c.text, add_special_tokens=False)["input_ids"] == c.token_ids
        else:
            assert len(c.token_ids) == len(c.twin_token_ids) == 20
            assert stream.eos_id not in c.token_ids and 0 not in c.token_ids  # no special id is drawn
            assert space["size"] == (stream.vocab_size - len(stream.tokenizer.all_special_ids)) ** 20


def test_document_canaries_have_the_configured_length(stream):
    docs = [c for c in stream.canaries if c.kind == "document"]
    assert len(docs) == 6
    assert all(len(c.token_ids) == len(c.twin_token_ids) == 20 for c in docs)
    assert len({c.source for c in docs} | {c.twin_source for c in docs}) == 12


def _one_line_error(data_cfg, canary_cfg, match):
    with pytest.raises(ValueError, match=match) as e:
        build_stream(data_cfg, canary_cfg, seed=0)
    assert "\n" not in str(e.value)


def test_canary_longer_than_sequence(data_cfg):
    _one_line_error(data_cfg, CanaryConfig(kinds=["document"], number=1, length=128), "seq_len=128")
    _one_line_error(data_cfg, CanaryConfig(kinds=["random"], random_format="tokens", number=1, length=200),
                    "seq_len=128 fits at most 127")


def test_more_copies_than_the_text_fills_get_rows_of_their_own(data_cfg):
    """200 copies but text for a few rows of 4096: the stream grows to a row per copy, never two in one."""
    stream = build_stream(replace(data_cfg, seq_len=4096), CanaryConfig(number=2, copies=[50], length=16), seed=0)
    rows = [p.seq_index for c in stream.canaries for p in c.placements]
    assert len(rows) == 200 and len(set(rows)) == 200 and len(stream) >= 200
    for c in stream.canaries:
        for p in c.placements:
            row = stream.rows(p.seq_index, p.seq_index + 1)["input_ids"][0]
            assert row[p.offset:p.offset + len(c.token_ids)].tolist() == c.token_ids


def test_fixed_offset_past_the_end(data_cfg):
    _one_line_error(data_cfg, CanaryConfig(kinds=["random"], random_format="tokens", number=1, length=20,
                                           placement=120), r"offset in \[1, 108\]")


@pytest.mark.parametrize("bad, msg", [
    (dict(kinds=["secret"]), "canaries.kinds"), (dict(copies=[]), "canaries.copies"),
    (dict(copies=[0]), "copies"), (dict(placement="end"), "canaries.placement"),
    (dict(placement=0), "offset must be >= 1"), (dict(number=-1), "canaries.number"),
    (dict(length=0), "canaries.length"), (dict(random_format="x"), "format"),
])
def test_canary_config_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        CanaryConfig(**bad)
