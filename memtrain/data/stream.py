"""The single-pass training stream: packed sequences with canaries at recorded places.

Layout. The stream is one contiguous token array T of n_seq * seq_len + 1 tokens; row i has
input_ids = T[i*S : (i+1)*S] and labels = T[i*S+1 : (i+1)*S+1], so no token is lost between rows.
Training documents (or their pieces: data.text_piece_tokens), in an order shuffled by the seed, follow each
other, each closed by EOS. A canary copy is written as EOS, canary, EOS, with its first token at `offset` >= 1
of its row: every canary token, the first one included, is then a label of that row, predicted from the same
in-document context wherever the copy sits (which keeps the Goldfish mask identical across copies). Corpus
text flows around the canaries; a document interrupted by a canary resumes after it as a new document. The
tail of the last row is padding (label -100) when the text runs out.

doc_pos[t] is the position of T[t] inside its document: the number of tokens since the last EOS
(or padding, or the start of the stream).

Document attention (data.document_attention, the default): batches carry position_ids that restart at
every EOS of the inputs (the EOS that opens a document is its position 0) and at every row start. Given
position ids that restart, transformers masks attention block-diagonally (packed sequences; the engine builds that
mask itself for families whose own ignores position ids: memtrain/hf/documents.py), so each document attends only
to itself: a canary copy anywhere in a row is seen exactly as it is at evaluation,
[EOS, canary] from position 0, whatever text precedes it in the row.

The stream is a pure function of (corpus, tokenizer, seq_len, val_fraction, max_text_tokens,
text_piece_tokens, canary config, the content of canaries.file and canaries.unique_against, seed, and the batch
size its row count is rounded up to): no model or parallel setting enters, so every model size and every grid
trains on the same bytes. Rounding the rows up to a whole number of batches means a pass trains every row (a short
last batch would not split over the grid), so no canary copy sits where no step reaches it. It is cached under
<cache>/streams/<key>, key = hash of all of these."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from memtrain.data import canary_file
from memtrain.data.canaries import Canary, make_document_canaries, make_random_canaries
from memtrain.data.config import CanaryConfig, DataConfig
from memtrain.data.corpus import Corpus, load_corpus
from memtrain.data.packing import PAD, document_positions, locate, pack, place, row_positions
from memtrain.data.tokenizer import encode, load_tokenizer, tokenizer_fingerprint, vocab_size
from memtrain.files import file_lock, write_atomic
from memtrain.progress import quiet, stage
from memtrain.run_files import MANIFEST
from parallel import IGNORE_INDEX

FORMAT_VERSION = 1
_VAL_SEED = 0x5EED_0F_7A1  # fixed: the validation split is shared by every stream seed and canary set
_POOL_SEED = 0x9001  # fixed: canary pools are the same for every seed


class TrainStream:
    """Packed training sequences, canaries with their placements, and held-out validation text."""

    def __init__(self, tokens: np.ndarray, seq_len: int, canaries: list[Canary], val_texts: list[str],
                 tokenizer, meta: dict, document_attention: bool = True):
        self.tokens = tokens
        self.seq_len = seq_len
        self.document_attention = document_attention
        """Batches carry position_ids restarting at every document (see the module docstring)."""
        self.canaries = canaries
        self.val_texts = val_texts
        """Documents held out of training (never canaries), for validation loss / utility."""
        self.tokenizer = tokenizer
        self.meta = meta
        self.eos_id = int(tokenizer.eos_token_id)
        self.vocab_size = vocab_size(tokenizer)
        self.doc_pos = document_positions(tokens, self.eos_id)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    @property
    def key(self) -> str:
        return self.meta["key"]

    @property
    def corpus(self) -> dict:
        """The corpus the stream was cut from: its source, sha256 fingerprint and number of documents."""
        return {"source": self.meta.get("corpus_source"), "fingerprint": self.meta.get("corpus"),
                "documents": self.meta.get("n_docs")}

    def num_steps(self, batch_size: int) -> int:
        """Steps of one pass; the last batch is short when batch_size does not divide len(self)."""
        return -(-len(self) // batch_size)

    def rows(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Rows [lo, hi) as numpy arrays: input_ids, labels (-100 where unsupervised), doc_pos of labels, and
        with document attention position_ids."""
        if not 0 <= lo < hi <= len(self):
            raise IndexError(f"rows [{lo}, {hi}) outside the stream's {len(self)} sequences")
        S = self.seq_len
        idx = np.arange(lo, hi)[:, None] * S + np.arange(S + 1)[None, :]
        t = self.tokens[idx].astype(np.int64)
        x, y = t[:, :-1], t[:, 1:]
        out = {"input_ids": np.where(x == PAD, self.eos_id, x),
               "labels": np.where((y == PAD) | (x == PAD), IGNORE_INDEX, y),
               "doc_pos": self.doc_pos[idx[:, 1:]].astype(np.int64)}
        if self.document_attention:
            out["position_ids"] = row_positions(out["input_ids"], self.eos_id)
        return out

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the stream's token frequencies: the loss of the best model that ignores context."""
        counts = np.bincount(self.tokens[self.tokens != PAD]).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """Global batch `step`: sequences [step*B, (step+1)*B) as long tensors [B, S] (+ seq_index [B]).

        Data-parallel rank r of D takes rows [r*B/D, (r+1)*B/D) of it (see `locate`).
        """
        lo = step * batch_size
        hi = min(lo + batch_size, len(self))
        out = {k: torch.from_numpy(v) for k, v in self.rows(lo, hi).items()}
        out["seq_index"] = torch.arange(lo, hi)
        return out

    def copies_seen(self, batch_size: int, steps: int) -> dict[str, int]:
        """Copies of each canary that `steps` optimizer steps at this batch size reach (max_steps may stop before
        some; a stream built for another batch size may leave rows after its last full batch, which a pass
        drops)."""
        per_epoch = len(self) // batch_size
        return {c.id: sum(1 for s in range(steps) for p in c.placements
                          if p.seq_index // batch_size == s % per_epoch and p.seq_index < per_epoch * batch_size)
                for c in self.canaries}

    def last_steps(self, batch_size: int, steps: int) -> dict[str, int]:
        """The last of `steps` optimizer steps at this batch size that trained each canary; a canary no step reached
        is left out. Epochs repeat the batches in order, so a row of batch b is trained at b, b + per_epoch, ..."""
        per_epoch = len(self) // batch_size
        out = {}
        for c in self.canaries:
            batches = [p.seq_index // batch_size for p in c.placements if p.seq_index < per_epoch * batch_size]
            trained = [b + (steps - 1 - b) // per_epoch * per_epoch for b in batches if b < steps]
            if trained:
                out[c.id] = max(trained)
        return out

    def val_sequences(self, n_docs: int, max_tokens: int) -> list[list[int]]:
        """Whole held-out documents in rows as training reads text: each of the first `n_docs` as [EOS, *ids]
        cut into windows of seq_len + 1 tokens that overlap by one, so every token after the opening EOS is
        predicted once; until `max_tokens` tokens are predicted."""
        out, total, S = [], 0, self.seq_len
        for ids in encode(self.tokenizer, self.val_texts[:n_docs]):
            ids = [self.eos_id, *ids.tolist()]
            for a in range(0, len(ids) - 1, S):
                if total >= max_tokens:
                    return out
                window = ids[a:a + S + 1][:max_tokens - total + 1]
                out.append(window)
                total += len(window) - 1
        return out

    def manifest(self, batch_size: int, data_shards: int = 1) -> list[dict]:
        """Canary records with the step and data-parallel rank of every copy filled in for this grid."""
        records = []
        for c in self.canaries:
            d = c.to_dict()
            for p in d["placements"]:
                p["step"], p["dp_rank"] = locate(p["seq_index"], batch_size, data_shards)
            records.append(d)
        return records

    def write_manifest(self, path: str | os.PathLike, batch_size: int, data_shards: int = 1) -> Path:
        """Write the manifest, canaries.jsonl (one canary per line), for a run with this batch size and grid."""
        path = Path(path)
        if path.is_dir() or not path.suffix:
            path = path / MANIFEST
        lines = [json.dumps(r, ensure_ascii=False) for r in self.manifest(batch_size, data_shards)]
        write_atomic(path, ("\n".join(lines) + "\n" if lines else "").encode("utf-8"))
        return path


def _check_ids(canaries: list[Canary], file: str) -> None:
    """Every result is keyed by id (a twin's by id + "-twin"): a file's id that a generated canary or twin also
    has would merge the two."""
    seen: set[str] = set()
    for c in canaries:
        for name in (str(c.id), f"{c.id}-twin") if c.twin_token_ids else (str(c.id),):
            if name in seen:
                raise ValueError(f"canaries.file {file!r}: id {name!r} is also a generated canary's (or twin's): "
                                 "give that line another id, or another kind than 'random' and 'document'")
            seen.add(name)


def build_stream(data_cfg: DataConfig, canary_cfg: CanaryConfig | None = None, seed: int = 0,
                 batch_size: int = 1) -> TrainStream:
    """Build (or load from cache) the training stream for these configs and seed, its rows a whole number of
    `batch_size` batches."""
    canary_cfg = canary_cfg if canary_cfg is not None else CanaryConfig(number=0)
    corpus = load_corpus(data_cfg)
    tok = load_tokenizer(data_cfg, corpus)
    avoided = _avoided(canary_cfg, data_cfg)
    cache = data_cfg.resolved_cache_dir()
    spec = {"version": FORMAT_VERSION, "corpus": corpus.fingerprint, "tokenizer": tokenizer_fingerprint(tok),
            "seq_len": data_cfg.seq_len, "val_fraction": data_cfg.val_fraction,
            "max_text_tokens": data_cfg.max_text_tokens, "canaries": asdict(canary_cfg), "seed": seed}
    if data_cfg.text_piece_tokens is not None:  # None keeps the keys of streams built before pieces existed
        spec["text_piece_tokens"] = data_cfg.text_piece_tokens
    if data_cfg.tokenizer != "bpe":  # a tokenizer's EOS is in its tokenizer_config.json, not in what the
        spec["eos_token_id"] = int(tok.eos_token_id)  # fingerprint hashes: an edited EOS must pack anew
    if canary_cfg.file is not None:  # the path alone would let an edited file come back from the cache
        spec["canaries_file_sha256"] = canary_file.file_digest(canary_cfg.file)
        spec["canaries_file_texts_held"] = True  # streams before it trained documents holding a file's texts
        spec["canaries_file_whole_text"] = True  # before it, prefix and suffix were tokenized apart
        if not getattr(tok, "is_fast", False):
            spec["canaries_file_slow_cut"] = True  # without offsets, a cut into whole characters since then
    if avoided is not None:  # as for the file: its path alone keeps the key when edited text draws other canaries
        spec["unique_against_corpus"] = avoided.fingerprint
    if batch_size > 1:  # batch 1 keeps the keys streams had before rows were rounded
        spec["rows_multiple"] = batch_size
    key = _hash(spec)
    folder = cache / "streams" / key
    if not (folder / "meta.json").exists():
        with file_lock(folder.with_name(f"{key}.lock")):  # runs side by side build one entry once
            if not (folder / "meta.json").exists():
                with stage(f"data: tokenizing {len(corpus.docs):,} documents and packing them into sequences of "
                           f"{data_cfg.seq_len} tokens"):
                    _write_stream(folder, data_cfg, canary_cfg, seed, corpus, tok, {**spec, "key": key}, batch_size,
                                  avoided)
    try:  # the cache is ours, but a disk or a hand can damage it: name the entry, never a parser's message alone
        meta = json.loads((folder / "meta.json").read_text())
        tokens = np.load(folder / "tokens.npy")
        canaries = [Canary.from_dict(d) for d in json.loads((folder / "canaries.json").read_text())]
        val = json.loads((folder / "val.json").read_text())
        if not (isinstance(meta, dict) and isinstance(val, list) and tokens.ndim == 1):
            raise ValueError("a file holds the wrong kind of value")
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"the cached stream {str(folder)!r} is damaged ({' '.join(str(e).split())[:120]}): delete "
                         "that directory and it is rebuilt") from None
    return TrainStream(tokens, data_cfg.seq_len, canaries, val, tok, meta, data_cfg.document_attention)


def _write_stream(folder: Path, data_cfg: DataConfig, canary_cfg: CanaryConfig, seed: int, corpus, tok,
                  meta: dict, batch_size: int, avoided: Corpus | None) -> None:
    """Split the corpus, draw and place the canaries, pack, and write the stream's cache entry."""
    docs = _tokenized(corpus, tok, data_cfg.resolved_cache_dir())
    S, eos = data_cfg.seq_len, int(tok.eos_token_id)
    n = len(corpus.docs)
    n_val = max(1, round(data_cfg.val_fraction * n)) if data_cfg.val_fraction and n > 1 else 0
    val_idx = set(np.random.default_rng(_VAL_SEED).permutation(n)[:n_val].tolist())
    rest = [i for i in range(n) if i not in val_idx]

    canaries: list[Canary] = []
    held: set[int] = set()
    content_seed = seed if canary_cfg.seed is None else canary_cfg.seed
    if canary_cfg.number and "random" in canary_cfg.kinds:
        canaries += make_random_canaries(canary_cfg, tok, np.random.default_rng([content_seed, 1]))
    if canary_cfg.number and "document" in canary_cfg.kinds:
        candidates = [i for i in rest if len(docs[i]) >= canary_cfg.length]
        if canary_cfg.pools > 1:  # disjoint pools, each 1.5x what a seed draws (some have no unique chunk)
            reserved = np.random.default_rng(_POOL_SEED).permutation(candidates)
            reserved = reserved[:canary_cfg.pools * 3 * canary_cfg.number]
            pool = np.array_split(reserved, canary_cfg.pools)[content_seed % canary_cfg.pools]
            held.update(int(i) for i in reserved)  # every seed trains on the same text: no pool ever is text
            candidates = sorted(int(i) for i in pool)
        doc_canaries, used = make_document_canaries(canary_cfg, tok, corpus.docs, candidates,
                                                    np.random.default_rng([content_seed, 2]),
                                                    "\0".join(d.text for d in avoided.docs) if avoided else "")
        canaries += doc_canaries
        held.update(used)
    if canary_cfg.file is not None:
        mine = canary_file.to_canaries(canary_file.read(canary_cfg.file), tok, canary_cfg.file, canary_cfg.copies)
        canaries += mine
        _check_ids(canaries, canary_cfg.file)
        # A document holding a file canary's text would train it more often than its copies, one holding a twin
        # would train the control: held out, as document canaries' sources are.
        texts = [t for c in mine for t in (c.text, c.twin_text) if t]
        held.update(i for i in rest if any(t in corpus.docs[i].text for t in texts))
    for c in canaries:
        if len(c.token_ids) > S - 1 or len(c.twin_token_ids) > S - 1:
            L, who = max(len(c.token_ids), len(c.twin_token_ids)), "" if len(c.token_ids) > S - 1 else "'s twin"
            fix = "canaries.length" if c.format != "text" else \
                f"that canary in canaries.file {c.source!r} (canaries.length sizes only the generated ones)"
            raise ValueError(f"canary {c.id!r}{who} has {L} tokens but seq_len={S} fits at most {S - 1} (one position "
                             f"holds the EOS before it): shorten {fix} or raise data.seq_len")

    train = [i for i in rest if i not in held]
    if not train:
        raise ValueError(f"no training documents left in corpus {corpus.source!r} after holding out "
                         f"{len(val_idx)} validation and {len(held)} canary documents: use a larger corpus")
    rng = np.random.default_rng([seed, 1])
    P = data_cfg.text_piece_tokens
    if P is None:
        pieces = [docs[i] for i in rng.permutation(np.asarray(train))]
    else:
        pieces = [docs[i][k:k + P] for i in train for k in range(0, len(docs[i]), P)]
        pieces = [pieces[j] for j in rng.permutation(len(pieces))]
    text = np.concatenate([x for piece in pieces for x in (piece, np.array([eos], dtype=np.int32))])
    if data_cfg.max_text_tokens is not None:
        text = text[:data_cfg.max_text_tokens]

    n_copies = sum(c.copies for c in canaries)
    need = len(text) + sum(c.copies * (len(c.token_ids) + 2) for c in canaries)
    n_seq = max(1, n_copies, -(-(need - 1) // S))  # every copy has a row of its own
    n_seq = -(-n_seq // batch_size) * batch_size  # whole batches: every row is trained
    place(canaries, n_seq, S, canary_cfg.placement, np.random.default_rng([seed, 2]))
    tokens = pack(text, canaries, n_seq, S, eos)

    meta = {**meta, "corpus_source": corpus.source, "n_seq": n_seq, "n_docs": n, "n_train_docs": len(train),
            "n_val_docs": len(val_idx), "n_canary_docs": len(held), "text_tokens": int(len(text)),
            "canary_copies": n_copies}
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "tokens.npy", _npy_bytes(tokens))
    write_atomic(folder / "canaries.json", json.dumps([c.to_dict() for c in canaries]).encode())
    write_atomic(folder / "val.json", json.dumps([corpus.docs[i].text for i in sorted(val_idx)]).encode())
    write_atomic(folder / "meta.json", json.dumps(meta, indent=1).encode())  # last: marks the entry complete


def _avoided(canary_cfg: CanaryConfig, data_cfg: DataConfig) -> Corpus | None:
    """The corpus no canary may come from (canaries.unique_against), read with the data section's text_field,
    corpus_split, file_glob and cache, whole (every document, each one document); None where it changes nothing
    (no document canaries are drawn), which keeps such streams' keys and skips reading it."""
    if canary_cfg.unique_against is None or not canary_cfg.number or "document" not in canary_cfg.kinds:
        return None
    with quiet():
        return load_corpus(replace(data_cfg, corpus=canary_cfg.unique_against, txt_sample_by="document",
                                   max_docs=None))


def _tokenized(corpus, tok, cache: Path) -> list[np.ndarray]:
    """Token ids of every corpus document, cached per (corpus, tokenizer) so seeds and canary settings
    reuse one tokenization."""
    key = _hash({"corpus": corpus.fingerprint, "tokenizer": tokenizer_fingerprint(tok)})
    folder = cache / "tokenized" / key
    if (folder / "offsets.npy").exists():
        ids, offsets = np.load(folder / "ids.npy"), np.load(folder / "offsets.npy")
    else:
        parts = encode(tok, [d.text for d in corpus.docs])
        offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "ids.npy", _npy_bytes(ids))
        write_atomic(folder / "offsets.npy", _npy_bytes(offsets))
    return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:24]


def _npy_bytes(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


