"""The names of the files in a run directory: one list that the trainer, evaluation, export, the sweep and the
results reader all use (importable without torch, so `memtrain plot` starts fast).

    runs/my-run/
      config.toml          the resolved config (a recipe may also sit here before the run starts)
      run.json             grid, parameters, learning rate, precision, MFU's peak and its source, the stream's
                           key, what was trained, and the config it trained with (what --resume checks
                           config.toml against)
      metrics.jsonl        one line per logged step
      passes.jsonl         the canaries scored after every pass (eval.every_pass)
      canaries.jsonl       the manifest: every canary copy's step, data-parallel rank, sequence and offset
      eval.json            the final evaluation's aggregates
      eval_canaries.jsonl  one row per canary and twin
      tokenizer/           the run's tokenizer, HF format
      model_dir/           trained from a model directory (model.name=DIR): DIR's config.json and the code files its
                           auto_map names, copied at the start of training, so that export and eval build the model
                           the run trained even once DIR is edited or gone; source.json says whether DIR held weights
      checkpoints/         sharded safetensors checkpoints; `latest` names the newest complete one
      wandb/, wandb-run.json   the W&B mirror and the id that resumes it

And the rule that protects them (`check_output`): a run directory's files are written by that run's own
training only. Every command's output path goes through it, so none can land inside another run, or on one.
"""

import os
from pathlib import Path

CONFIG = "config.toml"
RUN = "run.json"
METRICS = "metrics.jsonl"
PASSES = "passes.jsonl"
MANIFEST = "canaries.jsonl"
EVAL = "eval.json"
EVAL_CANARIES = "eval_canaries.jsonl"
TOKENIZER = "tokenizer"
MODEL_DIR = "model_dir"
MODEL_SOURCE = "source.json"
"""In model_dir/: the model.name it was copied from, and whether that directory held weights (a checkpoint's
config.json keeps its own vocabulary; an architecture's is sized to the tokenizer)."""
CHECKPOINTS = "checkpoints"
LATEST = "latest"
"""In checkpoints/: a file naming the newest complete checkpoint."""
WANDB = "wandb"
WANDB_RUN = "wandb-run.json"

OUTPUTS = (METRICS, PASSES, RUN, MANIFEST, EVAL, EVAL_CANARIES, CHECKPOINTS, TOKENIZER, MODEL_DIR, WANDB,
           WANDB_RUN)
"""What a run writes (its config.toml aside: a recipe may sit in the directory it trains into)."""
LOCK = ".lock"
"""The lock a trainer holds while it writes the directory; whatever else clears the directory takes it first."""


def is_run(path: str | os.PathLike) -> bool:
    """Whether `path` is a run directory: its config.toml beside something a run writes (a recipe alone is not)."""
    path = Path(path)
    return (path / CONFIG).is_file() and any((path / name).exists() for name in OUTPUTS)


def check_output(path: str | os.PathLike, flag: str = "--out", *, own_run: bool = False) -> Path:
    """`path` as a command's output directory, or a ValueError/OSError naming it and the fix: not empty, not a
    dangling link or a file, and neither inside a run directory nor (unless `own_run`: `train`, whose run_dir.claim
    decides between --resume and --force) a run directory itself. Links and `..` are followed first."""
    if not str(path):
        raise ValueError(f"{flag} is empty: name a directory")
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise FileNotFoundError(f"{flag} {str(path)!r} is a link to {os.readlink(path)!r}, which does not exist: "
                                "create its target, or name another directory")
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{flag} {str(path)!r} is a file: name a directory")
    real = path.resolve()
    if not own_run and is_run(real):
        raise FileExistsError(f"{flag} {str(path)!r} is a run directory, whose files only its own training writes: "
                              "name another directory")
    for parent in real.parents:
        if is_run(parent):
            raise FileExistsError(f"{flag} {str(path)!r} lies inside the run directory {str(parent)!r}, whose files "
                                  "only its own training writes: name a directory outside it")
    return path
