"""Sweep specs: a TOML file (or a preset of experiments/presets/) of a base config, axes and a
pretraining section, expanded into the validated points of a grid. The format: experiments/sweep/__init__.py.

`points_of` is the one way from a spec and the command line (--set, --wandb, --only) to the points: running a sweep,
`--list` and `--dry-run` all take theirs from it."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from memtrain import bounds
from memtrain.config import RunConfig, TrainConfig, apply_overrides, check_overrides, from_dict, load_toml, parse_value

from .slurm_options import options_from_spec

PRESETS = Path(__file__).resolve().parents[1] / "presets"
AXIS_ALIASES = {"seeds": "train.seed", "seed": "train.seed"}


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
    seq_len: int | None = None
    """Tokens per pretraining sequence (default: the fine-tuning data.seq_len); longer than the fine-tuning's
    is fine, the positions fine-tuning uses are then all pretrained."""
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

    def applies_to(self, cfg: RunConfig) -> bool:
        """Does a run of `cfg` start from a base model pretrained this way (pretraining on, no model.init)?"""
        return self.steps > 0 and not cfg.model.init


@dataclass
class Spec:
    name: str
    description: str = ""
    base: dict = field(default_factory=dict)
    axes: dict = field(default_factory=dict)
    pretrain: PretrainSpec = field(default_factory=PretrainSpec)
    keep_checkpoints: bool = True
    """false: once a run is evaluated, delete its checkpoints, all but its final weights if keep_final_weights."""
    keep_final_weights: bool | str = "auto"
    """With keep_checkpoints = false, whether a run keeps its final weights: the last checkpoint's model files and
    state.json, without the optimizer state (a third of the bytes), all `memtrain export` and `memtrain eval` read.
    true, false, or "auto": kept for models of at most FINAL_WEIGHTS_MAX_PARAMS parameters."""
    jobs: int = 1
    """Points run side by side on this machine (each with its share of the cores)."""
    slurm: dict = field(default_factory=dict)
    """Defaults of the cluster launchers (section [slurm]: slurm_options.py's ClusterOptions keys)."""
    source: str = ""

    def keeps_final_weights(self, params: int | None) -> bool:
        """Does a finished run of a model of `params` parameters (None: unknown) keep its final weights?"""
        if self.keep_final_weights == "auto":
            return params is None or params <= FINAL_WEIGHTS_MAX_PARAMS
        return self.keep_final_weights


FINAL_WEIGHTS_MAX_PARAMS = 100_000_000
"""keep_final_weights = "auto" keeps the weights of models up to this size: at most 0.4 GB a run in fp32, so a sweep
of small models stays exportable, while a sweep of billion-parameter runs keeps its results only."""


@dataclass
class Point:
    id: str
    axes: dict
    cfg: RunConfig
    digest: str = ""
    """Hash of what decides the run's result: its config as expanded (before the sweep points model.init at
    a cached base) without W&B settings or the cache location, plus the pretraining settings if any."""


BOOKKEEPING = {"log_every": True, "checkpoint_every": True, "checkpoint_every_min": False, "keep_checkpoints": False}
"""[train] keys that say how often a run logs and saves, never what it trains, so point digests and base-model keys
leave them out: changing them neither re-runs a point nor pretrains a base again. True: the key was hashed before,
so it is hashed at its default, and digests made then stay valid for runs that had the default."""


def trained_settings(cfg: RunConfig) -> dict:
    """`cfg` as a dict without its W&B settings and BOOKKEEPING: what decides the weights a run trains."""
    d = cfg.to_dict()
    d.pop("wandb", None)
    for key, hashed_before in BOOKKEEPING.items():
        d["train"].pop(key)
        if hashed_before:
            d["train"][key] = getattr(TrainConfig(), key)
    return d


def _digest(cfg: RunConfig, pre: PretrainSpec) -> str:
    d = trained_settings(cfg)
    d["data"] = dict(d["data"], cache_dir=None)
    blob = {"config": d, "pretrain": dataclasses.asdict(pre) if pre.applies_to(cfg) else None}
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
    return parse_spec(load_toml(path, "sweep spec"), source=str(path))


def parse_spec(raw: dict, source: str = "<dict>") -> Spec:
    unknown = set(raw) - {"sweep", "base", "axes", "pretrain", "slurm"}
    if unknown:
        raise ValueError(f"sweep spec {source}: unknown section(s) {sorted(unknown)}: use [sweep], [base], "
                         "[axes], [pretrain], [slurm]")
    for section, value in raw.items():
        if not isinstance(value, dict):
            raise ValueError(f"sweep spec {source}: [{section}] must be a table of keys, got {value!r}")
    sw = dict(raw.get("sweep", {}))
    name = sw.pop("name", None) or (Path(source).stem if source.endswith(".toml") else "sweep")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ValueError(f"sweep name {name!r} is invalid: use letters, digits, '.', '_' or '-'")
    spec = Spec(name=name, description=sw.pop("description", ""), keep_checkpoints=sw.pop("keep_checkpoints", True),
                keep_final_weights=sw.pop("keep_final_weights", "auto"), jobs=sw.pop("jobs", 1),
                base=copy.deepcopy(raw.get("base", {})), axes=dict(raw.get("axes", {})), source=source)
    if sw:
        raise ValueError(f"sweep spec {source}: unknown [sweep] key(s) {sorted(sw)}: use name, description, "
                         "keep_checkpoints, keep_final_weights, jobs")
    if isinstance(spec.jobs, bool) or not isinstance(spec.jobs, int) or not 1 <= spec.jobs <= MAX_JOBS:
        raise ValueError(f"sweep spec {source}: jobs = {spec.jobs!r} is invalid: use an integer in [1, {MAX_JOBS}]")
    if not isinstance(spec.keep_checkpoints, bool):
        raise ValueError(f"sweep spec {source}: keep_checkpoints = {spec.keep_checkpoints!r} is invalid: use true or "
                         "false (unquoted)")
    _check_keep_final(spec.keep_final_weights, f"sweep spec {source}: keep_final_weights = ")
    if not isinstance(spec.description, str):
        raise ValueError(f"sweep spec {source}: description = {spec.description!r} is invalid: use a string")
    spec.pretrain = _pretrain_spec(raw.get("pretrain", {}), source)
    spec.slurm = options_from_spec(raw.get("slurm", {}), source)
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
    for key, (kind, low, high, optional) in _PRETRAIN_RANGES.items():
        value = getattr(p, key)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, kind) or not (  # nan and inf fail the comparisons
                low <= value <= high and (key != "lr" or value > 0)):
            what = "an integer" if kind is int else "a finite number"
            raise ValueError(f"sweep spec {source}: pretrain.{key}={value!r} is invalid: use {what} in "
                             f"{'(' if key == 'lr' else '['}{low}, {bounds.shown(high)}]" + " or none" * optional)
    if p.min_lr is not None and p.min_lr > p.lr:  # each point's base model would fail on it, one by one
        raise ValueError(f"sweep spec {source}: pretrain.min_lr={p.min_lr!r} exceeds pretrain.lr={p.lr!r}: the "
                         "cosine decays from lr to min_lr; use a min_lr of at most lr")
    if not isinstance(p.corpus, str) or not p.corpus.strip():
        raise ValueError(f"sweep spec {source}: pretrain.corpus={p.corpus!r} is invalid: use 'disjoint', 'same' or "
                         "a data.corpus value")
    if not isinstance(p.set, list) or not all(isinstance(item, str) for item in p.set):
        raise ValueError(f"sweep spec {source}: pretrain.set={p.set!r} is invalid: use a list of "
                         "\"section.key=value\" strings")
    try:  # a mistyped key would otherwise fail each point's base model, one by one, after the sweep started
        check_overrides(p.set)
    except ValueError as e:
        raise ValueError(f"sweep spec {source}: pretrain.set: {e}") from None
    return p


_PRETRAIN_RANGES = {
    "steps": (int, 0, bounds.DEFAULT, False), "lr": ((int, float), 0, bounds.limit("train.lr"), False),
    "min_lr": ((int, float), 0, bounds.limit("train.min_lr"), True), "warmup_steps": (int, 0, bounds.DEFAULT, False),
    "batch_size": (int, 1, bounds.SEQUENCES, True), "seq_len": (int, 2, bounds.POSITIONS, True),
    "seed": (int, 0, bounds.SEED, False), "max_docs": (int, 1, bounds.DEFAULT, True),
}
"""[pretrain]'s numbers: (type, lowest, highest, may be none); lr must also be > 0."""
MAX_JOBS = 100_000
"""[sweep] jobs (and --jobs): points side by side, or cluster jobs in flight."""


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


def label(key: str, value) -> str:
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
    text = re.sub(r"[^A-Za-z0-9._=-]+", "-", text).strip("-")
    return text if text.strip(".") else "x"  # never "." or "..": a point's directory is out / id


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
    points, seen, ids = [], {}, {}
    for combo in combos:
        raw = copy.deepcopy(base)
        for key, value in combo:
            _apply_axis(raw, key, value)
        pid = "_".join(label(k, v) for k, v in combo) or "run"
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
        digest = _digest(cfg, spec.pretrain)
        if digest in ids:  # the report would count one run's canaries twice
            raise ValueError(f"sweep points {ids[digest]!r} and {pid!r} are the same run (an axis repeats a value, "
                             f"or two axes set the same key: {dict(combo)}): remove the repeat")
        ids[digest] = pid
        points.append(Point(id=pid, axes={AXIS_ALIASES.get(k, k): v for k, v in combo}, cfg=cfg, digest=digest))
    return points


def points_of(spec: Spec, overrides: list[str] | None = None, wandb_mode: str | None = None,
              only: str | None = None) -> tuple[Spec, list[Point]]:
    """The sweep's points as the command line asks for them: --set split between the run config and the spec's
    own [pretrain] and [sweep] sections, the grid expanded and validated, --only applied. Returns a copy of the
    spec with its sections' overrides applied (the points' digests depend on its [pretrain]) and the points."""
    run_over, pre_over, sw_over = split_overrides(list(overrides or []))
    spec = copy.deepcopy(spec)
    apply_spec_overrides(spec, pre_over, sw_over)
    return spec, select(expand(spec, run_over, wandb_mode), only)


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


def apply_spec_overrides(spec: Spec, pre: list[str], sw: list[str]) -> None:
    given = set()
    for item in pre + sw:
        if "=" not in item:
            raise ValueError(f"--set {item!r} is malformed: use section.key=value")
        path, value = item.split("=", 1)
        section, key = path.strip().split(".", 1)
        if (section, key) in given:  # which one wins would be a guess: the last, silently
            raise ValueError(f"--set {section}.{key} is given twice: give each key once")
        given.add((section, key))
        value = parse_value(value.strip())
        if section == "pretrain":
            if key not in {f.name for f in dataclasses.fields(PretrainSpec)}:
                raise ValueError(f"unknown [pretrain] key {key!r} in --set {item!r}")
            setattr(spec.pretrain, key, value)
        elif key == "keep_checkpoints":
            if not isinstance(value, bool):  # bool("no") is True
                raise ValueError(f"--set {item!r}: sweep.keep_checkpoints takes true or false")
            spec.keep_checkpoints = value
        elif key == "keep_final_weights":
            _check_keep_final(value, f"--set {item!r}: sweep.keep_final_weights = ")
            spec.keep_final_weights = value
        else:
            raise ValueError(f"--set {item!r}: only sweep.keep_checkpoints and sweep.keep_final_weights can be set "
                             "from the command line")
    spec.pretrain = _pretrain_spec(dataclasses.asdict(spec.pretrain), "--set")


def _check_keep_final(value, where: str) -> None:
    if not (isinstance(value, bool) or value == "auto"):  # a string "false" would read as true
        raise ValueError(f"{where}{value!r} is invalid: use true, false (unquoted) or \"auto\"")

