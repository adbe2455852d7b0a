"""Atomic writes of files and directories (a temporary name in the same directory, then a rename), and locks.

A reader (another rank, another run, a resumed sweep) sees the old file or the whole new one, never half a
file, and a crash mid-write leaves the previous version intact. The temporary name carries the pid, so two
processes writing the same path never share one; `atomic_dir` builds a whole directory that way.
`file_lock` serializes the builders of one cache entry (two sweeps, or two runs of one sweep, needing the
same stream or base model) across processes and threads.

Durable against power loss too: the data is fsync'd before the rename (or with each append) and the directory
after it, so what a write made visible survives, never as an empty file or a lost line. Where a directory cannot
be opened or synced (Windows, some FUSE mounts) its fsync is skipped.

JSONL files (metrics, passes, results) are only appended to: `append_jsonl` writes one fsync'd line and never
glues it onto a line a kill cut short; `read_jsonl` skips such a torn line (and anything but a JSON object) with
a warning naming the file and line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())  # else a power loss after the rename can leave `path` empty
        os.replace(tmp, path)
    except OSError:  # a full disk: no stray temporary beside the file left as it was
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)
    return path


def _sync_dir(path: str | os.PathLike) -> None:
    """fsync directory `path`, so the renames and new files in it survive a power loss."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows opens no directory (and has no directory entry to sync)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # a file system that syncs no directory (some FUSE)
            raise
    finally:
        os.close(fd)


def sync_file(path: str | os.PathLike) -> None:
    """fsync a file another writer closed (safetensors, save_pretrained: they sync nothing). On a file system shared
    between nodes, only the node that wrote a file flushes it: each writer syncs its own."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, `root` last."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            sync_file(os.path.join(folder, name))
        _sync_dir(folder)


def respect_umask(path: str | os.PathLike) -> None:
    """Give a file the mode open() would have (0o666 less the umask), so the group reads it as it reads every
    other file of a run: writers that build in a private temporary (safetensors' save_file) leave 0600."""
    try:
        os.chmod(path, 0o666 & ~_umask())
    except PermissionError:  # a file system that keeps modes of its own (some network mounts): the file is written
        pass


def _umask() -> int:
    try:  # Linux says it without changing it; the fallback sets it for a moment (another thread could see that)
        status = Path("/proc/self/status").read_text()
        return int(status.split("Umask:", 1)[1].split()[0], 8)
    except (OSError, IndexError, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the complete directory `tmp` to `final`, replacing what was there.

    The old directory is renamed aside before the new one is renamed in, and removed only after: a crash at
    any point leaves either the old or the new directory at `final` (or, between the two renames, the old
    one under its aside name), never a half-written one.
    """
    tmp, final = Path(tmp), Path(final)
    _sync_tree(tmp)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _sync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike):
    """Build a directory in an empty temporary sibling (yielded) that replaces `final` when the block ends;
    if the block raises, the temporary is removed and `final` stays as it was.

        with atomic_dir(run / "tokenizer") as tmp:
            tok.save_pretrained(tmp)
    """
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, final)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, blocking: bool = True):
    """Hold an exclusive advisory lock on `path` (created if missing) for the block. Not blocking, a lock held
    elsewhere raises BlockingIOError at once. flock is per open file, so threads of one process exclude each
    other too; the lock goes with the process, so a killed holder never leaves it stuck."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        yield


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append `record` as one line and flush it to disk; a previous line cut short by a kill is left alone."""
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        new = f.tell() == 0
        if not new:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line  # never glue our line onto a torn one
        f.seek(0, os.SEEK_END)
        f.write(line.encode())
        f.flush()
        os.fsync(f.fileno())
    if new:  # the file may have just been created: its directory entry too, or a power loss loses the file
        _sync_dir(Path(path).parent)


def read_jsonl(path: str | os.PathLike, *, quiet: bool = False) -> list[dict]:
    """Every JSON object of a JSONL file, in order ([] when the file is missing). A line that is not one (cut
    short by a kill, or foreign) is skipped with a warning on stderr unless `quiet`."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif not quiet:
            print(f"warning: {path}:{n} is not a complete JSON record (a write cut short by a kill?): skipped",
                  file=sys.stderr)
    return rows


def read_json(path: str | os.PathLike, what: str, fix: str) -> dict:
    """A file holding one JSON object (run.json, say), or a ValueError naming it, what is wrong (empty, not text,
    not JSON, not an object) and `fix`; a missing or unreadable file is the OSError naming it."""
    path = Path(path)
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{what} {str(path)!r} is empty: {fix}")
    try:
        obj = json.loads(data.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"{what} {str(path)!r} is damaged ({e}): {fix}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {str(path)!r} holds {type(obj).__name__}, not a JSON object: {fix}")
    return obj
