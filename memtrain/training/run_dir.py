"""A run directory belongs to one run.

A fresh run refuses a directory that already holds another run's files (`--force` clears them first, so the new
run starts clean, W&B id included); every trainer holds the directory's lock while it runs, so two trainers
never write one directory; and `--resume` accepts only changes that leave what is already trained as it was, and
only appends steps: it never rewrites a saved one (check_resume).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from pathlib import Path

from memtrain.config import RunConfig
from memtrain.config import load as load_config
from memtrain.files import file_lock, read_json
from memtrain.run_files import CHECKPOINTS, CONFIG, LOCK, OUTPUTS, RUN, is_run
from memtrain.training import checkpoint

RESUMABLE = ("train.max_steps", "train.epochs", "train.log_every", "train.checkpoint_every",
             "train.checkpoint_every_min", "train.keep_checkpoints", "train.compile", "train.activation_checkpointing",
             "train.micro_batch_size", "model.trust_remote_code", "eval.*", "wandb.*", "parallel.*")
"""Keys a resumed run may change: how long it goes on, what it evaluates and logs, how a step computes what it
computes: the grid (checkpoints hold full tensors and load on any grid), compiled blocks, recomputed activations,
micro-batches (a rank's share of a batch on another grid may need another), and the permission to run a model
directory's own code, which the command line gives and a resume must be able to give again."""

_HELD: dict[Path, object] = {}


def claim(out: Path, *, resume: bool, force: bool) -> None:
    """Refuse (or with `force` clear) another run's files in `out`, then hold its lock for this process."""
    hold(out)  # first: a directory another trainer is writing is refused even with --force
    existing = [name for name in OUTPUTS if (out / name).exists() or (out / name).is_symlink()]
    if existing and not resume:
        if not is_run(out):  # a run writes its config.toml first: these are someone else's (a wandb/ of their own)
            release(out)
            raise FileExistsError(f"{str(out)!r} holds {', '.join(existing[:3])} but no run's {CONFIG}: they are "
                                  "not a memtrain run's files, which --force would delete; choose another --out")
        if not force:
            release(out)
            raise FileExistsError(f"{str(out)!r} already holds a run ({', '.join(existing[:3])}): --resume "
                                  "continues it, --force replaces it, or choose another --out")
        for name in existing:
            path = out / name  # a link (checkpoints on scratch space) goes, never what it points to
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def hold(out: Path) -> None:
    """Lock `out` until this process ends (or `release`): a second trainer fails at once instead of mixing."""
    path = out.resolve()
    if path in _HELD:
        return
    lock = file_lock(path / LOCK, blocking=False)
    try:
        lock.__enter__()
    except BlockingIOError:
        raise FileExistsError(f"another trainer is writing {str(out)!r}: wait for it to end, or choose another "
                              "--out") from None
    _HELD[path] = lock


def release(out: Path) -> None:
    lock = _HELD.pop(out.resolve(), None)
    if lock is not None:
        lock.__exit__(None, None, None)


def resume_blockers(saved: RunConfig, cfg: RunConfig) -> list[str]:
    """The changed keys, as 'key (old -> new)', that a resume cannot take (see RESUMABLE)."""
    return _blockers(saved.to_dict(), cfg.to_dict())


def _blockers(a: dict, b: dict) -> list[str]:
    a, b = json.loads(json.dumps(a)), json.loads(json.dumps(b))  # as run.json holds them: lists, not tuples
    changed = [(f"{s}.{k}", v, b.get(s, {}).get(k)) for s, keys in a.items() if isinstance(keys, dict)
               for k, v in keys.items()]
    return [f"{key} ({old!r} -> {new!r})" for key, old, new in changed
            if old != new and not any(fnmatch.fnmatch(key, pattern) for pattern in RESUMABLE)]


def check_resume(out: Path, cfg: RunConfig) -> Path:
    """The checkpoint `--resume` continues from, checked before anything is written. Refused, each with its fix: a
    config.toml edited since the run (re)started (run.json records the config it trained with), a change outside
    RESUMABLE, a checkpoint without its optimizer state, a step target before the saved step, and saved steps after
    the one `latest` names: a resume continues the same run and appends steps, never rewriting a saved one."""
    saved = out / CONFIG
    if not saved.is_file():
        raise FileNotFoundError(f"--resume: {str(out)!r} has no config.toml: it is not a run directory")
    on_disk = load_config(saved)
    info = _run_info(out / RUN)
    edited = _blockers(info["config"], on_disk.to_dict()) if isinstance(info.get("config"), dict) else []
    if edited:
        raise ValueError(f"--resume: {str(saved)!r} was edited since the run started ({', '.join(edited)}): put back "
                         "the values it trained with (the first of each pair), or train a new run into another --out")
    blockers = resume_blockers(on_disk, cfg)
    if blockers:
        raise ValueError(f"--resume cannot change {', '.join(blockers)} of {str(saved)!r}: it would not "
                         "continue the same run; resume with those values, or train into a new --out")
    ckpt = checkpoint.latest(out)
    if ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {str(out / CHECKPOINTS)!r} (the run stopped before its "
                                "first save): start it again with --force")
    fresh = f"or train a new run from its weights into another --out (--set model.init='{ckpt}')"
    missing = checkpoint.missing_optimizer(ckpt)
    if missing:
        raise FileNotFoundError(f"--resume: checkpoint {str(ckpt)!r} lacks its optimizer state "
                                f"({', '.join(missing[:3])}): restore those files, {fresh}")
    step = checkpoint.read_state(ckpt)["step"]
    later = sorted(p.name for p in (out / CHECKPOINTS).glob("step_*")
                   if re.fullmatch(r"step_\d+", p.name) and int(p.name[5:]) > step and (p / "state.json").is_file())
    if later:
        raise FileExistsError(f"--resume from {str(ckpt)!r} would rewrite the later checkpoints {', '.join(later[:3])}:"
                              f" write the newest one's name into {str(out / CHECKPOINTS / 'latest')!r}, or move them "
                              "out of the run")
    t, trained = cfg.train, info.get("trained")
    per_pass = trained.get("steps_per_pass") if isinstance(trained, dict) else None
    ends = [(f"train.max_steps={t.max_steps}", t.max_steps)] if t.max_steps is not None else []
    if isinstance(per_pass, int):
        ends.append((f"train.epochs={t.epochs} ({per_pass} steps each)", per_pass * t.epochs))
    short = [what for what, end in ends if end < step]
    if short:
        raise ValueError(f"--resume: {short[0]} ends before step {step}, which {str(ckpt)!r} holds already: resuming "
                         f"would rewrite the run's checkpoints; resume with a later end, {fresh}")
    return ckpt


def _run_info(path: Path) -> dict:
    """run.json as a dict ({} before the run wrote one)."""
    if not path.is_file():
        return {}
    return read_json(path, "--resume: run.json", "restore it, or train a new run into another --out")
