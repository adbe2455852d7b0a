"""The dry run's tensors: fake CPU tensors that read as a training step needs, and what autograd saves on them.

memtrain/plan/dryrun.py runs the trainer's own step on them; its module docstring says which values the step
reads and how the saved tensors give the activation bytes.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn

import parallel

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------------
# Fake tensors that read as the step needs.


class DryMode(torch._subclasses.fake_tensor.FakeTensorMode):
    """FakeTensorMode whose data-dependent reads return fixed values (see the module docstring)."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.dtype.is_floating_point else 1
        if func is aten.nonzero.default:
            t = args[0]
            return super().__torch_dispatch__(aten.empty.memory_format, types, ([t.numel(), t.dim()],),
                                              {"dtype": torch.long, "device": t.device})
        return super().__torch_dispatch__(func, types, args, kwargs)


def to_fake(module: nn.Module, mode: DryMode) -> None:
    """Every meta parameter and buffer becomes a fake CPU tensor of its shape and dtype, in place: tied
    parameters stay one, ShardSpec tags and the other attributes of a parameter are kept."""
    done: dict[int, torch.Tensor] = {}
    with mode:
        for m in module.modules():
            for table in (m._parameters, m._buffers):
                for name, t in list(table.items()):
                    if t is None or t.device.type != "meta":
                        continue
                    if id(t) not in done:
                        new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                        if isinstance(t, nn.Parameter):
                            new = nn.Parameter(new, requires_grad=t.requires_grad)
                            new.__dict__.update(t.__dict__)
                        done[id(t)] = new
                    table[name] = done[id(t)]


# ---------------------------------------------------------------------------------------------------
# Activation bytes: what autograd saves for backward.


def _storage(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st._cdata, st.nbytes()


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the layers transformers checkpoints one by one."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class SavedTensors:
    """Distinct storages autograd saves in the first micro-batch's forward of a step (parameters and buffers
    excluded), attributed to the block running, and each block's input.

    Installed around the trainer's own step: the hooks return the tensor itself, so nothing changes. Inside a
    checkpointed block torch's own hooks take precedence, so with recomputation the blocks' saved tensors are
    measured after the step, by running one block of each kind again with its recorded inputs (`block_saved`)."""

    def __init__(self, plm):
        self.plm = plm
        self.exclude = {_storage(t)[0] for t in [*plm.parameters(), *plm.buffers()]}
        self.bytes: dict[int, int] = {}
        self.block_of: dict[int, int | None] = {}
        self.keep: list = []  # saved tensors stay alive (their storage keys unique) until the measurement ends
        self.inputs: dict[int, tuple[int, int]] = {}  # block -> (storage, bytes) of its input
        self.calls: dict[tuple, tuple] = {}  # block kind -> (block, args, kwargs) of its first call
        self.block: int | None = None
        self.micro = -1
        self.blocks = _blocks(plm.model)
        self._hooks = []

    def install(self) -> None:
        """Count micro-batches and follow which block runs (module hooks), from the next forward on."""
        self._hooks.append(self.plm.model.base_model.register_forward_pre_hook(self._forward))
        for i, b in enumerate(self.blocks):
            self._hooks.append(b.register_forward_pre_hook(
                lambda mod, args, kwargs, i=i: self._enter(i, mod, args, kwargs), with_kwargs=True))
            self._hooks.append(b.register_forward_hook(lambda *a: self._leave()))

    def remove(self) -> None:
        """Take the module hooks off."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def hooks(self):
        """The saved-tensor hooks to run the step under."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def _forward(self, *a) -> None:
        self.micro += 1

    def _enter(self, i: int, mod: nn.Module, args, kwargs) -> None:
        if self.micro:
            return
        self.block = i
        hidden = args[0] if args else kwargs["hidden_states"]
        self.inputs.setdefault(i, _storage(hidden))
        self.keep.append(hidden)
        kind = (type(mod), tuple((n, tuple(p.shape), p.dtype) for n, p in mod.named_parameters()))
        self.calls.setdefault(kind, (mod, args, kwargs))

    def _leave(self) -> None:
        self.block = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Record a tensor autograd saves in the first micro-batch; keep it unchanged."""
        if self.micro == 0:
            key, nbytes = _storage(t)
            if key not in self.exclude and key not in self.bytes:
                self.bytes[key], self.block_of[key] = nbytes, self.block
                self.keep.append(t)
        return t

    def block_saved(self, amp) -> int:
        """The most bytes one block saves: each kind of block run again on its recorded inputs, recomputation
        off (as in its recomputation), ledger paused."""
        largest = 0
        enabled, parallel.LEDGER.enabled = parallel.LEDGER.enabled, False
        try:
            for mod, args, kwargs in self.calls.values():
                rec = SavedTensors.__new__(SavedTensors)
                rec.exclude, rec.bytes, rec.block_of, rec.keep, rec.block, rec.micro = self.exclude, {}, {}, [], 0, 0
                flag, mod.gradient_checkpointing = getattr(mod, "gradient_checkpointing", False), False
                ac = torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext()
                try:
                    with torch.enable_grad(), rec.hooks(), ac:
                        out = mod(*args, **kwargs)
                    del out
                finally:
                    mod.gradient_checkpointing = flag
                largest = max(largest, sum(rec.bytes.values()))
        finally:
            parallel.LEDGER.enabled = enabled
        return largest

    def summary(self, checkpointing: bool, amp) -> dict:
        """Bytes autograd keeps for one micro-batch at its peak: at the end of the forward, or with recomputation
        during the backward of a block (saved outside the blocks + every block's input + one block's own)."""
        per_block: Counter = Counter()
        outside = 0
        for key, n in self.bytes.items():
            if self.block_of[key] is None:
                outside += n
            else:
                per_block[self.block_of[key]] += n
        inputs = {key: n for key, n in self.inputs.values()}
        held_inputs = sum(n for key, n in inputs.items() if self.block_of.get(key, -1) is not None)
        out = {"saved_outside_blocks": outside, "blocks": len(self.inputs), "block_inputs": held_inputs}
        if checkpointing:
            out["largest_block"] = self.block_saved(amp)
            out["total"] = outside + held_inputs + out["largest_block"]
        else:
            out["largest_block"] = max(per_block.values(), default=0)
            out["total"] = sum(self.bytes.values())
        return out
