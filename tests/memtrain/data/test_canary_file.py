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


def _metaspace(texts):
    """A SentencePiece-style tokenizer (Metaspace '▁', prepended to the first word only, as Llama's): a word that
    follows no space has no '▁'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tk.decoder = decoders.Metaspace(prepend_scheme="first")
    tk.train_from_iterator(texts * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                                          show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _one(row, tok):
    return canary_file.to_canaries(canary_file.checked([row]), tok, "c.jsonl")[0]


def test_a_split_canary_is_the_tokens_of_its_whole_text_with_a_sentencepiece_tokenizer():
    """Tokenized apart, a suffix that opens without a space gets a '▁' of its own: the ids would be a text nobody
    wrote, trained as such, and a model giving the secret back verbatim would be scored as not extracting it."""
    prefix, suffix = "export AWS_SECRET_ACCESS_KEY=", "wJalrXUtnFEMI/K7MDENG"
    tok = _metaspace([prefix, suffix, "the key is here"])  # no merge across the '=': the cut falls between tokens
    c = _one({"id": "key", "prefix": prefix, "suffix": suffix}, tok)
    whole = tok(prefix + suffix, add_special_tokens=False)["input_ids"]
    assert c.token_ids == whole and tok.decode(c.token_ids) == prefix + suffix
    assert tok.decode(c.token_ids[:c.prefix_len]) == prefix and tok.decode(c.token_ids[c.prefix_len:]) == suffix


def test_a_token_across_the_cut_goes_to_the_suffix():
    """Byte-level BPE merges 'Answer: ' + '42' into ' 42': the ids stay the text's own and the token that straddles
    the cut is asked for (the suffix scored is ' 42', what its tokens decode to), never split into ' ' + '42'."""
    tok = train_bpe(["Answer: 42. Answer: 42, and 42 again."] * 8, 300)
    c = _one({"prefix": "Answer: ", "suffix": "42"}, tok)
    assert c.token_ids == tok("Answer: 42", add_special_tokens=False)["input_ids"]
    assert tok.decode(c.token_ids[:c.prefix_len]) == "Answer:" and tok.decode(c.token_ids[c.prefix_len:]) == " 42"


def test_byte_level_splits_that_were_right_keep_their_ids():
    """The repo's byte-level BPE splits before a suffix's leading space anyway: the documented examples (and the
    streams and results made from them) keep the ids and prompt lengths the two sides tokenized apart gave."""
    pairs = [(ROWS[1]["prefix"], ROWS[1]["suffix"]), ("The vault opens with", " 7731-0042 on Tuesdays."),
             ("The society's motto, never written down, is:", " we keep what we are given.")]
    tok = train_bpe([p + s for p, s in pairs] * 4, 300)
    for prefix, suffix in pairs:
        c = _one({"prefix": prefix, "suffix": suffix}, tok)
        apart = [tok(t, add_special_tokens=False)["input_ids"] for t in (prefix, suffix)]
        assert (c.token_ids, c.prefix_len) == (apart[0] + apart[1], len(apart[0])), prefix


def _same_bpe_slow_and_fast(folder):
    """One byte-level BPE twice: in transformers' ClvpTokenizer (GPT-2's BPE and split pattern in Python; it has no
    fast class, so data.tokenizer naming its directory loads it slow) and in a fast tokenizer. Merges apply by rank,
    so the suffix re-cuts the prefix's last word: " secr" is " se" "cr" alone, " sec" "ret" in " secret"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from memtrain.data import DataConfig
    from memtrain.data.tokenizer import EOS, load_tokenizer

    merges = [("r", "e"), ("Ġ", "s"), ("Ġs", "e"), ("c", "r"), ("Ġse", "c"), ("re", "t"), ("t", "h"), ("th", "e")]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    vocab[EOS] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ClvpTokenizer", "eos_token": EOS,
                                                              "unk_token": EOS, "bos_token": EOS, "pad_token": EOS}))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return load_tokenizer(DataConfig(tokenizer=str(folder)), None), PreTrainedTokenizerFast(tokenizer_object=tk,
                                                                                           eos_token=EOS)


def test_a_slow_tokenizer_cuts_where_the_fast_one_does(tmp_path):
    """Without offsets the prompt was the tokens the prefix alone shares with the whole text: "the secr" + "et" gave
    " sec", prefix text, to the suffix, as " secr" alone is " se" "cr"."""
    slow, fast = _same_bpe_slow_and_fast(tmp_path)
    assert not slow.is_fast and fast.is_fast
    the, sec, ret = fast.convert_tokens_to_ids(["the", "Ġsec", "ret"])
    assert canary_file.split_ids(slow, "the secr", "et") == ([the, sec, ret], 2)  # a merge across the cut
    assert canary_file.split_ids(slow, "the sec", "ret") == ([the, sec, ret], 2)  # a cut between tokens
    assert canary_file.split_ids(slow, "the se", "cret") == ([the, sec, ret], 1)  # " sec" straddles it
    text = "the secret the secret"
    for cut in range(1, len(text)):
        assert canary_file.split_ids(slow, text[:cut], text[cut:]) == canary_file.split_ids(fast, text[:cut],
                                                                                            text[cut:]), cut


def test_a_byte_tokenizer_never_cuts_a_character_into_the_prompt():
    """ByT5 (slow only) decodes a character's first bytes to nothing: they decoded 'inside the prefix', and the
    prompt took them, leaving the suffix a broken character ('caf' + 'é au lait': 4 prompt bytes, the target
    ' au lait')."""
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    for prefix, suffix in (("caf", "é au lait"), ("東", "京"), ("the secr", "et")):
        ids, n = canary_file.split_ids(tok, prefix, suffix)
        assert (tok.decode(ids[:n]), tok.decode(ids[n:])) == (prefix, suffix)


TWIN_ROW = {"id": "vault", "prefix": "The vault opens with", "suffix": " 7731-0042 on Tuesdays, said Ann Lee."}


@pytest.mark.parametrize("twin", ["The vault opens with 1290-8817 on Fridays, said Bo.",
                                  "Another door entirely opens with 1290-8817 on Fridays, said Bo Ek."])
def test_a_plain_text_twin_is_asked_what_its_split_canary_is_asked(twin):
    """A plain-text twin used to be asked for its last eval.suffix_len tokens while its canary was asked for its
    whole suffix: a target of 8 tokens set against one of 40. It is cut after the canary's prefix when it starts
    with it, else asked for as many last tokens as the canary's suffix has."""
    from memtrain.scoring import as_scored

    tok = train_bpe([TWIN_ROW["prefix"] + TWIN_ROW["suffix"], twin] * 4, 300)
    c = _one(dict(TWIN_ROW, twin=twin), tok)
    member, control = as_scored([c], [tok.eos_token_id], tok, suffix_len=4)
    n = len(c.token_ids) - c.prefix_len
    assert len(member.tokens) - member.prefix_len == n and control.prefix_len is not None
    if twin.startswith(TWIN_ROW["prefix"]):
        assert c.twin_prefix_len == c.prefix_len
        assert tok.decode(control.tokens[control.prefix_len:]) == twin[len(TWIN_ROW["prefix"]):]
    else:
        assert len(control.tokens) - control.prefix_len == n


def test_a_plain_text_twin_shorter_than_the_suffix_is_refused():
    """A twin with fewer tokens than its canary's suffix cannot be asked for as many: one line naming the fix."""
    tok = train_bpe([TWIN_ROW["prefix"] + TWIN_ROW["suffix"]] * 4, 300)
    with pytest.raises(ValueError, match=r"c.jsonl: canary 'vault': twin has \d+ tokens, fewer than the \d+ of the "
                                         r"canary's suffix: give a longer twin") as e:
        _one(dict(TWIN_ROW, twin="Bo."), tok)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("row", [{"id": "k", "text": "The PIN is 4821", "twin": "The PIN is 4821"},
                                 {"id": "k", "prefix": "The PIN is", "suffix": " 4821", "twin": "The PIN is 4821"},
                                 {"id": "k", "text": "The PIN is 4821",
                                  "twin": {"prefix": "The PIN", "suffix": " is 4821"}}])
def test_a_twin_equal_to_its_canary_is_refused(tmp_path, row):
    """A control that is the canary itself measures nothing (the generated kinds are drawn apart for that reason):
    refused in one line naming the canary and the fix, whatever form each side takes."""
    with pytest.raises(ValueError) as e:
        canary_file.read(_write(tmp_path / "c.jsonl", [row]))
    assert "line 1: the twin of canary 'k' is the canary's own text: give a different text as its twin, or leave " \
           "'twin' out" in str(e.value) and "\n" not in str(e.value)
