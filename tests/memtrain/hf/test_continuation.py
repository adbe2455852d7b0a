"""Continuations of a shared context scored on the grid (`parallel_continuation_logprobs`: every rank runs the
context once and copies its KV cache of local heads to each batch) equal eval's whole-sequence scores of the plain
HF model, and exposure through `GridModel` (candidates scored after their common head) equals one process's.

8 gloo ranks, on a grid with data and X, Y > 1 and one with Z > 1, in sharded and easy mode, for Llama (GQA),
GPT-NeoX and GPT-2 (vocabulary 99, padded on Y=2); 4 rows per rank, so several batches with dummy rows. Within
1e-5 nats per log-prob (sharded matmuls and the vocabulary-parallel softmax sum in another order, the context in a
batch of one) and 1e-4 bits of exposure (Px sums ~10 of them; the fitted log-CDF is smooth in Px).
"""

import math
import os
import time

import numpy as np
import pytest

import parallel
from eval.decode import continuation_logprobs, sequence_logprobs
from eval.exposure import SlotSpace, exposure
from memtrain.hf import GridModel, parallelize
from memtrain.hf.decode import parallel_continuation_logprobs
from parallel.forked import run_ranks
from tests._helpers import MODES, grid_id, once_per_session
from tests.memtrain._models import tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("llama", "neox", "gpt2")
GRIDS = [(2, 2, 2, 1), (1, 2, 2, 2)]
SEED, STD, BATCH = 3, 0.3, 4
CONTEXT = [5, 17, 42, 8, 61, 23]
CONTINUATIONS = [[3, 9], [77], [], [12, 50, 31, 7, 90], [4, 4], [66, 2, 18], [1, 2, 3, 4], [88, 9, 13], [70]]
SPACE = SlotSpace(3, [[70 + d] if d % 2 else [70 + d, 80 + d] for d in range(10)])  # rows of 3 to 6 tokens


def candidates(indices):  # a 4-token template before the slots, as a secret's "The secret code of <name> is"
    return [[30, 31, 32, 33, *s] for s in SPACE.render(indices)]


def expose(model, batch_tokens=0):
    r = exposure(model, [1], candidates, SPACE.size, true_index=456, exact_limit=0, n_samples=40, batch_size=BATCH,
                 batch_tokens=batch_tokens, chunk=25)
    return r.exposure, r.log_perplexity


def plain(fam):
    init = parallelize(tiny(fam, "meta", initializer_range=STD), parallel.Grid(1, 1, 1, 1), seed=SEED,
                       device="cpu").full_state_dict()
    hf = tiny(fam, initializer_range=STD)
    hf.load_state_dict(init, strict=not hf.config.tie_word_embeddings)
    return hf.eval()


def _worker(rank, world):
    out = {}
    for degrees in GRIDS:
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        for fam in FAMILIES:
            for mode in MODES:
                plm = parallelize(tiny(fam, "meta", initializer_range=STD), grid, mode, seed=SEED, device="cpu")
                for context in (CONTEXT, CONTEXT[:1]):
                    out[(degrees, fam, mode, len(context))] = parallel_continuation_logprobs(
                        plm, context, CONTINUATIONS, batch_size=BATCH)
                out[("exposure", degrees, fam, mode)] = expose(GridModel(plm), batch_tokens=64)
    return out


@pytest.fixture(scope="module")
def results(request):
    def compute():
        refs = {}
        for fam in FAMILIES:
            hf = plain(fam)
            for context in (CONTEXT, CONTEXT[:1]):
                refs[(fam, len(context))] = sequence_logprobs(hf, [context + c for c in CONTINUATIONS]).logprobs
            refs[("exposure", fam)] = expose(hf)
        t = time.perf_counter()
        per_rank = run_ranks(8, _worker)
        print(f"8 ranks: {time.perf_counter() - t:.1f} s")
        return refs, per_rank

    return once_per_session(request, compute)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_continuations_on_the_grid_equal_whole_sequences(results, degrees, fam, mode):
    refs, per_rank = results
    for rank, out in enumerate(per_rank):
        for n in (len(CONTEXT), 1):
            context_lp, lps = out[(degrees, fam, mode, n)]
            whole = refs[(fam, n)]
            np.testing.assert_allclose(context_lp, whole[0][:n - 1], rtol=0, atol=1e-5, err_msg=str(rank))
            for lp, ref, c in zip(lps, whole, CONTINUATIONS):
                assert lp.shape == (len(c),), rank
                np.testing.assert_allclose(lp, ref[n - 1:], rtol=0, atol=1e-5, err_msg=str(rank))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_exposure_on_the_grid_equals_one_process(results, degrees, fam, mode):
    refs, per_rank = results
    want, want_px = refs[("exposure", fam)]
    assert 0.2 < want < math.log2(SPACE.size)  # neither nil nor capped: the comparison means something
    for rank, out in enumerate(per_rank):
        got, px = out[("exposure", degrees, fam, mode)]
        assert got == pytest.approx(want, abs=1e-4) and px == pytest.approx(want_px, abs=1e-4), rank


def test_empty_context_is_refused():
    plm = parallelize(tiny("gpt2", "meta"), parallel.Grid(1, 1, 1, 1), "easy", seed=SEED, device="cpu")
    with pytest.raises(ValueError, match="non-empty context"):
        parallel_continuation_logprobs(plm, [], [[1, 2]])


def _continuations_on_y2(rank, world, family):
    grid = parallel.Grid(1, 1, world, 1, rank=rank)
    grid.build_groups()
    plm = parallelize(tiny(family, "meta", initializer_range=STD), grid, "easy", seed=SEED, device="cpu")
    return parallel_continuation_logprobs(plm, CONTEXT, CONTINUATIONS, batch_size=BATCH)


@pytest.mark.parametrize("family", ["mamba", "falcon_h1"])
def test_a_state_space_models_continuations_are_scored_whole(family):
    """A cache of recurrent states serves one row only (Mamba's has no batch_repeat_interleave; Falcon-H1's repeats
    its keys and values but not its states): eval's and the grid's continuations of a stateful model are scored as
    whole sequences, within 1e-5 nats of eval's whole-sequence scores (Y=2 in easy mode sums the products in another
    order)."""
    hf = plain(family)
    whole = sequence_logprobs(hf, [CONTEXT + c for c in CONTINUATIONS]).logprobs
    n = len(CONTEXT)
    for context_lp, lps in [continuation_logprobs(hf, CONTEXT, CONTINUATIONS, batch_size=BATCH),
                            *run_ranks(2, _continuations_on_y2, family)]:
        np.testing.assert_allclose(context_lp, whole[0][:n - 1], rtol=0, atol=1e-5)
        for lp, ref, c in zip(lps, whole, CONTINUATIONS):
            assert lp.shape == (len(c),)
            np.testing.assert_allclose(lp, ref[n - 1:], rtol=0, atol=1e-5)
