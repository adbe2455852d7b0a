"""`memtrain plan --validate`: one training step of one grid at full scale, run in this process, against cost.py.

The planner's figures (cost.py) are transcriptions of the engine's code paths. The dry run checks them by
running the code itself, as one representative rank of the real world size would:

- torch.distributed is started with the "fake" backend at the grid's world size (e.g. 4,096 ranks) and
  `parallel.init` builds the grid's process groups as on a cluster (only the groups holding this rank:
  `use_local_synchronization`, 15 at most). A fake collective records its arguments and moves nothing.
- The model is built on the meta device, parallelized as this rank (`memtrain.hf.parallelize`, device="meta":
  the shards' shapes, nothing allocated), then its tensors become fake CPU tensors (FakeTensorMode: shapes,
  dtypes and devices, no storage), so bf16 autocast applies exactly as on a CPU (autocast has no meta
  device) and nothing is computed.
- One optimizer step of the trainer's own `memtrain.training.train_step` (micro-batches under
  parallel.overlap, autocast, activation checkpointing, gradient sync, clipping, AdamW, the loss all-reduce)
  runs on the fake tensors; every collective goes through parallel.comm as in a real run and lands in
  parallel.LEDGER. Nothing in the engine or the trainer knows it is a dry run.

Fake tensors hold no values, so the few values the step reads are supplied: a scalar read (`.item()`,
`float()`, a Python `if` on a tensor) gives 1 (AdamW's step count after the first step, a gradient norm that
does not clip, a mask that holds), a boolean-mask index selects every element (an upper bound; it feeds only
local scatters). None of these decides which collective runs or how many bytes it moves.

Reported, each beside the planner's figure:
- the ledger of the step, record for record (op, axes, group size, payload bytes; cost.step_records), and
  its totals per (op, axes): exact, so any difference fails;
- per-rank parameter, gradient and AdamW bytes from the local shards and the optimizer's state after the
  step (cost.state_bytes): exact;
- activation bytes of one micro-batch, from saved-tensor hooks installed around the step's first micro-batch:
  the distinct tensors autograd keeps for backward (parameters and buffers excluded). With activation
  checkpointing, what is kept at the peak of backward: everything saved outside the blocks, every block's
  input (the checkpoint keeps it) and the largest block's saved tensors (live again while it is recomputed;
  measured after the step by running one block of each kind again on its recorded inputs, recomputation off).
  cost.activation_bytes is an estimate (no temporaries, no allocator): reported as a ratio, never "equal".
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

import parallel
from memtrain.plan import cost
from memtrain.plan.network import GB, Network
from memtrain.plan.search import PlanConfig, load_config, plan, resolve_mode
from parallel.comm import Record, totals

aten = torch.ops.aten
MEMORY_KEYS = ("params", "grads", "optimizer")


@dataclass
class Check:
    """One figure: the planner's, the dry run's, and whether the planner's is exact (must be equal)."""

    what: str
    planner: float
    measured: float
    exact: bool = True

    @property
    def ok(self) -> bool:
        return not self.exact or self.planner == self.measured

    @property
    def ratio(self) -> float | None:
        return self.measured / self.planner if self.planner else None


@dataclass
class DryRun:
    model: str
    grid: tuple[int, int, int, int]
    """(data, x, y, z)."""
    rank: int
    mode: str
    batch: int
    seq: int
    micro_batch: int
    micro_batches: int
    precision: str
    checkpointing: bool
    options: dict
    """The trainer's step options the dry run passed (overlap, grad_sync)."""
    measured: Counter = field(repr=False)
    """The ledger of the step: Record -> times issued."""
    predicted: Counter = field(repr=False)
    """cost.step_records."""
    memory: list[Check] = field(default_factory=list)
    activations: dict = field(default_factory=dict)
    """The saved-tensor measurement's parts (bytes)."""
    seconds: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        d, x, y, z = self.grid
        return d * x * y * z

    def collectives(self) -> list[Check]:
        """Count and payload bytes per (op, axes), planner vs dry run (exact)."""
        keys = sorted({(r.op, r.axes) for r in self.measured} | {(r.op, r.axes) for r in self.predicted})
        count = lambda recs, k: sum(n for r, n in recs.items() if (r.op, r.axes) == k)  # noqa: E731
        want, got = totals(self.predicted), totals(self.measured)
        out = []
        for k in keys:
            out.append(Check(f"{k[0]} {k[1]} count", count(self.predicted, k), count(self.measured, k)))
            out.append(Check(f"{k[0]} {k[1]} bytes", want.get(k, 0), got.get(k, 0)))
        return out

    def record_differences(self) -> tuple[Counter, Counter]:
        """(records the dry run issued beyond the prediction, predicted records it did not issue)."""
        return self.measured - self.predicted, self.predicted - self.measured

    def checks(self) -> list[Check]:
        return self.memory + self.collectives()

    @property
    def ok(self) -> bool:
        extra, missing = self.record_differences()
        return not extra and not missing and all(c.ok for c in self.checks())


# ---------------------------------------------------------------------------------------------------
# Fake tensors that read as the step needs.


class _DryMode(torch._subclasses.fake_tensor.FakeTensorMode):
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


def _to_fake(module: nn.Module, mode: _DryMode) -> None:
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


class _SavedTensors:
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
        self._hooks.append(self.plm.model.base_model.register_forward_pre_hook(self._forward))
        for i, b in enumerate(self.blocks):
            self._hooks.append(b.register_forward_pre_hook(
                lambda mod, args, kwargs, i=i: self._enter(i, mod, args, kwargs), with_kwargs=True))
            self._hooks.append(b.register_forward_hook(lambda *a: self._leave()))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def hooks(self):
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
                rec = _SavedTensors.__new__(_SavedTensors)
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


# ---------------------------------------------------------------------------------------------------
# The run.


MODELLED_GRAD_SYNC = "blocking"
"""The gradient sync the dry run validates by default: the one cost.step_records transcribes (sync_gradients, one
flat all-reduce per set of reduce axes). The trainer's default, the overlapped sync, moves the same bytes in
buckets the planner does not cut."""


def _checked(cfg: PlanConfig, grid: tuple[int, ...]):
    """(config, mode, shape) of cfg's model; ValueError when the grid cannot run it (cost.check's rules)."""
    config = load_config(cfg.model)
    mode, shape = resolve_mode(config, cfg.mode), cost.shape_of(config)
    why = cost.check(shape, parallel.Grid(*grid), mode, cfg.batch, cfg.micro_batch)
    if why:
        raise ValueError(f"grid data={grid[0]} x={grid[1]} y={grid[2]} z={grid[3]} cannot run {cfg.model}: {why}")
    return config, mode, shape


def choose_micro(cfg: PlanConfig, grid: tuple[int, ...], net: Network | None) -> int:
    """The micro-batch of this grid: cfg.micro_batch, else the planner's (largest that fits), else all rows."""
    _, mode, _ = _checked(cfg, grid)
    if cfg.micro_batch:
        return cfg.micro_batch
    g = parallel.Grid(*grid)
    if net is not None:
        plans, _ = plan(PlanConfig(**dict(asdict(cfg), gpus=g.world_size)), net)
        for p in plans:
            if p.grid == tuple(grid):
                return p.micro_batch
    return cfg.batch // cost.rows_split(g, mode)


def dry_run(cfg: PlanConfig, grid: tuple[int, int, int, int], *, rank: int = 0, overlap: bool = True,
            grad_sync: str | None = None, steps: int = 1) -> DryRun:
    """One optimizer step of `cfg` on `grid` (data, x, y, z) as rank `rank` of a fake world; see the module
    docstring. cfg.micro_batch must be set (choose_micro); grad_sync None is MODELLED_GRAD_SYNC. `steps` > 1
    runs that many steps and measures the last (bucket orders observed in a first step take effect from the
    second)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memtrain.config import RunConfig
    from memtrain.hf import parallelize
    from memtrain.models import build_model
    from memtrain.training import build_optimizer, train_step

    if dist.is_initialized():
        raise RuntimeError("the dry run starts its own fake process group: torch.distributed is already running")
    world = math.prod(grid)
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank} is outside a grid of {world} ranks")
    if cfg.batch is None or cfg.micro_batch is None:
        raise ValueError("dry_run needs cfg.batch and cfg.micro_batch (see choose_micro)")
    if cfg.param_bytes != 4:
        raise ValueError(f"param_bytes={cfg.param_bytes}: the trainer keeps fp32 parameters (4 bytes)")
    seconds = {}
    t0 = time.perf_counter()
    _, mode, shape = _checked(cfg, grid)
    amp = torch.bfloat16 if cfg.precision == "bf16" else None
    step_kw = {"overlap": overlap, "grad_sync": grad_sync or MODELLED_GRAD_SYNC}

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        t = time.perf_counter()
        g = parallel.init(*grid)
        seconds["grid"] = time.perf_counter() - t
        t = time.perf_counter()
        model = build_model(cfg.model, device="meta")  # a local directory: its config (weights stay on disk)
        plm = parallelize(model, g, mode, device="meta")
        if cfg.activation_checkpointing:
            plm.enable_activation_checkpointing()
        plm.train()
        fake = _DryMode()
        _to_fake(plm, fake)
        seconds["model"] = time.perf_counter() - t
        with fake:
            opt = build_optimizer(plm, RunConfig())
            ids = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long)
            keep = torch.ones(cfg.batch, cfg.seq, dtype=torch.bool)
            saved = _SavedTensors(plm)
            t = time.perf_counter()
            for i in range(steps):
                parallel.LEDGER.reset()
                last = i == steps - 1
                if last:
                    saved.install()
                try:
                    with saved.hooks() if last else contextlib.nullcontext():
                        train_step(plm, g, opt, ids, ids, keep, cfg.micro_batch, amp=amp, **step_kw)
                finally:
                    saved.remove()
            measured = Counter(parallel.LEDGER.records)
            parallel.LEDGER.reset()
            seconds["step"] = (time.perf_counter() - t) / steps
            nbytes = lambda ts: sum(x.numel() * x.element_size() for x in ts)  # noqa: E731
            params = parallel.unique_parameters(plm)
            state = [x for st in opt.state.values() for x in st.values() if torch.is_tensor(x)]
            got = {"params": nbytes(params), "grads": nbytes(p.grad for p in params if p.grad is not None),
                   "optimizer": nbytes(state)}
            t = time.perf_counter()
            act = saved.summary(cfg.activation_checkpointing, amp)
            seconds["activations"] = time.perf_counter() - t
    finally:
        parallel.shutdown()
    g = parallel.Grid(*grid, rank=rank)
    kw = dict(precision=cfg.precision, param_bytes=cfg.param_bytes)
    predicted = cost.step_records(shape, g, mode, cfg.batch, cfg.seq, cfg.micro_batch,
                                  checkpointing=cfg.activation_checkpointing, **kw)
    want = cost.state_bytes(shape, g, mode, cfg.param_bytes)
    memory = [Check(k, want[k], got[k]) for k in MEMORY_KEYS]
    est = cost.activation_bytes(shape, g, mode, cfg.micro_batch * cfg.seq,
                                checkpointing=cfg.activation_checkpointing, **kw)
    memory.append(Check("activations", est, act["total"], exact=False))
    seconds["total"] = time.perf_counter() - t0
    local = cfg.batch // cost.rows_split(g, mode)
    return DryRun(cfg.model, tuple(grid), rank, mode, cfg.batch, cfg.seq, cfg.micro_batch, local // cfg.micro_batch,
                  cfg.precision, cfg.activation_checkpointing, {"overlap": overlap, **step_kw, "steps": steps},
                  measured, predicted, memory, act, seconds)


# ---------------------------------------------------------------------------------------------------
# Output.


def _gb(n: float) -> str:
    return f"{n / GB:.4g}"


def table(run: DryRun) -> str:
    """The comparison: per-rank bytes, then per (op, axes) count and payload bytes; planner, dry run, check."""
    head = f"{'':<34} {'planner':>16} {'dry run':>16}  check"
    lines = ["per-rank memory (bytes)", head]
    for c in run.memory:
        verdict = ("equal" if c.ok else "DIFFERENT") if c.exact else f"ratio {c.ratio:.3f} (estimate)"
        lines.append(f"{c.what:<34} {int(c.planner):>16,} {int(c.measured):>16,}  {verdict}")
    lines += ["", "collectives of one step: count and payload bytes per op x axes", head]
    for c in run.collectives():
        lines.append(f"{c.what:<34} {int(c.planner):>16,} {int(c.measured):>16,}  {'equal' if c.ok else 'DIFFERENT'}")
    extra, missing = run.record_differences()
    n = sum(run.measured.values())
    if extra or missing:
        lines.append(f"records: {sum(extra.values())} issued but not predicted, {sum(missing.values())} predicted "
                     f"but not issued (of {n}):")
        for tag, recs in (("+ issued", extra), ("- predicted", missing)):
            for r, k in sorted(recs.items(), key=lambda kv: (kv[0].op, kv[0].axes, kv[0].nbytes))[:8]:
                lines.append(f"  {tag:<11} {k:>6} x {r.op} {r.axes} (group {r.group_size}) {r.nbytes:,} bytes")
    else:
        lines.append(f"records: all {n:,} equal to the planner's, record for record "
                     f"({len(run.measured)} distinct)")
    return "\n".join(lines)


def header(run: DryRun) -> str:
    d, x, y, z = run.grid
    opts = ", ".join(f"{k}={v}" for k, v in run.options.items())
    return (f"dry run: {run.model}, {run.mode} mode, grid data={d} x={x} y={y} z={z} ({run.world_size:,} ranks, "
            f"fake process group, rank {run.rank}); batch {run.batch} x {run.seq} tokens, micro-batch "
            f"{run.micro_batch} x {run.micro_batches}, {run.precision}"
            f"{', activation checkpointing' if run.checkpointing else ''}; {opts}")


def to_json(run: DryRun) -> dict:
    rec = lambda r, n: {"op": r.op, "axes": r.axes, "group_size": r.group_size, "nbytes": r.nbytes, "count": n}  # noqa: E731
    extra, missing = run.record_differences()
    return {
        "model": run.model, "grid": dict(zip(("data", "x", "y", "z"), run.grid)), "world_size": run.world_size,
        "rank": run.rank, "mode": run.mode, "batch": run.batch, "seq": run.seq, "micro_batch": run.micro_batch,
        "micro_batches": run.micro_batches, "precision": run.precision, "activation_checkpointing": run.checkpointing,
        "options": run.options, "ok": run.ok,
        "memory": [dict(asdict(c), ok=c.ok, ratio=c.ratio) for c in run.memory],
        "activations": run.activations,
        "collectives": [dict(asdict(c), ok=c.ok) for c in run.collectives()],
        "records": {"measured": [rec(r, n) for r, n in run.measured.items()],
                    "issued_not_predicted": [rec(r, n) for r, n in extra.items()],
                    "predicted_not_issued": [rec(r, n) for r, n in missing.items()]},
        "seconds": run.seconds,
    }


__all__ = ["Check", "DryRun", "Record", "MODELLED_GRAD_SYNC", "choose_micro", "dry_run", "header", "table", "to_json"]
