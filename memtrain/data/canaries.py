"""Canaries: the sequences whose memorization we measure, each with a held-out twin.

Two generated kinds (and any kind a user's canary file names: memtrain/data/canary_file.py):
- random: a secret with a known candidate space, so exposure (Carlini et al. 2019) can be computed by
  enumerating or sampling the alternatives. Either a template "The secret code of <made-up name> is
  dddd-dddd-dddd-dddd" with uniform digits, or uniform random token ids.
- document: a chunk of a natural document held out of the corpus (the whole source document is
  removed from training, so the inserted copies are its only exposure).

The twin of a canary is drawn exactly the same way and never trained on: it is the negative that
exposure and membership inference compare against. Token ids are authoritative; texts are their
decoding (a random-token canary need not re-encode to the same ids).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import numpy as np

from memtrain.data.config import CanaryConfig
from memtrain.data.corpus import Document

SECRET_TEMPLATE = "The secret code of {name} is {secret}"
_SYLLABLES = ("ka", "lo", "mi", "ren", "zu", "vor", "ta", "quil", "bex", "no", "dra", "fen", "si", "mar",
              "tho", "gal", "wy", "pel", "ost", "ru", "xan", "bo", "lin", "hue", "tor", "ema", "cas", "jo")


@dataclass
class Placement:
    seq_index: int
    """Sequence (row) of the stream holding this copy."""
    offset: int
    """Index of the canary's first token in that row's input_ids; input_ids[offset - 1] is EOS."""
    step: int | None = None
    """Optimizer step that sees this copy (seq_index // batch_size), once a batch size is known."""
    dp_rank: int | None = None
    """Data-parallel rank that holds this copy, once the number of data shards is known."""


@dataclass
class Canary:
    id: str
    """Unique; a user file's id is kept as given (a string or an integer)."""
    kind: str
    """'random', 'document', or a user file's kind."""
    format: str
    """'secret', 'tokens', 'document', or 'text' (a user file's)."""
    text: str
    token_ids: list[int]
    twin_text: str
    twin_token_ids: list[int]
    copies: int
    candidate_space: dict
    """How the secret was drawn: size |R| (an int, possibly huge; None for documents), log2_size, the
    template and slot alphabet, so exposure can be computed from alternatives."""
    source: str | None = None
    """Document the chunk came from (document canaries)."""
    twin_source: str | None = None
    prefix_len: int | None = None
    """Leading tokens that are the prompt when a user file splits the canary into prefix and suffix; None: the
    evaluation's suffix is its last eval.suffix_len tokens."""
    twin_prefix_len: int | None = None
    placements: list[Placement] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Canary:
        d = dict(d)
        d["placements"] = [Placement(**p) for p in d.get("placements", [])]
        return cls(**d)


def render_secret(name: str, secret: str) -> str:
    """Text of a secret canary; exposure substitutes alternative secrets here."""
    return SECRET_TEMPLATE.format(name=name, secret=secret)


def secret_prefix_len(c: Canary, tok, twin: bool = False) -> int:
    """Tokens of a secret canary (or of its twin, whose made-up name is its own) before its secret: where its
    rendering and one with every digit changed part (the name and template are known context; the digits are what
    exposure and extraction ask for)."""
    slots = c.candidate_space["twin_slots" if twin else "slots"]
    ids = c.twin_token_ids if twin else c.token_ids
    changed = "".join(str((int(ch) + 5) % 10) if ch.isdigit() else ch for ch in slots["secret"])
    other = encode_text(tok, render_secret(slots["name"], changed))
    n = 0
    while n < min(len(other), len(ids)) and other[n] == ids[n]:
        n += 1
    return n


def make_random_canaries(cfg: CanaryConfig, tok, rng: np.random.Generator) -> list[Canary]:
    """`cfg.number` random canaries with distinct twins, in the configured format."""
    if cfg.random_format == "secret":
        draw, space = _secret_drawer(cfg, tok, rng), _secret_space(cfg)
    else:
        draw, space = _token_drawer(cfg, tok, rng), _token_space(cfg, tok)
    seen: set[tuple[int, ...]] = set()
    canaries = []
    for i in range(cfg.number):
        pair = []
        while len(pair) < 2:  # collisions are astronomically rare, but a twin must never equal a canary
            text, ids, slots = draw()
            if tuple(ids) not in seen:
                seen.add(tuple(ids))
                pair.append((text, ids, slots))
        (text, ids, slots), (twin_text, twin_ids, twin_slots) = pair
        canaries.append(Canary(
            id=f"random-{i:04d}", kind="random", format=cfg.random_format, text=text, token_ids=ids,
            twin_text=twin_text, twin_token_ids=twin_ids, copies=cfg.copies[i % len(cfg.copies)],
            candidate_space={**space, "slots": slots, "twin_slots": twin_slots}))
    return canaries


def _secret_drawer(cfg: CanaryConfig, tok, rng: np.random.Generator):
    def draw():
        name = " ".join(_made_up_word(rng) for _ in range(2))
        digits = rng.integers(0, 10, size=4 * cfg.secret_groups)
        secret = "-".join("".join(map(str, digits[g * 4:g * 4 + 4])) for g in range(cfg.secret_groups))
        text = render_secret(name, secret)
        return text, encode_text(tok, text), {"name": name, "secret": secret}
    return draw


def _made_up_word(rng: np.random.Generator) -> str:
    n = int(rng.integers(2, 4))
    return "".join(_SYLLABLES[int(i)] for i in rng.integers(0, len(_SYLLABLES), size=n)).capitalize()


def _secret_space(cfg: CanaryConfig) -> dict:
    n_digits = 4 * cfg.secret_groups
    return {"size": 10 ** n_digits, "log2_size": n_digits * math.log2(10), "template": SECRET_TEMPLATE,
            "secret_format": "-".join(["dddd"] * cfg.secret_groups), "alphabet": "0123456789",
            "note": "the name is known context; alternatives vary the secret digits only"}


def _allowed_token_ids(tok) -> np.ndarray:
    special = set(tok.all_special_ids)
    return np.array([i for i in range(len(tok)) if i not in special], dtype=np.int64)


def _token_drawer(cfg: CanaryConfig, tok, rng: np.random.Generator):
    allowed = _allowed_token_ids(tok)

    def draw():
        ids = [int(i) for i in rng.choice(allowed, size=cfg.length)]
        return tok.decode(ids), ids, None
    return draw


def _token_space(cfg: CanaryConfig, tok) -> dict:
    n = len(_allowed_token_ids(tok))
    return {"size": n ** cfg.length, "log2_size": cfg.length * math.log2(n),
            "alphabet": f"token ids in [0, {len(tok)}) except special ids {sorted(tok.all_special_ids)}",
            "note": "every position is a slot drawn uniformly from the alphabet"}


def encode_text(tok, text: str) -> list[int]:
    """A canary's token ids: no special tokens added, none read from the text (a string holding "</s>" is those
    characters)."""
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def make_document_canaries(cfg: CanaryConfig, tok, docs: list[Document], candidates: list[int],
                           rng: np.random.Generator, avoid: str = "") -> tuple[list[Canary], list[int]]:
    """`cfg.number` canaries cut from held-out documents; returns them and the indices of the documents
    used (canaries and twins), which the caller removes from the training text.

    A chunk starts at a line start and is accepted only if its text occurs nowhere else in the corpus
    (stdlib files share license headers and copied code) nor in `avoid` (the base model's pretraining text:
    sibling stdlib files share codec tables), so that neither a canary nor its twin reaches the model through
    another document.
    """
    need = 2 * cfg.number
    if len(candidates) < need:  # before the search, which reads the whole corpus once per candidate
        raise ValueError(f"corpus has only {len(candidates)} documents of canaries.length={cfg.length} tokens or more "
                         f"to cut canaries from, need {need} (canaries + twins): lower canaries.number or "
                         "canaries.length, or use a larger corpus")
    blob = "\0".join(d.text for d in docs)
    chosen: list[tuple[int, str, list[int]]] = []
    for di in rng.permutation(np.asarray(candidates, dtype=np.int64)):
        if len(chosen) == need:
            break
        chunk = _unique_chunk(docs[int(di)].text, tok, cfg.length, blob, rng, avoid)
        if chunk is not None:
            chosen.append((int(di), *chunk))
    if len(chosen) < need:
        raise ValueError(f"corpus has only {len(chosen)} documents with a unique chunk of canaries.length="
                         f"{cfg.length} tokens, need {need} (canaries + twins): lower canaries.number or "
                         "canaries.length, or use a larger corpus")
    canaries = []
    for i in range(cfg.number):
        (d, text, ids), (td, twin_text, twin_ids) = chosen[2 * i], chosen[2 * i + 1]
        canaries.append(Canary(
            id=f"document-{i:04d}", kind="document", format="document", text=text, token_ids=ids,
            twin_text=twin_text, twin_token_ids=twin_ids, copies=cfg.copies[i % len(cfg.copies)],
            candidate_space={"size": None, "log2_size": None, "note": "natural text: no enumerable space"},
            source=docs[d].name, twin_source=docs[td].name))
    return canaries, [c[0] for c in chosen]


def _unique_chunk(text: str, tok, length: int, blob: str, rng: np.random.Generator, avoid: str = "",
                  tries: int = 8):
    starts = [0] + [m.end() for m in re.finditer("\n", text) if m.end() < len(text)]
    for s in rng.choice(np.asarray(starts), size=min(tries, len(starts)), replace=False):
        # ~4 characters per token for code and prose; take generously and cut in tokens.
        ids = encode_text(tok, text[int(s):int(s) + 16 * length])[:length]
        if len(ids) < length:
            continue
        chunk = tok.decode(ids)
        # Once in its own document is expected; a second occurrence (or none, if decoding does not
        # give the source text back) means the chunk is not safely unique.
        if chunk.strip() and blob.count(chunk) == 1 and chunk not in avoid:
            return chunk, [int(i) for i in ids]
    return None
