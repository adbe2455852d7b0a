"""A run directory belongs to one run.

A fresh run refuses a directory that already holds another run's files (`--force` clears them first, so the new
run starts clean, W&B id included); every trainer holds the directory's lock while it runs, so two trainers
never write one directory; and `--resume` accepts only changes that leave what is already trained as it was.
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

from memtrain.config import RunConfig
from memtrain.files import file_lock
from memtrain.run_files import OUTPUTS

RESUMABLE = ("train.max_steps", "train.epochs", "train.log_every", "train.checkpoint_every",
             "train.checkpoint_every_min", "eval.*", "wandb.*", "parallel.*")
"""Keys a resumed run may change: how long it goes on, what it evaluates and logs, and the grid (checkpoints
hold full tensors and load on any grid)."""

_HELD: dict[Path, object] = {}


def claim(out: Path, *, resume: bool, force: bool) -> None:
    """Refuse (or with `force` clear) another run's files in `out`, then hold its lock for this process."""
    hold(out)  # first: a directory another trainer is writing is refused even with --force
    existing = [name for name in OUTPUTS if (out / name).exists()]
    if existing and not resume:
        if not force:
            release(out)
            raise FileExistsError(f"{str(out)!r} already holds a run ({', '.join(existing[:3])}): --resume "
                                  "continues it, --force replaces it, or choose another --out")
        for name in existing:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def hold(out: Path) -> None:
    """Lock `out` until this process ends (or `release`): a second trainer fails at once instead of mixing."""
    path = out.resolve()
    if path in _HELD:
        return
    lock = file_lock(path / ".lock", blocking=False)
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
    a, b = saved.to_dict(), cfg.to_dict()
    changed = [(f"{s}.{k}", a[s][k], b[s][k]) for s in a for k in a[s] if a[s][k] != b[s][k]]
    return [f"{key} ({old!r} -> {new!r})" for key, old, new in changed
            if not any(fnmatch.fnmatch(key, pattern) for pattern in RESUMABLE)]
