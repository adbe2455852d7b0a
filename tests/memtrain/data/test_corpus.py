"""Corpus loading (stdlib, directories, datasets files, save_to_disk, hub offline) and the tokenizer."""

import json
import os
import platform
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from memtrain.data import DataConfig, load_corpus, load_tokenizer, vocab_size  # noqa: E402


def _stdlib_texts(n: int, max_chars: int = 6000) -> list[tuple[str, str]]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    picked = files[:: max(1, len(files) // n)][:n]
    return [(p.stem, p.read_text("utf-8")[:max_chars]) for p in picked]


@pytest.fixture()
def text_dir(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for name, text in _stdlib_texts(12):
        (root / f"{name}.txt").write_text(text)
    return root


def test_stdlib_corpus_is_sorted_python_source_without_site_packages():
    corpus = load_corpus(DataConfig(max_docs=30))
    names = [d.name for d in corpus.docs]
    assert len(names) == 30 and names == sorted(names)
    assert all(n.endswith(".py") and "site-packages" not in n for n in names)
    assert corpus.fingerprint == load_corpus(DataConfig(max_docs=30)).fingerprint
    assert corpus.fingerprint != load_corpus(DataConfig(max_docs=31)).fingerprint
    assert corpus.source == f"stdlib (Python {platform.python_version()})"  # other Pythons, other text


def test_directory_corpus_skips_non_utf8_files_with_one_line(text_dir, capsys):
    (text_dir / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (text_dir / "koi8.txt").write_bytes("привет".encode("koi8-r"))
    corpus = load_corpus(DataConfig(corpus=str(text_dir)))
    assert len(corpus.docs) == 12 and not {"latin1.txt", "koi8.txt"} & {d.name for d in corpus.docs}
    assert capsys.readouterr().err.splitlines() == [
        f"data: skipped 2 files that are not UTF-8, e.g. {text_dir / 'koi8.txt'} (invalid continuation byte at "
        "byte 0)"]  # how many, and the first by path (other ranks stay silent: tests/memtrain/test_progress.py)


def test_corpus_of_unreadable_files_is_one_error(tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="no non-empty documents"):
        load_corpus(DataConfig(corpus=str(tmp_path)))
    assert capsys.readouterr().err == ""  # the error alone: no line about the skipped file before it


def test_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "a.txt").write_text("   \n\n")
    with pytest.raises(ValueError, match="no non-empty documents") as e:
        load_corpus(DataConfig(corpus=str(tmp_path)))
    assert "\n" not in str(e.value)


def test_jsonl_corpus_through_datasets_with_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [json.dumps({"body": t, "id": i}) + "\n" for i, (_, t) in enumerate(_stdlib_texts(5))]
    path.write_text("".join(rows))
    cfg = DataConfig(corpus=str(path), text_field="body", cache_dir=str(tmp_path / "cache"))
    corpus = load_corpus(cfg)
    assert [d.text for d in corpus.docs] == [t for _, t in _stdlib_texts(5)]
    with pytest.raises(ValueError, match="no column 'text'"):
        load_corpus(DataConfig(corpus=str(path), cache_dir=str(tmp_path / "cache")))


def test_a_file_named_like_a_pattern_is_that_file_and_bad_bytes_name_it(tmp_path):
    """`corpus [v2].jsonl` is one file, not a pattern matching `corpus v.jsonl` (read instead before); a value
    that is not UTF-8 inside a JSON file is one line naming the corpus and the fix."""
    mine = tmp_path / "corpus [v2].jsonl"
    mine.write_text(json.dumps({"text": "mine"}) + "\n")
    (tmp_path / "corpus v.jsonl").write_text(json.dumps({"text": "another file"}) + "\n")
    assert [d.text for d in load_corpus(DataConfig(corpus=str(mine), cache_dir=str(tmp_path / "c"))).docs] == ["mine"]
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl': column 'text' is not UTF-8 text .*write the file as UTF-8"):
        load_corpus(DataConfig(corpus=str(tmp_path / "latin1.jsonl"), cache_dir=str(tmp_path / "c")))


def test_save_to_disk_corpus(tmp_path):
    import datasets

    texts = [t for _, t in _stdlib_texts(4)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    assert [d.text for d in load_corpus(DataConfig(corpus=str(tmp_path / "saved"))).docs] == texts


def test_hub_corpus_fails_at_once_when_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1"):
        load_corpus(DataConfig(corpus="someone/some-dataset"))
    assert time.perf_counter() - t < 5


@pytest.mark.parametrize("bad, msg", [
    (dict(seq_len=1), "data.seq_len=1"), (dict(vocab_size=100), "vocab_size=100"),
    (dict(val_fraction=1.0), "val_fraction"), (dict(max_docs=0), "max_docs"),
    (dict(file_glob=""), "data.file_glob='' is invalid: use a pattern relative"),
    (dict(file_glob="/etc/*.txt"), "data.file_glob='/etc/.*' is invalid"),
])
def test_data_config_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        DataConfig(**bad)


def test_trained_bpe_is_cached_has_eos_and_round_trips(text_dir, tmp_path):
    cfg = DataConfig(corpus=str(text_dir), vocab_size=400, cache_dir=str(tmp_path / "cache"))
    corpus = load_corpus(cfg)
    tok = load_tokenizer(cfg, corpus)
    assert vocab_size(tok) == 400 and tok.eos_token_id is not None
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json"))) == 1
    again = load_tokenizer(cfg, corpus)  # from the cache this time
    assert again.get_vocab() == tok.get_vocab()
    text = corpus.docs[0].text
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # a different vocabulary size is a different cache entry
    load_tokenizer(replace(cfg, vocab_size=300), corpus)
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json"))) == 2


def test_missing_pretrained_tokenizer_is_a_clear_error(text_dir):
    cfg = DataConfig(corpus=str(text_dir), tokenizer=str(text_dir / "no-such-tokenizer"))
    with pytest.raises(ValueError, match="no-such-tokenizer"):
        load_tokenizer(cfg, load_corpus(cfg))
