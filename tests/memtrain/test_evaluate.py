"""Evaluation sees the context training saw, and teacher forcing decides exact match as greedy decoding does.

- Context: a canary buried mid-row trains, under document attention, in exactly the context evaluation gives
  it ([EOS] + canary from position 0): the teacher-forced loss of every canary token in its training row (the
  trainer's path: ParallelLM.token_losses with the stream's position_ids) equals the loss on the evaluation
  sequence (eval.sequence_logprobs on the plain HF model with the same weights), to 1e-5 relative (the two
  compute the same dot products in a different order: masked attention over the row vs causal attention over
  the short sequence). Without the position ids (classic packing) the same row gives other losses: the test
  can fail. A large init (std 0.3) makes the logits depend strongly on context.
- Teacher forcing: on a partly memorized model, "every suffix token is the greedy choice given the true
  tokens before it" (memtrain.hf.teacher_forced, one forward pass) equals "greedy decoding reproduces the
  suffix" (eval.greedy_decode), sequence by sequence, for every suffix length from 1 to 24 (a mix of hits
  and misses).
"""

import copy
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import parallel  # noqa: E402
from eval import greedy_decode, sequence_logprobs  # noqa: E402
from memtrain.data import CanaryConfig, DataConfig, build_stream  # noqa: E402
from memtrain.evaluate import copies_seen, dropped_copies  # noqa: E402
from memtrain.hf import parallelize, teacher_forced  # noqa: E402
from memtrain.models import build_model  # noqa: E402
from tests.eval._models import tiny_model, train_to_memorize  # noqa: E402

GRID = parallel.Grid(1, 1, 1, 1)  # one process: no process group needed


@pytest.fixture(scope="module")
def buried(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[::5][:30]:
        (corpus / f"{p.stem}.txt").write_text(p.read_text("utf-8")[:6000])
    data = DataConfig(corpus=str(corpus), vocab_size=400, seq_len=96, cache_dir=str(tmp_path_factory.mktemp("c")))
    return build_stream(data, CanaryConfig(number=4, copies=[2], length=24, placement="random"), seed=3)


def test_copies_in_rows_a_pass_drops_are_named_and_not_counted_as_seen(buried):
    rows = len(buried)
    placed = sorted(p.seq_index for c in buried.canaries for p in c.placements)
    batch = next(b for b in range(2, rows) if rows % b and placed[-1] >= rows // b * b)  # the last copy dropped
    dropped = dropped_copies(buried, batch)
    assert dropped and len(dropped) == sum(i >= rows // batch * batch for i in placed)
    seen = copies_seen(buried, batch, steps=rows // batch)  # one full pass
    assert sum(seen.values()) == len(placed) - len(dropped)
    assert all(seen[c] < 2 for c in set(dropped))  # two copies each were inserted


def _models(vocab):

    plm = parallelize(build_model("width-64", vocab, device="meta", initializer_range=0.3), GRID, seed=5)
    hf = build_model("width-64", vocab, initializer_range=0.3)
    hf.load_state_dict(plm.full_state_dict())
    return plm.eval(), hf.eval()


@torch.no_grad()
def test_a_buried_canary_trains_in_its_evaluation_context(buried):
    plm, hf = _models(buried.vocab_size)
    checked = 0
    for c in buried.canaries:
        want = -sequence_logprobs(hf, [[buried.eos_id, *c.token_ids]]).logprobs[0]  # [len(canary)]
        for p in c.placements:
            row = {k: torch.from_numpy(v) for k, v in buried.rows(p.seq_index, p.seq_index + 1).items()}
            span = slice(p.offset - 1, p.offset - 1 + len(c.token_ids))  # labels of the canary's tokens
            masked = plm.token_losses(row["input_ids"], row["labels"], row["position_ids"])[0, span].double()
            np.testing.assert_allclose(masked.numpy(), want, rtol=1e-5, atol=1e-5)
            if p.offset > 1:
                packed = plm.token_losses(row["input_ids"], row["labels"])[0, span].double().numpy()
                assert np.abs(packed - want).max() > 1e-2  # the row's text changes a classic packed row
                checked += 1
    assert checked >= 4


def test_teacher_forced_exact_match_is_greedy_extraction():
    g = torch.Generator().manual_seed(11)
    seqs = torch.randint(0, 256, (8, 40), generator=g).tolist()
    model = tiny_model("llama", seed=2, hidden=64, init_std=0.02)
    train_to_memorize(model, seqs, steps=15)  # partly: some suffixes come back, some do not
    plm = parallelize(copy.deepcopy(model), GRID, weights="model")  # parallelize replaces the copy's modules
    scores = teacher_forced(plm, [[0, *s] for s in seqs])
    outcomes = set()
    for n in range(1, 25):
        greedy = greedy_decode(model, [[0, *s[:-n]] for s in seqs], n)
        for s, gen, (_, right) in zip(seqs, greedy.tolist(), scores):
            exact = gen == s[-n:]
            assert bool(right[-n:].all()) == exact, (n, s)
            outcomes.add(exact)
    assert outcomes == {True, False}  # both kinds of outcome were compared
    lp = sequence_logprobs(model, [[0, *s] for s in seqs]).logprobs
    np.testing.assert_allclose(np.concatenate([loss for loss, _ in scores]), -np.concatenate(lp), rtol=1e-5,
                               atol=1e-6)
