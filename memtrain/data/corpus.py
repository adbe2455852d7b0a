"""Load a corpus as a list of named text documents, with a content fingerprint for cache keys.

The default corpus is this Python's standard library source: real text on every machine, with no
network and no extra install, and nothing third-party copied into the repository.
"""

from __future__ import annotations

import glob
import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from memtrain.data.config import DataConfig
from memtrain.progress import note

_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Document:
    name: str
    """Stable name: a path relative to the corpus root, or '<source>#<row>'."""
    text: str


@dataclass
class Corpus:
    source: str
    docs: list[Document]
    fingerprint: str
    """sha256 of the names and texts: changes whenever the content does, whatever the path."""


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read `cfg.corpus` into documents (empty ones dropped); raise if nothing is left."""
    src = cfg.corpus
    path = Path(src).expanduser()
    skipped: list[str] = []
    if src == "stdlib":
        docs = _stdlib_documents(skipped)
    elif path.is_dir() and _is_saved_dataset(path):
        docs = _dataset_documents(_load_from_disk(path, cfg.corpus_split), cfg.text_field, src)
    elif path.is_dir():
        docs = read_text_files(path, cfg.file_glob, skipped=skipped)
    elif path.is_file() or glob.has_magic(src):
        docs = _data_file_documents(src, cfg)
    else:
        docs = _hub_documents(src, cfg)
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        unreadable = f" ({len(skipped)} file(s) skipped as not UTF-8 text)" if skipped else ""
        raise ValueError(f"corpus {src!r} has no non-empty documents{unreadable}: check the path, file_glob, "
                         "text_field")
    report_skipped(skipped)  # after the check: a corpus that is only unreadable files is one error line
    if cfg.max_docs is not None and cfg.max_docs < len(docs):
        # Evenly spaced rather than the first n, so a small corpus still spans the whole source.
        docs = [docs[i * len(docs) // cfg.max_docs] for i in range(cfg.max_docs)]
    # the built-in corpus is this interpreter's own sources: another Python version reads other text
    source = f"stdlib (Python {platform.python_version()})" if src == "stdlib" else src
    return Corpus(source=source, docs=docs, fingerprint=fingerprint(docs))


def fingerprint(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode("utf-8", "surrogatepass") + b"\0")
        h.update(d.text.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def read_text_files(root: Path, pattern: str = "**/*", skip_parts: tuple[str, ...] = (),
                    skipped: list[str] | None = None) -> list[Document]:
    """Every file under root matching pattern, sorted by path, one UTF-8 document each.

    Files that are not UTF-8 are skipped rather than decoded with replacement characters that the model would
    then learn: appended to `skipped` ("path (reason)") when given, else reported at once (`report_skipped`).
    """
    report = skipped is None
    skipped = [] if skipped is None else skipped
    docs = []
    for p in sorted(root.glob(pattern)):
        rel = p.relative_to(root)
        if not p.is_file() or any(part in skip_parts or part.startswith(".") for part in rel.parts):
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            skipped.append(f"{p} ({e.reason} at byte {e.start})")
            continue
        docs.append(Document(name=rel.as_posix(), text=text))
    if report:
        report_skipped(skipped)
    return docs


def report_skipped(skipped: list[str]) -> None:
    """One stderr line (global rank 0) for the files left out as not UTF-8: how many, and the first."""
    if skipped:
        n = len(skipped)
        note(f"data: skipped {n} file{'s' if n > 1 else ''} that {'are' if n > 1 else 'is'} not UTF-8, "
             f"e.g. {skipped[0]}")


def _stdlib_documents(skipped: list[str] | None = None) -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return read_text_files(root, "**/*.py", skip_parts=("site-packages", "dist-packages", "__pycache__"),
                           skipped=skipped)


def _is_saved_dataset(path: Path) -> bool:
    return any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _load_from_disk(path: Path, split: str):
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"corpus {str(path)!r} has splits {list(ds)}, not {split!r}: "
                             "set data.corpus_split")
        ds = ds[split]
    return ds


def _dataset_documents(ds, field: str, src: str) -> list[Document]:
    if field not in ds.column_names:
        raise ValueError(f"corpus {src!r} has no column {field!r} (columns: {ds.column_names}): "
                         "set data.text_field")
    try:
        texts = list(ds[field])  # read here: a column reads its values lazily
    except UnicodeDecodeError as e:  # pyarrow keeps a JSON file's bytes unchecked: they fail only when read
        raise ValueError(f"corpus {src!r}: column {field!r} is not UTF-8 text ({e.reason} at byte {e.start} of a "
                         "value): write the file as UTF-8") from None
    for i, t in enumerate(texts):
        if t is not None and not isinstance(t, str):  # numbers, lists: a column that is not the text
            raise ValueError(f"corpus {src!r}: row {i} of column {field!r} holds {type(t).__name__} {str(t)[:40]!r}, "
                             "not text: set data.text_field to the column that holds the documents")
    return [Document(name=f"{src}#{i}", text=t or "") for i, t in enumerate(texts)]


def _data_file_documents(src: str, cfg: DataConfig) -> list[Document]:
    import datasets

    path = os.path.expanduser(src)  # a file is itself, even with [ * ? in its name; anything else a pattern
    files = [path] if os.path.isfile(path) else sorted(glob.glob(path, recursive=True))
    if not files:
        raise ValueError(f"corpus {src!r} matches no file")
    exts = {_extension(f) for f in files}
    if len(exts) != 1 or not exts <= set(_BUILDERS):
        raise ValueError(f"corpus {src!r} has file types {sorted(exts)}: use files of one type among "
                         f"{sorted(_BUILDERS)} (or a directory, read one document per file)")
    ext = exts.pop()
    files = [f for f in files if os.path.getsize(f) > 0]  # an empty file holds no document (and stops the parser)
    if not files:
        raise ValueError(f"corpus {src!r} is empty (0 bytes): name a file that holds documents")
    kwargs = {"sample_by": cfg.txt_sample_by} if ext == ".txt" else {}
    datasets.disable_progress_bars()  # a bar per split of a few local files is noise
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its parse errors come back as ours, below
    try:
        ds = datasets.load_dataset(_BUILDERS[ext], data_files=[glob.escape(f) for f in files], split="train",
                                   cache_dir=str(cfg.resolved_cache_dir() / "hf_datasets"), **kwargs)
    except (datasets.exceptions.DatasetGenerationError, ValueError) as e:  # the parser's own error is the cause
        cause = e.__cause__ or e  # pyarrow's and an empty table's errors come as they are (ValueErrors)
        raise ValueError(f"corpus {src!r} does not parse as {ext[1:]} ({type(cause).__name__}: "
                         f"{str(cause)[:120]}): fix the file or name another data.corpus") from None
    return _dataset_documents(ds, "text" if ext == ".txt" else cfg.text_field, src)


def _extension(f: str) -> str:
    return Path(f).suffix.lower()


def _hub_documents(src: str, cfg: DataConfig) -> list[Document]:
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "").lower() in _TRUE]
    if offline:
        # Fail at once: offline, `load_dataset` would only find what an earlier run cached, and its
        # error would not say that `corpus` was not found as a local path either.
        raise ValueError(f"corpus {src!r} is not a local path and {offline[0]}=1: download it on a machine "
                         "with network (load_dataset(...).save_to_disk(dir)) and pass that directory")
    import datasets

    ds = datasets.load_dataset(src, split=cfg.corpus_split)
    return _dataset_documents(ds, cfg.text_field, src)
