"""One forward of a model on the meta device, where nothing is allocated or computed, to see what its code does
with the layers the engine replaces: which Linear layers it calls as layers (Mamba reads its time-step projection as
a matrix, `dt_proj.weight @ x`, which the engine holds as a flat shard), and which ops it applies to the LM head's
output (a soft-cap or a scale the engine's vocabulary-parallel loss must carry or refuse).

The forward runs on a weightless copy, in eval mode (no layer dropped at random) and on a forked generator. A meta
kernel may be stricter than the real one (torch's grouped GEMM of MoE experts takes bf16 only), so a failed
forward is tried again in bf16; one that fails in both tells nothing. A path taken only on a GPU or with kernels
installed (Mamba's fused CUDA kernels read more weights as matrices) is not the one probed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

KEEPS_LOGITS = {"__getitem__", "float", "to", "type", "contiguous", "view", "reshape", "detach", "clone"}
"""Ops on the LM head's output that leave its values as they are."""


@dataclass
class Seen:
    called: set[str]
    """The layers of those asked about that the forward called as layers (all of them when the forward failed)."""
    after_head: list[str] | None
    """The ops applied to the LM head's output and what was computed from it, in order; None when it failed."""


def meta_forward(model, layers: list[str], head: str) -> Seen:
    """What one forward of `model` does with its `layers` and with the output of `head` (module names)."""
    for dtype in (None, torch.bfloat16):
        called: set[str] = set()
        after = _AfterHead()
        try:
            probe = _meta_copy(model, dtype).eval()
            for name in layers:
                probe.get_submodule(name).register_forward_pre_hook(lambda mod, args, n=name, seen=called: seen.add(n))
            probe.get_submodule(head).register_forward_hook(lambda mod, args, out, seen=after: seen.follow(out))
            with torch.no_grad(), torch.random.fork_rng(devices=[]), after:
                probe(input_ids=torch.zeros(1, 8, dtype=torch.long, device="meta"))
            return Seen(called, after.ops)
        except Exception:  # noqa: BLE001 - a kernel without a meta implementation, a data-dependent branch...
            continue
    return Seen(set(layers), None)


class _AfterHead(TorchFunctionMode):
    """Records every op whose input descends from a followed tensor (the head's output), and follows its output."""

    def __init__(self):
        super().__init__()
        self.followed: dict[int, torch.Tensor] = {}  # by id, holding the tensor so that no id is reused
        self.ops: list[str] = []

    def follow(self, out) -> None:
        for t in _tensors(out):
            self.followed[id(t)] = t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        descends = any(id(t) in self.followed for t in _tensors((args, kwargs)))
        if descends and _tensors(out):  # not .shape, .size() ...
            self.ops.append(getattr(func, "__name__", str(func)))
            self.follow(out)
        return out


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (a model output is a dict)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors(x)]
    return []


def _meta_copy(model, dtype: torch.dtype | None):
    """The model as built and changed since, on the meta device (floating tensors in `dtype` if given): no weight
    is copied."""
    def meta(t):
        return torch.empty_like(t, device="meta", dtype=dtype if dtype and t.is_floating_point() else t.dtype)

    memo = {id(t): nn.Parameter(meta(t), t.requires_grad) if isinstance(t, nn.Parameter) else meta(t)
            for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)
