"""One forward of a model on the meta device, where nothing is allocated or computed, to see what its code does
with the layers the engine replaces: which Linear layers it calls as layers (Mamba reads its time-step projection as
a matrix, `dt_proj.weight @ x`, which the engine holds as a flat shard), and which ops it applies between the base
model's hidden states and the logits (a soft-cap or a scale the engine's vocabulary-parallel loss, which reads the
hidden states, must carry or refuse).

The forward runs on a weightless copy, in eval mode (no layer dropped at random) and on a forked generator. A meta
kernel may be stricter than the real one (torch's grouped GEMM of MoE experts takes bf16 only) and a model's cache
code may want attention layers, so a failed forward is tried again in bf16, then without a cache; one that fails in
all tells nothing. A path taken only on a GPU or with kernels installed (Mamba's fused CUDA kernels read more
weights as matrices) is not the one probed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name

KEEPS_LOGITS = {"__getitem__", "float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "view",
                "view_as", "reshape", "reshape_as", "flatten", "squeeze", "unsqueeze", "detach", "clone",
                "requires_grad_", "data.__get__"}
"""Ops on the hidden states or the logits that leave their values as they are (a slice of rows: logits_to_keep)."""

ATTEMPTS = ((None, {}), (torch.bfloat16, {}), (None, {"use_cache": False}))
"""(dtype of the copy's floating tensors, forward arguments) of each try, in order."""


@dataclass
class Seen:
    called: set[str]
    """The layers of those asked about that the forward called as layers (all of them when the forward failed)."""
    around_head: list[str] | None
    """The ops applied to the base model's hidden states before the LM head and to its output after, in order; None
    when the forward failed or never called the head."""


def meta_forward(model, layers: list[str], head: str) -> Seen:
    """What one forward of `model` does with its `layers` and around `head` (module names)."""
    for dtype, kwargs in ATTEMPTS:
        called: set[str] = set()
        around = _AroundHead()
        try:
            probe = _meta_copy(model, dtype).eval()
            for name in layers:
                probe.get_submodule(name).register_forward_pre_hook(lambda mod, args, n=name, seen=called: seen.add(n))
            probe.base_model.register_forward_hook(lambda mod, args, out, seen=around: seen.follow(out[0]))
            probe.get_submodule(head).register_forward_pre_hook(lambda mod, args, seen=around: seen.pause())
            probe.get_submodule(head).register_forward_hook(lambda mod, args, out, seen=around: seen.follow(out))
            with torch.no_grad(), torch.random.fork_rng(devices=[]), around:
                probe(input_ids=torch.zeros(1, 8, dtype=torch.long, device="meta"), **kwargs)
            return Seen(called, around.ops if around.head_called else None)
        except Exception:  # noqa: BLE001 - a kernel without a meta implementation, a data-dependent branch...
            continue
    return Seen(set(layers), None)


class _AroundHead(TorchFunctionMode):
    """Records every op on a followed tensor (the base model's hidden states, then the head's output) or on what was
    computed from one, and follows its output; the head's own ops are not recorded."""

    def __init__(self):
        super().__init__()
        self.followed: dict[int, torch.Tensor] = {}  # by id, holding the tensor so that no id is reused
        self.ops: list[str] = []
        self.paused = self.head_called = False

    def follow(self, out) -> None:
        self.paused = False
        for t in _tensors(out):
            self.followed[id(t)] = t

    def pause(self) -> None:
        self.paused = self.head_called = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused or not any(id(t) in self.followed for t in _tensors((args, kwargs))):
            return out
        name = resolve_name(func) or getattr(func, "__name__", repr(func))
        name = name.removeprefix("torch.Tensor.").removeprefix("torch.nn.functional.").removeprefix("torch.")
        in_place = name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))  # returns no tensor
        if _tensors(out) or in_place:  # not .shape, .size() ...
            if name == "__getitem__" and out.dim() and args[0].dim() and out.shape[-1] != args[0].shape[-1]:
                name = "a slice of the last dimension"  # fewer logits: another softmax (rows only: logits_to_keep)
            self.ops.append(name)
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
