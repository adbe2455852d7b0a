"""Sharded, resharding checkpoints: every rank writes and reads only its own shards, in safetensors.

A checkpoint directory holds, per writing rank r, model-<r>.safetensors and optimizer-<r>.safetensors, and
state.json (step, scheduler, RNG, config digest, grid). A file holds that rank's pieces of the full HF
tensors: rectangles named '<HF name>:<offsets>' ('exp_avg/<HF name>:<offsets>' for the AdamW moments), and
each tensor's full shape in its metadata. A replicated value is written once (by the rank at coordinate 0 of
the axes that replicate it), so the pieces of all files tile every tensor exactly once.

Loading goes through the same slots that load HF weights: each rank asks for the rectangles its shards hold,
and `CheckpointSource` assembles them from the overlapping pieces, read slice by slice from the files. So a
checkpoint saved on one grid loads on any other grid and on one process, and no rank ever holds more than
its shards plus the piece it is copying: never the full model, as gathering to rank 0 would.

Why not torch.distributed.checkpoint: DCP reshards tensors whose every rank-local part is one rectangle of a
global shape (DTensor). Here a Z shard of a flattened block can start mid-row, and a fused projection sends a
shard's rows to several runs of HF rows (GPT-2's QKV): several rectangles per rank per tensor, which DTensor
cannot describe. The pieces format describes them, stays in HF names (the export reads it key by key) and needs
nothing but safetensors. Files written by memtrain before this format (one model.safetensors of full tensors)
are read the same way: a full tensor is a single piece at offset 0.

A save writes into a temporary sibling renamed into place by rank 0 once every rank has voted its files
complete, then `latest` is rewritten by rename: a crash leaves the previous checkpoint intact and never a
half-written "latest". The directory must be on a file system every rank sees (as for DCP). A save that fails
(a full disk on any rank) removes its temporary and raises an OSError naming the file: the previous checkpoint
stays what `latest` names. After each save rank 0 deletes all but the newest `keep` checkpoints (`prune`).
Files get the umask's mode, like every other file of a run (group-readable on a shared cluster).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import parallel
from memtrain.files import replace_dir, respect_umask, sync_file, write_atomic
from memtrain.hf.slots import Source
from memtrain.run_files import CHECKPOINTS, LATEST

MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointSource(Source):
    """Full HF tensors of a checkpoint, assembled on demand from the pieces in its files.

    `read(key, index)` reads only the pieces overlapping the requested rectangle, and only their overlap;
    a rectangle the pieces do not cover completely is an error (a checkpoint missing a rank's file).
    """

    def __init__(self, files: list[Path], prefix: str = ""):
        from safetensors import safe_open

        self._stack = ExitStack()
        self._pieces: dict[str, list] = defaultdict(list)
        self._shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            try:
                h = self._stack.enter_context(safe_open(str(f), framework="pt"))
                shapes = json.loads((h.metadata() or {}).get("shapes", "{}"))
            except Exception as e:  # safetensors raises its own error types for corrupt files
                self.close()
                raise ValueError(f"checkpoint file {str(f)!r} is corrupt ({type(e).__name__}: {e}): use an earlier "
                                 "checkpoint or re-run training") from None
            for name in h.keys():
                if not name.startswith(prefix):
                    continue
                key, _, offsets = name[len(prefix):].partition(":")
                shape = tuple(h.get_slice(name).get_shape())
                start = tuple(int(o) for o in offsets.split(",")) if offsets else (0,) * len(shape)
                self._pieces[key].append((start, shape, h, name))
                self._shapes[key] = tuple(shapes.get(key, shape))

    def keys(self) -> list[str]:
        return list(self._pieces)

    def shape(self, key) -> tuple[int, ...]:
        return self._shapes[key]

    def dtype(self, key) -> torch.dtype:
        _, shape, h, name = self._pieces[key][0]
        return h.get_slice(name)[tuple(slice(0, min(n, 1)) for n in shape)].dtype

    def read(self, key, index=None) -> torch.Tensor:
        full = self._shapes[key]
        index = tuple(index or ()) + (slice(None),) * (len(full) - len(index or ()))
        box = [s.indices(n)[:2] for s, n in zip(index, full)]
        out, filled = None, 0
        for start, shape, h, name in self._pieces[key]:
            lo = [max(b0, s) for (b0, _), s in zip(box, start)]
            hi = [min(b1, s + n) for (_, b1), s, n in zip(box, start, shape)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            part = h.get_slice(name)[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))]
            if out is None:
                out = torch.empty([b1 - b0 for b0, b1 in box], dtype=part.dtype)
            out[tuple(slice(a - b0, b - b0) for a, b, (b0, _) in zip(lo, hi, box))] = part
            filled += part.numel()
        want = math.prod(b1 - b0 for b0, b1 in box)
        if filled != want:
            raise ValueError(f"checkpoint pieces cover {filled} of the {want} values of {key}{box}: a rank's file "
                             "is missing; use an earlier checkpoint")
        return out if out is not None else torch.empty([b1 - b0 for b0, b1 in box], dtype=self.dtype(key))


def _files(path: Path, kind: str) -> list[Path]:
    return sorted(path.glob(f"{kind}*.safetensors"))


def _vote(ok: bool, grid, device) -> bool:
    """Collective: whether every rank's `ok` is true (also a barrier)."""
    if grid.world_size == 1:
        return ok
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    parallel.comm.all_reduce(flag, grid, parallel.AXES, op=dist.ReduceOp.MIN)
    return flag.item() == 1.0


def _save_file(tensors: dict, path: Path, shapes: dict) -> None:
    """safetensors' save_file, with its I/O errors as the OSError they are (it raises its own error type, the
    errno only in the message) and the file's mode as the umask says (it writes a private temporary)."""
    try:
        save_file(tensors, str(path), metadata={"shapes": json.dumps(shapes)})
    except Exception as e:  # noqa: BLE001 - SafetensorError; anything but an OS error is re-raised as it was
        code = re.search(r"\(os error (\d+)\)", str(e))  # "I/O error: No space left on device (os error 28)"
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    respect_umask(path)
    sync_file(path)  # by the rank that wrote it: rank 0's sync of the directory would not flush another node's


def _masters(opt) -> dict:
    """parameter -> fp32 master weight of an optimizer that keeps them apart from the parameters (offload.py's,
    whose device parameters may be bf16): those are the weights a checkpoint holds. {} for torch's AdamW."""
    return getattr(opt, "masters", None) or {}


def _write_rank_files(tmp: Path, plm, opt, rank: int) -> None:
    with _params_hold(_masters(opt)):
        pieces, shapes = plm.shard_pieces()
    if pieces:
        _save_file({k: v.contiguous().cpu() for k, v in pieces.items()}, tmp / f"model-{rank:05d}.safetensors",
                   shapes)
    del pieces
    moments, shapes = {}, {}
    for moment in MOMENTS:
        held = {p: opt.state[p][moment] for p in parallel.unique_parameters(plm) if moment in opt.state.get(p, {})}
        with _params_hold(held):
            got, shapes = plm.shard_pieces(only=held.__contains__)
        moments.update({f"{moment}/{k}": v.contiguous().cpu() for k, v in got.items()})
    if moments:
        _save_file(moments, tmp / f"optimizer-{rank:05d}.safetensors", shapes)


class _params_hold:
    """Temporarily point each parameter's data at another tensor of the same shard shape (a moment), so the
    slots that cut and fill weights cut and fill that tensor instead."""

    def __init__(self, tensors: dict):
        self.tensors, self.saved = tensors, {}

    def __enter__(self):
        for p, t in self.tensors.items():
            self.saved[p], p.data = p.data, t

    def __exit__(self, *exc):
        for p, d in self.saved.items():
            p.data = d


def save(run_dir: Path, plm, opt, sched, step: int, extra: dict, keep: int = 0) -> Path | None:
    """Collective: every rank writes its pieces; rank 0 the state and the rename, then keeps the newest `keep`
    checkpoints (0: all). Returns the directory on rank 0."""
    grid = plm.grid
    device = next(plm.parameters()).device
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = root / f".{final.name}.tmp-save"
    if grid.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*.tmp-*"):  # saves cut short by a kill (a live run holds the run's lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _vote(True, grid, device)  # the temporary directory exists
    error = None
    try:
        _write_rank_files(tmp, plm, opt, grid.rank)
    except Exception as e:  # voted first, so the other ranks stop too instead of waiting out the timeout
        error = e
    if not _vote(error is None, grid, device):
        if grid.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, OSError):
            raise _not_saved(error, step) from None
        raise error or OSError(f"saving checkpoint {str(final)!r} failed on another rank: see its error")
    if grid.rank == 0:
        state = dict(extra, step=step, scheduler=sched.state_dict(), rng=torch.get_rng_state().tolist(),
                     grid={a: getattr(grid, a) for a in parallel.AXES})
        new = not final.exists()
        try:
            (tmp / "state.json").write_text(json.dumps(state))
            replace_dir(tmp, final)
            write_atomic(root / LATEST, final.name)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if new:  # renamed in before `latest` failed: a later checkpoint than `latest` would block --resume
                shutil.rmtree(final, ignore_errors=True)
            error = e
    # Every rank learns how rank 0's part went: the others would otherwise train on into a collective it never joins.
    if not _vote(error is None, grid, device):
        raise _not_saved(error, step) if error else OSError(
            f"saving checkpoint {str(final)!r} failed on rank 0: see its error; `latest` still names the one before")
    if grid.rank != 0:
        return None
    if keep:
        prune(root, keep, step)
    return final


def _not_saved(e: OSError, step: int) -> OSError:
    """`e` (one line: the file and why), saying what it left: no checkpoint of `step`, `latest` as it was."""
    if not e.strerror:
        return e
    return OSError(e.errno, f"{e.strerror}: the checkpoint of step {step} was not saved (`latest` still names the "
                            "one before, which --resume continues from)", e.filename)


def prune(root: Path, keep: int, newest: int) -> None:
    """Delete all but the newest `keep` checkpoints up to step `newest`, the one `latest` names (later ones, which
    a resume refuses to overwrite, are left for the user). Each goes by a rename to a temporary name first, so a
    kill mid-delete leaves no half-deleted checkpoint that `latest`'s fallback could pick (the next save removes
    the temporary)."""
    steps = sorted((int(p.name[5:]), p) for p in root.glob("step_*") if re.fullmatch(r"step_\d+", p.name))
    for _, path in [(s, p) for s, p in steps if s <= newest][:-keep]:
        doomed = path.with_name(f".{path.name}.tmp-prune")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def latest(run_dir: Path) -> Path | None:
    """The checkpoint `latest` points at, or, when that pointer is missing or dangles (a kill between the two
    renames of a save), the newest complete one."""
    root = run_dir / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_bytes().decode("ascii").strip()
        except UnicodeDecodeError:
            name = None
        if name is None or not re.fullmatch(r"step_\d+", name):  # damaged: a guess could resume the wrong step
            raise ValueError(f"{str(pointer)!r} is damaged (it must name a checkpoint directory, e.g. step_000100): "
                             "write the name of the checkpoint to use into it, or delete it to use the newest one")
        path = root / name
        if (path / "state.json").is_file():
            return path
    complete = sorted((int(p.name[5:]), p) for p in root.glob("step_*")  # by number: step_1000000 > step_999999
                      if re.fullmatch(r"step_\d+", p.name) and (p / "state.json").is_file())
    return complete[-1][1] if complete else None


def keep_final_weights(run_dir: Path) -> Path | None:
    """Trim a finished run to its final weights: the checkpoint `latest` names keeps its model files and state.json,
    its optimizer files and every other checkpoint are deleted (export and evaluation read nothing else; a resume
    from it is refused by `missing_optimizer`). Returns that checkpoint, or None when the run has none."""
    ckpt = latest(Path(run_dir))
    if ckpt is None:
        return None
    prune(ckpt.parent, 1, int(ckpt.name[5:]))
    for f in _files(ckpt, "optimizer"):
        f.unlink()
    return ckpt


def missing_optimizer(path: Path) -> list[str]:
    """The optimizer files a checkpoint lacks: every rank that saved model pieces saved its AdamW moments beside
    them (model-<r> and optimizer-<r>), so without one a resume would continue with fresh moments."""
    wanted = [f.name.replace("model", "optimizer", 1) for f in _files(Path(path), "model")]
    return [name for name in wanted if not (Path(path) / name).is_file()]


def model_source(path: Path) -> CheckpointSource:
    """The model tensors of a checkpoint directory (opened lazily), with a clear error when it is not one."""
    path = Path(path)
    if not (path / "state.json").is_file() or not _files(path, "model"):
        raise FileNotFoundError(f"checkpoint {str(path)!r} is missing state.json or its model files: point at a "
                                "directory written by `memtrain train`")
    return CheckpointSource(_files(path, "model"))


def read_state(path: Path) -> dict:
    """A checkpoint's state.json (its step an int), or a ValueError naming it and the fix."""
    try:
        state = json.loads((Path(path) / "state.json").read_bytes().decode("utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("step"), int) or isinstance(state["step"], bool):
            raise ValueError("no step saved")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
        raise ValueError(f"checkpoint {str(path)!r} has a corrupt state.json ({e}): use an earlier checkpoint "
                         "or re-run training") from None
    return state


def load(path: Path, plm, opt=None) -> dict:
    """Collective-free: fill this rank's shards (and AdamW moments when `opt` is given; an offloading optimizer's
    fp32 masters too) from a checkpoint saved on any grid; returns its state."""
    path = Path(path)
    masters = _masters(opt)
    with model_source(path) as src:
        state = read_state(path)
        plm.load_hf_state_dict(src)
        if masters:  # the fp32 values themselves, not the parameters' bf16 rounding of them
            with _params_hold(masters):
                plm.load_hf_state_dict(src)
    if opt is not None:
        params = parallel.unique_parameters(plm)
        for moment in MOMENTS:
            with CheckpointSource(_files(path, "optimizer"), prefix=moment + "/") as src:
                if not src.keys():
                    continue
                held = {p: torch.zeros_like(masters.get(p, p.data)) for p in params if p.requires_grad}
                with _params_hold(held):
                    plm.load_hf_state_dict(src, strict=False)
            for p, t in held.items():
                opt.state[p][moment] = t
        on_device = opt.defaults.get("fused") or opt.defaults.get("capturable")  # their kernels read it there
        for p in params:
            if p in opt.state:
                device = p.device if on_device else "cpu"
                opt.state[p]["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device=device)
    return state


def read_weights(path: str | Path) -> Source:
    """Model weights to start from, opened lazily: a memtrain run or checkpoint directory, or an HF directory."""
    path = Path(path)
    if (path / CHECKPOINTS).is_dir():
        path = latest(path) or path
    if (path / "state.json").is_file():
        return model_source(path)
    if not (path.is_dir() and any(path.glob("*.safetensors"))):
        raise FileNotFoundError(f"model.init={str(path)!r} holds no checkpoint or *.safetensors weights: "
                                "point at a memtrain run/checkpoint directory or an HF model directory")
    return Source(path)
