"""Canaries of one's own: a JSONL file of texts (PII strings, passages, a benchmark's test items) to inject in
training (`canaries.file`) or to score against any model (`memtrain eval --model DIR --canaries FILE`).

One JSON object a line:

    {"text": "Jane Roe's card number is 4111 1111 1111 1111"}
    {"id": "q17", "kind": "benchmark", "prefix": "Question: ...\\nAnswer:", "suffix": " 42",
     "twin": {"prefix": "Question: ...\\nAnswer:", "suffix": " 17"}}

- `text`, or `prefix` and `suffix`: with `text` the evaluation's suffix is its last eval.suffix_len tokens; with
  prefix/suffix the split is yours. The text prefix + suffix is tokenized once, as training and the model see it
  (tokenizing the sides apart gives a SentencePiece-style tokenizer a '▁' before a suffix that opens without a
  space: a text nobody wrote), then cut where the prefix's characters end. A token that straddles that point
  (" 42" from "Answer: " + "42") belongs to the suffix: the suffix scored is what its tokens decode to.
- `id` (optional, any JSON string or integer, unique): kept as given in every output; default "<kind>-<line>".
- `kind` (optional, default "user"): results are grouped by it.
- `twin` (optional): a text (or prefix/suffix) of the same form that is never trained, and not the canary's own
  text: the non-member that membership inference and the twin-controlled measures compare against. A plain-text
  twin of a prefix/suffix canary answers the same question: cut after the canary's prefix when it starts with
  it, else asked for its last tokens, as many as the canary's suffix has.
- `copies` (optional, int >= 1): copies inserted in training; default canaries.copies, cycled as for the
  generated kinds. When auditing a model trained elsewhere it is only a label (how often you put it in).

Texts become token ids once, with the scoring model's own tokenizer: a decode/encode round trip can change the
split (measured: 50/64 vs 53/64 exact matches when scored from decoded text), so ids are what is kept.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from memtrain.data.canaries import Canary, encode_text

KEYS = {"text", "prefix", "suffix", "id", "kind", "twin", "copies"}
MAX_ROWS = 1_000_000


def read(path: str | Path) -> list[dict]:
    """The file's canaries as validated dicts (texts, not yet tokens); one line naming the row and the fix on
    any problem."""
    path = Path(path)
    where = f"canary file {str(path)!r}"
    rows = []
    try:  # utf-8-sig: a byte-order mark, as some editors write one, is not part of the first line
        lines = path.read_bytes().decode("utf-8-sig").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte {e.start}): write it as UTF-8 JSON lines") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if len(rows) == MAX_ROWS:
            raise ValueError(f"{where} has more than {MAX_ROWS:,} canaries: split it")
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} line {n} is not JSON ({e.msg}): write one JSON object a line") from None
    return checked(rows, where)


def checked(rows: list, where: str = "canaries") -> list[dict]:
    """Canary dicts (or (line number, dict) pairs, as a file gives them) validated, with their default id and
    kind; one line naming the row and the fix on any problem."""
    out, ids = [], set()
    for i, item in enumerate(rows, 1):
        n, row = item if isinstance(item, tuple) else (i, item)
        row = _checked(row, f"{where} line {n}")
        row.setdefault("kind", "user")
        row.setdefault("id", f"{row['kind']}-{n:04d}")
        if row["id"] in ids:
            raise ValueError(f"{where} line {n}: id {row['id']!r} is used twice: give every canary its own id")
        if "twin" in row and _text(row["twin"]) == _text(row):  # a control equal to its canary measures nothing
            raise ValueError(f"{where} line {n}: the twin of canary {row['id']!r} is the canary's own text: give a "
                             "different text as its twin, or leave 'twin' out")
        ids.add(row["id"])
        out.append(row)
    if not out:
        raise ValueError(f"{where} holds no canaries: write one JSON object a line with a 'text' "
                         "(or 'prefix' and 'suffix')")
    return out


def file_digest(path: str | Path) -> str:
    """What identifies the file's content (a stream built from an edited file must not come from the cache)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _checked(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is not a JSON object: write {{\"text\": ...}} or "
                         "{\"prefix\": ..., \"suffix\": ...}")
    unknown = sorted(set(row) - KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}: use only {sorted(KEYS)}")
    _texts(row, where)
    if "twin" in row:
        twin = row["twin"]
        if isinstance(twin, dict):
            extra = sorted(set(twin) - {"text", "prefix", "suffix"})
            if extra:
                raise ValueError(f"{where}: twin has unknown keys {extra}: give it 'text', or 'prefix' and 'suffix'")
            _texts(twin, f"{where} (twin)")
        elif not (isinstance(twin, str) and twin.strip()):
            raise ValueError(f"{where}: twin must be a non-empty text or an object with 'prefix' and 'suffix'")
        else:
            _utf8(twin, f"{where}: twin")
    if "id" in row and (isinstance(row["id"], bool) or not isinstance(row["id"], (str, int))):
        raise ValueError(f"{where}: id {row['id']!r} is invalid: use a string or an integer")
    if "kind" in row and not (isinstance(row["kind"], str) and row["kind"].strip()):
        raise ValueError(f"{where}: kind {row['kind']!r} is invalid: use a non-empty string")
    copies = row.get("copies")
    if copies is not None and (isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= 10**6):
        raise ValueError(f"{where}: copies {copies!r} is invalid: use an integer from 1 to 1,000,000")
    return dict(row)


def _texts(row: dict, where: str) -> None:
    has_text, split = "text" in row, ("prefix" in row) + ("suffix" in row)
    if has_text == bool(split) or split == 1:
        raise ValueError(f"{where}: give either 'text' or both 'prefix' and 'suffix'")
    for key in ("text",) if has_text else ("prefix", "suffix"):
        if not (isinstance(row.get(key), str) and row[key]):
            raise ValueError(f"{where}: {key!r} must be a non-empty string")
        _utf8(row[key], f"{where}: {key!r}")


def _utf8(text: str, what: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer takes: name them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate (\\u{ord(text[e.start]):04x} at character {e.start}): "
                         "write real characters, or escape pairs that make one") from None


def _text(item) -> str:
    """The whole text of a canary, a twin, or a {prefix, suffix} pair."""
    return item if isinstance(item, str) else item.get("text") or item["prefix"] + item["suffix"]


def split_ids(tok, prefix: str, suffix: str) -> tuple[list[int], int]:
    """(token ids of prefix + suffix tokenized as one text, how many of them are the prompt): the leading tokens
    that end at or before the prefix's last character; one that straddles the cut goes to the suffix. A byte-level
    BPE whose pre-tokenizer already splits there gets the ids of the sides tokenized apart."""
    text, cut = prefix + suffix, len(prefix)
    if not getattr(tok, "is_fast", False):  # a Python tokenizer has no offsets: decoded text marks where tokens end
        ids, own = encode_text(tok, text), encode_text(tok, prefix)
        n = next((i for i, (a, b) in enumerate(zip(ids, own)) if a != b), min(len(ids), len(own)))
        # The suffix can re-cut the prefix's last word (" se" "cr" alone, " sec" "ret" whole): tokens past the ids
        # the sides share still belong to the prompt while they decode inside the prefix, decoded too (a normalizing
        # tokenizer's text is not the prefix's). A token must add a whole character: a byte-level tokenizer's part
        # of one decodes to U+FFFD (BPE) or to nothing (ByT5), and the rest may be the suffix's.
        said = tok.decode(own, clean_up_tokenization_spaces=False)
        kept = tok.decode(ids[:n], clean_up_tokenization_spaces=False)
        for k in range(n + 1, len(ids) + 1):
            head = tok.decode(ids[:k], clean_up_tokenization_spaces=False)
            if len(head) > len(said):
                break
            if len(head) > len(kept) and said.startswith(head):
                n, kept = k, head
        return ids, n
    enc = tok(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], enc["offset_mapping"]
    n = next((i for i, (_, end) in enumerate(spans) if end > cut), len(ids))
    return ids, n


def _ids(item, tok, where: str) -> tuple[list[int], int | None]:
    """(token ids, prefix length or None) of a text or a {prefix, suffix} pair."""
    if isinstance(item, str):
        item = {"text": item}
    if "text" in item:
        return encode_text(tok, item["text"]), None
    ids, n = split_ids(tok, item["prefix"], item["suffix"])
    if n == len(ids):  # a tokenizer that drops the suffix's characters (a normalizer) leaves nothing to ask for
        raise ValueError(f"{where}: suffix {item['suffix']!r} gives no token of its own: give a suffix with text "
                         "the tokenizer keeps")
    return ids, n


def _twin_ids(row: dict, tok, ids: list[int], prefix_len: int | None, where: str) -> tuple[list[int], int | None]:
    """The twin's ids and prompt length. A plain-text twin of a prefix/suffix canary is asked what the canary is:
    cut after the canary's prefix when it starts with it, else asked for as many last tokens as the canary's
    suffix has (eval.suffix_len would set a target of another length against the canary's)."""
    twin = row["twin"]
    twin = twin.get("text", twin) if isinstance(twin, dict) else twin  # {"text": t} is the text t
    if not isinstance(twin, str) or prefix_len is None:
        return _ids(twin, tok, f"{where} (twin)")
    prefix = row["prefix"]
    if twin.startswith(prefix) and len(twin) > len(prefix):
        return _ids({"prefix": prefix, "suffix": twin[len(prefix):]}, tok, f"{where} (twin)")
    twin_ids, n = encode_text(tok, twin), len(ids) - prefix_len
    if len(twin_ids) < n:
        raise ValueError(f"{where}: twin has {len(twin_ids)} tokens, fewer than the {n} of the canary's suffix: give "
                         "a longer twin, or a twin with its own 'prefix' and 'suffix'")
    return twin_ids, len(twin_ids) - n


def to_canaries(rows: list[dict], tok, source: str, copies: list[int] | None = None) -> list[Canary]:
    """The rows as Canary records with `tok`'s token ids. `copies`: the cycle for rows that give none (training);
    None leaves them 0 ("not given")."""
    out = []
    for i, row in enumerate(rows):
        where = f"{source}: canary {row['id']!r}"
        ids, prefix_len = _ids(row if "text" in row else {k: row[k] for k in ("prefix", "suffix")}, tok, where)
        twin_ids, twin_prefix_len = _twin_ids(row, tok, ids, prefix_len, where) if "twin" in row else ([], None)
        n = row.get("copies") or (copies[i % len(copies)] if copies else 0)
        text = _text(row)
        twin_text = _text(row["twin"]) if "twin" in row else ""
        out.append(Canary(id=row["id"], kind=row["kind"], format="text", text=text, token_ids=ids,
                          twin_text=twin_text, twin_token_ids=twin_ids, copies=n,
                          candidate_space={"size": None, "log2_size": None, "note": "user text: no enumerable space"},
                          source=source, prefix_len=prefix_len, twin_prefix_len=twin_prefix_len))
    return out
