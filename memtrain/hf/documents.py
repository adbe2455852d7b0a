"""Packed documents kept apart: the attention mask a model family needs for document attention, and the probe that
says whether a model gets it.

Document attention (data.document_attention) packs several documents into a row and gives it position ids that
restart at each one. Most transformers families pass those position ids to their mask (transformers' packed-sequence
path), so every document attends to itself only. Some never do (OPT, MPT, XGLM among those checked), and their
documents attend across the row. For them the engine builds the same block-causal mask here and passes it as the
attention mask, already in the 4-D form their forward takes as is. BLOOM builds its ALiBi from a 2-D mask: given
the 4-D one, its model builds ALiBi from the positions within each document instead (`alibi_from_documents`), the
biases each document gets alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# the attention implementations whose 4-D mask is a plain tensor: bool (True attends) or additive float
MASK_FORMATS = {"sdpa": "bool", "eager": "additive"}


def block_causal_mask(position_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The [b, 1, S, S] mask in which each token sees the earlier tokens of its own document: a document starts
    wherever a position does not follow the one before it. In the format `attn_implementation` adds or selects by
    (MASK_FORMATS); additive masks in `dtype`, the parameters' (transformers builds its own in the dtype of the
    embeddings' output, which autocast leaves in the parameters')."""
    if attn_implementation not in MASK_FORMATS:  # it changed since isolate_documents chose this mask
        raise ValueError(f"document attention by a block-causal mask needs attn_implementation sdpa or eager, not "
                         f"{attn_implementation!r}: set it back, or data.document_attention=false")
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    document = starts.cumsum(-1)
    S = position_ids.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool, device=position_ids.device).tril()
    sees = ((document[:, :, None] == document[:, None, :]) & causal)[:, None]
    if MASK_FORMATS[attn_implementation] == "bool":
        return sees
    return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(~sees, torch.finfo(dtype).min)


def alibi_from_documents(model: torch.nn.Module) -> None:
    """Let a model that builds ALiBi by its `build_alibi_tensor(mask, num_heads, dtype)` method (BLOOM) take the
    block-causal mask: from a 4-D mask the biases are slope x the key's position within its document, as that
    document alone gets them (bit for bit: the same float32 products of a slope and an integer); a 2-D mask or
    none goes to the model's own builder. Nothing changes for a model without that method."""
    own = getattr(model, "build_alibi_tensor", None)
    if own is None or getattr(own, "from_documents", False):
        return

    def build(mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        if mask.ndim != 4:
            return own(mask, num_heads, dtype)
        sees = mask if mask.dtype == torch.bool else mask == 0
        # row k of a block-causal mask sees its document's first token through k: k's position in its document
        positions = sees[:, 0].sum(-1) - 1
        slopes = own(torch.ones(1, 2, device=mask.device), num_heads, torch.float32)[:, 0, 1]  # slope x position 1
        b, S = positions.shape
        return (slopes[None, :, None] * positions[:, None, :]).reshape(b * num_heads, 1, S).to(dtype)

    build.from_documents = True
    model.build_alibi_tensor = build


def leak(token_losses: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
         vocab_size: int) -> torch.Tensor:
    """How far a row's losses move when what they must not see changes, as a fraction of how far they move when
    what they must see changes: 0 for a model that keeps documents apart and attends causally, O(1) for one that
    does not, whatever its weights' scale (a model fresh from a small init moves its losses by 1e-5 of their size
    either way). Rows of two documents, scored as they are, with the first document changed (the second's losses
    must not move), with the last token changed (no loss before it may move), and with the second document's first
    token changed (the losses after it must). `token_losses(ids, labels, positions)` scores one row [1, S]; the
    result is a float32 tensor of one element on the device the losses are on."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8],
                        [9, 10, 11, 4, 5, 6, 7, 8],
                        [1, 2, 3, 4, 5, 6, 7, 12],
                        [1, 2, 3, 13, 5, 6, 7, 8]]) % vocab_size
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * len(ids))
    labels = torch.full_like(ids, -100)
    labels[:, 3:6] = ids[0, 4:7]  # the second document's targets, before the last token
    base, other_document, later_token, own_token = (token_losses(ids[i:i + 1], labels[i:i + 1],
                                                                 positions[i:i + 1])[0] for i in range(len(ids)))
    leaked = torch.maximum((base - other_document).abs().max(), (base - later_token).abs().max())
    seen = (base - own_token)[4:6].abs().max()  # after the changed token, through attention alone
    return (leaked / seen.clamp_min(torch.finfo(torch.float32).tiny)).reshape(1).float()
