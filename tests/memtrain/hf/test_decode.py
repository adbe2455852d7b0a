"""Greedy decoding on a parallelized model (8 gloo ranks) vs transformers' `generate` on one process.

The tiny models of tests/_helpers.py (Llama with GQA, GPT-NeoX, GPT-2 with a vocabulary of 99 that
is padded on Y=2 and Y=8) with a larger init (std 0.3, so greedy decoding is not stuck on one token)
decode a batch of prefixes of mixed lengths on every 8-rank grid in sharded and easy mode. The tokens
must equal `model.generate(do_sample=False, max_new_tokens=N_NEW)` of the plain HF model with the same
weights, token for token, on every rank. Ten prefixes with 4 rows per rank: 1 global batch of 10 (+6
dummy rows) on 8 row groups, 2 batches on 2 or 4 groups, 3 on 1 group, so dummy rows, several batches
and lockstep are all exercised. The same grids score the prefixes with their continuations teacher-forced
(`teacher_forced`, and `parallel_sequence_logprobs` with the softmax statistics Min-K%++ needs) against
`eval.sequence_logprobs` of the plain model.
"""

import os
import time

import numpy as np
import pytest
import torch

import parallel
from eval.decode import greedy_decode, pad_left, sequence_logprobs
from memtrain.hf import (
    ParallelStepper,
    parallel_greedy_decode,
    parallel_sequence_logprobs,
    parallelize,
    teacher_forced,
)
from parallel import vocab_parallel_argmax
from parallel.forked import run_ranks
from tests._helpers import GRIDS, MODES, grid_id, once_per_session
from tests.memtrain._models import tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("llama", "neox", "gpt2")
SEED, STD, N_NEW, BATCH = 3, 0.3, 6, 4
LENGTHS = [3, 1, 7, 5, 2, 8, 4, 6, 3, 2]  # + N_NEW <= 16 = GPT-2's n_positions


def model(fam, device=None):
    return tiny(fam, device, initializer_range=STD)


def prefixes(vocab):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def reference(fam):
    """The engine's seeded weights in the plain HF model: generate on the left-padded batch, and the
    teacher-forced log-probs (with their vocabulary mean and std) of every prefix followed by its greedy
    continuation, concatenated [3, tokens]."""
    init = parallelize(model(fam, "meta"), parallel.Grid(1, 1, 1, 1), seed=SEED, device="cpu").full_state_dict()
    hf = model(fam)
    hf.load_state_dict(init, strict=not hf.config.tie_word_embeddings)
    hf.eval()
    hf.generation_config.eos_token_id = None  # always exactly N_NEW tokens
    hf.generation_config.pad_token_id = 0
    ids, mask = pad_left(prefixes(hf.config.vocab_size))
    with torch.no_grad():
        gen = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=N_NEW)[:, ids.shape[1]:]
    lp = sequence_logprobs(hf, continued(prefixes(hf.config.vocab_size), gen), with_stats=True)
    return gen, np.stack([np.concatenate(a) for a in (lp.logprobs, lp.mean, lp.std)])


def continued(prefixes, gen):
    return [p + g for p, g in zip(prefixes, gen.tolist())]


def _argmax_cases(grid):
    """vocab_parallel_argmax against torch.argmax: ties across members, padding with the largest values."""
    y = grid.y
    v_local = 5
    full = torch.randint(0, 4, (6, y * v_local), generator=torch.Generator().manual_seed(1)).float()
    full[0] = 2.0  # all tied: index 0
    full[1, -1] = 9.0  # the largest value is in the padding: must not win
    valid = y * v_local - 2
    local = full[:, grid.coord("y") * v_local:(grid.coord("y") + 1) * v_local]
    got = vocab_parallel_argmax(local, grid, "y", valid)
    return torch.equal(got, full[:, :valid].argmax(-1))


def _worker(rank, world, refs):
    out = {}
    for degrees in GRIDS:
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        out[("argmax", degrees)] = _argmax_cases(grid)
        for fam in FAMILIES:
            for mode in MODES:
                plm = parallelize(model(fam, "meta"), grid, mode, seed=SEED, device="cpu")
                out[(degrees, fam, mode)] = parallel_greedy_decode(plm, prefixes(plm.config.vocab_size), N_NEW,
                                                                   batch_size=BATCH)
                scores = teacher_forced(plm, continued(prefixes(plm.config.vocab_size), refs[fam][0]), BATCH)
                out[("teacher", degrees, fam, mode)] = (np.concatenate([loss for loss, _ in scores]),
                                                        [bool(right[-N_NEW:].all()) for _, right in scores])
                lp = parallel_sequence_logprobs(plm, continued(prefixes(plm.config.vocab_size), refs[fam][0]), BATCH,
                                                with_stats=True)
                out[("logprobs", degrees, fam, mode)] = np.stack([np.concatenate(a)
                                                                  for a in (lp.logprobs, lp.mean, lp.std)])
                if degrees == (2, 2, 2, 1):
                    # The stepper alone through eval's own list API: every rank decodes every prefix.
                    out[("stepper", fam, mode)] = greedy_decode(ParallelStepper(plm), prefixes(plm.config.vocab_size),
                                                                N_NEW, batch_size=BATCH)
    return out


@pytest.fixture(scope="module")
def results(request):
    def compute():
        refs = {fam: reference(fam) for fam in FAMILIES}
        t = time.perf_counter()
        per_rank = run_ranks(8, _worker, refs)
        print(f"8 ranks: {time.perf_counter() - t:.1f} s")
        return refs, per_rank

    return once_per_session(request, compute)


def test_references_are_not_degenerate(results):
    refs, _ = results
    for fam, (ref, _) in refs.items():
        assert ref.shape == (len(LENGTHS), N_NEW)
        assert len(set(ref.flatten().tolist())) >= 15, (fam, ref)  # of 60 tokens


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_decode_matches_generate(results, degrees, fam, mode):
    refs, per_rank = results
    for rank, out in enumerate(per_rank):
        got = out[(degrees, fam, mode)]
        assert torch.equal(got, refs[fam][0]), (rank, got, refs[fam][0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_teacher_forced_scores_match_one_process(results, degrees, fam, mode):
    """Losses within 1e-5 of the plain model's (sharded matmuls sum in another order), and every greedily
    generated token is the greedy choice under teacher forcing (exact match is one forward pass)."""
    refs, per_rank = results
    for rank, out in enumerate(per_rank):
        losses, greedy = out[("teacher", degrees, fam, mode)]
        np.testing.assert_allclose(losses, -refs[fam][1][0], rtol=1e-5, atol=1e-5, err_msg=str(rank))
        assert all(greedy), rank


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_sequence_logprobs_match_one_process(results, degrees, fam, mode):
    """Log-probs and their vocabulary mean and std within 1e-5 of eval's on whole logits (the softmax sums
    split over Y in another order); vocabulary padding (GPT-2's 99 on Y=2 and 8) stays out of all three."""
    refs, per_rank = results
    for rank, out in enumerate(per_rank):
        np.testing.assert_allclose(out[("logprobs", degrees, fam, mode)], refs[fam][1], rtol=1e-5, atol=1e-5,
                                   err_msg=str(rank))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fam", FAMILIES)
def test_stepper_with_eval_greedy_decode(results, fam, mode):
    refs, per_rank = results
    for out in per_rank:
        assert torch.equal(out[("stepper", fam, mode)], refs[fam][0])


@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_vocab_parallel_argmax_ties_and_padding(results, degrees):
    assert all(out[("argmax", degrees)] for out in results[1])


def test_single_process_and_bad_inputs():
    plm = parallelize(model("gpt2", "meta"), parallel.Grid(1, 1, 1, 1), "easy", seed=SEED, device="cpu")
    plm.train()
    got = parallel_greedy_decode(plm, prefixes(99), N_NEW, batch_size=3)
    assert torch.equal(got, reference("gpt2")[0]) and plm.training  # decoded in eval mode, mode restored
    assert parallel_greedy_decode(plm, [], N_NEW).shape == (0, N_NEW)
    with pytest.raises(ValueError, match="at least one token"):
        parallel_greedy_decode(plm, [[1], []], N_NEW)
    with pytest.raises(ValueError, match="n_new=0"):
        parallel_greedy_decode(plm, [[1]], 0)
    with pytest.raises(ValueError, match="empty sequence"):
        parallel_sequence_logprobs(plm, [[1, 2], []])


def _mamba_decodes(rank, world, seqs):
    grid = parallel.Grid(1, 1, world, 1, rank=rank)
    grid.build_groups()
    plm = parallelize(model("mamba", "meta"), grid, "easy", seed=SEED, device="cpu")
    return parallel_greedy_decode(plm, seqs, N_NEW, batch_size=2)


def test_a_state_space_model_decodes_left_padded_rows_as_each_alone():
    """Mamba multiplies its input by the 2-D mask, so on a cached step (one token, a longer mask) it must take none,
    as its generation hook says: with the mask, padded rows decoded garbage (a step broadcast to the mask's length).
    And all ranks pass their mask or none: rows of 3, 3, 5 and 5 tokens on Y=2 pad one rank's rows only, and the
    ranks' collectives mismatched. Eval's decoding of the plain model and the grid's both give each row's own
    `generate` tokens."""
    seqs = [[5, 6, 7], [3, 4, 5], [9, 8, 7, 6, 5], [1, 2, 3, 4, 5]]
    hf = model("mamba")
    init = parallelize(model("mamba", "meta"), parallel.Grid(1, 1, 1, 1), seed=SEED, device="cpu").full_state_dict()
    hf.load_state_dict(init, strict=not hf.config.tie_word_embeddings)
    hf.eval()
    want = torch.stack([hf.generate(torch.tensor([s]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(s):] for s in seqs])
    assert torch.equal(greedy_decode(hf, seqs, N_NEW, batch_size=4), want)
    for got in run_ranks(2, _mamba_decodes, seqs):
        assert torch.equal(got, want)
