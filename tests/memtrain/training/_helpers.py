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
