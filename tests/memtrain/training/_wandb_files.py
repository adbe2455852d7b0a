"""Reading back what an offline W&B run wrote: wandb ships no reader of its .wandb files, so this decodes them with
wandb's own Record protobufs."""

import struct
import time
from pathlib import Path

BLOCK = 32768


def records(run_dir: Path, timeout: float = 30.0) -> list:
    """The records of the one offline W&B run under `run_dir`, up to its exit record. wandb's service process writes
    the file, and may still be writing it when `finish` has returned: read until the exit record is there."""
    (path,) = (Path(run_dir) / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        out = _parse(path)
        if any(r.WhichOneof("record_type") == "exit" for r in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def _parse(path: Path) -> list:
    """A .wandb file is a LevelDB-style log (a 7-byte header, then 32 KiB blocks of chunks: crc32, length, type
    full/first/middle/last) of Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, out, pos, buf = path.read_bytes(), [], 7, b""
    assert len(data) < 7 or data[:4] == b":W&B", f"{path} is not a W&B run file"
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            out.append(pb.Record.FromString(buf))
            buf = b""
    return out


def of_type(recs: list, kind: str) -> list:
    """The messages of one record type ('run', 'metric', 'history', ...)."""
    return [getattr(r, kind) for r in recs if r.WhichOneof("record_type") == kind]
