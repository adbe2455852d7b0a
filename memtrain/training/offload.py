"""AdamW with its state in host memory, updated bucket by bucket as the gradient all-reduce completes
(train.optimizer_offload; the 2021 AxoNN paper's use of CPU memory as the optimizer's scratch space).

    opt = OffloadAdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, param_dtype=torch.bfloat16)
    opt.zero_grad()                             # a step begins
    with sync:                                  # parallel.grad_sync: buckets all-reduced during backward
        loss.backward()
        opt.stream(sync, update=grad_clip == 0)  # each bucket: wait, copy to host (and update) in launch order
    norm = opt.finish(model, grid, grad_clip)   # the rest, the norm, clipping, the math, the copy back

Per parameter the host holds its fp32 master value, exp_avg and exp_avg_sq (fp32), torch's `step` scalar and a
staging buffer for its gradient in the gradient's dtype, pinned when CUDA is available so the copies run
asynchronously. The device keeps only the parameter and its gradient: under bf16 training (`param_dtype`) the
parameter itself becomes bf16, the fp32 master lives on the host alone, and the device holds 4 bytes per
parameter instead of 16 (fp32: 8 instead of 16). On a CPU-only machine the host is the same memory; the code
path (separate state, bucketed update, copy back) is the same.

The math is torch's own functional AdamW (`torch.optim.adamw.adamw`, its single-tensor CPU path), run on the
host tensors: on a CPU it is the same fp32 arithmetic in the same order as `torch.optim.AdamW` on the device, so
an offloaded fp32 run equals a non-offloaded one bitwise (tests/memtrain/training/test_offload.py). On a GPU the
device's AdamW runs other kernels (foreach, contracted multiply-adds) than the host's: the same operations, each
within an ulp or so, i.e. ~1e-6 relative per step rather than bitwise (expected; unmeasured on a GPU).

Measured on one H100 (2026-11-24; llama-3.2-1b, bf16, batch 8 x 1024, `memtrain train`, medians of steps 4-12): peak
device memory 16.6 GiB offloaded vs 28.3 GiB not, at 1.96 s per step vs 0.205 s; on one H200 (2026-11-28, medians
after the first step): 16.55 GiB vs 30.08 GiB, at 1.944 s vs 0.162 s. One GPU has no gradient all-reduce to hide the
host's AdamW behind, so its ~1B-parameter update on 16 host cores is the step: offload buys memory (a model that
does not fit otherwise), not speed, at one GPU.

Gradient clipping needs the global norm, i.e. every bucket summed: with train.grad_clip > 0 what overlaps the
all-reduce of later buckets is each finished bucket's copy to the host; the math waits for the norm, then runs
bucket by bucket, each bucket's copy back to the device overlapping the next one's math. With grad_clip = 0 a
bucket is updated as soon as its all-reduce completes. Clipping scales the staged host gradients by the
coefficient `parallel.clip_grad_norm_` would apply to the device's: the same multiplication, so the same values.

Checkpoints (checkpoint.py) save and load `masters` as the weights and the moments in their fp32 host form:
the format is a non-offloaded run's, so either loads into the other. The model's GradSync must be built after
this optimizer (it buckets gradients by the dtype the parameters have then).
"""

from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw

import parallel
from parallel.bucketed import BUCKET_BYTES


class OffloadAdamW(torch.optim.Optimizer):
    """torch AdamW (amsgrad, maximize off) whose state and fp32 master weights live in host memory."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0, *,
                 param_dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.pin = any(p.is_cuda for group in self.param_groups for p in group["params"])
        self.bucket_bytes = bucket_bytes
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        """parameter -> its fp32 value on the host: what AdamW updates and checkpoints save."""
        self.staged: dict[torch.Tensor, torch.Tensor] = {}
        """parameter -> host buffer of its gradient (the gradient's dtype), made at its first gradient."""
        self.transfer_bytes = 0
        """Bytes copied since the step began (zero_grad) between the device's parameters and gradients and the
        host (over the host link on a GPU; a copy within the same memory on a CPU-only machine)."""
        self._group = {}
        self._pending: list[torch.Tensor] = []  # staged this step, not updated yet, in staging order
        self._seen: set = set()  # staged this step
        self._clip: float | None = None  # the clipping coefficient `finish` passes to `step`
        self._events: dict[torch.Tensor, object] = {}  # parameter -> CUDA event of its staging copy
        for group in self.param_groups:
            for p in group["params"]:
                self._group[p] = group
                self.masters[p] = self._host_copy(p.detach(), torch.float32)
                if param_dtype is not None and p.dtype != param_dtype:
                    p.data = p.data.to(param_dtype)

    def _host_copy(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype, pin_memory=self.pin).copy_(t)

    def _state(self, p: torch.Tensor) -> dict:
        """p's AdamW state as torch creates it, kept in (pinned) host memory: a resumed checkpoint's moments
        arrive as plain host tensors and are moved here at their first use."""
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.tensor(0.0)
        for k in ("exp_avg", "exp_avg_sq"):
            t = st.get(k)
            if t is None:
                st[k] = torch.zeros(p.shape, dtype=torch.float32, pin_memory=self.pin)
            elif t.device.type != "cpu" or t.dtype != torch.float32 or (self.pin and not t.is_pinned()):
                st[k] = self._host_copy(t, torch.float32)
        return st

    # ----------------------------------------------------------------------------------------- one step

    @torch.no_grad()
    def _stage(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (parameter, its summed gradient on the device) to the host, asynchronously on a GPU. The
        buffer takes the parameter's shape, whatever view of the gradient arrives: AdamW updates it against the
        master, and the bf16 cast back copies the master into it."""
        event = None
        for p, g in pairs:
            buf = self.staged.get(p)
            if buf is None or buf.dtype != g.dtype:
                buf = self.staged[p] = torch.empty(p.shape, dtype=g.dtype, pin_memory=self.pin)
            buf.copy_(g.view_as(buf), non_blocking=True)
            self.transfer_bytes += buf.numel() * buf.element_size()
            self._pending.append(p)
            self._seen.add(p)
            if g.device.type == "cuda":
                if event is None:
                    event = torch.cuda.Event()
                self._events[p] = event
        if event is not None:
            event.record()

    @torch.no_grad()
    def _update(self, params: list[torch.Tensor], coef: float | None) -> None:
        """AdamW on the host for `params` (staged), then each parameter's new value copied back to the device."""
        for p in params:
            event = self._events.pop(p, None)
            if event is not None:
                event.synchronize()
        by_group: dict[int, list] = {}
        for p in params:
            by_group.setdefault(id(self._group[p]), []).append(p)
        for ps in by_group.values():
            group = self._group[ps[0]]
            grads = []
            for p in ps:
                g = self.staged[p]
                if coef is not None:
                    g.mul_(coef)  # as parallel.clip_grad_norm_ scales p.grad, in the gradient's dtype
                grads.append(g if g.dtype == torch.float32 else g.float())
            states = [self._state(p) for p in ps]
            beta1, beta2 = group["betas"]
            adamw([self.masters[p] for p in ps], grads, [s["exp_avg"] for s in states],
                  [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=False,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=False)
            for p in ps:
                master = self.masters[p]
                src = master if p.dtype == master.dtype else self.staged[p].copy_(master)  # cast on the host
                p.data.copy_(src, non_blocking=True)
                self.transfer_bytes += src.numel() * src.element_size()

    def _buckets(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """`params` cut in order into runs of about bucket_bytes (the copy back of one overlaps the next's math)."""
        out, size = [[]], 0
        for p in params:
            if out[-1] and size >= self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append(p)
            size += p.numel() * 4
        return [b for b in out if b]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, and the start of a step (train_step calls it first): nothing staged yet."""
        super().zero_grad(set_to_none)
        self.transfer_bytes, self._pending, self._seen = 0, [], set()

    @torch.no_grad()
    def stream(self, sync: parallel.GradSync, *, update: bool) -> None:
        """Inside `sync`'s context, after the step's last backward: wait for each launched bucket in order, copy
        its summed gradients (its flat buffer, what `sync` then copies into .grad) to the host and, when
        `update` (no clipping), update its parameters while later buckets are still being reduced. Buckets
        launched only at the context's exit are left to `finish`."""
        for b in sync.buckets:
            if b.work is None:
                continue
            b.work.wait()
            pairs, offset = [], 0
            for i in b.packed:
                p = sync.params[i]
                n = p.numel()
                if p in self.masters:
                    pairs.append((p, b.buf[offset:offset + n].view_as(p)))
                offset += n
            self._stage(pairs)
            if update:
                self._update(self._pending, None)
                self._pending = []

    @torch.no_grad()
    def finish(self, model, grid: parallel.Grid, grad_clip: float) -> torch.Tensor:
        """After the gradient sync: copy the gradients `stream` did not, take the global norm (of the unclipped
        device gradients, as the trainer does), then `step`, clipped to grad_clip (0: not clipped). Returns the
        norm before clipping, as train_step's other path does."""
        rest = [p for group in self.param_groups for p in group["params"]
                if p.grad is not None and p not in self._seen]
        for bucket in self._buckets(rest):
            self._stage([(p, p.grad) for p in bucket])
        norm = parallel.grad_norm(model, grid)
        if grad_clip > 0:
            c = grad_clip / (float(norm) + 1e-6)  # parallel.clip_grad_norm_'s coefficient and condition
            self._clip = c if c < 1.0 and math.isfinite(c) else None
        self.step()  # through torch's step wrapper: the LR scheduler sees the optimizer stepped
        return norm.float() if grad_clip > 0 else norm  # clip_grad_norm_'s float32, grad_norm's float64

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter not updated yet in this step, from its gradient as it is (staged now unless
        `stream` or `finish` did), bucket by bucket; scaled by `finish`'s clipping coefficient, if any."""
        if closure is not None:
            raise ValueError("OffloadAdamW.step(closure) is not supported: call it without a closure")
        rest = [p for group in self.param_groups for p in group["params"]
                if p.grad is not None and p not in self._seen]
        for bucket in self._buckets(rest):
            self._stage([(p, p.grad) for p in bucket])
        for bucket in self._buckets(self._pending):
            self._update(bucket, self._clip)
        self._pending, self._seen, self._clip = [], set(), None

    @torch.no_grad()
    def restore_params(self) -> None:
        """Give every parameter its fp32 master value, in fp32 (the end of training: evaluation then reads the
        weights the checkpoint holds, as after a non-offloaded run). The optimizer is not stepped after this."""
        for p, master in self.masters.items():
            p.data = master.to(p.device, copy=True)
