"""Memorization sweeps: one full run (fine-tune one pass, then evaluate) per point of a grid of configs.

    memtrain sweep quick                                  # a preset from experiments/presets/
    memtrain sweep my_sweep.toml --set train.lr=3e-4 --out runs/mine
    memtrain sweep quick --resume                         # run only points without a finished result
    memtrain sweep quick --list                           # print the points and exit
    python -m experiments.sweep quick ...                 # the same without the console script

A sweep spec is a TOML file:

    [sweep]
    name = "quick"                      # default --out is runs/<name>
    description = "..."
    keep_checkpoints = true             # false: delete each fine-tuned run's checkpoints once evaluated

    [base]                              # a partial RunConfig: sections model, train, loss, data, ...
    data = { max_docs = 300, seq_len = 128 }

    [axes]                              # the grid is the product of every axis, in this order
    "model.name" = ["ladder-1m", "ladder-3m"]           # section.key = list of values
    loss = [{ kind = "standard" }, { kind = "goldfish", k = 4 }]   # section = list of tables
    seeds = [0, 1]                                      # shorthand for "train.seed"

    [pretrain]                          # the base model each fine-tuning run starts from
    steps = 200                         # 0: no pretraining (fine-tune from model.init or the seeded init)
    lr = 3e-3
    corpus = "disjoint"                 # see PretrainSpec

Every point runs `python -m memtrain train --config RUN_DIR/config.toml --out RUN_DIR` (or under
torchrun) in its own directory <out>/<point-id>, and appends one line to <out>/results.jsonl when it
ends: its axes, status, run and base directories, the eval.json contents, final training metrics and a
compact per-canary list. The file is only ever appended to (and flushed), never rewritten; a failed run
is recorded with the last line of its stderr and the sweep goes on. The report (experiments.report) is
drawn from results.jsonl alone at the end.

Base models: a fine-tuning study needs a trained model to start from. Offline, the sweep pretrains one
per model size on a corpus WITHOUT canaries, cached under <cache>/base/<hash> (cache = data.cache_dir,
$MEMTRAIN_CACHE or ~/.cache/memtrain) by a hash of everything that determines it, so later sweeps and
other presets reuse it; fine-tuning runs set model.init to it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from memtrain.config import RunConfig, apply_overrides, from_dict, to_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESETS = Path(__file__).resolve().parent / "presets"
RESULTS = "results.jsonl"
BASE_VERSION = 1
AXIS_ALIASES = {"seeds": "train.seed", "seed": "train.seed"}

# A runner executes one command for a run directory and returns (exit code, last stderr line or None).
Runner = Callable[[list, Path], "tuple[int, str | None]"]


# ---------------------------------------------------------------------------------------------------
# spec


@dataclass
class PretrainSpec:
    """How the base model of each size is made before fine-tuning (section [pretrain])."""

    steps: int = 0
    """Optimizer steps of pretraining (0: none; runs start from base model.init or the seeded init)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float | None = None
    """End of the cosine decay (default lr / 10)."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    batch_size: int | None = None
    """Sequences per step (default: the fine-tuning train.batch_size)."""
    seed: int = 1234
    """Seed of the pretraining (initialization and data order); independent of the sweep's seeds."""
    corpus: str = "disjoint"
    """'disjoint': the documents of the fine-tuning corpus's source that the fine-tuning corpus does NOT
    use (needs data.max_docs; canaries, their twins and validation documents are never seen);
    'same': the fine-tuning corpus itself with canaries.number = 0 (the documents later cut into
    document canaries and their twins are then seen once in pretraining);
    anything else: a data.corpus value (path) read with the fine-tuning tokenizer."""
    max_docs: int | None = None
    """Use at most this many pretraining documents (evenly spaced)."""
    set: list[str] = field(default_factory=list)
    """Extra 'section.key=value' overrides of the pretraining run's config."""


@dataclass
class Spec:
    name: str
    description: str = ""
    base: dict = field(default_factory=dict)
    axes: dict = field(default_factory=dict)
    pretrain: PretrainSpec = field(default_factory=PretrainSpec)
    keep_checkpoints: bool = True
    source: str = ""


@dataclass
class Point:
    id: str
    axes: dict
    cfg: RunConfig
    digest: str = ""
    """Hash of what decides the run's result: its config as expanded (before the sweep points model.init at
    a cached base) without W&B settings or the cache location, plus the pretraining settings if any."""


def _digest(cfg: RunConfig, pre: PretrainSpec) -> str:
    d = cfg.to_dict()
    d.pop("wandb", None)
    d["data"] = dict(d["data"], cache_dir=None)
    blob = {"config": d, "pretrain": dataclasses.asdict(pre) if pre.steps and not cfg.model.init else None}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.toml"))


def resolve_spec_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    preset = PRESETS / f"{spec}.toml"
    if preset.is_file():
        return preset
    raise FileNotFoundError(f"sweep spec {spec!r} is neither a file nor a preset: use a TOML path or one of "
                            f"{presets()}")


def load_spec(spec: str | Path) -> Spec:
    path = resolve_spec_path(str(spec))
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"sweep spec {str(path)!r} is not valid TOML: {e}") from None
    return parse_spec(raw, source=str(path))


def parse_spec(raw: dict, source: str = "<dict>") -> Spec:
    unknown = set(raw) - {"sweep", "base", "axes", "pretrain"}
    if unknown:
        raise ValueError(f"sweep spec {source}: unknown section(s) {sorted(unknown)}: use [sweep], [base], "
                         "[axes], [pretrain]")
    sw = dict(raw.get("sweep", {}))
    name = sw.pop("name", None) or (Path(source).stem if source.endswith(".toml") else "sweep")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ValueError(f"sweep name {name!r} is invalid: use letters, digits, '.', '_' or '-'")
    spec = Spec(name=name, description=sw.pop("description", ""), keep_checkpoints=sw.pop("keep_checkpoints", True),
                base=copy.deepcopy(raw.get("base", {})), axes=dict(raw.get("axes", {})), source=source)
    if sw:
        raise ValueError(f"sweep spec {source}: unknown [sweep] key(s) {sorted(sw)}: use name, description, "
                         "keep_checkpoints")
    spec.pretrain = _pretrain_spec(raw.get("pretrain", {}), source)
    from_dict(copy.deepcopy(spec.base))  # validate the base early: a typo fails before any run starts
    for key, values in spec.axes.items():
        _axis_key(key)
        if not isinstance(values, list) or not values:
            raise ValueError(f"sweep axis {key!r} must be a non-empty list of values, got {values!r}")
    return spec


def _pretrain_spec(raw: dict, source: str) -> PretrainSpec:
    names = {f.name for f in dataclasses.fields(PretrainSpec)}
    bad = set(raw) - names
    if bad:
        raise ValueError(f"sweep spec {source}: unknown [pretrain] key(s) {sorted(bad)}: use {sorted(names)}")
    p = PretrainSpec(**raw)
    if not isinstance(p.steps, int) or p.steps < 0:
        raise ValueError(f"pretrain.steps={p.steps!r} is invalid: use an integer >= 0")
    return p


def _sections() -> set[str]:
    return {f.name for f in dataclasses.fields(RunConfig)}


def _axis_key(key: str) -> tuple[str | None, str | None]:
    """('section', 'key') for 'section.key', ('section', None) for a whole-section axis, (None, None) for a
    named axis (any other word) whose values are tables of "section.key" = value."""
    key = AXIS_ALIASES.get(key, key)
    section, dot, sub = key.partition(".")
    if dot and section not in _sections():
        raise ValueError(f"sweep axis {key!r}: unknown config section {section!r} (sections: "
                         f"{sorted(_sections())})")
    if not dot and section not in _sections():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key):
            raise ValueError(f"sweep axis {key!r} is not a valid name")
        return None, None
    return section, (sub or None)


def _apply_axis(raw: dict, key: str, value) -> None:
    section, sub = _axis_key(key)
    if section is None:  # named axis: {"section.key" = value, ..., label = "..."}
        if not isinstance(value, dict):
            raise ValueError(f"sweep axis {key!r} is not a config section: its values must be tables of "
                             f"\"section.key\" = value (and an optional label), got {value!r}")
        for k, v in value.items():
            if k == "label":
                continue
            if "." not in k:
                raise ValueError(f"sweep axis {key!r}: key {k!r} must be written section.key")
            sec, name = k.split(".", 1)
            raw.setdefault(sec, {})[name] = copy.deepcopy(v)
    elif sub is None:
        if not isinstance(value, dict):
            raise ValueError(f"sweep axis {key!r} sets a whole section: its values must be tables like "
                             f"{{kind = \"goldfish\", k = 4}}, got {value!r}")
        raw.setdefault(section, {}).update(copy.deepcopy(value))
    else:
        raw.setdefault(section, {})[sub] = copy.deepcopy(value)


def _axis_covers(axis: str, key: str, values: list) -> bool:
    """Does this axis set config key 'section.name'?"""
    section, sub = _axis_key(axis)
    if section is not None:
        return f"{section}.{sub}" == key if sub else any(
            isinstance(v, dict) and f"{section}.{k}" == key for v in values for k in v)
    return any(isinstance(v, dict) and key in v for v in values)


def _label(key: str, value) -> str:
    """A short readable piece of a point id for one axis value."""
    section, sub = _axis_key(key)
    if isinstance(value, dict) and "label" in value:
        text = str(value["label"])
    elif isinstance(value, dict):
        parts = []
        for k, v in value.items():
            name = k.rsplit(".", 1)[-1]
            if name in ("kind", "name", "corpus", "tokenizer", "init"):
                parts.append(str(v).rstrip("/").rsplit("/", 1)[-1])
            else:
                parts.append(f"{name}{_fmt(v)}")
        text = "-".join(parts)
    elif sub in ("name", "kind", "corpus", "tokenizer", "init"):
        text = str(value).rstrip("/").rsplit("/", 1)[-1]
    else:
        text = f"{sub or key}{_fmt(value)}"
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", text).strip("-") or "x"


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, list):
        return "-".join(_fmt(x) for x in v)
    return str(v)


def expand(spec: Spec, overrides: list[str] | None = None, wandb_mode: str | None = None) -> list[Point]:
    """Every point of the sweep grid, validated, in axis order (the first axis varies slowest)."""
    base = apply_overrides(copy.deepcopy(spec.base), list(overrides or []))
    axes = list(spec.axes.items())
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        if any(_axis_covers(k, key, spec.axes[k]) for k in spec.axes):
            warnings.warn(f"--set {item!r} is overridden by the sweep axis that sets {key}: use --only to pick "
                          "points, or edit the axis in a copy of the spec", stacklevel=2)
    combos: list[list[tuple[str, object]]] = [[]]
    for key, values in axes:
        combos = [c + [(key, v)] for c in combos for v in values]
    points, seen = [], {}
    for combo in combos:
        raw = copy.deepcopy(base)
        for key, value in combo:
            _apply_axis(raw, key, value)
        pid = "_".join(_label(k, v) for k, v in combo) or "run"
        if pid in seen:
            seen[pid] += 1
            pid = f"{pid}_{seen[pid]}"
        else:
            seen[pid] = 0
        wb = raw.setdefault("wandb", {})
        wb.setdefault("group", spec.name)
        wb["name"] = pid
        if wandb_mode:
            wb["mode"] = wandb_mode
        try:
            cfg = from_dict(raw)
        except (ValueError, TypeError) as e:
            raise ValueError(f"sweep point {pid!r} has an invalid config: {e}") from None
        points.append(Point(id=pid, axes={AXIS_ALIASES.get(k, k): v for k, v in combo}, cfg=cfg,
                            digest=_digest(cfg, spec.pretrain)))
    return points


def select(points: list[Point], only: str | None) -> list[Point]:
    if not only:
        return points
    try:
        pattern = re.compile(only)
    except re.error as e:
        raise ValueError(f"--only {only!r} is not a valid regular expression: {e}") from None
    chosen = [p for p in points if pattern.search(p.id)]
    if not chosen:
        raise ValueError(f"--only {only!r} matches no point: the points are {[p.id for p in points]}")
    return chosen


def split_overrides(items: list[str]) -> tuple[list[str], list[str], list[str]]:
    """--set values for the run config, for [pretrain] and for [sweep] (the latter two by prefix)."""
    run, pre, sw = [], [], []
    for item in items:
        head = item.split("=", 1)[0].strip()
        (pre if head.startswith("pretrain.") else sw if head.startswith("sweep.") else run).append(item)
    return run, pre, sw


def _apply_spec_overrides(spec: Spec, pre: list[str], sw: list[str]) -> None:
    from memtrain.config import _parse_value

    for item in pre + sw:
        if "=" not in item:
            raise ValueError(f"--set {item!r} is malformed: use section.key=value")
        path, value = item.split("=", 1)
        section, key = path.strip().split(".", 1)
        value = _parse_value(value.strip())
        if section == "pretrain":
            if key not in {f.name for f in dataclasses.fields(PretrainSpec)}:
                raise ValueError(f"unknown [pretrain] key {key!r} in --set {item!r}")
            setattr(spec.pretrain, key, value)
        elif key == "keep_checkpoints":
            spec.keep_checkpoints = bool(value)
        else:
            raise ValueError(f"--set {item!r}: only sweep.keep_checkpoints can be set from the command line")
    spec.pretrain = _pretrain_spec(dataclasses.asdict(spec.pretrain), "--set")


# ---------------------------------------------------------------------------------------------------
# results file


def read_results(path: Path) -> list[dict]:
    """Every parseable line of a results.jsonl (a line cut by a kill is skipped, with a warning)."""
    rows = []
    if not path.is_file():
        return rows
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"warning: {path}:{n} is not valid JSON (an interrupted write?); ignored", file=sys.stderr)
    return rows


def append_result(path: Path, record: dict) -> None:
    """Append one line and flush it to disk; a previous line cut short by a kill is left alone."""
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line  # never glue our line onto a torn one
        f.seek(0, os.SEEK_END)
        f.write(line.encode())
        f.flush()
        os.fsync(f.fileno())


def latest_by_point(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for r in rows:
        if "point" in r:
            out[r["point"]] = r
    return out


# ---------------------------------------------------------------------------------------------------
# running


def default_command(launcher: str = "local", nproc: int = 1, runner: str | None = None) -> list[str]:
    """The command prefix a `train --config ... --out ...` tail is appended to."""
    if runner:
        return shlex.split(runner)
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "memtrain"]
    if launcher != "local":
        raise ValueError(f"--launcher {launcher!r} is invalid: use 'local' or 'torchrun'")
    return [sys.executable, "-m", "memtrain"]


def last_line(text: str) -> str | None:
    """Last non-empty line of a process's output (progress bars' carriage returns count as breaks)."""
    for line in reversed(re.split(r"[\r\n]+", text)):
        if line.strip():
            return line.strip()
    return None


def subprocess_runner(cmd: list, log_dir: Path) -> tuple[int, str | None]:
    """Run `cmd`, stdout and stderr to log_dir/{stdout,stderr}.log; a kill of the sweep stops it too."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Idle OpenMP threads sleep instead of spinning: on a shared or oversubscribed CPU, spinning threads
    # made small runs 4-20x slower here (a 7 s run took 47-238 s); on an idle machine it costs little.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with open(log_dir / "stdout.log", "wb") as out, open(log_dir / "stderr.log", "wb") as err:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, env=env)
        try:
            rc = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    tail = (log_dir / "stderr.log").read_bytes()[-20000:].decode("utf-8", "replace")
    return rc, (last_line(tail) if rc != 0 else None)


def _train_tail(config: Path, out: Path, resume: bool = False) -> list[str]:
    return ["train", "--config", str(config), "--out", str(out)] + (["--resume"] if resume else [])


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive advisory lock (two sweeps building the same base wait for each other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except (ImportError, OSError):  # pragma: no cover - no flock: run unlocked
            pass
        yield


# ---------------------------------------------------------------------------------------------------
# base models (pretraining)


def cache_root(cfg: RunConfig) -> Path:
    return cfg.data.resolved_cache_dir()


def _corpus_and_tokenizer(data_cfg):
    from memtrain.data import load_corpus, load_tokenizer

    with warnings.catch_warnings():  # "skipping a non-UTF-8 file": each training run's log says it again
        warnings.simplefilter("ignore", UserWarning)
        corpus = load_corpus(data_cfg)
    return corpus, load_tokenizer(data_cfg, corpus)


def _saved_tokenizer(tok, root: Path) -> Path:
    """The fine-tuning tokenizer as an HF directory, so the pretraining corpus is read with the same ids."""
    from memtrain.data.tokenizer import tokenizer_fingerprint

    folder = root / "tokenizers" / tokenizer_fingerprint(tok)[:20]
    if not (folder / "tokenizer.json").is_file():
        tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(str(tmp))
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another sweep saved it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _disjoint_corpus(data_cfg, ft_corpus, max_docs: int | None, root: Path) -> Path:
    """A directory of the source's documents that the fine-tuning corpus does not contain."""
    from memtrain.data import load_corpus

    if data_cfg.max_docs is None:
        raise ValueError("pretrain.corpus='disjoint' needs data.max_docs (the fine-tuning corpus is then a "
                         "subset of its source, and pretraining reads the rest): set data.max_docs, or "
                         "pretrain.corpus='same' or a path")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
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
        tmp = folder.with_name(f".{key}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "docs").mkdir(parents=True)
        width = len(str(len(rest)))
        for i, d in enumerate(rest):
            (tmp / "docs" / f"{i:0{width}d}.txt").write_text(d.text, encoding="utf-8")
        (tmp / "complete").write_text(json.dumps({"source": data_cfg.corpus, "docs": len(rest)}))
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    return folder / "docs"


def pretrain_config(cfg: RunConfig, pre: PretrainSpec, corpus: str | None = None, tokenizer: str | None = None,
                    max_docs: int | None = None) -> RunConfig:
    """The pretraining run of a fine-tuning config: same model, parallel grid and data layout, no canaries,
    standard loss, no evaluation, `pre.steps` steps."""
    raw = cfg.to_dict()
    batch = pre.batch_size or cfg.train.batch_size
    micro = cfg.train.micro_batch_size if cfg.train.micro_batch_size and batch % cfg.train.micro_batch_size == 0 \
        else None
    raw["model"].update(init=None)
    raw["train"].update(seed=pre.seed, batch_size=batch, micro_batch_size=micro, epochs=1_000_000,
                        max_steps=pre.steps, lr=pre.lr, min_lr=pre.min_lr if pre.min_lr is not None else pre.lr / 10,
                        warmup_steps=min(pre.warmup_steps, max(0, pre.steps - 1)), checkpoint_every=0)
    raw["loss"] = {"kind": "standard"}
    raw["canaries"].update(number=0)
    raw["eval"].update(enabled=False)
    if corpus is not None:
        raw["data"].update(corpus=corpus, max_docs=max_docs)
    if tokenizer is not None:
        raw["data"].update(tokenizer=tokenizer)
    raw["wandb"].update(group="memtrain-base", name=None)
    raw = {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in raw.items()}
    return from_dict(apply_overrides(raw, list(pre.set)))


def base_key(pcfg: RunConfig, corpus_fp: str, tokenizer_fp: str) -> str:
    """Hash of what determines a base model: not where files live, the grid, or W&B."""
    d = pcfg.to_dict()
    d.pop("wandb")
    d.pop("parallel")
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
        self._prep: dict[str, tuple] = {}

    def _prepare(self, cfg: RunConfig):
        """(corpus value, tokenizer value, corpus fingerprint, tokenizer fingerprint) for a data config."""
        from memtrain.data.tokenizer import tokenizer_fingerprint

        key = json.dumps(cfg.to_dict()["data"], sort_keys=True) + "|" + self.pre.corpus + f"|{self.pre.max_docs}"
        if key in self._prep:
            return self._prep[key]
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
        result = (corpus_value, str(tok_value) if tok_value else None, corpus_fp, tokenizer_fingerprint(tok))
        self._prep[key] = result
        return result

    def config_for(self, cfg: RunConfig) -> tuple[RunConfig, Path]:
        corpus_value, tok_value, corpus_fp, tok_fp = self._prepare(cfg)
        max_docs = self.pre.max_docs if self.pre.corpus not in ("same", "disjoint") else None
        pcfg = pretrain_config(cfg, self.pre, corpus_value, tok_value, max_docs)
        if self.pre.corpus == "disjoint":  # one document per .txt file of the materialized directory
            pcfg.data.file_glob, pcfg.data.txt_sample_by = "**/*.txt", "document"
        key = base_key(pcfg, corpus_fp, tok_fp)
        pcfg.wandb.name = f"base-{_label('model.name', cfg.model.name)}-{key[:8]}"
        return pcfg, cache_root(cfg) / "base" / key

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
        with _lock(folder.with_name(f"{key}.lock")):
            if (folder / "base.json").is_file():
                self.log(f"base model {cfg.model.name}: cached {folder}")
                self._done[key] = (folder, None)
                return folder
            shutil.rmtree(folder, ignore_errors=True)  # a pretraining cut short: start it again
            folder.mkdir(parents=True)
            (folder / "config.toml").write_text(to_toml(pcfg))
            self.log(f"base model {cfg.model.name}: pretraining {self.pre.steps} steps into {folder}")
            t0 = time.time()
            rc, err = self.run_fn(self.command + _train_tail(folder / "config.toml", folder), folder)
            if rc != 0:
                msg = f"pretraining {cfg.model.name} failed (exit {rc}): {err or 'no stderr'} [log: {folder}]"
                self._done[key] = (None, msg)
                raise BaseModelError(msg)
            for opt in (folder / "checkpoints").glob("*/optimizer.safetensors"):
                opt.unlink()  # fine-tuning starts a fresh optimizer: keep only the weights (1/3 of the bytes)
            (folder / "base.json").write_text(json.dumps({
                "key": key, "model": cfg.model.name, "steps": self.pre.steps, "created": _now(),
                "seconds": round(time.time() - t0, 1), "pretrain": dataclasses.asdict(self.pre)}, indent=1))
            self.log(f"base model {cfg.model.name}: done in {time.time() - t0:.0f}s")
        self._done[key] = (folder, None)
        return folder


class BaseModelError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------
# collecting a finished run


_CANARY_KEYS = ("id", "kind", "copies", "inserted", "exact_match", "token_match", "rouge_l", "longest_prefix",
                "exposure")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _median(xs):
    xs = sorted(x for x in xs if isinstance(x, (int, float)) and math.isfinite(x))
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def train_summary(run_dir: Path) -> dict:
    """Final training metrics of a run from its metrics.jsonl (loss at the end, median throughput)."""
    recs = []
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                recs.append(json.loads(line))
    if not recs:
        return {}
    last = recs[-1]
    tail = recs[-max(1, len(recs) // 10):]
    out = {k: last.get(k) for k in ("step", "loss", "tokens", "lr", "loss_kept", "loss_dropped", "epoch")}
    out["loss_tail_mean"] = sum(r.get("loss", 0.0) for r in tail) / len(tail)
    out["tokens_per_s"] = _median([r.get("tokens_per_s") for r in recs[1:] or recs])
    out["mfu"] = _median([r.get("mfu") for r in recs[1:] or recs])
    out["kept_fraction"] = _median([r.get("kept_fraction") for r in recs])
    mems = [r.get("memory_mb") for r in recs if isinstance(r.get("memory_mb"), (int, float))]
    out["memory_mb"] = max(mems) if mems else None
    return out


def canary_rows(run_dir: Path) -> list[dict]:
    rows = []
    path = run_dir / "eval_canaries.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                r = json.loads(line)
                rows.append({k: r[k] for k in _CANARY_KEYS if k in r})
    return rows


def loss_label(cfg: RunConfig) -> str:
    loss = cfg.loss
    if loss.kind != "goldfish":
        return loss.kind
    extra = "" if loss.h == 13 else f" h={loss.h}"
    extra += "" if loss.mask == "hashed" else f" {loss.mask}"
    return f"goldfish k={loss.k}{extra}"


def make_record(spec_name: str, point: Point, run_dir: Path, base_dir: Path | None, status: str,
                error: str | None, started: str, seconds: float) -> dict:
    run = _read_json(run_dir / "run.json") or {}
    ev = _read_json(run_dir / "eval.json")
    if status == "ok" and ev is None and point.cfg.eval.enabled:
        status, error = "failed", "the run exited 0 but wrote no eval.json"
    return {
        "sweep": spec_name, "point": point.id, "status": status, "error": error,
        "axes": point.axes, "model": point.cfg.model.name, "loss": loss_label(point.cfg),
        "seed": point.cfg.train.seed, "params": run.get("params"), "run_dir": str(run_dir),
        "base_dir": str(base_dir) if base_dir else None, "config_digest": point.digest,
        "started": started, "finished": _now(), "seconds": round(seconds, 1),
        "train": train_summary(run_dir) | {"steps_planned": (run.get("trained") or {}).get("steps")},
        "eval": ev, "canaries": canary_rows(run_dir), "run": {k: run.get(k) for k in ("grid", "mode", "trained")},
        "config": point.cfg.to_dict(),
    }


# ---------------------------------------------------------------------------------------------------
# the sweep


def run_sweep(spec: Spec, out_dir: str | Path | None = None, *, overrides: list[str] | None = None,
              resume: bool = False, launcher: str = "local", nproc: int = 1, wandb_mode: str | None = None,
              runner: str | None = None, run_fn: Runner | None = None, report: bool = True, only: str | None = None,
              log=print) -> dict:
    """Run every point of `spec` not already finished (only those whose id matches the regular expression
    `only`, if given); returns {ok, failed, skipped, results, out, report}."""
    run_over, pre_over, sw_over = split_overrides(list(overrides or []))
    spec = copy.deepcopy(spec)
    _apply_spec_overrides(spec, pre_over, sw_over)
    points = select(expand(spec, run_over, wandb_mode), only)
    out = Path(out_dir) if out_dir else Path("runs") / spec.name
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out / ".sweep.lock"):
        return _run_points(spec, points, out, overrides=overrides, resume=resume, launcher=launcher, nproc=nproc,
                           runner=runner, run_fn=run_fn, report=report, log=log)


@contextlib.contextmanager
def _exclusive(path: Path):
    """Fail at once if another sweep is writing into the same directory."""
    with open(path, "w") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover
            pass
        except OSError:
            raise FileExistsError(f"another sweep is running in {str(path.parent)!r}: wait for it, or use "
                                  "another --out") from None
        yield


def _run_points(spec: Spec, points: list[Point], out: Path, *, overrides, resume, launcher, nproc, runner, run_fn,
                report, log) -> dict:
    results = out / RESULTS
    previous = latest_by_point(read_results(results))
    if previous and not resume:
        raise FileExistsError(f"{str(results)!r} already holds {len(previous)} result(s): pass --resume to run "
                              "only the missing points, or choose another --out")
    _write_atomic(out / "sweep.json", json.dumps({
        "name": spec.name, "description": spec.description, "source": spec.source, "overrides": overrides or [],
        "launcher": launcher, "nproc": nproc, "pretrain": dataclasses.asdict(spec.pretrain),
        "axes": spec.axes, "points": [p.id for p in points], "written": _now()}, indent=1, default=str))

    todo = []
    for p in points:
        prev = previous.get(p.id)
        if prev and prev.get("status") == "ok" and prev.get("config_digest") == p.digest:
            continue
        if prev and prev.get("status") == "ok":
            log(f"{p.id}: its config changed since the recorded result: running it again")
        todo.append(p)
    skipped = len(points) - len(todo)
    log(f"sweep {spec.name}: {len(points)} point(s), {len(todo)} to run"
        + (f", {skipped} already done" if skipped else "") + f" -> {out}")

    command = default_command(launcher, nproc, runner)
    run_fn = run_fn or subprocess_runner
    bases = BaseModels(spec.pretrain, command, run_fn, log=log)
    ok = failed = 0
    for i, p in enumerate(todo, 1):
        run_dir = out / p.id
        started, t0 = _now(), time.time()
        base_dir = None
        status, error = "ok", None
        try:
            if spec.pretrain.steps > 0 and not p.cfg.model.init:
                base_dir = bases.get(p.cfg)
                p.cfg.model.init = str(base_dir)
            started, t0 = _now(), time.time()  # the run's own time, without building its base model
            resume_run = _prepare_run_dir(run_dir, p, resume)
            log(f"[{i}/{len(todo)}] {p.id}: {'resuming' if resume_run else 'training'} in {run_dir}")
            rc, err = run_fn(command + _train_tail(run_dir / "config.toml", run_dir, resume_run), run_dir)
            if rc != 0:
                status, error = "failed", err or f"exit code {rc}"
        except BaseModelError as e:
            status, error = "failed", str(e)
            shutil.rmtree(run_dir, ignore_errors=True)  # no stale files of an older run in this record
            run_dir.mkdir(parents=True)
        record = make_record(spec.name, p, run_dir, base_dir, status, error, started, time.time() - t0)
        append_result(results, record)
        if record["status"] == "ok":
            ok += 1
            if not spec.keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            ev = record["eval"] or {}
            log(f"[{i}/{len(todo)}] {p.id}: ok in {record['seconds']:.0f}s  params={_num(record['params'])}  "
                f"exact={_num(ev.get('exact_match_rate'))}  rougeL={_num(ev.get('rougeL'))}  "
                f"mia_auc={_num(ev.get('mia_auc_loss'))}  val_loss={_num(ev.get('val_loss'))}")
        else:
            failed += 1
            log(f"[{i}/{len(todo)}] {p.id}: FAILED after {record['seconds']:.0f}s: {record['error']}  "
                f"[logs: {run_dir}]")
    log(f"sweep {spec.name}: {ok} ok, {failed} failed, {skipped} skipped; results: {results}")
    summary = {"ok": ok, "failed": failed, "skipped": skipped, "results": results, "out": out}
    if report and results.is_file():
        summary["report"] = _report(out, points[0].cfg if points else None, log)
    return summary


def _prepare_run_dir(run_dir: Path, p: Point, resume: bool) -> bool:
    """Write the run's config.toml; True if a checkpoint of this exact config lets the run resume."""
    text = to_toml(p.cfg)
    if run_dir.exists():
        same = (run_dir / "config.toml").is_file() and (run_dir / "config.toml").read_text() == text
        if resume and same and (run_dir / "checkpoints" / "latest").is_file():
            for name in ("eval.json", "eval_canaries.jsonl"):
                (run_dir / name).unlink(missing_ok=True)
            return True
        shutil.rmtree(run_dir)  # leftovers of an interrupted or older run of this point
    run_dir.mkdir(parents=True)
    _write_atomic(run_dir / "config.toml", text)
    return False


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v / 1e6:.2f}M"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _report(out: Path, cfg: RunConfig | None, log) -> dict | None:
    """Draw the report; mirror it to a W&B 'report' run of the sweep's group. Never fails the sweep."""
    try:
        from experiments import report as rep

        made = rep.build_report(out / RESULTS, out)
    except Exception as e:  # noqa: BLE001 - results.jsonl is safe; the report can be redrawn with `memtrain plot`
        log(f"warning: the report could not be drawn ({type(e).__name__}: {e}); retry with `memtrain plot {out}`")
        return None
    log(f"report: {made['report']}\nfigures: {made['figures_dir']}")
    if cfg is not None and cfg.wandb.mode != "disabled":
        from memtrain.tracking import Tracker

        tracker = Tracker.start(cfg, out / "report", 0, job_type="report", name=f"{cfg.wandb.group}-report")
        tracker.log_table("results", made.get("table", []))
        tracker.log_images(made["figures"])
        tracker.finish()
    return made


# ---------------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="memtrain sweep", description="Run a memorization sweep: one full run (train one pass, evaluate) "
        "per point of a grid of configs, results appended to <out>/results.jsonl, then a report.",
        epilog=f"presets: {', '.join(presets())} (experiments/presets/)")
    ap.add_argument("spec", help="a preset name or a sweep TOML file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override the base config (TOML value syntax; repeatable); pretrain.* and "
                         "sweep.keep_checkpoints set the sweep's own sections")
    ap.add_argument("--out", default=None, help="the sweep's directory (default runs/<sweep name>)")
    ap.add_argument("--resume", action="store_true",
                    help="run only points without a finished result (failed points are retried)")
    ap.add_argument("--launcher", choices=("local", "torchrun"), default="local",
                    help="local: one process per run; torchrun: torchrun --standalone --nproc-per-node N")
    ap.add_argument("--nproc", type=int, default=1, help="processes per run with --launcher torchrun")
    ap.add_argument("--wandb", choices=("auto", "online", "offline", "disabled"), default=None,
                    help="W&B mode of every run (default: the spec's wandb.mode, 'auto')")
    ap.add_argument("--runner", default=None,
                    help="command that replaces `python -m memtrain` to launch runs (tests, custom launchers)")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="run only the points whose id matches (e.g. one model size per launcher)")
    ap.add_argument("--no-report", action="store_true", help="do not draw the report at the end")
    ap.add_argument("--list", action="store_true", help="print the points of the sweep and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGTERM, _terminate)  # like Ctrl-C: the running child is stopped too
    if args.nproc < 1:
        print("error: --nproc must be >= 1", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
        if args.list:
            run_over, pre_over, sw_over = split_overrides(args.overrides)
            _apply_spec_overrides(spec, pre_over, sw_over)
            points = select(expand(spec, run_over, args.wandb), args.only)
            print(f"sweep {spec.name}: {spec.description}".rstrip(": "))
            print(f"pretrain: {spec.pretrain.steps} steps" + (f" ({spec.pretrain.corpus} corpus)"
                                                            if spec.pretrain.steps else ""))
            for p in points:
                print(f"  {p.id}  " + "  ".join(f"{k}={json.dumps(v)}" for k, v in p.axes.items()))
            return 0
        summary = run_sweep(spec, args.out, overrides=args.overrides, resume=args.resume, launcher=args.launcher,
                            nproc=args.nproc, wandb_mode=args.wandb, runner=args.runner,
                            report=not args.no_report, only=args.only)
    except KeyboardInterrupt:
        print("\ninterrupted: finished runs are in results.jsonl; continue with --resume", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if summary["failed"] else 0


def _terminate(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
