"""Document attention: the engine's block-causal mask and the probe that chooses it (memtrain/hf/documents.py)."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import parallel
from memtrain.hf import parallelize
from memtrain.hf.documents import alibi_from_documents, block_causal_mask
from parallel.forked import run_ranks
from tests.memtrain._models import tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEED = 3


def test_block_causal_mask_lets_each_token_see_its_own_documents_past():
    """Against the definition, token by token: j is seen from i when j <= i and no document starts in (j, i]. The
    second row starts inside a document (positions 3, 4), as a row cut from a packed stream may."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [3, 4, 0, 1, 2, 3, 0, 1, 2]])
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    S = positions.shape[1]
    want = torch.tensor([[[j <= i and not starts[b, j + 1:i + 1].any() for j in range(S)] for i in range(S)]
                         for b in range(2)])[:, None]
    assert torch.equal(block_causal_mask(positions, "sdpa", torch.float32), want)
    additive = block_causal_mask(positions, "eager", torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert torch.equal(additive == 0, want) and (additive[~want] == torch.finfo(torch.bfloat16).min).all()
    with pytest.raises(ValueError, match="needs attn_implementation sdpa or eager, not 'flash_attention_2'"):
        block_causal_mask(positions, "flash_attention_2", torch.float32)  # changed after isolate_documents


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_alibi_from_a_block_causal_mask_is_each_documents_own(mask_dtype):
    """BLOOM's ALiBi, built from the engine's mask (bool or additive), holds for each document bitwise the biases
    BLOOM builds for that document alone: slope x position within the document, not within the row (equal after
    the softmax only up to rounding, which the scoring test below cannot tell apart). A 2-D mask is BLOOM's own
    builder's as before."""
    model = tiny("bloom").transformer
    own = model.build_alibi_tensor
    alibi_from_documents(model)
    lengths, heads = (5, 6, 5), model.config.n_head
    positions = torch.cat([torch.arange(n) for n in lengths])[None].repeat(2, 1)
    impl = "sdpa" if mask_dtype == torch.bool else "eager"
    got = model.build_alibi_tensor(block_causal_mask(positions, impl, torch.float32), heads, torch.bfloat16)
    assert got.shape == (2 * heads, 1, sum(lengths))
    for doc, start in zip(lengths, (0, 5, 11)):
        alone = own(torch.ones(2, doc), heads, torch.bfloat16)
        assert torch.equal(got[:, :, start:start + doc], alone)
    padded = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    assert torch.equal(model.build_alibi_tensor(padded, heads, torch.float32), own(padded, heads, torch.float32))


@pytest.mark.parametrize("family, impl", [("opt", "sdpa"), ("opt", "eager"), ("bloom", "eager")])
def test_a_packed_row_scores_as_each_document_alone(family, impl):
    """OPT's own mask ignores position ids, and BLOOM builds ALiBi from a 2-D mask: their documents would see each
    other (without the engine's mask the losses below move by 0.06-0.08 for OPT, 1e-3 for BLOOM from its small
    init). With it, and BLOOM's ALiBi from positions within each document, a row packing three documents gets the
    per-token losses the plain transformers model gives each document on its own. Tolerance 1e-5 relative: the
    same products, but the attention's matmuls span the row's other (zero-weighted) keys too, which moves rounding
    by ~1e-7. BLOOM has no SDPA path."""
    ref = AutoModelForCausalLM.from_config(tiny(family, "meta").config, attn_implementation=impl).eval()
    plm = parallelize(copy.deepcopy(ref), parallel.Grid(1, 1, 1, 1), "easy", weights="model").eval()
    assert plm.isolate_documents()
    lengths = (5, 6, 5)
    ids = torch.randint(0, 96, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = torch.cat([torch.cat([doc[1:], torch.tensor([-100])]) for doc in ids[0].split(lengths)])[None]
    with torch.no_grad():
        got = plm.token_losses(ids, labels, positions)
        alone = torch.cat([F.cross_entropy(ref(doc[None]).logits[0], lab, reduction="none")
                           for doc, lab in zip(ids[0].split(lengths), labels[0].split(lengths))])
        plm._document_mask = False  # OPT's own mask
        leaked = plm.token_losses(ids, labels, positions)
    assert (got[0] - alone).abs().max() <= 1e-5 * alone.abs().max()
    assert (leaked[0] - alone).abs().max() > 10 * 1e-5 * alone.abs().max()  # the tolerance tells them apart


def _isolation(rank, world):
    grid = parallel.Grid(1, 2, 1, 1, rank=rank)
    grid.build_groups()
    return {fam: parallelize(tiny(fam, "meta"), grid, mode, seed=SEED, device="cpu").isolate_documents()
            for fam, mode in (("llama", "sharded"), ("gpt2", "sharded"), ("opt", "easy"), ("bloom", "easy"))}


@pytest.mark.filterwarnings("ignore:_compile flag on create_block_mask")  # transformers' flex path, torch's words
def test_which_models_keep_packed_documents_apart():
    """Llama, GPT-NeoX and GPT-2 keep packed documents apart by transformers' own mask; OPT and MPT, whose masks
    ignore position ids, and BLOOM, whose ALiBi is built from a 2-D mask, by the engine's; OPT under flex attention
    (which takes no plain 4-D mask) by neither, so the trainer refuses it with the fix. The probe is collective: on
    a grid every rank gives the same answer."""
    one = {}
    for fam, mode in (("llama", "sharded"), ("neox", "sharded"), ("gpt2", "sharded"), ("opt", "easy"),
                      ("mpt", "easy"), ("bloom", "easy")):
        plm = parallelize(tiny(fam, "meta"), parallel.Grid(1, 1, 1, 1), mode, seed=SEED, device="cpu")
        one[fam] = (plm.isolate_documents(), plm._document_mask)
    flex = AutoModelForCausalLM.from_config(tiny("opt", "meta").config, attn_implementation="flex_attention")
    plm = parallelize(flex, parallel.Grid(1, 1, 1, 1), "easy", seed=SEED, device="cpu")
    one["opt-flex"] = (plm.isolate_documents(), plm._document_mask)
    assert one == {"llama": (True, False), "neox": (True, False), "gpt2": (True, False), "opt": (True, True),
                   "mpt": (True, True), "bloom": (True, True), "opt-flex": (False, False)}
    assert run_ranks(2, _isolation) == [{"llama": True, "gpt2": True, "opt": True, "bloom": True}] * 2
