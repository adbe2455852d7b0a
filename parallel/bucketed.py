"""Gradient all-reduce overlapped with backward: buckets launched as their gradients become final.

    sync = parallel.grad_sync(model, grid)       # built once per model: hooks on its parameters
    with sync:                                    # armed: the synced backward inside launches all-reduces
        for batch in micro_batches[:-1]:
            with parallel.no_sync():              # gradient accumulation: nothing launches
                loss(batch).backward()
        loss(micro_batches[-1]).backward()        # buckets launch while backward goes on
    optimizer.step()                              # on exit: the rest launched, all waited, sums in .grad

The result is the blocking path's (`sync_gradients`, still there): every gradient summed over the live axes of
its ShardSpec's reduce axes. What changes is when the bytes move and how they are cut into messages.

Buckets, as torch DDP's reducer cuts them: parameters grouped by (live reduce axes, dtype), each group in the
order its gradients are expected to become final - reverse registration at first, then the order observed in
the first synced backward - and cut when a bucket reaches `first_bucket_bytes` (a group's first bucket) or
`bucket_bytes`. A parameter's
post-accumulate-grad hook marks it ready when it fires in an armed, synced backward with its gradient
present; a bucket whose parameters are all ready is copied into its flat buffer and its all-reduce launched
async, strictly in bucket order within its group, so every rank issues the same collectives in the same order.
`finish` (the context's exit) launches the buckets still waiting, waits for all and copies the sums back.

Every rank must cut the same buckets and launch them at the same points of backward. Both follow from the
order autograd runs the same graph in, which is the same on every rank (the engine relies on it already:
ORS issues its reduce-scatters, and the prefetcher its all-gathers, in that order, recorded per rank). Unlike
torch DDP, the observed order is therefore not broadcast from rank 0: no collective beyond the buckets'
all-reduces, so a model whose groups each fit in one bucket sends exactly the blocking path's messages.

Never ready during backward, so their buckets launch at `finish`:
- weight shards whose Z reduce-scatter ORS defers (`parallel.overlap(reduce_scatter=True)`, z > 1): their
  `.grad` is completed only when the overlap context exits, yet their hook fires in backward (with no `.grad`,
  or the previous micro-batches' sum). A parameter with a deferred reduce-scatter pending is not counted;
- parameters that get no gradient in a step: a bucket is packed with the gradients present, as the blocking
  path skips a parameter without one (every rank must agree on which, in both paths).
A tied weight (one Parameter under two names) is one parameter: autograd sums both uses into its
accumulation, which runs its post-accumulate-grad hook once per backward.

Summation order: a ring all-reduce adds the ranks' contributions in an order that depends on an element's
offset in its message, so bucket boundaries other than the blocking path's single flat message can change
the last bit of a sum over 3+ ranks (two ranks: a + b is commutative, bitwise). tests/parallel/
test_grad_sync.py measures it.
"""

from __future__ import annotations

import torch

from . import comm, grads
from .grid import Grid
from .overlap import finish_pending
from .overlap import state as overlap_state
from .sharding import spec_of, unique_parameters

FIRST_BUCKET_BYTES = 2**20  # torch DDP's defaults: a small first bucket starts communication early
BUCKET_BYTES = 25 * 2**20


GRAD_SYNCS = ("overlap", "blocking")
"""How a step reduces gradients over the grid: 'overlap', this module's buckets launched during backward;
'blocking', grads.sync_gradients after it. Same sums up to the last bits."""


def cut_buckets(entries, first_bucket_bytes: float, bucket_bytes: float) -> dict:
    """The cut rule (shared with the planner, memtrain/plan/cost.py): `entries` are (group key, item, bytes) in
    the order their gradients become final; each group's items are cut into buckets, one closed once it holds
    `first_bucket_bytes` (the group's first) or `bucket_bytes` (the next ones). Returns key -> [[item, ...], ...]."""
    groups: dict = {}
    size: dict = {}
    for key, item, nbytes in entries:
        cuts = groups.setdefault(key, [[]])
        cap = first_bucket_bytes if len(cuts) == 1 else bucket_bytes
        if cuts[-1] and size[key] >= cap:
            cuts.append([])
            size[key] = 0
        cuts[-1].append(item)
        size[key] = size.get(key, 0) + nbytes
    return groups


class _Bucket:
    __slots__ = ("axes", "dtype", "index", "ready", "packed", "work", "buf")

    def __init__(self, axes, dtype, index: list[int]):
        self.axes, self.dtype, self.index = axes, dtype, index
        self.ready, self.packed, self.work, self.buf = 0, [], None, None


class GradSync:
    """Bucketed all-reduce of a model's gradients, launched from backward; see the module docstring."""

    def __init__(self, model_or_params, grid: Grid, *, first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 bucket_bytes: int = BUCKET_BYTES, rebuild: bool = True):
        self.grid, self.first_bucket_bytes, self.bucket_bytes = grid, first_bucket_bytes, bucket_bytes
        synced = _synced(model_or_params, grid)
        self.params, self.axes = [p for p, _ in synced], [axes for _, axes in synced]
        self._pos = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        self.rebuild, self._replan_pending = rebuild, rebuild
        self.plan(range(len(self.params) - 1, -1, -1))
        self._armed = False
        self._reset()

    def plan(self, order) -> None:
        """Cut the parameters, in `order` (indices into .params), into buckets; every rank must pass the same."""
        groups = cut_buckets((((self.axes[i], self.params[i].dtype), i,
                               self.params[i].numel() * self.params[i].element_size()) for i in order),
                             self.first_bucket_bytes, self.bucket_bytes)
        self.queues = {key: [_Bucket(*key, idx) for idx in cuts] for key, cuts in groups.items()}
        self.buckets = [b for q in self.queues.values() for b in q]
        self._bucket_of = [None] * len(self.params)
        for b in self.buckets:
            for i in b.index:
                self._bucket_of[i] = b

    def matches(self, model_or_params, grid: Grid) -> bool:
        """Whether this sync still covers exactly these parameters on this grid."""
        return grid is self.grid and [id(p) for p, _ in _synced(model_or_params, grid)] == [id(p) for p in self.params]

    def remove(self) -> None:
        """Detach the hooks (a model rebuilt with other parameters or another grid gets a new GradSync)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ----------------------------------------------------------------------------------------- one step

    def start(self) -> None:
        """Arm: from now on, a synced backward launches each bucket's all-reduce once its gradients are final."""
        if self._armed:
            raise RuntimeError("parallel.grad_sync: start() twice without finish()")
        self._armed = True

    def __enter__(self) -> GradSync:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:  # no new collectives on an error path; buffers still in flight are never reused
            for b in self.buckets:
                if b.work is not None:
                    b.buf = None
            self._reset()

    def _reset(self) -> None:
        self._armed = False
        self._fired = [False] * len(self.params)
        self._order: list[int] = []
        self._next = dict.fromkeys(self.queues, 0)
        for b in self.buckets:
            b.ready, b.packed, b.work = 0, [], None

    def _hook(self, p: torch.Tensor) -> None:
        if not self._armed or not grads.sync_enabled():
            return
        i = self._pos[id(p)]
        if self._fired[i]:
            raise RuntimeError("parallel.grad_sync: a parameter's gradient was accumulated twice in one synced step "
                               "(its bucket may already be summed): run every backward but the last of a step "
                               "under parallel.no_sync()")
        self._fired[i] = True
        if p.grad is None or self._deferred(p):
            return
        self._order.append(i)
        b = self._bucket_of[i]
        b.ready += 1
        if b.ready == len(b.index):
            key = (b.axes, b.dtype)
            q, k = self.queues[key], self._next[key]
            while k < len(q) and q[k].ready == len(q[k].index):
                self._launch(q[k])
                k += 1
            self._next[key] = k

    @staticmethod
    def _deferred(p: torch.Tensor) -> bool:
        """Whether an ORS reduce-scatter into p.grad is pending (its .grad is completed at the overlap exit)."""
        st = overlap_state()
        return st is not None and id(p) in st.deferred

    @torch.no_grad()
    def _launch(self, b: _Bucket) -> None:
        b.packed = [i for i in b.index if self.params[i].grad is not None]
        if not b.packed:
            return
        gs = [self.params[i].grad for i in b.packed]
        if b.buf is None:
            p0 = self.params[b.index[0]]
            b.buf = torch.empty(sum(self.params[i].numel() for i in b.index), dtype=b.dtype, device=p0.device)
        flat = b.buf[:sum(g.numel() for g in gs)]
        torch.cat([g.reshape(-1) for g in gs], out=flat)
        b.work = comm.all_reduce(flat, self.grid, b.axes, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the buckets still waiting, wait for every bucket and copy the sums into .grad; disarm.

        Under `parallel.no_sync()` with nothing launched yet, it only disarms (the gradients stay local)."""
        if not self._armed:
            return
        try:
            if not grads.sync_enabled() and not any(b.work for b in self.buckets):
                return
            finish_pending()  # called inside an overlap context: complete its deferred gradients first
            for key, q in self.queues.items():
                for b in q[self._next[key]:]:
                    self._launch(b)
            for b in self.buckets:
                if b.work is None:
                    continue
                b.work.wait()
                offset = 0
                for i in b.packed:
                    g = self.params[i].grad
                    g.copy_(b.buf[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
            if self._replan_pending:
                self._replan_pending = False
                self._replan()
        finally:
            self._reset()

    def _replan(self) -> None:
        """Re-cut the buckets in the order gradients became ready in this step (the same on every rank: see the
        module docstring); the parameters that were not ready (deferred, unused) go last."""
        seen = set(self._order)
        self.plan(self._order + [i for i in range(len(self.params) - 1, -1, -1) if i not in seen])


def _synced(model_or_params, grid: Grid) -> list[tuple[torch.nn.Parameter, tuple[str, ...]]]:
    """(parameter, its live reduce axes) of every trainable parameter some axis of `grid` sums."""
    out = []
    for p in unique_parameters(model_or_params):
        axes = tuple(a for a in spec_of(p).reduce_axes if grid.size(a) > 1)
        if p.requires_grad and axes:
            out.append((p, axes))
    return out


def grad_sync(model: torch.nn.Module, grid: Grid, **buckets) -> GradSync:
    """The model's GradSync on `grid`, built on first use and kept on the model (hooks are registered once).

    `buckets` (first_bucket_bytes, bucket_bytes, rebuild) rebuild it when they differ from the kept one's;
    without them the kept one is returned as it is. A model whose parameters or grid changed gets a new one."""
    sync = getattr(model, "_mt_grad_sync", None)
    if sync is None or not sync.matches(model, grid) or any(getattr(sync, k) != v for k, v in buckets.items()):
        if sync is not None:
            sync.remove()
        sync = GradSync(model, grid, **buckets)
        model._mt_grad_sync = sync
    return sync
