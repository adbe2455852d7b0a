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
  parallel.LEDGER. Nothing in the engine or the trainer knows it is a dry run. The gradient sync is the
  trainer's default unless told: parallel.GradSync's buckets, launched during the last backward.
- fake.py holds the fake tensors and the saved-tensor measurement below.

Fake tensors hold no values, so the few values the step reads are supplied: a scalar read (`.item()`,
`float()`, a Python `if` on a tensor) gives 1 (AdamW's step count after the first step, a gradient norm that
does not clip, a mask that holds), a boolean-mask index selects every element (an upper bound; it feeds only
local scatters). None of these decides which collective runs or how many bytes it moves.

Reported, each beside the planner's figure:
- the ledger of the step, record for record (op, axes, group size, payload bytes; cost.step_records), and
  its totals per (op, axes): exact, so any difference fails. The gradient all-reduces are among them, one
  record per bucket (cost.gradient_buckets: as many messages, each of the same bytes, as GradSync cuts);
- per-rank parameter, gradient and AdamW bytes from the local shards and the optimizer's state after the
  step, and the flat buffers of the buckets the overlapped gradient sync launched in it (cost.state_bytes): exact;
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

import parallel
from memtrain.config import RunConfig
from memtrain.plan import cost
from memtrain.plan.fake import DryMode, SavedTensors, to_fake
from memtrain.plan.network import Network
from memtrain.plan.search import PlanConfig, load_config, plan, resolve_mode
from parallel.comm import Record, totals

MEMORY_KEYS = ("params", "grads", "optimizer", "grad_buckets")


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
    gradients: dict[str, list[int]]
    """cost.gradient_buckets by axes label: the gradient all-reduces among `predicted`, bytes in launch order."""
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
# The run.


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
    docstring. cfg.micro_batch must be set (choose_micro); grad_sync None is cfg.grad_sync (the trainer's default,
    whose buckets cost.gradient_buckets cuts as parallel.GradSync does, or "blocking"). `steps` > 1
    runs that many steps and measures the last: the overlapped sync cuts its buckets in reverse registration
    order on the first step, then in the order the first backward made the gradients final (predicted as such)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

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
    step_kw = {"overlap": overlap, "grad_sync": grad_sync or cfg.grad_sync}

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
        fake = DryMode()
        to_fake(plm, fake)
        seconds["model"] = time.perf_counter() - t
        with fake:
            opt = build_optimizer(plm, RunConfig())
            ids = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long)
            keep = torch.ones(cfg.batch, cfg.seq, dtype=torch.bool)
            saved = SavedTensors(plm)
            # The model's GradSync, built now rather than in the first step (train_step's call returns this one):
            # its buckets are read before the measured step, as the first step re-cuts them when it ends and only
            # the next step allocates the new ones' buffers (of the same bytes) and keeps them.
            sync = parallel.grad_sync(plm, g) if step_kw["grad_sync"] == "overlap" else None
            t = time.perf_counter()
            for i in range(steps):
                parallel.LEDGER.reset()
                last = i == steps - 1
                if last:
                    buckets = list(sync.buckets) if sync is not None else []
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
                   "optimizer": nbytes(state), "grad_buckets": nbytes(b.buf for b in buckets if b.buf is not None)}
            t = time.perf_counter()
            act = saved.summary(cfg.activation_checkpointing, amp)
            seconds["activations"] = time.perf_counter() - t
    finally:
        parallel.shutdown()
    g = parallel.Grid(*grid, rank=rank)
    kw = dict(precision=cfg.precision, param_bytes=cfg.param_bytes)
    sync = dict(grad_sync=step_kw["grad_sync"], first_step=steps == 1)
    predicted = cost.step_records(shape, g, mode, cfg.batch, cfg.seq, cfg.micro_batch,
                                  checkpointing=cfg.activation_checkpointing, **kw, **sync)
    buckets = cost.gradient_buckets(shape, g, mode, cfg.param_bytes, **sync)
    want = cost.state_bytes(shape, g, mode, cfg.param_bytes, grad_sync=step_kw["grad_sync"])
    memory = [Check(k, want[k], got[k]) for k in MEMORY_KEYS]
    est = cost.activation_bytes(shape, g, mode, cfg.micro_batch * cfg.seq,
                                checkpointing=cfg.activation_checkpointing, **kw)
    memory.append(Check("activations", est, act["total"], exact=False))
    seconds["total"] = time.perf_counter() - t0
    local = cfg.batch // cost.rows_split(g, mode)
    return DryRun(cfg.model, tuple(grid), rank, mode, cfg.batch, cfg.seq, cfg.micro_batch, local // cfg.micro_batch,
                  cfg.precision, cfg.activation_checkpointing, {"overlap": overlap, **step_kw, "steps": steps},
                  measured, predicted, {g.label(a): b for a, b in buckets.items()}, memory, act, seconds)


# ---------------------------------------------------------------------------------------------------
# Output.


def table(run: DryRun) -> str:
    """The comparison: per-rank bytes, then per (op, axes) count and payload bytes; planner, dry run, check. Last,
    the planner's gradient all-reduces per group (checked with every other record)."""
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
    cut = "one per group" if run.options["grad_sync"] == "blocking" else (
        "buckets in reverse registration order: a first step" if run.options["steps"] == 1 else
        "buckets in the first backward's gradient order")
    lines.append(f"the planner's gradient all-reduces among them (grad_sync={run.options['grad_sync']}, {cut}):")
    for axes, b in run.gradients.items():
        lines.append(f"  {axes:<14} {len(b):>6} all-reduce{'s' if len(b) > 1 else ' '} {sum(b):>16,} bytes")
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
        "gradient_buckets": run.gradients,
        "records": {"measured": [rec(r, n) for r, n in run.measured.items()],
                    "issued_not_predicted": [rec(r, n) for r, n in extra.items()],
                    "predicted_not_issued": [rec(r, n) for r, n in missing.items()]},
        "seconds": run.seconds,
    }


__all__ = ["Check", "DryRun", "Record", "choose_micro", "dry_run", "header", "table", "to_json"]
