"""Canaries of one's own: a JSONL file of texts (PII strings, passages, a benchmark's test items) to inject in
training (`canaries.file`) or to score against any model (`memtrain eval --model DIR --canaries FILE`).

One JSON object a line:

    {"text": "Jane Roe's card number is 4111 1111 1111 1111"}
    {"id": "q17", "kind": "benchmark", "prefix": "Question: ...\\nAnswer:", "suffix": " 42",
     "twin": {"prefix": "Question: ...\\nAnswer:", "suffix": " 17"}}

- `text`, or `prefix` and `suffix`: with `text` the evaluation's suffix is its last eval.suffix_len tokens; with
  prefix/suffix the split is yours (each side tokenized on its own, so the split never moves).
- `id` (optional, any JSON string or integer, unique): kept as given in every output; default "<kind>-<line>".
- `kind` (optional, default "user"): results are grouped by it.
- `twin` (optional): a text (or prefix/suffix) of the same form that is never trained: the non-member that
  membership inference and the twin-controlled measures compare against.
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


def _ids(item, tok) -> tuple[list[int], int | None]:
    """(token ids, prefix length or None) of a text or a {prefix, suffix} pair."""
    if isinstance(item, str):
        item = {"text": item}
    if "text" in item:
        return encode_text(tok, item["text"]), None
    prefix = encode_text(tok, item["prefix"])
    return prefix + encode_text(tok, item["suffix"]), len(prefix)


def to_canaries(rows: list[dict], tok, source: str, copies: list[int] | None = None) -> list[Canary]:
    """The rows as Canary records with `tok`'s token ids. `copies`: the cycle for rows that give none (training);
    None leaves them 0 ("not given")."""
    out = []
    for i, row in enumerate(rows):
        ids, prefix_len = _ids(row if "text" in row else {k: row[k] for k in ("prefix", "suffix")}, tok)
        twin_ids, twin_prefix_len = _ids(row["twin"], tok) if "twin" in row else ([], None)
        n = row.get("copies") or (copies[i % len(copies)] if copies else 0)
        text = row.get("text") or row["prefix"] + row["suffix"]
        twin = row.get("twin")
        twin_text = (twin if isinstance(twin, str) else twin.get("text") or twin["prefix"] + twin["suffix"]) if twin \
            else ""
        out.append(Canary(id=row["id"], kind=row["kind"], format="text", text=text, token_ids=ids,
                          twin_text=twin_text, twin_token_ids=twin_ids, copies=n,
                          candidate_space={"size": None, "log2_size": None, "note": "user text: no enumerable space"},
                          source=source, prefix_len=prefix_len, twin_prefix_len=twin_prefix_len))
    return out
