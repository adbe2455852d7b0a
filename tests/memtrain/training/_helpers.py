"""What the `memtrain train` tests share: the command run as a user runs it, and a small stdlib corpus."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
           OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def memtrain(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memtrain", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=timeout)


def stdlib_corpus(root: Path, every: int, count: int, chars: int) -> Path:
    """Every `every`-th top-level stdlib module (at most `count`), its first `chars` characters a .txt file."""
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[::every][:count]:
        (root / f"{p.stem}.txt").write_text(p.read_text("utf-8")[:chars])
    return root


TINY = {
    "model": {"name": "ladder-1m"},
    "train": {"batch_size": 8, "max_steps": 6, "lr": 3e-3, "warmup_steps": 2},
    "data": {"vocab_size": 512, "seq_len": 64},
    "canaries": {"number": 2, "copies": [1, 2], "length": 24, "secret_groups": 2},
    "eval": {"suffix_len": 8, "exposure_samples": 64, "val_docs": 8},
    "wandb": {"mode": "disabled"},
}
"""A run that trains and evaluates in seconds: the tests' recipe, changed per test by `write_recipe`."""


def write_recipe(path: Path, corpus: Path, cache: Path, **changes: dict) -> Path:
    """TINY over `corpus` (stream cache in `cache`) with `changes` ({section: {key: value}}) merged in, written
    as a TOML recipe at `path`. Validated on the way: a recipe the CLI would refuse fails here."""
    from memtrain.config import from_dict, to_toml

    raw = {section: dict(values) for section, values in TINY.items()}
    raw["data"].update(corpus=str(corpus), cache_dir=str(cache))
    for section, values in changes.items():
        raw.setdefault(section, {}).update(values)
    path.write_text(to_toml(from_dict(raw)))
    return path


def checkpoint_files(step_dir: Path) -> dict:
    """Every tensor of a checkpoint directory, keyed '<file>/<piece>': two checkpoints saved on the same grid
    are bitwise equal iff these are."""
    from safetensors.torch import load_file

    files = sorted(Path(step_dir).glob("*.safetensors"))
    return {f"{f.name}/{k}": v for f in files for k, v in load_file(str(f)).items()}
