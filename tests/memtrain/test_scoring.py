"""What the evaluation asks a canary and its twin for (memtrain/scoring.py): a secret too short for the suffix is
asked for its digits, and its twin for the twin's own digits, whose made-up name has its own length; extraction from
a canary's in-row context (memtrain/evaluate.py) asks for the same tokens."""

import os
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from memtrain.data import CanaryConfig, DataConfig, build_stream  # noqa: E402
from memtrain.evaluate import _in_row_canaries  # noqa: E402
from memtrain.scoring import as_scored, prefix_lens  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[1::4][:40]:
        (root / f"{p.stem}.txt").write_text(p.read_text("utf-8")[:8000])
    return DataConfig(corpus=str(root), vocab_size=512, seq_len=128, val_fraction=0.1,
                      cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def stream(data):
    return build_stream(data, CanaryConfig(kinds=["random"], number=12, copies=[1]), seed=0)


def _asked(stream, scored) -> str:
    return stream.tokenizer.decode(scored.tokens[scored.prefix_len:]).strip()


def test_short_secrets_and_their_twins_are_asked_for_their_own_digits(stream):
    canaries = stream.canaries
    # The names are drawn apart: some twins' prompts are longer or shorter than their canary's.
    assert len({len(c.token_ids) - len(c.twin_token_ids) for c in canaries}) > 1
    scored = as_scored(canaries, [stream.eos_id], stream.tokenizer, suffix_len=64)
    for c, member, twin in zip(canaries, scored[0::2], scored[1::2], strict=True):
        assert _asked(stream, member) == c.candidate_space["slots"]["secret"], c.id
        assert _asked(stream, twin) == c.candidate_space["twin_slots"]["secret"], c.id
        assert member.tokens[0] == twin.tokens[0] == stream.eos_id and twin.id == f"{c.id}-twin"


def test_a_twin_answers_what_its_canary_is_asked(stream):
    """Where only one of a pair fits the suffix, the twin still answers the canary's question: its digits when the
    canary is asked for digits, the last suffix_len tokens when the canary is (unless the twin is too short)."""
    tok, pairs = stream.tokenizer, 0
    for c in stream.canaries:
        for suffix_len in range(min(len(c.token_ids), len(c.twin_token_ids)), max(len(c.token_ids),
                                                                                 len(c.twin_token_ids))):
            prefix, twin = prefix_lens(c, tok, suffix_len)
            member_short = len(c.token_ids) <= suffix_len
            assert (prefix is not None) == member_short
            assert (twin is not None) == (member_short or len(c.twin_token_ids) <= suffix_len)
            pairs += 1
    assert pairs > 0  # some pair had lengths on both sides of a suffix length


def test_in_row_extraction_asks_for_what_the_canary_is_asked(data):
    """Without document attention a canary buried in a row is also asked after the row's text before it: for the
    same tokens as the main extraction (a short secret's digits), not for the last suffix_len of context + canary."""
    buried = build_stream(replace(data, document_attention=False),
                          CanaryConfig(kinds=["random"], number=12, copies=[1], placement="random"), seed=0)
    assert any(c.placements[0].offset > 1 for c in buried.canaries)
    main = as_scored(buried.canaries, [buried.eos_id], buried.tokenizer, suffix_len=64)[0::2]
    in_row = _in_row_canaries(buried, {}, suffix_len=64)
    for c, a, b in zip(buried.canaries, main, in_row, strict=True):
        assert b.prefix_len > len(b.tokens) - len(c.token_ids)  # the row's text is context, never asked for
        assert b.tokens[b.prefix_len:] == a.tokens[a.prefix_len:], c.id


def test_a_plain_twin_in_an_earlier_manifest_is_asked_as_many_tokens_as_its_split_canary():
    """Manifests (and cached streams) from before canary_file split a plain-text twin hold twin_prefix_len None
    beside a canary's own split: the twin is still asked for as many last tokens as the canary's suffix has, not
    eval.suffix_len (a 40-token target against an 8-token one); a longer canary suffix than the twin asks it whole."""
    from memtrain.data import Canary

    c = Canary(id="k", kind="user", format="text", text="", token_ids=list(range(50)), twin_text="",
               twin_token_ids=list(range(45)), copies=1, candidate_space={}, prefix_len=10)
    assert prefix_lens(c, None, suffix_len=8) == (10, 5)
    member, twin = as_scored([c], [0], None, suffix_len=8)
    assert len(member.tokens) - member.prefix_len == len(twin.tokens) - twin.prefix_len == 40
    assert prefix_lens(Canary(**{**c.to_dict(), "prefix_len": 2}), None, suffix_len=8) == (2, 0)
