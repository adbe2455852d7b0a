"""Configuration of the training stream: where the text comes from and which canaries go into it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

CANARY_KINDS = ("random", "document")
RANDOM_FORMATS = ("secret", "tokens")


@dataclass
class DataConfig:
    corpus: str = "stdlib"
    """'stdlib' (this Python's own *.py sources: offline, no install), a directory of text files (one
    document per file), a text/json/jsonl/csv/parquet file or glob, a `save_to_disk` directory, or a hub
    dataset name (needs network)."""
    text_field: str = "text"
    """Column holding the text in json/jsonl/csv/parquet/hub/`save_to_disk` corpora."""
    file_glob: str = "**/*"
    """Files read (one document each) when `corpus` is a plain directory."""
    txt_sample_by: str = "paragraph"
    """How a .txt corpus file is cut into documents: 'document' (whole file), 'paragraph' or 'line'."""
    corpus_split: str = "train"
    """Split read from hub datasets and from `save_to_disk` dataset dictionaries."""
    max_docs: int | None = None
    """Use only this many documents, evenly spaced through the sorted corpus (quick runs, tests)."""
    val_fraction: float = 0.05
    """Fraction of documents held out of training for utility evaluation (validation loss)."""
    tokenizer: str = "bpe"
    """'bpe' trains a byte-level BPE on the corpus (cached); otherwise a local directory or hub id."""
    vocab_size: int = 4096
    """Vocabulary of the trained BPE, EOS included (ignored for a pretrained tokenizer)."""
    seq_len: int = 256
    """Input tokens per training sequence (labels are the next tokens)."""
    document_attention: bool = True
    """Each packed document attends only to itself, positions restarting at its EOS, so a canary is trained
    in exactly the context it is evaluated in wherever it sits in a row; false: attention across the whole
    row (classic packing), and evaluation also scores canaries from their recorded in-row context."""
    max_text_tokens: int | None = None
    """Keep at most this many tokens of corpus text (whole documents in shuffled order, the last one cut) in
    the training stream besides the canaries; None keeps all of it."""
    text_piece_tokens: int | None = None
    """Cut each training document into pieces of at most this many tokens before the shuffle, each piece then
    read as a document of its own (EOS-closed); None shuffles whole documents. A run that reads only part of its
    text (a few hundred pretraining steps, or max_text_tokens) then samples the whole corpus instead of its first
    few shuffled files, one of which can hold a fifth of the tokens read. Validation and canary documents stay
    whole."""
    cache_dir: str | None = None
    """Where tokenizers and prepared streams are cached; default $MEMTRAIN_CACHE or ~/.cache/memtrain."""

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len={self.seq_len} is invalid: use at least 2 tokens per sequence")
        if self.tokenizer == "bpe" and self.vocab_size < 258:
            raise ValueError(f"data.vocab_size={self.vocab_size} is too small for a byte-level BPE: "
                             "use >= 258 (256 bytes + EOS + merges)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction} is invalid: use a value in [0, 1)")
        if self.max_text_tokens is not None and self.max_text_tokens < 0:
            raise ValueError(f"data.max_text_tokens={self.max_text_tokens} is invalid: use None (all) or >= 0")
        if self.text_piece_tokens is not None and self.text_piece_tokens < 1:
            raise ValueError(f"data.text_piece_tokens={self.text_piece_tokens} is invalid: use None (whole documents) "
                             "or >= 1")
        if self.max_docs is not None and self.max_docs < 1:
            raise ValueError(f"data.max_docs={self.max_docs} is invalid: use None (all) or >= 1")
        if self.txt_sample_by not in ("document", "paragraph", "line"):
            raise ValueError(f"data.txt_sample_by={self.txt_sample_by!r} is invalid: "
                             "use 'document', 'paragraph' or 'line'")
        if not self.file_glob.strip() or Path(self.file_glob).is_absolute():
            raise ValueError(f"data.file_glob={self.file_glob!r} is invalid: use a pattern relative to the corpus "
                             "directory, e.g. '**/*.txt'")

    def resolved_cache_dir(self) -> Path:
        root = self.cache_dir or os.environ.get("MEMTRAIN_CACHE") or "~/.cache/memtrain"
        return Path(root).expanduser()


@dataclass
class CanaryConfig:
    kinds: list[str] = field(default_factory=lambda: ["random", "document"])
    """Canary kinds inserted: 'random' (secrets with a known candidate space, for exposure) and
    'document' (natural documents held out of the corpus)."""
    number: int = 8
    """Canaries of each kind (each also gets a held-out twin drawn the same way, never trained on)."""
    copies: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Duplication levels: canary i of each kind is inserted copies[i % len(copies)] times."""
    placement: str | int = "start"
    """Offset of a canary's first token in its sequence: 'start' (1, right after the EOS that opens it: every
    copy starts a sequence, as in the Goldfish setup), 'random' (uniform over the offsets where it fits: buried
    in the row's text), or a fixed int >= 1."""
    length: int = 64
    """Tokens per canary for random-token and document canaries (secrets have the template's length)."""
    random_format: str = "secret"
    """'secret': "The secret code of <name> is dddd-dddd-dddd-dddd" with uniform digits (Secret Sharer);
    'tokens': `length` token ids drawn uniformly from the vocabulary (special tokens excluded)."""
    secret_groups: int = 4
    """Groups of 4 digits in a secret: the candidate space has 10**(4 * secret_groups) secrets."""
    seed: int | None = None
    """Seed of canary content (which secrets, which documents); None follows train.seed, so a seeds axis draws
    new canaries for every seed. Placement always follows train.seed."""
    pools: int = 1
    """Split the documents that may become canaries into this many disjoint pools (a fixed split, the same for
    every seed); the content seed s draws its document canaries and twins from pool s % pools. Seeds in
    different pools never share a canary or twin document: settings chosen on one seed stay independent of
    the seeds they are reported on. Every pool's documents stay out of the training text, for every seed."""
    file: str | None = None
    """A JSONL file of your own canaries (PII strings, passages, test items; format: memtrain/data/canary_file.py),
    inserted beside the generated kinds with `copies` (unless a line gives its own) and `placement`; the
    manifest records each one's id, kind and this file. Its `twin` texts are never trained: the controls."""
    unique_against: str | None = None
    """A corpus (any data.corpus value) that must hold no canary or twin text, e.g. the base model's
    pretraining documents: a document chunk found there is not used (a chunk must also be unique in the
    fine-tuning corpus itself)."""

    def __post_init__(self):
        self.kinds = list(self.kinds)
        self.copies = list(self.copies)
        for kind in self.kinds:
            if kind not in CANARY_KINDS:
                raise ValueError(f"canaries.kinds contains {kind!r}: use any of {list(CANARY_KINDS)}")
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"canaries.kinds={self.kinds} repeats a kind: list each kind once")
        if self.number < 0:
            raise ValueError(f"canaries.number={self.number} is invalid: use >= 0 canaries per kind")
        if not self.copies or any(not isinstance(c, int) or c < 1 for c in self.copies):
            raise ValueError(f"canaries.copies={self.copies} is invalid: use a non-empty list of ints >= 1")
        if isinstance(self.placement, str):
            if self.placement not in ("start", "random"):
                raise ValueError(f"canaries.placement={self.placement!r} is invalid: "
                                 "use 'start', 'random' or an int offset >= 1")
        elif isinstance(self.placement, bool) or not isinstance(self.placement, int) or self.placement < 1:
            raise ValueError(f"canaries.placement={self.placement!r} is invalid: an int offset must be >= 1 "
                             "(position offset-1 holds the EOS that opens the canary)")
        if self.length < 1:
            raise ValueError(f"canaries.length={self.length} is invalid: use >= 1 token")
        if self.random_format not in RANDOM_FORMATS:
            raise ValueError(f"canaries.random_format={self.random_format!r} is invalid: "
                             "use 'secret' or 'tokens'")
        if self.pools < 1:
            raise ValueError(f"canaries.pools={self.pools} is invalid: use >= 1 pool")
        if self.secret_groups < 1:
            raise ValueError(f"canaries.secret_groups={self.secret_groups} is invalid: use >= 1 group")
