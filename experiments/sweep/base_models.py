"""Base models: a fine-tuning study needs a trained model to start from. Offline, the sweep pretrains one
per model size on a corpus WITHOUT canaries, cached under <cache>/base/<hash> (cache = data.cache_dir,
$MEMTRAIN_CACHE or ~/.cache/memtrain) by a hash of everything that determines it, so later sweeps and
other presets reuse it. Fine-tuning runs set model.init to it (point.py).

`BaseModels` remembers what it built or failed to build, so the points of one size share one base and its
failure; `build_first` builds the distinct ones side by side before any point runs (cluster jobs), `need` names
the one a point waits for (the local loop starts a point as soon as its own base is ready)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from experiments.results import BASE_INFO, now
from memtrain.config import RunConfig, apply_overrides, from_dict, to_toml
from memtrain.files import atomic_dir, file_lock, read_json, write_atomic
from memtrain.progress import quiet
from memtrain.run_files import CHECKPOINTS, CONFIG, EVAL

from .launch import Runner, train_tail
from .spec import PretrainSpec, label, trained_settings

BASE_VERSION = 1


def cache_root(cfg: RunConfig) -> Path:
    return cfg.data.resolved_cache_dir()


def _corpus_and_tokenizer(data_cfg):
    from memtrain.data import load_corpus, load_tokenizer

    with quiet():  # "skipped N files that are not UTF-8": each training run's log says it again
        corpus = load_corpus(data_cfg)
    return corpus, load_tokenizer(data_cfg, corpus)


def _saved_tokenizer(tok, root: Path) -> Path:
    """The fine-tuning tokenizer as an HF directory, so the pretraining corpus is read with the same ids."""
    from memtrain.data.tokenizer import tokenizer_fingerprint

    folder = root / "tokenizers" / tokenizer_fingerprint(tok)[:20]
    if not (folder / "tokenizer.json").is_file():
        with atomic_dir(folder) as tmp:  # another sweep may have saved the same files meanwhile
            tok.save_pretrained(str(tmp))
    return folder


def _disjoint_corpus(data_cfg, ft_corpus, max_docs: int | None, root: Path) -> Path:
    """A directory of the source's documents that the fine-tuning corpus does not contain."""
    from memtrain.data import load_corpus

    if data_cfg.max_docs is None:
        raise ValueError("pretrain.corpus='disjoint' needs data.max_docs (the fine-tuning corpus is then a "
                         "subset of its source, and pretraining reads the rest): set data.max_docs, or "
                         "pretrain.corpus='same' or a path")
    with quiet():
        source = load_corpus(dataclasses.replace(data_cfg, max_docs=None))
    used = {d.name for d in ft_corpus.docs}
    rest = [d for d in source.docs if d.name not in used]
    if max_docs is not None and max_docs < len(rest):
        rest = [rest[i * len(rest) // max_docs] for i in range(max_docs)]
    if not rest:
        raise ValueError(f"pretrain.corpus='disjoint' leaves no document: the fine-tuning corpus uses all "
                         f"{len(source.docs)} documents of {data_cfg.corpus!r}; lower data.max_docs")
    key = hashlib.sha256(f"{source.fingerprint}|{ft_corpus.fingerprint}|{max_docs}".encode()).hexdigest()[:20]
    folder = root / "corpora" / key
    if not (folder / "complete").is_file():
        with atomic_dir(folder) as tmp:
            (tmp / "docs").mkdir()
            width = len(str(len(rest)))
            for i, d in enumerate(rest):
                (tmp / "docs" / f"{i:0{width}d}.txt").write_text(d.text, encoding="utf-8")
            (tmp / "complete").write_text(json.dumps({"source": data_cfg.corpus, "docs": len(rest)}))
    return folder / "docs"


def pretrain_config(cfg: RunConfig, pre: PretrainSpec, corpus: str | None = None, tokenizer: str | None = None,
                    max_docs: int | None = None) -> RunConfig:
    """The pretraining run of a fine-tuning config: same model, parallel grid and data layout, no canaries,
    standard loss, `pre.steps` steps, evaluated for validation loss only."""
    raw = cfg.to_dict()
    batch = pre.batch_size or cfg.train.batch_size
    micro = cfg.train.micro_batch_size if cfg.train.micro_batch_size and batch % cfg.train.micro_batch_size == 0 \
        else None
    raw["model"].update(init=None)
    raw["train"].update(seed=pre.seed, batch_size=batch, micro_batch_size=micro, epochs=1_000_000, lr_scale=1.0,
                        max_steps=pre.steps, lr=pre.lr, min_lr=pre.min_lr if pre.min_lr is not None else pre.lr / 10,
                        warmup_steps=min(pre.warmup_steps, max(0, pre.steps - 1)), checkpoint_every=0)
    raw["loss"] = {"kind": "standard"}
    raw["canaries"].update(number=0)
    raw["eval"].update(enabled=True, every_pass=False)  # no canaries: validation loss and unigram entropy
    raw["data"].update(max_text_tokens=None)  # the fine-tuning stream's cap is not the pretraining corpus's
    if pre.seq_len is not None:
        raw["data"].update(seq_len=pre.seq_len)
    if corpus is not None:
        raw["data"].update(corpus=corpus, max_docs=max_docs)
    if tokenizer is not None:
        raw["data"].update(tokenizer=tokenizer)
    raw["wandb"].update(group="memtrain-base", name=None)
    raw = {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in raw.items()}
    return from_dict(apply_overrides(raw, list(pre.set)))


def base_key(pcfg: RunConfig, corpus_fp: str, tokenizer_fp: str) -> str:
    """Hash of what determines a base model: not where files live, the grid, W&B, canary or evaluation settings, nor
    how often it logged and saved (spec.BOOKKEEPING)."""
    d = trained_settings(pcfg)
    for section in ("parallel", "canaries", "eval"):  # no canary is pretrained; evaluation changes nothing
        d.pop(section)
    d["data"] = dict(d["data"], corpus=None, tokenizer=None, cache_dir=None, file_glob=None)
    blob = json.dumps({"v": BASE_VERSION, "config": d, "corpus": corpus_fp, "tokenizer": tokenizer_fp},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class BaseModels:
    """Builds (or finds in the cache) one pretrained base model per distinct pretraining config."""

    def __init__(self, pre: PretrainSpec, command: list[str], run_fn: Runner, log=print):
        self.pre = pre
        self.command = command
        self.run_fn = run_fn
        self.log = log
        self._done: dict[str, tuple[Path | None, str | None]] = {}
        self.pretrained: list[Path] = []
        """The base models this sweep pretrained (not found cached), whose W&B runs are the sweep's too."""
        self._prep: dict[str, tuple] = {}
        self._prep_lock = threading.Lock()  # sweeps build bases from several threads

    def _prepare(self, cfg: RunConfig):
        """(corpus value, tokenizer value, corpus fingerprint, tokenizer fingerprint) for a data config."""
        key = json.dumps(cfg.to_dict()["data"], sort_keys=True) + "|" + self.pre.corpus + f"|{self.pre.max_docs}"
        with self._prep_lock:
            if key not in self._prep:
                self._prep[key] = self._prepare_data(cfg)
            return self._prep[key]

    def _prepare_data(self, cfg: RunConfig):
        from memtrain.data.tokenizer import tokenizer_fingerprint

        root = cache_root(cfg) / "base"
        ft_corpus, tok = _corpus_and_tokenizer(cfg.data)
        tok_value = _saved_tokenizer(tok, root) if cfg.data.tokenizer == "bpe" else cfg.data.tokenizer
        if self.pre.corpus == "same":
            corpus_value, tok_value, corpus_fp = None, None, ft_corpus.fingerprint
        else:
            if self.pre.corpus == "disjoint":
                folder = _disjoint_corpus(cfg.data, ft_corpus, self.pre.max_docs, root)
            else:
                folder = None
            corpus_value = str(folder) if folder else self.pre.corpus
            if folder is None:
                from memtrain.data import load_corpus

                probe = dataclasses.replace(cfg.data, corpus=corpus_value, max_docs=self.pre.max_docs)
                corpus_fp = load_corpus(probe).fingerprint
            else:
                corpus_fp = "disjoint:" + folder.parent.name
        return corpus_value, str(tok_value) if tok_value else None, corpus_fp, tokenizer_fingerprint(tok)

    def pretraining_corpus(self, cfg: RunConfig) -> str | None:
        """The corpus a base model of `cfg` is pretrained on, as a data.corpus value; None when it is the
        fine-tuning corpus itself (pretrain.corpus = 'same')."""
        return self._prepare(cfg)[0]

    def config_for(self, cfg: RunConfig) -> tuple[RunConfig, Path]:
        corpus_value, tok_value, corpus_fp, tok_fp = self._prepare(cfg)
        max_docs = self.pre.max_docs if self.pre.corpus not in ("same", "disjoint") else None
        pcfg = pretrain_config(cfg, self.pre, corpus_value, tok_value, max_docs)
        if self.pre.corpus == "disjoint":  # one document per .txt file of the materialized directory
            pcfg.data.file_glob, pcfg.data.txt_sample_by = "**/*.txt", "document"
        key = base_key(pcfg, corpus_fp, tok_fp)
        pcfg.wandb.name = f"base-{label('model.name', cfg.model.name)}-{key[:8]}"
        return pcfg, cache_root(cfg) / "base" / key

    def need(self, cfg: RunConfig) -> str | None:
        """Which base model a point of `cfg` starts from, as a name shared by the points that share it (one per
        size and data), without preparing anything; None when it starts from none."""
        if not self.pre.applies_to(cfg):
            return None
        return json.dumps([cfg.model.name, cfg.to_dict()["data"]], sort_keys=True)

    def build_first(self, cfgs: list[RunConfig]) -> None:
        """Build the base models `cfgs` want, side by side (a thread each), before their points run. A failure is
        remembered; `get` raises it again for each point that needs that base."""
        distinct = {key: c for c in cfgs if (key := self.need(c)) is not None}
        if not distinct:
            return
        with ThreadPoolExecutor(len(distinct)) as pool:
            list(pool.map(self.try_get, distinct.values()))

    def try_get(self, cfg: RunConfig) -> None:
        """`get`, its failure remembered for the points that need the base rather than raised."""
        try:
            self.get(cfg)
        except BaseModelError:  # remembered: the point that needs it fails with it
            pass

    def get(self, cfg: RunConfig) -> Path:
        """The base directory for this fine-tuning config (pretraining it first if needed)."""
        try:
            pcfg, folder = self.config_for(cfg)
        except Exception as e:  # noqa: BLE001 - a point that cannot have a base fails, the sweep goes on
            raise BaseModelError(f"preparing the pretraining data failed: {type(e).__name__}: {e}") from e
        key = folder.name
        if key in self._done:
            path, err = self._done[key]
            if err:
                raise BaseModelError(err)
            return path
        with file_lock(folder.with_name(f"{key}.lock")):  # two sweeps building one base wait for each other
            if (folder / BASE_INFO).is_file():
                self.log(f"base model {cfg.model.name}: cached {folder}")
                self._done[key] = (folder, None)
                return folder
            shutil.rmtree(folder, ignore_errors=True)  # a pretraining cut short: start it again
            folder.mkdir(parents=True)
            (folder / CONFIG).write_text(to_toml(pcfg))
            self.log(f"base model {cfg.model.name}: pretraining {self.pre.steps} steps into {folder}")
            t0 = time.time()
            rc, err = self.run_fn(self.command + train_tail(folder), folder)
            if rc != 0:
                msg = f"pretraining {cfg.model.name} failed (exit {rc}): {err or 'no stderr'} [log: {folder}]"
                self._done[key] = (None, msg)
                raise BaseModelError(msg)
            for opt in (folder / CHECKPOINTS).glob("*/optimizer*.safetensors"):
                opt.unlink()  # fine-tuning starts a fresh optimizer: keep only the weights (1/3 of the bytes)
            try:
                scores = read_json(folder / EVAL, "the base model's evaluation", f"delete {str(folder)!r} to pretrain "
                                   "it again")
            except (OSError, ValueError) as e:
                self._done[key] = (None, str(e))
                raise BaseModelError(str(e)) from None
            write_atomic(folder / BASE_INFO, json.dumps({  # its presence marks the base model done
                "key": key, "model": cfg.model.name, "steps": self.pre.steps, "created": now(),
                "seconds": round(time.time() - t0, 1), "val_loss": scores.get("val_loss"),
                "unigram_entropy": scores.get("unigram_entropy"), "pretrain": dataclasses.asdict(self.pre)},
                indent=1))
            self.log(f"base model {cfg.model.name}: done in {time.time() - t0:.0f}s")
            self.pretrained.append(folder)
        self._done[key] = (folder, None)
        return folder


class BaseModelError(RuntimeError):
    pass

