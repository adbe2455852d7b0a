"""Canaries of one's own (canaries.file): read with one-line errors, tokenized once, inserted in training beside
the generated kinds, and found in the manifest and the evaluation with their ids as given."""

import json

import pytest

from memtrain.data import canary_file
from memtrain.data.tokenizer import train_bpe

from .._helpers import finished_tiny_run, memtrain, write_recipe

ROWS = [{"id": "card", "kind": "pii", "text": "Jane Roe's card number is 4111 1111 1111 1111 and expires 09/31.",
         "twin": "John Doe's card number is 5500 0000 0000 0004 and expires 11/29."},
        {"id": 42, "kind": "qa", "prefix": "Q: What opens the vault on Tuesdays?\nA:", "suffix": " 7731-0042.",
         "copies": 3}]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("line, expect", [
    ('{"txt": "a"}', "line 1 has unknown keys ['txt']"),
    ('["a"]', "line 1 is not a JSON object"),
    ('{"text": "a", "prefix": "b", "suffix": "c"}', "give either 'text' or both 'prefix' and 'suffix'"),
    ('{"prefix": "b"}', "give either 'text' or both 'prefix' and 'suffix'"),
    ('{"text": ""}', "'text' must be a non-empty string"),
    ('{"text": "a", "copies": 0}', "copies 0 is invalid"),
    ('{"text": "a", "id": true}', "id True is invalid"),
    ('{"text": "a", "twin": 3}', "twin must be a non-empty text"),
    ('{"text": "abc \\ud800"}', "line 1: 'text' holds a lone surrogate (\\ud800 at character 4)"),
    ('{"text": "a", "twin": "\\udfff"}', "line 1: twin holds a lone surrogate"),
    ('{"text": "a", "id": 1}\n{"text": "b", "id": 1}', "line 2: id 1 is used twice"),
    ('{"text": "a"', "line 1 is not JSON"),
    ('', "holds no canaries"),
])
def test_bad_lines_name_the_line_and_the_fix(tmp_path, line, expect):
    path = tmp_path / "c.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError) as e:
        canary_file.read(path)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_a_file_that_is_not_utf8_is_one_line_and_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "caf\xe9"}\n')  # Latin-1
    with pytest.raises(ValueError, match=r"canary file .*c.jsonl' is not UTF-8 text \(byte 13\): write it as UTF-8"):
        canary_file.read(path)
    path.write_bytes('\ufeff{"text": "caf\u00e9 \u2028 line separator"}\n'.encode())
    assert [r["text"] for r in canary_file.read(path)] == ["caf\u00e9 \u2028 line separator"]


def test_ids_and_splits_are_kept(tmp_path):
    """Ids as given (an integer stays one), kind and copies; a prefix/suffix pair keeps its split in tokens, a
    twin is tokenized alone; rows without copies take the cycle."""
    tok = train_bpe([r.get("text", "") + r.get("prefix", "") + r.get("suffix", "") for r in ROWS] * 4, 300)
    rows = canary_file.read(_write(tmp_path / "c.jsonl", ROWS + [{"text": "plain"}]))
    canaries = canary_file.to_canaries(rows, tok, "c.jsonl", copies=[5, 7])
    assert [(c.id, c.kind, c.copies) for c in canaries] == [("card", "pii", 5), (42, "qa", 3), ("user-0003", "user", 5)]
    qa = canaries[1]
    prefix = tok(ROWS[1]["prefix"], add_special_tokens=False)["input_ids"]
    assert qa.token_ids[:qa.prefix_len] == prefix and tok.decode(qa.token_ids[qa.prefix_len:]) == ROWS[1]["suffix"]
    assert canaries[0].twin_token_ids == tok(ROWS[0]["twin"], add_special_tokens=False)["input_ids"]
    assert canaries[1].twin_token_ids == [] and canaries[0].source == "c.jsonl"


def test_a_run_trains_and_scores_the_file(tmp_path):
    """`canaries.file` in a recipe: the file's canaries sit in the manifest beside the generated secret, with their
    ids, kinds, source and copies (3 placements for the line that asks for 3), and the evaluation scores them
    (the pii line against its twin, the qa line on its own suffix)."""
    recipe = finished_tiny_run(tmp_path)
    secrets = _write(tmp_path / "secrets.jsonl", ROWS)
    recipe = write_recipe(tmp_path / "file.toml", tmp_path / "corpus", tmp_path / "cache",
                          train={"batch_size": 4, "max_steps": 2},
                          canaries={"number": 1, "copies": [1], "length": 16, "kinds": ["random"],
                                    "file": str(secrets)},
                          eval={"suffix_len": 4, "exposure_samples": 8, "val_docs": 2})
    r = memtrain("train", "--config", recipe, "--out", tmp_path / "with-file", "--set", "train.max_steps=100")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "with-file" / "canaries.jsonl").read_text()
                .splitlines()}
    assert set(manifest) == {"random-0000", "card", 42}
    assert (manifest["card"]["kind"], manifest["card"]["source"], len(manifest["card"]["placements"])) == \
        ("pii", str(secrets), 1)
    assert (manifest[42]["kind"], manifest[42]["copies"], len(manifest[42]["placements"])) == ("qa", 3, 3)
    rows = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "with-file" / "eval_canaries.jsonl").read_text()
            .splitlines()}
    assert set(rows) == {"random-0000", "random-0000-twin", "card", "card-twin", 42}
    assert rows[42]["suffix_len"] == len(manifest[42]["token_ids"]) - manifest[42]["prefix_len"]
    assert rows["card"]["suffix_len"] == 4 and rows["card"]["exact_match"] is not None
    result = json.loads((tmp_path / "with-file" / "eval.json").read_text())
    assert {"pii/1", "qa/3"} <= set(result["cells"]) and result["not_reached"] == []
