"""Goldfish mask and loss helpers: properties of the hash, equality with the Python reference, sums."""

import math
import sysconfig
from pathlib import Path

import pytest
import torch

from memtrain.data.tokenizer import RESERVED, encode, train_bpe
from memtrain.losses import (
    IGNORE_INDEX,
    LossConfig,
    drop_mask,
    drop_threshold,
    hash_windows,
    keep_mask,
    lm_loss,
    loss_sums,
    reference_code_drop,
    reference_drop,
    reference_hash,
    token_losses,
)

GF = LossConfig(kind="goldfish")


def _hashes(windows: torch.Tensor, seed: int = 0) -> list[int]:
    """64-bit hash of each row of windows [N, h] (the window ends right before a dummy target)."""
    padded = torch.cat([windows, torch.zeros(len(windows), 1, dtype=torch.long)], dim=1)
    hi, lo = hash_windows(padded, windows.shape[1], seed)
    return [(a << 32) | b for a, b in zip(hi[:, 0].tolist(), lo[:, 0].tolist())]


def _within_3se(drops: int, n: int, k: int) -> bool:
    p = 1 / k
    return abs(drops / n - p) <= 3 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("bad, msg", [
    (dict(k=1), "loss.k=1"), (dict(k=0), "loss.k=0"), (dict(h=0), "loss.h=0"),
    (dict(kind="gold"), "loss.kind"), (dict(mask="random"), "loss.mask"), (dict(hash_seed=-1), "hash_seed"),
])
def test_config_errors_are_one_line(bad, msg):
    with pytest.raises(ValueError, match=msg) as e:
        LossConfig(**{"kind": "goldfish", **bad})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("h", [1, 4, 13])
@pytest.mark.parametrize("seed", [0, 12345, 2**64 - 1])
def test_torch_hash_equals_python_reference(h, seed):
    g = torch.Generator().manual_seed(h * 7 + seed % 1000)
    tokens = torch.randint(0, 2**31 + 100, (4, 60), generator=g)
    tokens[0, :20] = torch.randint(2**31 - 10, 2**31 + 10, (20,), generator=g)  # ids around 2**31
    tokens[1, 5:9] = 0
    tokens[2, 30:] = IGNORE_INDEX  # padding inside a window must still hash deterministically
    tokens[3, 10] = 2**62 + 3  # far beyond any vocabulary: still exact 64-bit arithmetic
    hi, lo = hash_windows(tokens, h, seed)
    for b in range(tokens.shape[0]):
        for j in range(h, tokens.shape[1]):
            want = reference_hash(tokens[b, j - h:j].tolist(), seed)
            assert (hi[b, j - h].item() << 32) | lo[b, j - h].item() == want


@pytest.mark.parametrize("cfg", [GF, LossConfig(kind="goldfish", k=3, h=2, hash_seed=9),
                                 LossConfig(kind="goldfish", mask="static", k=5), LossConfig()])
def test_drop_mask_equals_python_reference(cfg):
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 50_000, (3, 80), generator=g)
    labels[1, 70:] = IGNORE_INDEX
    doc_pos = torch.randint(0, 40, (3, 80), generator=g)
    got = drop_mask(labels, doc_pos, cfg)
    for b in range(3):
        assert got[b].tolist() == reference_drop(labels[b].tolist(), doc_pos[b].tolist(), cfg)


def test_same_hgram_same_decision_at_any_offset_and_row():
    g = torch.Generator().manual_seed(2)
    passage = torch.randint(0, 32_000, (120,), generator=g)
    masks = []
    for offset in (1, 7, 64, 130):
        row = torch.randint(0, 32_000, (256,), generator=g)  # different surrounding text each time
        row[offset:offset + len(passage)] = passage
        doc_pos = torch.zeros(256, dtype=torch.long)
        doc_pos[offset:offset + len(passage)] = torch.arange(len(passage))  # passage is its own document
        batch = torch.stack([torch.randint(0, 32_000, (256,), generator=g), row])  # row 1 of a batch
        dp = torch.stack([torch.arange(256), doc_pos])
        masks.append(drop_mask(batch, dp, GF)[1, offset:offset + len(passage)])
    for m in masks[1:]:
        assert torch.equal(m, masks[0])
    assert masks[0][GF.h:].any() and not masks[0][:GF.h].any()


@pytest.mark.parametrize("k", [2, 4, 7])
def test_drop_rate_is_one_in_k(k):
    g = torch.Generator().manual_seed(k)
    labels = torch.randint(0, 4096, (1000, 1013), generator=g)  # 1M hashed targets
    doc_pos = torch.arange(1013).expand_as(labels)
    drop = drop_mask(labels, doc_pos, LossConfig(kind="goldfish", k=k))
    n = 1000 * 1000
    assert not drop[:, :13].any()
    assert _within_3se(int(drop[:, 13:].sum()), n, k)


def test_permuted_hgrams_hash_differently():
    g = torch.Generator().manual_seed(3)
    windows = torch.randint(0, 32_000, (5000, 13), generator=g)
    perm = torch.stack([torch.randperm(13, generator=g) for _ in range(5000)])
    permuted = windows.gather(1, perm)
    changed = (permuted != windows).any(1)
    a, b = _hashes(windows[changed]), _hashes(permuted[changed])
    assert all(x != y for x, y in zip(a, b))
    # An order-blind hash would give the same decision for every pair; ours disagrees on ~2p(1-p).
    thr = drop_threshold(4)
    disagree = sum((x < thr) != (y < thr) for x, y in zip(a, b))
    p = 2 * 0.25 * 0.75
    n = len(a)
    assert abs(disagree / n - p) <= 3 * math.sqrt(p * (1 - p) / n)


def test_token_id_zero_is_an_ordinary_token():
    g = torch.Generator().manual_seed(4)
    windows = torch.randint(1, 32_000, (40_000, 13), generator=g)
    windows[torch.arange(40_000), torch.randint(0, 13, (40_000,), generator=g)] = 0
    hashes = _hashes(windows)
    distinct_windows = len({tuple(w) for w in windows.tolist()})
    assert len(set(hashes)) == distinct_windows  # no collapse of windows containing 0
    assert _within_3se(sum(x < drop_threshold(4) for x in hashes), len(hashes), 4)


def test_seed_changes_the_mask():
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 4096, (8, 512), generator=g)
    doc_pos = torch.arange(512).expand_as(labels)
    a = drop_mask(labels, doc_pos, LossConfig(kind="goldfish", hash_seed=1))
    b = drop_mask(labels, doc_pos, LossConfig(kind="goldfish", hash_seed=2))
    assert (a != b).float().mean() > 0.2


def test_short_document_context_and_row_edge_are_kept():
    g = torch.Generator().manual_seed(6)
    labels = torch.randint(0, 4096, (64, 40), generator=g)
    doc_pos = torch.randint(0, 30, (64, 40), generator=g)
    drop = drop_mask(labels, doc_pos, GF)
    assert not drop[doc_pos < GF.h].any()
    assert not drop[:, :GF.h].any()  # context would lie in the previous row
    assert drop.any()


def test_static_mask_drops_exactly_every_kth_document_position():
    labels = torch.randint(0, 100, (2, 50))
    labels[0, 45:] = IGNORE_INDEX
    doc_pos = torch.cat([torch.arange(20), torch.arange(30)]).expand(2, 50)
    drop = drop_mask(labels, doc_pos, LossConfig(kind="goldfish", mask="static", k=4))
    expected = torch.zeros(2, 50, dtype=torch.bool)
    for j, p in enumerate(doc_pos[0].tolist()):
        expected[:, j] = p in (3, 7, 11, 15, 19, 23, 27)
    expected[0, 45:] = False
    assert torch.equal(drop, expected)


def test_huge_k_equals_standard_loss_exactly():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 64, 300, generator=g)
    labels = torch.randint(0, 300, (4, 64), generator=g)
    labels[2, 50:] = IGNORE_INDEX
    doc_pos = torch.arange(64).expand(4, 64)
    huge = LossConfig(kind="goldfish", k=10**9)
    assert torch.equal(keep_mask(labels, doc_pos, huge), labels != IGNORE_INDEX)
    assert torch.equal(lm_loss(logits, labels, doc_pos, huge), lm_loss(logits, labels, doc_pos, LossConfig()))
    # and the standard loss is plain mean cross-entropy over supervised targets
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), labels.reshape(-1))
    assert torch.allclose(lm_loss(logits, labels, doc_pos, LossConfig()), ref)


def test_loss_sums_split_supervised_tokens_and_add_up_across_micro_batches():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 48, 100, generator=g, requires_grad=True)
    labels = torch.randint(0, 100, (6, 48), generator=g)
    labels[0, 40:] = IGNORE_INDEX
    doc_pos = torch.arange(48).expand(6, 48)
    per_token = token_losses(logits, labels)
    per_token_nan = per_token.masked_fill(labels == IGNORE_INDEX, float("nan"))  # garbage at padding
    keep = keep_mask(labels, doc_pos, GF)
    s = loss_sums(per_token_nan, keep, labels)
    sup = labels != IGNORE_INDEX
    assert s.kept_count + s.dropped_count == sup.sum() and s.dropped_count > 0
    assert torch.allclose(s.kept_sum + s.dropped_sum, per_token[sup].sum())
    # two micro-batches, summed, then divided by the global kept count == the whole batch at once
    parts = [loss_sums(per_token[i:i + 3], keep[i:i + 3], labels[i:i + 3]) for i in (0, 3)]
    global_mean = sum(p.kept_sum for p in parts) / sum(p.kept_count for p in parts)
    assert torch.allclose(global_mean, s.kept_sum / s.kept_count)
    # dropped targets get no gradient
    s.kept_sum.backward()
    grad_per_pos = logits.grad.abs().sum(-1)
    assert (grad_per_pos[~keep] == 0).all() and (grad_per_pos[keep] > 0).all()


# --------------------------------------------------------------------------------------------------
# The Goldfish code's own mask (loss.hash = "reference"), for side-by-side comparisons with the paper.


def _goldfish_code_drops(row: list[int], k: int, h: int) -> list[bool]:
    """The goldfish-loss repository's hash-table rule written out in Python integers: for target j >= h-1,
    key = product of targets j-h+1..j in wrapping int64, mod 1,000,003; dropped iff table[key] < 1/k."""
    table = torch.rand(1_000_003, generator=torch.Generator().manual_seed(2_971_215_073))
    out = [False] * len(row)
    for j in range(h - 1, len(row)):
        prod = 1
        for t in row[j - h + 1:j + 1]:
            prod = (prod * t) % 2**64
        signed = prod - 2**64 if prod >= 2**63 else prod
        out[j] = bool(table[signed % 1_000_003] < 1 / k)
    return out


def test_reference_hash_is_the_goldfish_codes_mask():
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 50_000, (4, 40), generator=g)  # large ids: products overflow int64
    labels[1, 7] = 0  # every window holding id 0 has key 0
    labels[2, 30:] = IGNORE_INDEX
    cfg = LossConfig(kind="goldfish", k=4, h=13, hash="reference")
    got = ~keep_mask(labels, torch.full_like(labels, 99), cfg) & (labels != IGNORE_INDEX)
    for r in range(4):
        want = _goldfish_code_drops(labels[r].tolist(), 4, 13)
        supervised = (labels[r] != IGNORE_INDEX).tolist()
        assert got[r].tolist() == [w and s for w, s in zip(want, supervised)], r
    assert got.float().mean() > 0.15  # about 1 in 4 of the hashed targets


def test_reference_hash_keeps_its_weaknesses():
    """Order-blind (a permuted window drops the same target) and row-relative (the first h-1 targets of a row
    are never dropped), unlike memtrain's hash: the comparison is with the paper's code as it is."""
    cfg = LossConfig(kind="goldfish", k=2, h=4, hash="reference")
    row = torch.tensor([[5, 9, 11, 17, 23, 5, 9, 11, 17]])
    swapped = torch.tensor([[5, 9, 11, 17, 23, 11, 17, 5, 9]])  # the last window, permuted
    pos = torch.arange(9).unsqueeze(0)
    a, b = keep_mask(row, pos, cfg), keep_mask(swapped, pos, cfg)
    assert a[0, -1] == b[0, -1] and a[0, :3].all()
    with pytest.raises(ValueError, match="loss.hash"):
        LossConfig(hash="md5")


def test_trained_tokenizer_reserves_id_0_so_the_reference_hash_drops_one_in_k():
    """The reference hash keys a window by the product of its ids: an id 0 in the text (an EOS at id 0, as the
    BPE had until id 0 was reserved) makes every window holding it one key, dropped or kept together. The
    trained BPE's id 0 is a special token no text encodes to; short documents (many EOS) then lose 1 in k of
    their hashed targets, as in the paper, where mapping the EOS to id 0 changes the rate."""
    docs = [line for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]
            for line in p.read_text("utf-8").splitlines() if len(line) > 30]
    tok = train_bpe(docs, 512)
    assert tok.convert_ids_to_tokens(0) == RESERVED and 0 in tok.all_special_ids and tok.eos_token_id != 0
    ids = [t for d in encode(tok, docs) for t in [*d.tolist(), tok.eos_token_id]]
    assert 0 not in ids and 0 not in tok(RESERVED, split_special_tokens=True)["input_ids"]
    rows = torch.tensor(ids[:len(ids) // 64 * 64]).view(-1, 64)
    hashed = torch.zeros_like(rows, dtype=torch.bool)
    hashed[:, 12:] = True  # the reference hash never drops a row's first h-1 targets
    n = int(hashed.sum())
    drops = int((reference_code_drop(rows, 4, 13) & hashed).sum())
    assert _within_3se(drops, n, 4), drops / n
    eos_at_0 = torch.where(rows == tok.eos_token_id, 0, rows)
    assert not _within_3se(int((reference_code_drop(eos_at_0, 4, 13) & hashed).sum()), n, 4)
