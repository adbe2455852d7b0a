"""One optimizer step on the grid, and what it needs: the AdamW groups, the LR schedule, the autocast dtype.

Normalization is what makes grids interchangeable: every rank reads the whole global batch's labels (cheap),
so the number of supervised tokens N of the step is known everywhere without communication; each
micro-batch back-propagates sum(kept token losses) / N and gradients are summed over ranks. Gradient
accumulation, data parallelism and Goldfish dropping therefore never change the result.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import nullcontext

import torch

import parallel
from memtrain.config import PRECISIONS, RunConfig
from memtrain.losses import LossSums, loss_sums
from memtrain.training.offload import OffloadAdamW
from memtrain.training.perf import bf16_faster


def autocast_dtype(cfg: RunConfig, device: torch.device, grid: parallel.Grid | None = None) -> torch.dtype | None:
    """The matmul dtype under autocast (None: plain fp32).

    'auto' takes bf16 only where it is faster: on CUDA when the GPU supports it, on a CPU when a matmul probe
    says so (machines differ: AVX512-BF16/AMX runs bf16 2-4x faster than fp32, AVX2-only 15-40x slower).
    Collective when `grid` has several ranks: bf16 only if every rank's probe agrees, so no two ranks ever
    compute in different dtypes.
    """
    p = cfg.train.precision
    if p not in PRECISIONS:
        raise ValueError(f"train.precision={p!r} is invalid: use one of {', '.join(map(repr, PRECISIONS))}")
    if p != "auto":
        return torch.bfloat16 if p == "bf16" else None
    vote = torch.tensor([1.0 if bf16_faster(device) else 0.0], device=device)
    if grid is not None and grid.world_size > 1:
        parallel.comm.all_reduce(vote, grid, parallel.AXES, op=torch.distributed.ReduceOp.MIN)
    return torch.bfloat16 if vote.item() == 1.0 else None


def peak_lr(cfg: RunConfig, hidden_size: int) -> float:
    """The learning rate of this model: train.lr * lr_scale, times (lr_width / hidden_size) ** lr_width_exponent
    when train.lr_width is set (the learning rate falling with width, from a base tuned at width lr_width)."""
    t = cfg.train
    width = 1.0 if t.lr_width is None else (t.lr_width / hidden_size) ** t.lr_width_exponent
    return t.lr * t.lr_scale * width


def build_optimizer(plm, cfg: RunConfig, amp: torch.dtype | None = None) -> torch.optim.Optimizer:
    """AdamW over this rank's shards at `peak_lr`: matrices (every engine weight is a matrix shard) decay;
    norms and biases do not. Fused on CUDA (`adamw_kwargs`). With train.optimizer_offload its state and fp32 master
    weights live in host memory (offload.py), and under bf16 autocast (`amp`) the device keeps the parameters in
    bf16."""
    params = [p for p in parallel.unique_parameters(plm) if p.requires_grad]
    decay = [p for p in params if parallel.spec_of(p).shard_axes == ("x", "y", "z") or p.dim() >= 2]
    rest = [p for p in params if all(p is not q for q in decay)]
    t = cfg.train
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    lr, betas = peak_lr(cfg, plm.config.hidden_size), (t.beta1, t.beta2)
    if t.optimizer_offload:
        return OffloadAdamW(groups, lr=lr, betas=betas, eps=1e-8, param_dtype=amp)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **adamw_kwargs(p.device.type for p in params))


def adamw_kwargs(device_types: Iterable[str]) -> dict:
    """torch.optim.AdamW's implementation for parameters on these device types: fused (the whole update in one
    multi-tensor kernel, where foreach, torch's CUDA default, launches a chain of them) when all are on CUDA;
    torch's default anywhere else, so a CPU run keeps its single-tensor update, bit for bit."""
    return {"fused": True} if set(device_types) == {"cuda"} else {}


def build_schedule(opt, cfg: RunConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the optimizer's lr, then a cosine decay to min_lr / lr of it at `total_steps` (the
    ratio of train.min_lr to train.lr, so a width-scaled lr keeps its schedule's shape). A run shorter than its
    warm-up warms up over all its steps, reaching lr at its last, rather than training on a ramp that never gets
    there."""
    t = cfg.train
    warmup = min(t.warmup_steps, max(0, total_steps - 1))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return (t.min_lr + (t.lr - t.min_lr) * cosine) / t.lr

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_step(plm, grid: parallel.Grid, opt, input_ids: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor,
               micro_batch: int, *, position_ids: torch.Tensor | None = None, amp: torch.dtype | None = None,
               overlap: bool = True, grad_sync: str = "overlap",
               grad_clip: float = 1.0) -> tuple[LossSums, torch.Tensor]:
    """One optimizer step on a global batch (every rank passes the whole batch and takes its own rows).
    position_ids (document attention) restart at every packed document, which then attends only to itself.

    grad_sync (parallel.grad_sync in the config): 'overlap' starts the gradient all-reduces in buckets during
    the last micro-batch's backward (parallel.grad_sync), 'blocking' runs them after it (sync_gradients). Either
    way the earlier micro-batches only accumulate (parallel.no_sync).

    An OffloadAdamW (train.optimizer_offload) takes each bucket's sums to the host as its all-reduce completes
    (and updates its parameters then when nothing is clipped), and clips on the host: the device's .grad keeps
    the unclipped sums.

    Returns the step's global LossSums (float64 scalars, all-reduced over the grid) and the global gradient norm
    before clipping. The planner's byte model is tested against
    the collectives of exactly this function.
    """
    if grad_sync not in parallel.GRAD_SYNCS:
        raise ValueError(f"parallel.grad_sync={grad_sync!r} is invalid: use one of "
                         f"{', '.join(map(repr, parallel.GRAD_SYNCS))}")
    device = next(plm.parameters()).device
    n_kept = keep.sum().clamp(min=1)  # the global count: every rank sees the whole batch's labels
    rows = plm.local_rows(input_ids.shape[0])
    ids, labels, keep = input_ids[rows], labels[rows], keep[rows]
    pos = position_ids[rows] if position_ids is not None else None
    opt.zero_grad(set_to_none=True)
    # On the device: NCCL reduces device tensors only, and a host copy per micro-batch would wait for its backward.
    totals = torch.zeros(len(LossSums._fields), dtype=torch.float64, device=device)
    alone = grid.world_size == 1  # no gradient to sum with anyone's
    sync = parallel.grad_sync(plm, grid) if grad_sync == "overlap" and not alone else None
    offload = isinstance(opt, OffloadAdamW)
    tensor_parallel = overlap and grid.tensor_parallel_size > 1  # what OAR, ORS and OAG overlap
    with sync or nullcontext():  # on exit every gradient is summed over its reduce axes
        for i in range(0, ids.shape[0], micro_batch):
            sl = slice(i, i + micro_batch)
            accumulate = parallel.no_sync() if i + micro_batch < ids.shape[0] else nullcontext()
            ov = parallel.overlap(plm) if tensor_parallel else nullcontext()
            ac = torch.autocast(device.type, dtype=amp) if amp else nullcontext()
            with accumulate, ov:
                with ac:
                    token_losses = plm.token_losses(ids[sl].to(device), labels[sl].to(device),
                                                    None if pos is None else pos[sl].to(device))
                s = loss_sums(token_losses.float(), keep[sl].to(device), labels[sl].to(device))
                (s.kept_sum / n_kept).backward()
            totals += torch.stack(s).detach().double()
        if sync is not None and offload:
            opt.stream(sync, update=grad_clip <= 0)
    if sync is None and not alone:
        parallel.sync_gradients(plm, grid)
    if offload:
        norm = opt.finish(plm, grid, grad_clip)
    else:
        norm = parallel.clip_grad_norm_(plm, grad_clip, grid) if grad_clip > 0 else parallel.grad_norm(plm, grid)
        opt.step()
    parallel.comm.all_reduce(totals, grid, plm.row_axes)  # one message for the four sums
    return LossSums(*totals.cpu()), norm
