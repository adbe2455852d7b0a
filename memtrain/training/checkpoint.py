"""Layout-independent checkpoints: full tensors in safetensors, written by rank 0, atomically.

A checkpoint directory holds model.safetensors (HF parameter names), optimizer.safetensors (AdamW
moments under the same names), and state.json (step, scheduler, RNG, config digest, grid). Tensors are
gathered from the shards to full shape before saving and sliced again when loading, so a checkpoint
saved on one grid loads on any other grid and on a single process. Each save goes to a temporary
directory renamed into place (`files.replace_dir`), then `latest` is rewritten by rename: a crash leaves
the previous checkpoint intact and never a half-written "latest".
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import parallel
from memtrain.files import atomic_dir

MOMENTS = ("exp_avg", "exp_avg_sq")


@contextmanager
def _params_hold(plm, tensors: dict):
    """Temporarily point each parameter's data at another tensor of the same shard shape."""
    saved = {}
    try:
        for p, t in tensors.items():
            saved[p] = p.data
            p.data = t
        yield
    finally:
        for p, d in saved.items():
            p.data = d


def gather_optimizer(plm, opt) -> dict[str, torch.Tensor]:
    """Full-shape AdamW moments keyed '<moment>/<hf name>' (collective over the grid)."""
    out = {}
    for moment in MOMENTS:
        held = {p: opt.state[p][moment] for p in parallel.unique_parameters(plm) if p in opt.state}
        if not held:
            continue
        with _params_hold(plm, held):
            for name, t in plm.full_state_dict().items():
                out[f"{moment}/{name}"] = t
    return out


def scatter_optimizer(plm, opt, tensors: dict[str, torch.Tensor], step: int) -> None:
    """Inverse of gather_optimizer: slice full moments into this rank's AdamW state."""
    for moment in MOMENTS:
        full = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(moment + "/")}
        if not full:
            continue
        held = {p: torch.zeros_like(p.data) for p in parallel.unique_parameters(plm)}
        with _params_hold(plm, held):
            plm.load_hf_state_dict(full)
        for p, t in held.items():
            opt.state[p][moment] = t
    for p in parallel.unique_parameters(plm):
        if p in opt.state:
            opt.state[p]["step"] = torch.tensor(float(step))


def save(run_dir: Path, plm, opt, sched, step: int, extra: dict) -> Path | None:
    """Collective: gather on every rank, write on global rank 0. Returns the directory on rank 0."""
    model = {k: v.contiguous() for k, v in plm.full_state_dict().items()}
    moments = {k: v.contiguous() for k, v in gather_optimizer(plm, opt).items()}
    grid = plm.grid
    if grid.rank != 0:
        return None
    ckpt_root = run_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    for stale in ckpt_root.glob(".step_*.tmp-*"):  # saves cut short by a kill (a live run holds the run's lock)
        shutil.rmtree(stale, ignore_errors=True)
    with atomic_dir(final) as tmp:
        save_file(model, str(tmp / "model.safetensors"))
        save_file(moments, str(tmp / "optimizer.safetensors"))
        state = dict(extra, step=step, scheduler=sched.state_dict(), rng=torch.get_rng_state().tolist(),
                     grid={a: getattr(grid, a) for a in parallel.AXES})
        (tmp / "state.json").write_text(json.dumps(state))
    latest_tmp = ckpt_root / f".latest_{os.getpid()}"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, ckpt_root / "latest")
    return final


def latest(run_dir: Path) -> Path | None:
    """The checkpoint `latest` points at, or, when that pointer is missing or dangles (a kill between the two
    renames of a save), the newest complete one."""
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if (path / "state.json").is_file():
            return path
    complete = sorted(p for p in root.glob("step_*") if (p / "state.json").is_file())
    return complete[-1] if complete else None


def read(path: Path) -> tuple[dict, dict, dict]:
    """(model tensors, optimizer tensors, state) of a checkpoint directory, with clear errors."""
    path = Path(path)
    files = [path / "model.safetensors", path / "state.json"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {str(path)!r} is missing {', '.join(missing)}: "
                                "point at a directory written by `memtrain train`")
    try:
        model = load_file(str(path / "model.safetensors"))
        opt = load_file(str(path / "optimizer.safetensors")) if (path / "optimizer.safetensors").is_file() else {}
        state = json.loads((path / "state.json").read_text())
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"checkpoint {str(path)!r} is corrupt ({type(e).__name__}: {e}): "
                         "use an earlier checkpoint or re-run training") from None
    return model, opt, state


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Model weights to start from: a memtrain run or checkpoint directory, or an HF directory."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        path = latest(path) or path
    if (path / "state.json").is_file():
        return read(path)[0]
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"model.init={str(path)!r} holds no checkpoint or *.safetensors weights: "
                                "point at a memtrain run/checkpoint directory or an HF model directory")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights
