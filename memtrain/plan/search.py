"""Which (data, x, y, z) grid to train a model with on N GPUs, decided before launching.

For every factorization of N the model's sizes and the batch allow (the architectures' divisibility rules), the
planner estimates per-rank memory (parameters, gradients, AdamW state, the gradient sync's bucket buffers,
activations) and drops grids that do not fit the device; then it predicts the time of one optimizer step and ranks
grids by it: one rank's compute time (compute.py: the FLOPs of its shards at the machine's rate for their shapes,
which fall as shards get thin, and what a step spends besides matmuls) plus the communication overlap cannot hide,
from cost.py's exact records, each at the time measured for its op, group size and payload where its group sits,
issued alone or queued behind others as the engine issues it (network.py). MFU is the unsharded model's FLOPs over
the predicted step time and the GPUs' peak.
With `offload` (train.optimizer_offload) the AdamW state leaves the device for the host, the step pays the
device<->host copies, and `fewest_gpus` says how many GPUs the model needs with and without it.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import asdict, dataclass

from memtrain.config import PARALLEL_MODES, ParallelConfig
from memtrain.hf.architectures import architecture_of
from memtrain.plan import compute, cost
from memtrain.plan.network import GB, Network, inside_node
from parallel import GRAD_SYNCS, Grid


@dataclass
class PlanConfig:
    """What to plan: the model, the GPU count and the training step (the flags of `memtrain plan`)."""

    model: str
    """A named model (`memtrain models`) or a local HF directory (its config.json)."""
    gpus: int
    batch: int | None = None
    """Global batch in sequences (None: one per GPU)."""
    seq: int = 2048
    """Tokens per sequence."""
    micro_batch: int | None = None
    """Sequences per rank per forward/backward; None: the largest divisor of the rank's share that fits."""
    mode: str = "auto"
    """'sharded', 'easy' or 'auto' (sharded for the architectures memtrain/hf/architectures.py plans)."""
    precision: str = "bf16"
    """'bf16' (autocast over fp32 parameters, the trainer on GPUs) or 'fp32'."""
    param_bytes: int = 4
    """Bytes per parameter (the trainer keeps fp32 parameters, gradients and AdamW state)."""
    activation_checkpointing: bool = False
    offload: bool = False
    """Optimizer offload (train.optimizer_offload): AdamW moments and fp32 master weights in host memory; under
    bf16 the device keeps bf16 weights and gradients (2 bytes each)."""
    host_gbps: float = 25.0
    """Device<->host bandwidth per GPU and direction with offload, GB/s (PCIe 4.0 x16: 32 peak, ~25 reached);
    0: the ranks are CPUs, whose host memory is their device memory (no traffic; the host's bytes and AdamW count
    on the rank)."""
    grad_sync: str = ParallelConfig.grad_sync
    """The trainer's gradient sync (parallel.grad_sync): "overlap" (its default) keeps a flat buffer per bucket on
    the device and hides the all-reduce behind the last backward; "blocking" runs it after backward."""


@dataclass
class Plan:
    data: int
    x: int
    y: int
    z: int
    micro_batch: int
    micro_batches: int
    step_seconds: float
    """Predicted time of one optimizer step: compute + the communication overlap leaves exposed (compute.py)."""
    compute_seconds: float
    """One rank's compute time per step: matmuls, and the non-matmul term (`other_seconds`)."""
    comm_seconds: float
    """Every collective of the step one after another (communication alone, before overlap)."""
    flops: float
    """FLOPs one rank runs per step."""
    mfu: float
    """Model FLOPs utilization at the predicted step time: model FLOPs / (step time x GPUs x peak FLOP/s)."""
    moved_bytes: float
    """Bytes one rank sends per step (ring model)."""
    memory: dict
    """Bytes per rank: params, grads, optimizer, grad_buckets, activations, total (CPU ranks with offload: and
    the host's, "offloaded")."""
    axes: dict
    """Per axes label: payload bytes, moved bytes, seconds, whether its groups stay inside a node."""
    host_memory: int = 0
    """Bytes per rank in host memory (offload: master weights, AdamW moments, step scalars, gradient staging)."""
    host_traffic: int = 0
    """Bytes per rank per step between device and host (offload: gradients down, weights up)."""
    other_seconds: float = 0.0
    """The part of compute_seconds that is not matmuls: kernels' fixed cost, elementwise work, AdamW, attention's
    softmax (compute.py; 0 on a machine without those rates)."""

    @property
    def grid(self) -> tuple[int, int, int, int]:
        return self.data, self.x, self.y, self.z


def load_config(model: str):
    """The transformers config of a named model or a local HF directory (ValueError names the choices)."""
    from memtrain.models import get_config

    if os.path.isdir(model):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(model)
        except Exception as e:  # noqa: BLE001 - a damaged config.json: ValueError, TypeError, huggingface_hub's own
            raise ValueError(f"--model {model!r}: its config.json is not a model config transformers reads "
                             f"({' '.join(str(e).split())[:200]}): restore it, or save the model again") from None
    return get_config(model)


def resolve_mode(config, mode: str) -> str:
    if mode not in PARALLEL_MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(PARALLEL_MODES)}")
    if mode == "auto":
        return "sharded" if architecture_of(config).sharded else "easy"
    return mode


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending: up to its square root, so a million GPUs or sequences take a millisecond."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def factorizations(n: int):
    """Every (data, x, y, z) whose product is n."""
    divs = divisors(n)
    for data in divs:
        for x in (d for d in divs if (n // data) % d == 0):
            for y in (d for d in divs if (n // data // x) % d == 0):
                yield data, x, y, n // data // x // y


def device_param_bytes(cfg: PlanConfig) -> int:
    """Bytes per parameter on the device: 2 with offload under bf16 (the fp32 masters live on the host)."""
    return 2 if cfg.offload and cfg.precision == "bf16" else cfg.param_bytes


def device_state(shape, grid: Grid, mode: str, cfg: PlanConfig) -> dict[str, int]:
    """Per-rank device bytes besides activations (cost.state_bytes at cfg's options). With offload onto CPU ranks
    (host_gbps 0) the host's bytes too ("offloaded"): their host memory is the device memory the limit bounds."""
    pb = device_param_bytes(cfg)
    state = cost.state_bytes(shape, grid, mode, pb, cfg.offload, cfg.grad_sync)
    if cfg.offload and cfg.host_gbps == 0:
        state["offloaded"] = sum(cost.host_bytes(shape, grid, mode, pb).values())
    return state


def evaluate(shape, grid: Grid, mode: str, cfg: PlanConfig, net: Network, micro: int) -> Plan:
    """Predicted time, bytes and memory of one grid at a given micro-batch. With offload the device<->host
    copies count in full at host_gbps (the gradients' copies overlap the all-reduce, the weights' the next
    bucket's math; the host's AdamW time is not modelled, but on CPU ranks, host_gbps 0, it is the rank's own).
    The blocking gradient sync's all-reduces run after backward: nothing hides them."""
    pb = device_param_bytes(cfg)
    kw = dict(precision=cfg.precision, param_bytes=pb)
    log = cost.step_log(shape, grid, mode, cfg.batch, cfg.seq, micro, checkpointing=cfg.activation_checkpointing,
                        grad_sync=cfg.grad_sync, **kw)
    records = log.records
    gradients = cost.gradient_records(shape, grid, mode, pb) if cfg.grad_sync == "overlap" else Counter()

    def seconds(r, series: str) -> float:
        return net.seconds_on(r, grid, series)

    axes: dict[str, dict] = {}
    for r, n, _, how in compute.issued(records, gradients, log.oar):
        inside = inside_node(grid, r.axes.split("+"), net.gpus_per_node)
        a = axes.setdefault(r.axes, {"payload": 0, "moved": 0.0, "seconds": 0.0, "inside_node": inside})
        a["payload"] += n * r.nbytes
        a["moved"] += n * r.moved_bytes
        a["seconds"] += n * seconds(r, how)
    memory = device_state(shape, grid, mode, cfg)
    memory["activations"] = cost.activation_bytes(shape, grid, mode, micro * cfg.seq,
                                                  checkpointing=cfg.activation_checkpointing, **kw)
    memory["total"] = sum(memory.values())
    local = cfg.batch // cost.rows_split(grid, mode)
    comm = compute.comm_seconds(records, gradients, log.oar, seconds)
    work = compute.step_compute(shape, grid, mode, cfg.batch, cfg.seq, micro, net, cfg.precision,
                                cfg.activation_checkpointing, cfg.offload and cfg.host_gbps > 0)
    host, traffic = 0, 0
    step = compute.step_seconds(work.seconds, work.last_backward_seconds, comm, work.optimizer_seconds,
                                net.overlap)
    if cfg.offload:
        host = sum(cost.host_bytes(shape, grid, mode, pb).values())
        traffic = cost.offload_traffic(shape, grid, mode, pb, host_is_device=cfg.host_gbps == 0)
        step += traffic / (cfg.host_gbps * GB) if traffic else 0.0
    return Plan(grid.data, grid.x, grid.y, grid.z, micro, local // micro, step_seconds=step,
                compute_seconds=work.seconds, comm_seconds=sum(comm.values()), flops=work.flops,
                mfu=work.model_flops / (step * grid.world_size * net.peak_flops(cfg.precision)),
                moved_bytes=sum(a["moved"] for a in axes.values()), memory=memory, axes=axes,
                host_memory=host, host_traffic=traffic, other_seconds=work.other_seconds)


def plan(cfg: PlanConfig, net: Network) -> tuple[list[Plan], dict]:
    """All grids that run and fit, fastest first, and a summary of what was dropped and why."""
    if cfg.gpus < 1:
        raise ValueError(f"--gpus {cfg.gpus} is invalid: plan for at least 1 GPU")
    cfg.batch = cfg.batch or cfg.gpus
    for what, v in (("batch", cfg.batch), ("seq", cfg.seq), ("micro-batch", cfg.micro_batch or 1)):
        if v < 1:
            raise ValueError(f"--{what} {v} is invalid: it must be at least 1")
    if cfg.precision not in ("bf16", "fp32"):
        raise ValueError(f"unknown precision {cfg.precision!r}: use bf16 or fp32")
    net.peak_flops(cfg.precision)  # a measured machine without this precision's matmuls fails here, in one line
    config = load_config(cfg.model)
    mode = resolve_mode(config, cfg.mode)
    shape = cost.shape_of(config)
    limit, pb = net.gpu_memory_gb * GB, device_param_bytes(cfg)
    if cfg.host_gbps < 0 or not math.isfinite(cfg.host_gbps):
        raise ValueError(f"--host-gbps {cfg.host_gbps} is invalid: give the GB/s between a GPU and host memory "
                         "(0: the ranks are CPUs)")
    if cfg.grad_sync not in GRAD_SYNCS:
        raise ValueError(f"grad_sync {cfg.grad_sync!r} is invalid: use one of {', '.join(GRAD_SYNCS)}")
    plans, rejected, least = [], Counter(), None
    for d in factorizations(cfg.gpus):
        grid = Grid(*d)
        why = cost.check(shape, grid, mode, cfg.batch, cfg.micro_batch)
        if why:
            rejected[why] += 1
            continue
        local = cfg.batch // cost.rows_split(grid, mode)
        micros = [cfg.micro_batch] if cfg.micro_batch else divisors(local)[::-1]
        state = sum(device_state(shape, grid, mode, cfg).values())
        for micro in micros:  # the largest micro-batch that fits: fewest weight gathers per step
            total = state + cost.activation_bytes(
                shape, grid, mode, micro * cfg.seq, precision=cfg.precision, param_bytes=pb,
                checkpointing=cfg.activation_checkpointing)
            if total <= limit:
                plans.append(evaluate(shape, grid, mode, cfg, net, micro))
                break
        else:
            rejected[f"needs more than {net.gpu_memory_gb:g} GB per GPU"] += 1
            least = total if least is None else min(least, total)
    plans.sort(key=lambda p: (p.step_seconds, p.memory["total"], p.grid))
    summary = {"model": cfg.model, "family": shape.family, "mode": mode, "grids": sum(rejected.values()) + len(plans),
               "valid": len(plans), "rejected": dict(rejected), "least_memory_over_limit": least}
    if not plans:
        raise ValueError(_no_plan(cfg, mode, rejected, least))
    return plans, summary


def fewest_gpus(cfg: PlanConfig, net: Network, batch: int | None, most: int = 2**16) -> tuple[int | None, str]:
    """(n, ""): the fewest GPUs n, a power of two up to `most`, on which some grid runs cfg.model and fits the
    device memory at micro-batch cfg.micro_batch (None: 1), with `batch` sequences (None: one per GPU). Else
    (None, why): more GPUs than `most` are needed, or past some count no grid runs the model at all (cost.check's
    commonest reason at the count after the last that runs it: e.g. no larger power of two divides the batch)."""
    config = load_config(cfg.model)
    mode, shape = resolve_mode(config, cfg.mode), cost.shape_of(config)
    limit, pb, micro = net.gpu_memory_gb * GB, device_param_bytes(cfg), cfg.micro_batch or 1
    n, runs, stalled = 1, 0, ""  # the last count some grid runs at; why none runs at the count after it
    while n <= most:
        reasons, grids = Counter(), 0
        for d in factorizations(n):
            grid, grids = Grid(*d), grids + 1
            why = cost.check(shape, grid, mode, batch or n, micro)
            if why:
                reasons[why] += 1
                continue
            total = sum(device_state(shape, grid, mode, cfg).values()) + cost.activation_bytes(
                shape, grid, mode, micro * cfg.seq, precision=cfg.precision, param_bytes=pb,
                checkpointing=cfg.activation_checkpointing)
            if total <= limit:
                return n, ""
        if sum(reasons.values()) < grids:
            runs, stalled = n, ""
        elif not stalled:
            stalled = reasons.most_common(1)[0][0]
        n *= 2
    if not stalled:
        return None, f"more than {most:,} GPUs"
    if not runs:
        return None, f"none ({stalled})"
    return None, (f"none (too little memory on {runs:,} GPU{'s' * (runs != 1)}, and no larger power of two runs it: "
                  f"{stalled})")


def _no_plan(cfg: PlanConfig, mode: str, rejected: Counter, least) -> str:
    reasons = "; ".join(f"{why} ({n} grid{'s' if n > 1 else ''})" for why, n in rejected.most_common(4))
    hint = ""
    if least is not None:
        hint = (f" (the smallest needs {size_text(least)}): use more GPUs, --activation-checkpointing, a "
                "smaller --micro-batch or --seq")
    return f"no grid of {cfg.gpus} GPUs runs {cfg.model} in {mode} mode with batch {cfg.batch}: {reasons}{hint}"


# ---------------------------------------------------------------------------------------------------
# Output.


def size_text(nbytes: float) -> str:
    """Bytes in GB, MB or kB, the largest unit that keeps a whole one, to 3 significant digits: a limit of a
    few MB reads as such, not as "0.0 GB"."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:,.0f} {unit}"
    return f"{nbytes:.0f} bytes"


def table(plans: list[Plan], top: int) -> str:
    """The ranked grids; with offload, a column of each rank's host memory beside its device memory."""
    host = any(p.host_memory for p in plans)
    head = (f"{'rank':>4} {'data':>5} {'x':>4} {'y':>4} {'z':>4} {'micro':>9} {'step s':>9} {'MFU':>6} "
            f"{'compute s':>9} {'comm s':>9} {'GB sent':>9} {'state GB':>9} {'act GB':>8} {'total GB':>9}  "
            + (f"{'host GB':>8}  " if host else "") + "slowest axes")
    lines = [head]
    for i, p in enumerate(plans[:top], 1):
        worst = sorted(p.axes.items(), key=lambda kv: -kv[1]["seconds"])[:2]
        slow = ", ".join(f"{k}{'' if v['inside_node'] else '*'} {v['seconds']:.3g}s" for k, v in worst)
        m = p.memory
        state = m["total"] - m["activations"]  # parameters, gradients, AdamW, bucket buffers (CPU ranks: the host's)
        lines.append(f"{i:>4} {p.data:>5} {p.x:>4} {p.y:>4} {p.z:>4} {f'{p.micro_batch}x{p.micro_batches}':>9} "
                     f"{p.step_seconds:>9.4g} {100 * p.mfu:>5.1f}% {p.compute_seconds:>9.4g} {p.comm_seconds:>9.4g} "
                     f"{p.moved_bytes / GB:>9.4g} {state / GB:>9.4g} "
                     f"{m['activations'] / GB:>8.4g} {m['total'] / GB:>9.4g}  "
                     + (f"{p.host_memory / GB:>8.4g}  " if host else "") + slow)
    return "\n".join(lines)


def to_json(plans: list[Plan], summary: dict, cfg: PlanConfig, net: Network) -> dict:
    return {"config": asdict(cfg), "network": asdict(net), "summary": summary,
            "plans": [dict(asdict(p), rank=i) for i, p in enumerate(plans, 1)]}
