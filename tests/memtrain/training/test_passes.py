"""Memorization measured after every pass, and where a canary sits in its row not mattering (`memtrain train`).

A tiny model memorizes 16 document canaries over 16 passes of a stream holding little else, scored after every
pass (eval.every_pass). One run has every copy at the start of its row; the other buries every copy mid-row
(placement "random") behind document attention. Checked:
- passes.jsonl has one line per pass, counts of n = 16, and the rate rises from 0 (the run does memorize);
- the last pass's teacher-forced exact matches are the final greedy extraction's, canary for canary (the
  same model scored two ways: they must agree exactly);
- the buried run's final exact-match rate lies within the start run's 95% Wilson interval and vice versa
  (the model sees each copy in the same context either way; the runs differ only in their batches' other
  text), while the same buried run without document attention is scored from its in-row context too.
"""

import json
from pathlib import Path

import pytest
import torch

from experiments.report.stats import wilson
from memtrain.config import RunConfig
from memtrain.data import CanaryConfig, DataConfig, build_stream
from memtrain.losses import LossConfig, drop_mask
from memtrain.training.probe import suffix_drops
from tests._helpers import once_per_session
from tests.memtrain._helpers import memtrain, stdlib_corpus


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    corpus = stdlib_corpus(tmp_path_factory.mktemp("corpus"), every=3, count=60, chars=5000)
    cache = tmp_path_factory.mktemp("cache")
    return f"""
[model]
name = "width-64"
[train]
batch_size = 2
epochs = 16
lr = 3e-3
min_lr = 3e-3
warmup_steps = 4
[data]
corpus = "{corpus}"
vocab_size = 512
seq_len = 64
max_text_tokens = 300
cache_dir = "{cache}"
[canaries]
kinds = ["document"]
number = 16
copies = [1]
length = 24
[eval]
suffix_len = 8
every_pass = true
exposure_samples = 16
val_docs = 4
[wandb]
mode = "disabled"
"""


def _train(recipe: str, out: Path, *sets: str) -> dict:
    path = out.with_suffix(".toml")
    path.write_text(recipe)
    r = memtrain("train", "--config", path, "--out", out, *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stderr[-3000:]
    passes = [json.loads(line) for line in (out / "passes.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (out / "eval_canaries.jsonl").read_text().splitlines()]
    return {"passes": passes, "eval": json.loads((out / "eval.json").read_text()), "rows": rows}


@pytest.fixture(scope="module")
def start(recipe, tmp_path_factory, request):
    """The canaries at row starts: what its files say (plain data, computed once per session)."""
    return once_per_session(request, lambda: _train(recipe, tmp_path_factory.mktemp("runs") / "start"))


def test_every_pass_is_scored_and_agrees_with_greedy_extraction(start):
    passes = start["passes"]
    assert [p["pass"] for p in passes] == list(range(0, 17))  # pass 0: the starting model, before any step
    assert all(p["members"]["n"] == 16 and p["members"]["cells"]["document/1"]["n"] == 16 for p in passes)
    rates = [p["members"]["exact_match_rate"] for p in passes]
    assert rates[0] == rates[1] == 0 and rates[-1] >= 0.25, rates  # it memorizes, pass by pass
    assert all(p["val_loss"] > 0 and p["val_tokens"] > 0 for p in passes)
    assert len({p["val_tokens"] for p in passes}) == 1  # one validation set for the start and every pass
    final = start["eval"]
    assert passes[-1]["members"]["k"] == final["exact_count"]  # the same model, scored two ways
    assert final["val_loss"] == passes[-1]["val_loss"]  # the probe's held-out loss, not scored a second time
    assert final["cells"]["document/16"]["n"] == 16  # 1 copy x 16 passes seen


def test_members_lose_more_suffix_loss_than_their_never_trained_twins(start):
    """The probe scores twins beside members, from pass 0 on: the twin-controlled drop is positive once
    members are trained; under the standard loss no position is dropped."""
    first, last = start["passes"][0]["canaries"], start["passes"][-1]["canaries"]
    assert first["id"] == last["id"] and len(first["id"]) == 32 and sum(first["inserted"]) == 16
    drop = [a - b for a, b in zip(first["suffix_loss"], last["suffix_loss"])]
    member = [d for d, m in zip(drop, first["inserted"]) if m]
    twin = [d for d, m in zip(drop, first["inserted"]) if not m]
    assert sum(member) / 16 > sum(twin) / 16 + 1.0, (member, twin)
    assert all(v is None for v in last["suffix_loss_dropped"]) and last["suffix_loss_kept"] == last["suffix_loss"]
    assert last["suffix_dropped"] == [0] * 32 and last["suffix_tokens"] == [8] * 32


def test_suffix_drops_marks_the_suffix_targets_the_loss_drops():
    """A known answer without the hash: the static mask drops doc_pos % k == k - 1, so of the 16 suffix targets
    of [EOS, 32 tokens] (doc_pos 16..31: the first token after the EOS is 0) it drops 19, 23, 27 and 31 at k=4; the
    standard loss drops none."""
    seq = [0, *range(1, 33)]
    static = RunConfig(loss=LossConfig(kind="goldfish", k=4, mask="static"))
    assert suffix_drops(seq, 16, static).nonzero().flatten().tolist() == [3, 7, 11, 15]
    assert int(suffix_drops(seq, 16, RunConfig()).sum()) == 0


@pytest.mark.parametrize("mask", ["static", "hashed"])
def test_suffix_drops_are_what_training_drops_in_the_stream(tmp_path, mask):
    """The probe's mask of a canary equals the one the loss applies to the canary's copy in its training row."""
    (tmp_path / "corpus").mkdir()
    corpus = stdlib_corpus(tmp_path / "corpus", every=4, count=40, chars=8000)
    data = DataConfig(corpus=str(corpus), vocab_size=512, seq_len=128, cache_dir=str(tmp_path / "cache"))
    stream = build_stream(data, CanaryConfig(kinds=["document"], number=4, copies=[1], length=32), seed=0)
    loss = LossConfig(kind="goldfish", k=4, h=4, mask=mask)
    for c in stream.canaries:
        (p,) = c.placements
        row = stream.rows(p.seq_index, p.seq_index + 1)
        trained = drop_mask(torch.from_numpy(row["labels"]), torch.from_numpy(row["doc_pos"]), loss)[0]
        trained = trained[p.offset - 1:p.offset - 1 + len(c.token_ids)][-16:]  # label j predicts token j + 1
        assert torch.equal(suffix_drops([stream.eos_id, *c.token_ids], 16, RunConfig(loss=loss)), trained), c.id
        assert trained.any()


def test_buried_canaries_behind_document_attention_are_memorized_alike(start, recipe, tmp_path):
    buried = _train(recipe, tmp_path / "buried", 'canaries.placement="random"')
    assert any(p["offset"] > 1 for line in (tmp_path / "buried" / "canaries.jsonl").read_text().splitlines()
               for p in json.loads(line)["placements"])
    a, b = start["eval"], buried["eval"]
    lo_a, hi_a = wilson(a["exact_count"], a["n_evaluated"])
    lo_b, hi_b = wilson(b["exact_count"], b["n_evaluated"])
    assert lo_a <= b["exact_match_rate"] <= hi_a and lo_b <= a["exact_match_rate"] <= hi_b, (a, b)
    assert "in_row" not in b  # with document attention the own-prefix score is the training context
    classic = _train(recipe, tmp_path / "classic", 'canaries.placement="random"', "data.document_attention=false")
    assert classic["eval"]["in_row"]["n_evaluated"] == 16  # scored from the row as well
    assert any("exact_match_in_row" in r for r in classic["rows"])
