"""The packed stream: determinism, independence from model and grid, manifest correctness, Goldfish fit."""

import inspect
import json
import os
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from memtrain.data import CanaryConfig, DataConfig, TrainStream, build_stream, locate  # noqa: E402
from memtrain.data.corpus import load_corpus  # noqa: E402
from memtrain.losses import IGNORE_INDEX, LossConfig, keep_mask  # noqa: E402

CANARIES = CanaryConfig(number=4, copies=[1, 2, 3, 5], length=24, seed=0)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for p in files[::4][:40]:
        (root / f"{p.stem}.txt").write_text(p.read_text("utf-8")[:8000])
    return root


@pytest.fixture(scope="module")
def data_cfg(corpus_dir, tmp_path_factory):
    return DataConfig(corpus=str(corpus_dir), vocab_size=512, seq_len=128, val_fraction=0.1,
                      cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def stream(data_cfg):
    return build_stream(data_cfg, CANARIES, seed=0)


def test_same_seed_is_byte_identical_even_from_scratch(stream, data_cfg, tmp_path):
    fresh = build_stream(replace(data_cfg, cache_dir=str(tmp_path)), CANARIES, seed=0)  # retrains the BPE too
    assert fresh.tokens.tobytes() == stream.tokens.tobytes()
    assert [c.to_dict() for c in fresh.canaries] == [c.to_dict() for c in stream.canaries]
    assert fresh.val_texts == stream.val_texts
    cached = build_stream(data_cfg, CANARIES, seed=0)
    assert cached.tokens.tobytes() == stream.tokens.tobytes()
    assert [c.to_dict() for c in cached.canaries] == [c.to_dict() for c in stream.canaries]


def test_canary_content_follows_the_stream_seed_unless_fixed(stream, data_cfg):
    follow = replace(CANARIES, seed=None)
    assert [c.token_ids for c in build_stream(data_cfg, follow, seed=0).canaries] == \
        [c.token_ids for c in stream.canaries]
    assert [c.token_ids for c in build_stream(data_cfg, follow, seed=1).canaries] != \
        [c.token_ids for c in stream.canaries]


def test_different_seed_changes_order_and_placement_not_content(stream, data_cfg):
    other = build_stream(data_cfg, CANARIES, seed=1)
    assert other.tokens.tobytes() != stream.tokens.tobytes()
    assert [c.placements for c in other.canaries] != [c.placements for c in stream.canaries]
    assert [c.token_ids for c in other.canaries] == [c.token_ids for c in stream.canaries]
    assert sorted(other.tokens.tolist()) == sorted(stream.tokens.tolist())  # same text, other order
    assert other.val_texts == stream.val_texts


def test_nothing_about_model_or_grid_enters_the_stream(stream):
    # the batch size only rounds the row count up to whole batches (test_a_pass_trains_every_row...)
    assert list(inspect.signature(build_stream).parameters) == ["data_cfg", "canary_cfg", "seed", "batch_size"]
    # Rows are the same whatever the batch size; the grid only changes step/rank labels in the manifest.
    rows = lambda B: torch.cat([stream.batch(s, B)["input_ids"] for s in range(stream.num_steps(B))])  # noqa: E731
    whole = rows(6)
    assert torch.equal(whole, rows(8))
    assert len(whole) == len(stream)
    where = lambda m: [[(p["seq_index"], p["offset"]) for p in c["placements"]] for c in m]  # noqa: E731
    assert where(stream.manifest(8, 1)) == where(stream.manifest(16, 4)) == where(stream.manifest(6, 3))


def test_batches_are_next_token_pairs_with_document_positions(stream):
    S = stream.seq_len
    for step in (0, stream.num_steps(8) - 1):  # the last batch is short and padded at the end
        b = stream.batch(step, 8)
        x, y, pos = b["input_ids"], b["labels"], b["doc_pos"]
        assert x.dtype == y.dtype == pos.dtype == torch.long and x.shape[1] == S
        sup = y != IGNORE_INDEX
        assert torch.equal(y[:, :-1][sup[:, :-1]], x[:, 1:][sup[:, :-1]])
        for r in range(len(x)):
            i = int(b["seq_index"][r])
            nxt = stream.tokens[(i + 1) * S]
            assert y[r, -1] == (nxt if nxt >= 0 else IGNORE_INDEX)
        # doc_pos: 0 right after an EOS input, otherwise one more than the previous target's
        after_eos = x[:, 1:] == stream.eos_id
        assert (pos[:, 1:][after_eos] == 0).all()
        cont = ~after_eos & sup[:, 1:] & sup[:, :-1]
        assert torch.equal(pos[:, 1:][cont], pos[:, :-1][cont] + 1)
    last = stream.batch(stream.num_steps(8) - 1, 8)["labels"]
    assert (last[-1] == IGNORE_INDEX).any()  # padding exists and is never supervised


def test_every_manifest_entry_points_at_its_canary(stream, tmp_path):
    path = stream.write_manifest(tmp_path, batch_size=8, data_shards=2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == len(stream.canaries) == 8
    for rec in records:
        ids = rec["token_ids"]
        L = len(ids)
        for p in rec["placements"]:
            row = stream.rows(p["seq_index"], p["seq_index"] + 1)
            o = p["offset"]
            assert row["input_ids"][0, o:o + L].tolist() == ids
            assert row["input_ids"][0, o - 1] == stream.eos_id
            assert row["labels"][0, o - 1:o - 1 + L].tolist() == ids  # every canary token is a target
            assert row["labels"][0, o - 1 + L] == stream.eos_id
            assert row["doc_pos"][0, o - 1:o - 1 + L].tolist() == list(range(L))
            assert (p["step"], p["dp_rank"]) == locate(p["seq_index"], 8, 2)
            b = stream.batch(p["step"], 8)["input_ids"]
            shard = b[p["dp_rank"] * 4:(p["dp_rank"] + 1) * 4]
            assert any(r[o:o + L].tolist() == ids for r in shard)


def test_locate_and_its_errors():
    assert locate(0, 8, 2) == (0, 0)
    assert locate(13, 8, 2) == (1, 1)
    assert locate(11, 8, 4) == (1, 1)
    with pytest.raises(ValueError, match="multiple of data_shards"):
        locate(3, 6, 4)


def test_goldfish_mask_is_identical_on_every_copy(stream):
    cfg = LossConfig(kind="goldfish", k=3, h=4)
    multi = [c for c in stream.canaries if c.copies > 1]
    assert multi
    for c in multi:
        L = len(c.token_ids)
        masks = []
        for p in c.placements:
            row = stream.batch(p.seq_index, 1)
            keep = keep_mask(row["labels"], row["doc_pos"], cfg)[0, p.offset - 1:p.offset - 1 + L]
            masks.append(keep)
        assert all(torch.equal(m, masks[0]) for m in masks)
        assert masks[0][:cfg.h].all()


def test_copies_spread_through_the_pass(data_cfg):
    s = build_stream(data_cfg, CanaryConfig(kinds=["random"], number=2, copies=[10], random_format="tokens",
                                            length=8, placement="start"), seed=3)
    rows = sorted(p.seq_index for c in s.canaries for p in c.placements)
    assert len(set(rows)) == 20
    strata = np.arange(21) * len(s) // 20
    assert all(lo <= r < hi for r, lo, hi in zip(rows, strata[:-1], strata[1:]))
    assert {p.offset for c in s.canaries for p in c.placements} == {1}


def test_no_canaries_is_plain_text(data_cfg):
    s = build_stream(data_cfg, None, seed=0)
    assert s.canaries == [] and s.meta["canary_copies"] == 0
    assert s.vocab_size == 512


def test_document_attention_positions_restart_at_every_document(stream):
    eos = stream.eos_id
    rows = stream.rows(0, len(stream))
    ids, pos = rows["input_ids"], rows["position_ids"]
    assert (pos[:, 0] == 0).all() and (pos[ids == eos] == 0).all()  # row starts and EOS inputs open documents
    inside = (ids[:, 1:] != eos)
    assert (pos[:, 1:][inside] == pos[:, :-1][inside] + 1).all()  # and count up inside them
    for c in stream.canaries:
        for p in c.placements:
            assert pos[p.seq_index, p.offset - 1:p.offset + len(c.token_ids)].tolist() == \
                list(range(len(c.token_ids) + 1))  # [EOS, canary] at 0..len: its evaluation positions
    classic = TrainStream(stream.tokens, stream.seq_len, stream.canaries, stream.val_texts, stream.tokenizer,
                          stream.meta, document_attention=False)
    assert "position_ids" not in classic.rows(0, 2)


def test_max_text_tokens_caps_the_ordinary_text(data_cfg):
    only = build_stream(replace(data_cfg, max_text_tokens=0), CANARIES, seed=0)
    copies = sum(c.copies for c in only.canaries)
    assert len(only) == copies  # a row per copy and nothing else
    some = build_stream(replace(data_cfg, max_text_tokens=500), CANARIES, seed=0)
    text = (some.tokens >= 0).sum() - (only.tokens >= 0).sum()
    assert 450 <= text <= 500  # the cap, minus EOS shared at canary boundaries
    assert 0 < only.unigram_entropy() < some.unigram_entropy() < np.log(only.vocab_size)


def _documents(s: TrainStream) -> list[tuple[int, ...]]:
    """The EOS-separated runs of a stream's text, in order (padding dropped)."""
    tokens = s.tokens[s.tokens >= 0].tolist()
    out, cur = [], []
    for t in tokens:
        if t == s.eos_id:
            if cur:
                out.append(tuple(cur))
            cur = []
        else:
            cur.append(t)
    return out + ([tuple(cur)] if cur else [])


def test_text_pieces_cut_and_shuffle_the_same_text(data_cfg):
    whole = build_stream(data_cfg, None, seed=0)
    cut = build_stream(replace(data_cfg, text_piece_tokens=64), None, seed=0)
    docs, pieces = _documents(whole), _documents(cut)
    chunks = [d[k:k + 64] for d in docs for k in range(0, len(d), 64)]
    assert max(map(len, pieces)) == 64 and max(map(len, docs)) > 64  # (its own cache entry, not whole's)
    assert sorted(pieces) == sorted(chunks)  # the same tokens, cut at every 64th of a document
    assert pieces != chunks  # and shuffled as pieces: a document's pieces are spread through the stream
    assert cut.val_texts == whole.val_texts  # validation documents stay whole
    with pytest.raises(ValueError, match="text_piece_tokens=0"):
        replace(data_cfg, text_piece_tokens=0)


def test_seeds_in_different_pools_share_no_canary_document_and_train_on_the_same_text(data_cfg):
    pooled = replace(CANARIES, seed=None, number=1, kinds=["document"], pools=3)
    streams = [build_stream(data_cfg, pooled, seed=s) for s in range(3)]
    sources = [{c.source for c in s.canaries} | {c.twin_source for c in s.canaries} for s in streams]
    assert all(len(x) == 2 for x in sources)
    assert not (sources[0] & sources[1] or sources[0] & sources[2] or sources[1] & sources[2])
    texts = [sorted(np.unique(s.tokens[s.tokens >= 0]).tolist()) for s in streams]
    assert texts[0] == texts[1] == texts[2]  # the same training text, in each seed's own order
    assert len({s.meta["n_train_docs"] for s in streams}) == 1 and len({s.meta["text_tokens"] for s in streams}) == 1
    assert texts[0] and streams[0].meta["n_canary_docs"] == 3 * 3 * 1  # every pool is held out for every seed
    one_pool = build_stream(data_cfg, replace(pooled, pools=1), seed=0)
    assert one_pool.meta["n_canary_docs"] == 2  # one pool: only the documents drawn are held out


def test_a_canary_found_in_the_pretraining_text_is_not_used(data_cfg, tmp_path):
    cfg = replace(CANARIES, number=2, kinds=["document"])
    first = build_stream(data_cfg, cfg, seed=5)
    pretraining = tmp_path / "pretraining"
    pretraining.mkdir()
    (pretraining / "copied.txt").write_text("unrelated text\n" + first.canaries[0].text + "\nmore text\n")
    avoided = build_stream(data_cfg, replace(cfg, unique_against=str(pretraining)), seed=5)
    texts = {c.text for c in avoided.canaries} | {c.twin_text for c in avoided.canaries}
    assert first.canaries[0].text not in texts and len(avoided.canaries) == 2
    assert avoided.key != first.key


def test_the_unique_against_corpus_enters_the_key_by_its_content(data_cfg, tmp_path):
    """The corpus canaries.unique_against names decides which canaries are drawn: with its path alone in the key,
    an edited corpus kept the key a run recorded while a rebuild drew other canaries."""
    (tmp_path / "pre").mkdir()
    (tmp_path / "pre" / "a.txt").write_text("unrelated text\n")
    cfg = replace(CANARIES, number=2, kinds=["document"], unique_against=str(tmp_path / "pre"))
    first = build_stream(data_cfg, cfg, seed=5)
    (tmp_path / "pre" / "a.txt").write_text("unrelated text\n")  # rewritten, the same content
    assert build_stream(data_cfg, cfg, seed=5).key == first.key
    (tmp_path / "pre" / "a.txt").write_text("unrelated text\n" + first.canaries[0].text + "\n")
    edited = build_stream(data_cfg, cfg, seed=5)
    assert edited.key != first.key and first.canaries[0].text not in {c.text for c in edited.canaries}


def test_unique_against_reads_its_corpus_with_the_data_sections_settings(data_cfg, tmp_path):
    """A pretraining corpus of JSON lines whose text is in 'body', as the fine-tuning corpus's (data.text_field):
    read with that field (it was read with the default 'text' and refused)."""
    docs = load_corpus(data_cfg).docs
    (tmp_path / "pre.jsonl").write_text("".join(json.dumps({"body": d.text}) + "\n" for d in docs[:5]))
    (tmp_path / "ft.jsonl").write_text("".join(json.dumps({"body": d.text}) + "\n" for d in docs))
    data = replace(data_cfg, corpus=str(tmp_path / "ft.jsonl"), text_field="body")
    cfg = replace(CANARIES, number=2, kinds=["document"], unique_against=str(tmp_path / "pre.jsonl"))
    s = build_stream(data, cfg, seed=5)
    assert len(s.canaries) == 2 and all(c.text not in d.text for c in s.canaries for d in docs[:5])


def test_a_tokenizer_whose_eos_changed_packs_a_new_stream(data_cfg, tmp_path):
    """A tokenizer directory's EOS lives in its tokenizer_config.json, which the tokenizer's fingerprint does not
    hash: the stream's key takes the EOS id, so an edited EOS is not packed with the old one's boundaries."""
    built = build_stream(data_cfg, CANARIES, seed=0)
    built.tokenizer.save_pretrained(tmp_path / "tok")
    mine = replace(data_cfg, tokenizer=str(tmp_path / "tok"))
    first = build_stream(mine, CANARIES, seed=0)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|reserved-0|>"
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    second = build_stream(mine, CANARIES, seed=0)
    assert second.key != first.key and second.eos_id != first.eos_id
    assert int((second.tokens == second.eos_id).sum()) > 0 and int((second.tokens == first.eos_id).sum()) == 0


@pytest.mark.parametrize("batch", [3, 4, 7])
def test_a_pass_trains_every_row_so_every_copy_is_seen(data_cfg, batch):
    # the rows are rounded up to whole batches: a pass drops none, and no copy sits where no step reaches it
    s = build_stream(data_cfg, CANARIES, seed=0, batch_size=batch)
    assert len(s) % batch == 0
    assert s.copies_seen(batch, steps=len(s) // batch) == {c.id: c.copies for c in s.canaries}
    plain = build_stream(data_cfg, CANARIES, seed=0)  # batch 1: the stream as it was
    assert len(plain) <= len(s) < len(plain) + batch


def test_last_steps_follow_the_batches_a_run_took(data_cfg):
    """The last step that trained each canary, against a replay of the run's batches: before the pass ends (some
    canaries never reached: left out), at its end, and halfway through a second epoch."""
    batch = 4
    s = build_stream(data_cfg, CANARIES, seed=0, batch_size=batch)
    per_epoch = len(s) // batch
    for steps in (per_epoch // 3, per_epoch, per_epoch + per_epoch // 2):
        replay = {}
        for step in range(steps):
            rows = range(step % per_epoch * batch, (step % per_epoch + 1) * batch)
            for c in s.canaries:
                if any(p.seq_index in rows for p in c.placements):
                    replay[c.id] = step
        assert s.last_steps(batch, steps) == replay, steps
        assert set(replay) == {i for i, n in s.copies_seen(batch, steps).items() if n}
    assert len(s.last_steps(batch, per_epoch // 3)) < len(s.canaries)  # the early stop left some out



@pytest.mark.parametrize("row, taken", [({"text": "a canary of my own", "kind": "document"}, "document-0002"),
                                        ({"text": "a canary of my own", "id": "random-0002-twin"}, "random-0002-twin")])
def test_a_file_canary_cannot_take_a_generated_canarys_id(data_cfg, tmp_path, row, taken):
    """Results are keyed by id: a file line's default id (its kind and line number) or its own may not be one a
    generated canary or twin has, or the two would be counted as one."""
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"text": "first line"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"id '{taken}' is also a generated canary's .*give that line another id"):
        build_stream(data_cfg, replace(CANARIES, file=str(path)), seed=0)


def test_a_corpus_document_holding_a_file_canary_or_its_twin_is_not_trained(data_cfg, tmp_path):
    """A file's canary is trained its copies' times and its twin never, even where the corpus itself holds them:
    such documents are held out."""
    docs = load_corpus(data_cfg).docs
    canary, twin = docs[3].text[100:250], docs[5].text[100:250]
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "mine", "text": canary, "twin": twin, "copies": 2}) + "\n")
    s = build_stream(data_cfg, replace(CANARIES, file=str(path)), seed=0)
    (c,) = [c for c in s.canaries if c.id == "mine"]
    trained = s.tokenizer.decode(s.tokens[s.tokens >= 0])
    assert twin not in trained and trained.count(canary) == len(c.placements) == 2


@pytest.mark.parametrize("damage", ["meta.json", "canaries.json", "tokens.npy"])
def test_a_damaged_cached_stream_is_named_with_the_fix(data_cfg, tmp_path, damage):
    cfg = replace(data_cfg, cache_dir=str(tmp_path))
    build_stream(cfg, CANARIES, seed=0)
    (entry,) = [p for p in (tmp_path / "streams").iterdir() if p.is_dir()]
    (entry / damage).write_bytes(b"\xff\x00 not what was written")
    with pytest.raises(ValueError, match="cached stream .* is damaged .*delete that directory"):
        build_stream(cfg, CANARIES, seed=0)


@pytest.mark.parametrize("row, who", [({"id": "long", "text": "word " * 300}, "'long'"),
                                      ({"id": 7, "text": "short", "twin": "word " * 300}, "7's twin")])
def test_a_file_canary_too_long_for_a_row_names_itself_and_its_fix(data_cfg, tmp_path, row, who):
    """canaries.length sizes only the generated canaries: a file's canary (or twin) too long for seq_len is named by
    its id, and the fix is to shorten it in the file or raise data.seq_len."""
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError) as e:
        build_stream(data_cfg, replace(CANARIES, file=str(path)), seed=0)
    assert f"canary {who} has " in str(e.value) and "\n" not in str(e.value)
    assert f"shorten that canary in canaries.file {str(path)!r} (canaries.length sizes only the generated ones) " \
           "or raise data.seq_len" in str(e.value)
