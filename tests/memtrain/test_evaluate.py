"""Evaluation sees the context training saw, and teacher forcing decides exact match as greedy decoding does.

- Context: a canary buried mid-row trains, under document attention, in exactly the context evaluation gives
  it ([EOS] + canary from position 0): the teacher-forced loss of every canary token in its training row (the
  trainer's path: ParallelLM.token_losses with the stream's position_ids) equals the loss on the evaluation
  sequence (eval.sequence_logprobs on the plain HF model with the same weights), to 1e-5 relative (the two
  compute the same dot products in a different order: masked attention over the row vs causal attention over
  the short sequence). Without the position ids (classic packing) the same row gives other losses: the test
  can fail. A large init (std 0.3) makes the logits depend strongly on context.
- On the grid: the whole final evaluation (extraction, MIA, exposure, validation loss) of a partly memorized model
  on 8 gloo ranks, sharded (1,2,2,2) and easy (2,2,1,2) through `GridModel`, equals the plain model's on one
  process: the same greedy tokens and exact/token/ROUGE/prefix metrics, losses and MIA scores within 1e-5
  relative (sharded matmuls and the vocabulary-parallel softmax sum in another order), every rank with the same
  results, and the files of the rank told to write them (rank 0, as evaluate_after picks; the CLI test runs that).
- Teacher forcing: on a partly memorized model, "every suffix token is the greedy choice given the true
  tokens before it" (memtrain.hf.teacher_forced, one forward pass) equals "greedy decoding reproduces the
  suffix" (eval.greedy_decode), sequence by sequence, for every suffix length from 1 to 24 (a mix of hits
  and misses).
"""

import copy
import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import parallel  # noqa: E402
from eval import greedy_decode, sequence_logprobs  # noqa: E402
from memtrain.config import EvalConfig, RunConfig  # noqa: E402
from memtrain.data import CanaryConfig, DataConfig, build_stream  # noqa: E402
from memtrain.evaluate import evaluate  # noqa: E402
from memtrain.hf import GridModel, parallelize, teacher_forced  # noqa: E402
from memtrain.models import build_model  # noqa: E402
from parallel.forked import run_ranks  # noqa: E402
from tests.eval._models import tiny_model, train_to_memorize  # noqa: E402
from tests.memtrain._helpers import memtrain, refused  # noqa: E402

GRID = parallel.Grid(1, 1, 1, 1)  # one process: no process group needed


@pytest.fixture(scope="module")
def buried(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[::5][:30]:
        (corpus / f"{p.stem}.txt").write_text(p.read_text("utf-8")[:6000])
    data = DataConfig(corpus=str(corpus), vocab_size=400, seq_len=96, cache_dir=str(tmp_path_factory.mktemp("c")))
    return build_stream(data, CanaryConfig(number=4, copies=[2], length=24, placement="random"), seed=3)


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


def _partly_memorized(stream):
    """A small Llama trained on the canaries alone until some, not all, come back verbatim."""
    torch.manual_seed(0)
    model = build_model("ladder-1m", stream.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=4, intermediate_size=128)
    seqs = [[stream.eos_id, *c.token_ids] for c in stream.canaries]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = labels[i, :len(s)] = torch.tensor(s)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(40):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _evaluate_on_grid(rank, world, model, stream, cfg, out, degrees, mode):
    grid = parallel.Grid(*degrees, rank=rank)
    grid.build_groups()
    plm = parallelize(copy.deepcopy(model), grid, mode, weights="model")
    return evaluate(GridModel(plm), stream, cfg, out, steps=1, write=rank == 0)


ROW_EXACT = ("generated", "exact_match", "token_match", "rouge_l", "rouge_l_text", "longest_prefix")
ROW_CLOSE = ("loss", "min_k", "min_k_pp", "zlib", "exposure")


@pytest.mark.parametrize("degrees,mode", [((1, 2, 2, 2), "sharded"), ((2, 2, 1, 2), "easy")])
def test_evaluation_on_the_grid_equals_one_process(buried, tmp_path, degrees, mode):
    cfg = RunConfig(eval=EvalConfig(suffix_len=8, batch_size=4, exposure_samples=32, val_docs=8, pythia=False))
    model = _partly_memorized(buried)
    want = evaluate(model, buried, cfg, tmp_path / "one", steps=1)
    assert 0 < want["exact_count"] < want["n"] and want["twins"]["exact_count"] < want["twins"]["n"]
    per_rank = run_ranks(8, _evaluate_on_grid, model, buried, cfg, tmp_path / "grid", degrees, mode)
    for rank, got in enumerate(per_rank):
        assert len(got["rows"]) == len(want["rows"]) == 2 * len(buried.canaries)
        compared = 0
        for a, b in zip(want["rows"], got["rows"]):
            assert {k: a[k] for k in ROW_EXACT} == {k: b[k] for k in ROW_EXACT}, (rank, a["id"])
            for k in ROW_CLOSE:  # exposure is None for document canaries
                assert (a[k] is None) == (b[k] is None), (rank, a["id"], k)
                if a[k] is not None:
                    assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (rank, a["id"], k)
                    compared += 1
        assert compared == len(ROW_CLOSE) * len(want["rows"]) - len(want["rows"]) // 2  # all but documents'
        for k in ("exact_count", "n_evaluated", "mia_auc_loss", "token_match", "rougeL"):
            assert got[k] == want[k], (rank, k)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    written = json.loads((tmp_path / "grid" / "eval.json").read_text())
    assert written["exact_count"] == want["exact_count"] and len(list((tmp_path / "grid").iterdir())) == 2


def test_a_twin_is_scored_against_candidates_with_its_own_name(buried):
    """Exposure ranks a secret among alternatives that differ in the digits only: the twin's alternatives carry
    the twin's name (with the member's, the twin itself is not among them and its exposure is ~0 by
    construction)."""
    import numpy as np

    from memtrain.data.canaries import make_random_canaries
    from memtrain.evaluate import _candidates

    tok = buried.tokenizer
    for c in make_random_canaries(CanaryConfig(number=3, secret_groups=2), tok, np.random.default_rng(0)):
        space = c.candidate_space
        for twin, slots, ids in ((False, space["slots"], c.token_ids), (True, space["twin_slots"], c.twin_token_ids)):
            fn, size = _candidates(c, tok, twin=twin)
            assert size == 10**8 and slots["name"] != space["twin_slots" if not twin else "slots"]["name"]
            assert fn([int(slots["secret"].replace("-", ""))]) == [list(ids)]


def test_re_evaluation_with_other_settings_goes_to_its_own_directory(tiny_run, tmp_path):
    """`memtrain eval RUN --set eval.*` writes into --out (the run's own eval.json stays its config's) with the
    settings given; without --out it is refused, and a key of another section is refused as the line is read."""
    before = (tiny_run.out / "eval.json").read_bytes()
    r = memtrain("eval", tiny_run.out, "--set", "eval.exposure_samples=16", "--suffix-len", "6", "--out",
                 tmp_path / "again")
    assert r.returncode == 0, r.stderr[-3000:]
    again = json.loads((tmp_path / "again" / "eval.json").read_text())
    assert (again["exposure_samples"], again["suffix_len"]) == (16, 6)
    assert {row["suffix_len"] for row in map(json.loads, (tmp_path / "again" / "eval_canaries.jsonl").read_text()
                                             .splitlines()) if row["kind"] == "document"} == {6}
    assert (tiny_run.out / "eval.json").read_bytes() == before
    refused(memtrain("eval", tiny_run.out, "--set", "eval.exposure_samples=16"), "needs --out DIR")
    refused(memtrain("eval", tiny_run.out, "--set", "train.lr=0.1", "--out", tmp_path / "x"), "train.lr")


def test_an_earlier_checkpoint_is_scored_apart_with_the_copies_trained_by_its_step(tiny_run, tmp_path):
    """`memtrain eval RUN --checkpoint step_3` of a 6-step run: refused without --out (the run's own eval.json is
    its final model's), and with --out each canary counts the copies trained in steps 1-3 (the manifest's steps
    0-2), not the run's 6. A checkpoint of another run is refused: its weights would be scored on this run's
    canaries."""
    run = tmp_path / "run"
    r = memtrain("train", "--config", tiny_run.recipe, "--out", run, "--set", "train.checkpoint_every=3",
                 "--set", "train.keep_checkpoints=2")
    assert r.returncode == 0, r.stderr[-3000:]
    before = (run / "eval.json").read_bytes()
    early = run / "checkpoints" / "step_000003"
    refused(memtrain("eval", run, "--checkpoint", early), "is step 3 of a 6-step run: add --out DIR")
    assert (run / "eval.json").read_bytes() == before
    r = memtrain("eval", run, "--checkpoint", early, "--out", tmp_path / "at3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "at3" / "eval.json").read_text())["steps"] == 3
    trained = {c["id"]: sum(p["step"] < 3 for p in c["placements"])
               for c in map(json.loads, (run / "canaries.jsonl").read_text().splitlines())}
    rows = [json.loads(x) for x in (tmp_path / "at3" / "eval_canaries.jsonl").read_text().splitlines()]
    assert {row["id"]: row["copies"] for row in rows if row["inserted"]} == trained
    assert sum(trained.values()) < sum(c["copies"] for c in map(json.loads, (run / "canaries.jsonl")
                                                              .read_text().splitlines()))  # some come later
    other = tiny_run.out / "checkpoints" / "step_000006"
    refused(memtrain("eval", run, "--checkpoint", other, "--out", tmp_path / "x"), "is not one of")


def test_a_run_whose_stream_key_predates_this_memtrain_is_evaluated_if_its_canaries_are_the_same(tiny_run, tmp_path):
    """A stream's key grows when memtrain keys streams by more settings (such as the unique_against corpus's
    content), and the runs trained before then would be refused as "another stream". Their corpus fingerprint
    (run.json) and manifest (every canary, twin and placement) say whether the rebuilt stream is the one they
    trained on: then they are evaluated, with a note; a changed canary or corpus is still refused."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run.out, run)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps(dict(info, stream_key="an older key")))
    r = memtrain("eval", run, "--set", "eval.exposure_samples=16", "--out", tmp_path / "again")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "its stream's key predates this memtrain's" in r.stderr
    assert json.loads((tmp_path / "again" / "eval.json").read_text())["n"] == json.loads(
        (run / "eval.json").read_text())["n"]
    manifest = [json.loads(line) for line in (run / "canaries.jsonl").read_text().splitlines()]
    manifest[0]["token_ids"][-1] += 1
    (run / "canaries.jsonl").write_text("".join(json.dumps(c) + "\n" for c in manifest))
    refused(memtrain("eval", run, "--out", tmp_path / "x"), "was trained on another stream")
    shutil.copy(tiny_run.out / "canaries.jsonl", run / "canaries.jsonl")
    corpus = dict(info["corpus"], fingerprint="0" * 64)
    (run / "run.json").write_text(json.dumps(dict(info, stream_key="an older key", corpus=corpus)))
    refused(memtrain("eval", run, "--out", tmp_path / "y"), "was trained on another stream")
