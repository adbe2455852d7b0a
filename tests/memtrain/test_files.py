"""memtrain/files.py's durability: what a write, a directory or an append made visible is fsync'd (the data
before its rename, the directory entry after), and a directory that cannot be synced is skipped, not an error."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from memtrain.files import append_jsonl, atomic_dir, read_jsonl, write_atomic


def _inode(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


@pytest.fixture
def calls(monkeypatch):
    """Every os.fsync (as ("fsync", the inode it synced)) and os.replace (("replace", destination)), in order:
    a temporary's inode is its final file's after the rename."""
    log, fsync, replace = [], os.fsync, os.replace

    def record_fsync(fd):
        st = os.fstat(fd)
        log.append(("fsync", (st.st_dev, st.st_ino)))
        fsync(fd)

    def record_replace(src, dst):
        replace(src, dst)
        log.append(("replace", str(dst)))

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    return log


def test_write_atomic_syncs_the_data_before_the_rename_and_the_directory_after(tmp_path, calls):
    path = write_atomic(tmp_path / "eval.json", b"x" * 1024)
    assert calls == [("fsync", _inode(path)), ("replace", str(path)), ("fsync", _inode(tmp_path))]
    assert path.read_bytes() == b"x" * 1024


def test_atomic_dir_syncs_every_file_and_folder_before_the_rename_and_the_parent_after(tmp_path, calls):
    final = tmp_path / "tokenizer"
    final.mkdir()
    (final / "stale.json").write_text("{}")  # an earlier version: renamed aside, then deleted
    with atomic_dir(final) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "tokenizer.json").write_text("{}")
        (tmp / "sub" / "vocab.txt").write_text("a b")
    last_replace = max(i for i, c in enumerate(calls) if c[0] == "replace")
    before = {c[1] for c in calls[:last_replace] if c[0] == "fsync"}
    assert {_inode(final / "tokenizer.json"), _inode(final / "sub" / "vocab.txt"), _inode(final / "sub"),
            _inode(final)} <= before
    assert calls[last_replace + 1:] == [("fsync", _inode(tmp_path))]
    assert sorted(os.listdir(final)) == ["sub", "tokenizer.json"]


def test_append_jsonl_syncs_each_line_and_a_new_file_s_directory_entry(tmp_path, calls):
    path = tmp_path / "results.jsonl"
    append_jsonl(path, {"point": 1})
    assert calls == [("fsync", _inode(path)), ("fsync", _inode(tmp_path))]
    calls.clear()
    append_jsonl(path, {"point": 2})
    assert calls == [("fsync", _inode(path))]  # the entry is on disk already: the data alone
    assert read_jsonl(path) == [{"point": 1}, {"point": 2}]


@pytest.mark.parametrize("where, error, raised", [
    ("open", PermissionError(errno.EACCES, "Access is denied"), False),  # Windows opens no directory
    ("fsync", OSError(errno.EINVAL, "Invalid argument"), False),  # a file system that syncs no directory
    ("fsync", OSError(errno.EIO, "Input/output error"), True),  # a failing disk is not hidden
])
def test_a_directory_that_cannot_be_synced(tmp_path, monkeypatch, where, error, raised):
    tried, real = [], {"open": os.open, "fsync": os.fsync}

    def refuse_directories(target, *args):
        is_dir = os.path.isdir(target) if where == "open" else stat.S_ISDIR(os.fstat(target).st_mode)
        if is_dir:
            tried.append(target)
            raise error
        return real[where](target, *args)

    monkeypatch.setattr(os, where, refuse_directories)
    path = tmp_path / "run.json"
    if raised:
        with pytest.raises(OSError, match="Input/output error"):
            write_atomic(path, "{}")
    else:
        write_atomic(path, "{}")
    assert tried and path.read_text() == "{}"
