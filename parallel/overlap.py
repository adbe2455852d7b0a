"""Communication/computation overlap: the OAR, ORS and OAG switches of AxoNN.

    with parallel.overlap(model, all_reduce=True, reduce_scatter=True, all_gather=True):
        loss = model(batch).sum(); loss.backward()
    optimizer.step()   # outside: weight gradients land in .grad when the context exits

- OAR: the backward input-gradient reduction (over the layer's in-feature axis) runs async while the
  weight-gradient matmul computes.
- ORS: weight-gradient reduce-scatters over Z run async; their results are added to `.grad` when the
  context exits, so `.grad` is incomplete inside it.
- OAG: a layer's Z all-gather of its weight is issued while the layer before it computes. The order
  is the one recorded during the previous pass (forward and backward separately), never the module
  registration order; a layer that was not prefetched simply gathers synchronously.
  Each gather moves the dtype the same position asked for in the previous pass (the matmul dtype under
  autocast, linear.py), checked when the layer takes it: the autocast state at issue time does not tell.
  The first forward gather is issued when this context opens, usually outside autocast; backward runs
  outside autocast while its matmuls keep the forward's dtype. (Activation-checkpointing recomputation
  replays the forward's autocast state, and its takes are forward positions of the same pass.)
  A gather in another dtype than the one taken is waited for and the layer gathers synchronously.
All three change only when communication happens, never what is computed, so results are identical.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


class Prefetcher:
    """Per-model record of the order (layer, gather dtype) layers gathered their weights, and the gathers
    in flight."""

    def __init__(self):
        self.order: dict[str, list] = {"fwd": [], "bwd": []}
        self.seen: dict[str, list] = {"fwd": [], "bwd": []}
        self.inflight: dict[tuple[str, int], tuple] = {}

    def begin(self) -> None:
        self.seen = {"fwd": [], "bwd": []}
        self._issue("fwd", 0)

    def _issue(self, phase: str, pos: int) -> None:
        order = self.order[phase]
        if pos < len(order):
            layer, dtype = order[pos]
            self.inflight[(phase, pos)] = (layer, dtype, *layer.gather_weight_async(dtype))

    def take(self, layer, phase: str, dtype: torch.dtype) -> torch.Tensor:
        pos = len(self.seen[phase])
        self.seen[phase].append((layer, dtype))
        hit = self.inflight.pop((phase, pos), None)
        self._issue(phase, pos + 1)
        if hit is not None and hit[0] is layer and hit[1] == dtype:
            _, _, flat, work = hit
            work.wait()
            return layer.view_gathered(flat)
        if hit is not None:
            hit[3].wait()
        return layer.gather_weight(dtype)

    def end(self) -> None:
        for *_, work in self.inflight.values():
            work.wait()
        self.inflight.clear()
        for phase in ("fwd", "bwd"):
            if self.seen[phase]:
                self.order[phase] = self.seen[phase]


@dataclass
class OverlapState:
    all_reduce: bool = False
    reduce_scatter: bool = False
    all_gather: bool = False
    prefetcher: Prefetcher | None = None
    pending: list = field(default_factory=list)  # (param, grad shard, work)
    deferred: set = field(default_factory=set)  # id() of the params in pending (the bucketed sync asks)

    def defer_grad(self, param: torch.nn.Parameter, grad: torch.Tensor, work) -> None:
        self.pending.append((param, grad, work))
        self.deferred.add(id(param))

    def finish(self) -> None:
        for param, grad, work in self.pending:
            work.wait()
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self.pending.clear()
        self.deferred.clear()


_STATE: OverlapState | None = None


def state() -> OverlapState | None:
    return _STATE


@contextmanager
def overlap(model: torch.nn.Module, *, all_reduce: bool = True, reduce_scatter: bool = True,
            all_gather: bool = True):
    global _STATE
    if _STATE is not None:
        raise RuntimeError("parallel.overlap() contexts do not nest")
    prefetcher = None
    if all_gather:
        prefetcher = getattr(model, "_mt_prefetcher", None)
        if prefetcher is None:
            prefetcher = Prefetcher()
            model._mt_prefetcher = prefetcher
        prefetcher.begin()
    _STATE = OverlapState(all_reduce, reduce_scatter, all_gather, prefetcher)
    try:
        yield _STATE
    finally:
        st, _STATE = _STATE, None
        st.finish()
        if prefetcher is not None:
            prefetcher.end()


def finish_pending() -> None:
    """Complete deferred work now (used by code that needs `.grad` inside the context)."""
    if _STATE is not None:
        _STATE.finish()

