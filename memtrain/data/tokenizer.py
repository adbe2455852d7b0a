"""Tokenizers: a byte-level BPE trained on the corpus (default) or any Hugging Face tokenizer.

The trained BPE is cached under <cache>/tokenizers/<key>, key = hash(corpus fingerprint, vocab size),
so every model of a ladder and every rerun shares one vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from memtrain.data.config import DataConfig
from memtrain.data.corpus import Corpus
from memtrain.files import write_atomic
from memtrain.progress import count, stage

EOS = "<|endoftext|>"
RESERVED = "<|reserved-0|>"
"""Token id 0 of a trained BPE: a special token no text encodes to. The Goldfish paper's hash ('reference')
keys a window by the product of its ids, so an id 0 in text (an EOS at id 0, say) would send every window
holding it to one table entry, dropped or kept together; with id 0 reserved, that hash behaves as in the paper."""
_BPE_VERSION = 2  # bump when the trainer settings below change


def load_tokenizer(cfg: DataConfig, corpus: Corpus) -> PreTrainedTokenizerBase:
    """The tokenizer named by cfg.tokenizer; it always has an EOS token (used between documents)."""
    if cfg.tokenizer == "bpe":
        tok = _cached_bpe(corpus, cfg.vocab_size, cfg.resolved_cache_dir())
    else:
        try:
            tok = AutoTokenizer.from_pretrained(cfg.tokenizer, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - a damaged file raises KeyError, TypeError, tokenizers' bare Exception
            local = Path(cfg.tokenizer).is_dir()
            why = " (a damaged or foreign tokenizer file?)" if local else \
                " (HF_HUB_OFFLINE is set: only local directories and cached ids work)" \
                if os.environ.get("HF_HUB_OFFLINE") else ""
            raise ValueError(f"data.tokenizer={cfg.tokenizer!r} could not be loaded{why}: {type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:200]}") from None
    if tok.eos_token_id is None:
        raise ValueError(f"data.tokenizer={cfg.tokenizer!r} has no EOS token: pick a tokenizer with one "
                         "(documents are separated by EOS)")
    return tok


def vocab_size(tok: PreTrainedTokenizerBase) -> int:
    """Embedding rows a model needs: every id the tokenizer can emit, added tokens included."""
    return len(tok)


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """Content hash of a tokenizer (its full serialized form), for cache keys."""
    if isinstance(tok, PreTrainedTokenizerFast):
        blob = tok.backend_tokenizer.to_str()
    else:  # slow tokenizers: the vocabulary and special tokens are what decide the ids
        blob = json.dumps([sorted(tok.get_vocab().items()), tok.all_special_tokens], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def encode(tok: PreTrainedTokenizerBase, texts: list[str], batch: int = 512) -> list[np.ndarray]:
    """Token ids of each text, without BOS/EOS, as int32 arrays.

    split_special_tokens: a literal "<|endoftext|>" inside a document must stay text, otherwise it would
    become an EOS in the middle of the document and break the document boundaries the loss relies on.
    """
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], add_special_tokens=False, split_special_tokens=True, verbose=False)
        out.extend(np.asarray(ids, dtype=np.int32) for ids in enc["input_ids"])
    return out


def train_bpe(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style): any text is encodable, and decoding gives the bytes back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[RESERVED, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer, length=len(texts))
    return _wrap(tk)


def _wrap(tk) -> PreTrainedTokenizerFast:
    # model_max_length: documents are packed by us, so the "sequence too long" warning is noise.
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS, additional_special_tokens=[RESERVED],
                                   model_max_length=1 << 40)


def _cached_bpe(corpus: Corpus, size: int, cache: Path) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer

    key = hashlib.sha256(f"bpe-v{_BPE_VERSION}|{corpus.fingerprint}|{size}".encode()).hexdigest()[:20]
    path = cache / "tokenizers" / key / "tokenizer.json"
    if path.exists():
        try:
            return _wrap(Tokenizer.from_file(str(path)))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a damaged file
            raise ValueError(f"the cached tokenizer {str(path)!r} is damaged ({str(e)[:120]}): delete its directory "
                             "and it is trained again") from None
    texts = [d.text for d in corpus.docs]
    with stage(f"data: corpus {corpus.source!r}: {len(texts):,} documents, {count(sum(map(len, texts)))} chars; "
               f"training a byte-level BPE tokenizer (vocab {size:,})"):
        tok = train_bpe(texts, size)
    write_atomic(path, tok.backend_tokenizer.to_str(pretty=True))  # a concurrent reader sees none or all of it
    return tok
