"""Atomic file writes: a temporary name in the same directory, then a rename.

A reader (another rank, another run, a resumed sweep) sees the old file or the whole new one, never half a
file, and a crash mid-write leaves the previous version intact. The temporary name carries the pid, so two
processes writing the same path never share one.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)
    return path
