"""Run configuration: typed dataclass sections, TOML recipes, `--set section.key=value` overrides.

Each field carries an attribute docstring (the string literal under it); `describe()` and `keys_help()` read
them back from the source (memtrain/config_keys.py), so the CLI help and the docs can never drift from the code.
A `--set` value is checked when the command line is parsed (`override_type`), and again with the whole config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import parallel
from memtrain import bounds
from memtrain.config_keys import closest, field_docs, listing, parse_value, placeholder, toml_value, tomllib, typed
from memtrain.data.config import CanaryConfig, DataConfig
from memtrain.losses import LossConfig


@dataclass
class ModelConfig:
    name: str = "ladder-1m"
    """A ladder or paper-shape name (see `memtrain models`), a local HF directory, or a hub id."""
    init: str | None = None
    """Start from these weights: a memtrain checkpoint directory or an HF directory (fine-tuning).
    None trains from the seeded initialization."""
    trust_remote_code: bool = False
    """Allow custom model code from a model directory (off: only architectures transformers ships). Set by the
    --trust-remote-code flag of the command being run, never from a file: a recipe's or run's value is ignored."""
    fan_in_init: bool = False
    """Draw the seeded initialization with std 1/sqrt(hidden_size) (fan-in scaling, torch.nn.Linear's rule up to a
    constant) instead of the architecture's initializer_range (0.02 in every named config: fan-in at a width of
    2,500). At width 32, 0.02 is 9x below fan-in: attention starts near-uniform and a short pretraining sits on a
    plateau whose length the seed decides (width-32's validation loss after 300 steps ranged 4.83-5.65 over six
    pretraining seeds, width-64's 4.94-5.43, and neither was better than the other on average). No effect on
    weights loaded from model.init or a checkpoint directory."""


PARALLEL_MODES = ("auto", *parallel.MODES)
"""parallel.mode's choices: the engine's two activation contracts, or 'auto' (sharded for a known architecture)."""
PRECISIONS = ("auto", "fp32", "bf16")
"""train.precision's choices (memtrain.training.step.autocast_dtype decides 'auto')."""
WANDB_MODES = ("auto", "online", "offline", "disabled")
"""wandb.mode's choices (memtrain.training.tracking decides 'auto')."""


@dataclass
class ParallelConfig:
    data: int = -1
    """Data-parallel degree (-1: whatever the world size leaves after x, y, z)."""
    x: int = 1
    """Tensor-parallel degree over in-features of normal layers (neighbouring ranks)."""
    y: int = 1
    """Tensor-parallel degree over out-features of normal layers and attention heads."""
    z: int = 1
    """Depth degree: weight blocks split further, FSDP-like; the batch is split over data and z."""
    mode: str = "auto"
    """'sharded' (activations stay sharded; Llama, GPT-NeoX, GPT-2), 'easy' (any model), 'auto'."""
    backend: str | None = None
    """torch.distributed backend; None picks nccl with CUDA, else gloo."""
    overlap: bool = True
    """Overlap communication with computation (all-reduce, reduce-scatter, all-gather prefetch)."""
    grad_sync: str = "overlap"
    """'overlap': gradient all-reduces start in buckets during backward, as gradients become final (as torch
    DDP); 'blocking': one all-reduce per set of reduce axes after backward. Same sums up to the last bits (the
    ring's order of summation follows the bucket boundaries)."""
    timeout_s: float | None = None
    """Seconds a collective may wait for the other ranks before the run fails (a stuck rank becomes an error):
    None is 120 on CPUs (gloo), 600 on GPUs."""
    tune_matmul: bool | None = None
    """Time each sharded Linear's GEMMs (forward, input and weight gradient) in a few memory layouts at first
    use and keep the fastest, one choice for every rank (parallel.tune_matmul); None: the engine's default for
    the device (off on CPUs and on CUDA, both measured: parallel.gemm_tuning.DEFAULT_ON)."""
    tune_matmul_cache: str | None = None
    """JSON file of the tuned choices, read at the start and extended with new ones, so a later run on the same
    machine reads them instead of timing; None: gemm_tuning.json in the run directory (a resumed run then runs
    the kernels it ran before, and resumes bitwise)."""


@dataclass
class TrainConfig:
    seed: int = 0
    """Seeds data order, canaries placement, initialization: the same for every model size and grid."""
    batch_size: int = 16
    """Global batch in sequences; no grid changes it (split over data and z)."""
    micro_batch_size: int | None = None
    """Sequences per rank per forward/backward; smaller than the rank's share = gradient accumulation."""
    epochs: int = 1
    """Passes over the stream (1 = the single-pass study)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (smoke runs); None runs every step of every epoch."""
    lr: float = 1e-3
    """Peak learning rate of AdamW (of a model of hidden size lr_width, when that is set)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay (scaled with lr when lr_width is set)."""
    lr_width: int | None = None
    """Scale the learning rate with the model's width: a model of hidden size H trains at
    lr * (lr_width / H) ** lr_width_exponent (from a base tuned at width lr_width). None: lr as given."""
    lr_width_exponent: float = 1.0
    """The rule's exponent: 1 is muP's 1/width for Adam; smaller falls more slowly with width."""
    lr_scale: float = 1.0
    """Multiplies the learning rate (and min_lr) the rule gives: for learning-rate sweeps around the rule."""
    warmup_steps: int = 10
    """Linear warm-up steps before the cosine decay (at most the run's steps - 1: a shorter run reaches lr at its
    last step)."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms, biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    precision: str = "auto"
    """'fp32', 'bf16' (autocast) or 'auto': bf16 only where it is faster (a GPU that supports it, or a CPU
    whose matmul probe shows it: native bf16, AVX512-BF16/AMX), else fp32. The choice is in run.json."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward to save memory."""
    compile: bool = False
    """torch.compile each transformer block for training (ParallelLM.compile_blocks): its norms, rotary embedding,
    activation and residual adds fuse into fewer kernels; evaluation stays eager. The first steps pay the
    compilation (seconds to a minute), and results differ from eager ones by rounding only. Under tensor
    parallelism or parallel.tune_matmul the engine's Linears and collectives run eagerly between the compiled
    pieces of a block, and train.activation_checkpointing is refused with it (torch.compile would run a
    checkpointed block eagerly). On one H200, llama-3.2-1b in bf16 at batch 8 x 1024: 0.114 s per step, MFU 45.6%
    and 24.1 GiB peak, against 0.162 s, 32.1% and 30.1 GiB eager (2026-11-28, one run each)."""
    optimizer_offload: bool = False
    """Keep the AdamW moments and fp32 master weights in host memory (pinned on CUDA) and run the update there,
    bucket by bucket as the gradient all-reduce completes. Device memory per parameter falls from 16 bytes
    (weight, gradient, two moments) to 8 in fp32, to 4 under bf16 (the device then keeps bf16 weights and
    gradients); the host holds 16 (fp32) or 14 (bf16), and each step copies gradients down and weights up.
    In fp32 the result equals on-device AdamW's (bitwise on CPUs); under bf16 the forward reads bf16 weights
    rounded from the fp32 masters. `memtrain plan --offload` shows how many fewer GPUs a model needs."""
    deterministic: bool = False
    """Ask torch for deterministic kernels (slower on GPUs)."""
    log_every: int = 1
    """Write a metrics.jsonl line every this many steps."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only the final one)."""
    checkpoint_every_min: float = 30.0
    """Also save a checkpoint once this many minutes of training have passed since the last one (0: off), so a
    long run killed midway loses at most that much (`--resume`). Rank 0's clock decides, for every rank."""
    keep_checkpoints: int = 3
    """Keep the newest this many checkpoints, time- and step-based (0: all); the one `latest` names always stays."""


@dataclass
class EvalConfig:
    enabled: bool = True
    """Evaluate memorization at the end of training."""
    every_pass: bool = False
    """Also score the canaries after every pass over the stream (teacher-forced on the grid: exact match,
    token accuracy, validation loss), into passes.jsonl: memorization as a function of passes."""
    suffix_len: int = 50
    """Tokens to extract: prefix = canary minus its last suffix_len tokens (Carlini/Goldfish: 50)."""
    batch_size: int = 64
    """Sequences per decoding batch."""
    exposure_samples: int = 2000
    """Candidates sampled per random canary for exposure when the space is too large to enumerate."""
    pythia: bool = True
    """Also run the Pythia protocol (32 tokens in, 32 greedy tokens out) beside the suffix protocol."""
    val_docs: int = 64
    """Held-out documents for validation loss (whole documents, in windows of data.seq_len)."""
    val_tokens: int = 20_480
    """Tokens of those documents scored for validation loss, at most (the same set for the base model and
    every fine-tune of a stream, so their losses compare)."""


@dataclass
class WandbConfig:
    mode: str = "auto"
    """'online', 'offline', 'disabled', or 'auto' (online with credentials, else offline)."""
    project: str = "memtrain"
    """W&B project."""
    group: str | None = None
    """W&B group (a sweep's name)."""
    name: str | None = None
    """W&B run name (default: the run directory's name)."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    canaries: CanaryConfig = field(default_factory=CanaryConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        import hashlib

        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _section_classes() -> dict[str, type]:
    return {f.name: type(getattr(RunConfig(), f.name)) for f in dataclasses.fields(RunConfig)}


# ---------------------------------------------------------------------------------------------------
# Validation: every value's type (from the field's annotation) before a section is built, every range and
# choice after, then the checks that need two fields. One line each, naming the key, the value and the fix.


def _at_least(n):
    return lambda v: v >= n, f"a value >= {n}"


def _above(n):
    return lambda v: v > n, f"a value > {n}"


def _fraction():
    return lambda v: 0 <= v < 1, "a value in [0, 1)"


def _one_of(*choices):
    return lambda v: v in choices, "one of " + ", ".join(repr(c) for c in choices)


RULES = {
    "parallel.data": (lambda v: v == -1 or v >= 1, "-1 (infer) or a degree >= 1"),
    "parallel.x": _at_least(1), "parallel.y": _at_least(1), "parallel.z": _at_least(1),
    "parallel.mode": _one_of(*PARALLEL_MODES),
    "parallel.backend": _one_of(*parallel.KNOWN_BACKENDS),
    "parallel.grad_sync": _one_of(*parallel.GRAD_SYNCS),
    "parallel.timeout_s": _above(0),
    "train.seed": _at_least(0), "canaries.seed": _at_least(0),
    "train.batch_size": _at_least(1), "train.micro_batch_size": _at_least(1), "train.epochs": _at_least(1),
    "train.max_steps": _at_least(1), "train.lr": _above(0), "train.min_lr": _at_least(0),
    "train.lr_width": _at_least(1), "train.lr_width_exponent": _at_least(0), "train.lr_scale": _above(0),
    "train.warmup_steps": _at_least(0), "train.weight_decay": _at_least(0), "train.beta1": _fraction(),
    "train.beta2": _fraction(), "train.grad_clip": _at_least(0), "train.precision": _one_of(*PRECISIONS),
    "train.log_every": _at_least(1), "train.checkpoint_every": _at_least(0),
    "train.checkpoint_every_min": _at_least(0), "train.keep_checkpoints": _at_least(0),
    "eval.suffix_len": _at_least(1), "eval.batch_size": _at_least(1), "eval.exposure_samples": _at_least(1),
    "eval.val_docs": _at_least(1), "eval.val_tokens": _at_least(1),
    "wandb.mode": _one_of(*WANDB_MODES),
}
"""Range or choice of each field that has one (None, where allowed, always passes)."""


def _build(section: str, cls: type, values: dict):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in list(values.items()):
        if key not in fields:
            raise ValueError(f"unknown config key {section}.{key}{closest(key, fields)}")
        values[key] = value = typed(f"{section}.{key}", value, fields[key])
        bounds.check(f"{section}.{key}", value)  # before the section's own checks, and before any work
    return cls(**values)


def _check_range(key: str, value) -> None:
    ok, allowed = RULES.get(key, (None, ""))
    if ok is not None and value is not None and not ok(value):
        raise ValueError(f"{key}={value!r} is invalid: use {allowed}")


def validate(cfg: RunConfig) -> RunConfig:
    """Ranges, choices and the checks across fields; raises ValueError (one line) on the first that fails."""
    for key in RULES:
        section, name = key.split(".")
        _check_range(key, getattr(getattr(cfg, section), name))
    if not cfg.data.corpus.strip():
        raise ValueError("data.corpus='' is empty: name 'stdlib', a directory, text/json/csv/parquet files or "
                         "a dataset")
    if cfg.train.min_lr > cfg.train.lr:
        raise ValueError(f"train.min_lr={cfg.train.min_lr} exceeds train.lr={cfg.train.lr}: the schedule "
                         "decays from lr to min_lr, so use min_lr <= lr")
    loss = cfg.loss
    if loss.kind == "goldfish" and loss.mask == "hashed" and loss.h >= cfg.data.seq_len:
        raise ValueError(f"loss.h={loss.h} leaves no target of a data.seq_len={cfg.data.seq_len} sequence its h tokens "
                         "of context, so the Goldfish mask would drop nothing: use h < seq_len (the paper: 13)")
    c = cfg.canaries
    if c.number and cfg.eval.enabled and set(c.kinds) & {"document"} and cfg.eval.suffix_len >= c.length:
        raise ValueError(f"eval.suffix_len={cfg.eval.suffix_len} leaves no prefix of the {c.length}-token document "
                         "canaries (canaries.length): use a suffix shorter than the canary")
    bounds.check_canary_rows(c.number, c.copies, len(c.kinds), cfg.data.seq_len)
    return cfg


def from_dict(raw: dict) -> RunConfig:
    classes = _section_classes()
    sections = {}
    for name, values in raw.items():
        if name not in classes:
            raise ValueError(f"unknown config section [{name}]{closest(name, classes)}")
        if not isinstance(values, dict):
            raise ValueError(f"config section [{name}] must be a table of keys, got {values!r}")
        sections[name] = _build(name, classes[name], dict(values))
    return validate(RunConfig(**sections))


def check_overrides(overrides: list[str]) -> None:
    """'section.key=value' strings on their own, before the config they go into exists (a sweep's pretraining
    `set`): each key, type, bound and range; the checks across keys wait for the whole config."""
    classes = _section_classes()
    for section, values in apply_overrides({}, overrides).items():
        built = _build(section, classes[section], values)
        for key in values:
            _check_range(f"{section}.{key}", getattr(built, key))


def _split(item: str, classes: dict[str, type]) -> tuple[str, str, str]:
    """'section.key=value' as (section, key, value text); ValueError unless the key is one of `classes`'."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ValueError(f"--set {item!r} is malformed: use section.key=value, e.g. train.seed=1")
    path, value = item.split("=", 1)
    section, key = path.strip().split(".", 1)
    if section not in classes:
        raise ValueError(f"unknown config section {section!r} in --set {item!r}{closest(section, classes)}")
    names = {f.name for f in dataclasses.fields(classes[section])}
    if key not in names:
        raise ValueError(f"unknown config key {section}.{key}{closest(key, names)}")
    return section, key, value.strip()


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply 'section.key=value' strings (values in TOML syntax, bare strings allowed) to a raw dict."""
    classes = _section_classes()
    given = set()
    for item in overrides:
        section, key, value = _split(item, classes)
        if (section, key) in given:  # which one wins would be a guess: the last, silently
            raise ValueError(f"--set {section}.{key} is given twice: give each key once")
        given.add((section, key))
        if not isinstance(raw.setdefault(section, {}), dict):
            raise ValueError(f"config section [{section}] must be a table of keys, got {raw[section]!r}")
        raw[section][key] = parse_value(value)
    return raw


def override_type(sections: tuple[str, ...] | None = None):
    """The argparse `type=` of a `--set SECTION.KEY=VALUE` option: each item checked as the command line is parsed
    (its key, its value's type, bound and range: a bad one is argparse's one-line error), and returned unchanged
    for `load` or `apply_overrides`, which check the keys together (a key given twice, min_lr <= lr, a section's
    own checks). `sections` limits the keys to those sections, e.g. ("eval",); None allows every section."""
    classes = _section_classes()
    allowed = {name: classes[name] for name in (classes if sections is None else sections)}
    where = ", ".join(f"{name}.*" for name in allowed)

    def override(item: str) -> str:
        try:
            section = item.split("=", 1)[0].split(".", 1)[0].strip()
            if section in classes and section not in allowed:
                raise ValueError(f"{item!r} cannot be set here: this command takes only {where} keys")
            section, key, text = _split(item, allowed)
            f = next(f for f in dataclasses.fields(allowed[section]) if f.name == key)
            value = typed(f"{section}.{key}", parse_value(text), f)
            bounds.check(f"{section}.{key}", value)
            _check_range(f"{section}.{key}", value)
        except ValueError as e:  # argparse names the option itself
            raise argparse.ArgumentTypeError(str(e).removeprefix("--set ")) from None
        return item

    return override


def load_toml(path: str | Path, what: str = "config file") -> dict:
    """A TOML file as a dict; a missing or malformed file is a one-line error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} not found: pass an existing TOML file")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {str(path)!r} is not valid TOML: {e}") from None


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    raw = load_toml(path) if path is not None else {}
    return from_dict(apply_overrides(raw, overrides or []))


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML (None fields are left out: absent means default None)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def keys_help(sections: tuple[str, ...] | None = None) -> str:
    """Every key of `sections` (None: all) for a command's --help: `  section.key: type = default`, then its doc."""
    classes = _section_classes()
    return listing({name: classes[name] for name in (classes if sections is None else sections)})


def describe() -> str:
    """Every config key with its default and docstring, for `memtrain config`: a valid TOML recipe that loads as
    the defaults. Each docstring is `# ` comments above its key; a key whose default is None (TOML has no null)
    is written commented out, with a placeholder of its type."""
    out = ["# memtrain run configuration: every key at its default. Save it (`memtrain config > recipe.toml`),",
           "# edit what you need and run `memtrain train --config recipe.toml`; a key left out keeps its default.",
           ""]
    defaults = RunConfig()
    for section, cls in _section_classes().items():
        out.append(f"[{section}]")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section), f.name)
            if f.name in docs:
                out += textwrap.wrap(docs[f.name], 110, initial_indent="# ", subsequent_indent="# ")
            if value is None:
                out.append(f"# {f.name} = {placeholder(str(f.type))}    (default: none)")
            else:
                out.append(f"{f.name} = {toml_value(value)}")
        out.append("")
    return "\n".join(out)
