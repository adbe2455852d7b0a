"""The machine as the planner sees it: node size, device memory, what each collective, matmul and other op achieves.

Presets live in machines.toml beside this file (with their sources); `memtrain plan --measure` writes a
measured table (every collective's time per group size and payload, the GFLOP/s of matmuls per shape, and the
rates of what a step spends besides matmuls; probes.py) that `--bandwidth` reads.
A collective costs, where its group sits (inside one node or across nodes; ranks are laid out X fastest, then Y,
Z, data): its measured time at that payload (`collective_curves`, interpolated), alone, queued behind others or
back to back with others as the engine issues it; else latency + ring-moved bytes
(`parallel.comm.Record.moved_bytes`) / bandwidth.
A matmul [m, k] x [k, n] costs 2mkn FLOPs at the measured rate of its shape (interpolated), or, for a preset, at
the GPU's dense peak times the fraction of it a large GEMM reaches.
The rest of a step (compute.py's non-matmul term) costs, at measured rates: a fixed time per kernel, a time per
element of each kind of elementwise layer, AdamW's time per parameter element and per parameter tensor, and
attention's kernel time per score. A preset, or a table measured before these rates were, has none of them: the
term is then zero and attention runs at the matmul rate alone (the planner predicts as it did before).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from memtrain import bounds
from memtrain.config import load_toml
from parallel import AXES, Grid
from parallel.comm import Record

MACHINES = Path(__file__).with_name("machines.toml")
DEFAULT_MACHINE = "dgx-a100"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
GB = 1e9
ELEMENTWISE = ("norm", "act", "add", "rotary", "loss")
"""Kinds of elementwise layer whose rate `memtrain plan --measure` probes (`Network.elementwise`): a norm, the MLP's
activation (SiLU x mul), an add or copy (residual adds, biases, re-layouts), rotary embedding, the loss."""
ASYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter")
"""The ops the engine also issues async (parallel.comm): the weights' Z gathers and reduce-scatters, the gradient
buckets."""
CHAINED_OPS = ("all_gather", "reduce_scatter", "all_to_all")
"""The ops of easy mode's re-layouts (parallel/linear.py), which follow one another with only copies between: each
Linear's output edge is followed by the next one's input edge (q, k and v, gate and up share an input). The probe
also times them back to back: on 8 gloo ranks sharing 2 cores such a call cost 0.65-0.86x a lone one in a step."""
SERIES = ("isolated", "streamed", "chained")
"""How a collective is issued, a measured curve's series: blocking after compute, async and queued, blocking and
back to back."""
SERIES_OPS = {"isolated": OPS, "streamed": ASYNC_OPS, "chained": CHAINED_OPS}
"""The ops whose curves have each series."""


@dataclass
class Network:
    """The machine as the planner sees it: node size, device memory, and what a ring collective achieves."""

    name: str = DEFAULT_MACHINE
    gpus_per_node: int = 8
    """Ranks per node. Groups whose ranks all sit in one node use the intra-node figures."""
    gpu_memory_gb: float = 80.0
    intra_node_gbps: float = 300.0
    """Ring bandwidth inside a node, GB/s per GPU per direction (used when no measured entry applies)."""
    inter_node_gbps: float = 25.0
    """Ring bandwidth across nodes, GB/s per GPU (the node's network injection bandwidth per GPU)."""
    collectives: dict = field(default_factory=dict)
    """Measured: op -> "intra"/"inter" -> {group size: [GB/s, latency us]}, from `memtrain plan --measure` (a summary
    of `collective_curves`, which the planner uses where it has them)."""
    collective_curves: dict = field(default_factory=dict)
    """Measured: op -> "intra"/"inter" -> {group size: {"bytes": [...], "isolated": [s...], "streamed": [s...],
    "chained": [s...]}}: one call's seconds per payload, after compute (collectives.lead: as a blocking collective
    meets its members in a step; its time beyond the compute's), for ASYNC_OPS queued behind others of its kind
    (as the engine's prefetched gathers, deferred reduce-scatters and gradient buckets run), and for CHAINED_OPS
    blocking, back to back (as easy mode's re-layouts run). Where an op has one, it replaces `collectives`' latency
    + bytes / bandwidth."""
    overlap: float = 1.0
    """Fraction of the shorter of compute and async communication that runs hidden when both are issued together
    (compute.step_seconds). Measured (collectives.measure_overlap); 1 in a preset: a GPU runs collectives on its
    own engines beside its compute, where CPU ranks run them on the cores the compute needs."""
    bf16_tflops: float = 312.0
    """Dense peak matmul TFLOP/s of one GPU in bf16 (tensor cores, no sparsity)."""
    fp32_tflops: float = 19.5
    """Dense peak matmul TFLOP/s of one GPU in fp32 (torch keeps fp32 matmuls out of TF32 by default)."""
    matmul_efficiency: float = 0.87
    """Fraction of the peak a large GEMM reaches (used when no measured matmul table applies)."""
    matmuls: dict = field(default_factory=dict)
    """Measured: precision -> {"dims": [d...], "gflops": [[[GFLOP/s of [m, k] x [k, n] for n] for k] for m]} with
    m, k, n over dims, from `memtrain plan --measure` (one rank's rate while every rank runs the probe)."""
    op_overhead_s: float = 0.0
    """A training step's seconds per kernel beyond the kernel's work (dispatch, allocation, views, modules' Python,
    autograd), times `compute.kernel_ops`. Measured; 0 (not counted) in a preset or an older table."""
    elementwise: dict = field(default_factory=dict)
    """Measured: kind (ELEMENTWISE) -> seconds per element of one such layer's forward + backward beyond its fixed
    cost, times `compute.micro_elements`; a kind absent counts 0."""
    optimizer: list = field(default_factory=list)
    """Measured: [seconds per parameter element, seconds per parameter tensor] of torch AdamW's step with the
    gradient norm clipping takes, over this rank's shards; [] counts 0."""
    attention: dict = field(default_factory=dict)
    """Measured: precision -> {"head_dims": [d...], "seconds": [[forward, backward] per score, for each d]}: causal
    SDPA's time per element of its seq x seq score square per head; none: attention at the matmul rate alone."""
    source: str = ""
    unmeasured: tuple = ()
    """Figures a bandwidth table left out (inter_node_gbps: null from a one-node --measure; gpu_memory_gb, which it
    never holds), so the preset's stand in: the plan's header says so."""

    def seconds_on(self, record: Record, grid: Grid, series: str = "isolated") -> float:
        """`seconds` of a record of a step on `grid`, inside a node or across as the grid places its groups."""
        return self.seconds(record, inside_node(grid, record.axes.split("+"), self.gpus_per_node), series)

    def seconds(self, record: Record, inside_node: bool, series: str = "isolated") -> float:
        """Time of one collective, from the nearest measured group size: its measured curve at this payload, in the
        series of how it is issued ("isolated", "streamed" or "chained"; compute.series; "isolated" where the curve
        has no such series), else latency + ring-moved bytes / bandwidth. A series not in SERIES is an error."""
        if series not in SERIES:
            raise ValueError(f"unknown series {series!r}: use one of {', '.join(SERIES)}")
        place = "intra" if inside_node else "inter"
        curves = (self.collective_curves.get(record.op) or {}).get(place)
        if curves:
            curve = curves[_nearest(curves, record.group_size)]
            times = curve.get(series) or curve["isolated"]
            return _interpolate(curve["bytes"], times, record.nbytes)
        table = self.collectives.get(record.op) or self.collectives.get("all_gather", {})
        sizes = table.get(place) or {}
        if sizes:
            gbps, latency_us = sizes[_nearest(sizes, record.group_size)]
        else:
            gbps, latency_us = (self.intra_node_gbps if inside_node else self.inter_node_gbps), 0.0
        return latency_us * 1e-6 + record.moved_bytes / (gbps * GB)

    def _table(self, precision: str) -> dict | None:
        if precision not in ("bf16", "fp32"):
            raise ValueError(f"unknown precision {precision!r}: use bf16 or fp32")
        if self.matmuls and precision not in self.matmuls:
            have = ", ".join(self.matmuls)
            raise ValueError(f"{self.name}: no measured {precision} matmuls (only {have}; `memtrain plan --measure` "
                             "skips bf16 where it is slower than fp32): plan with --precision "
                             f"{next(iter(self.matmuls))}")
        return self.matmuls.get(precision)

    def peak_flops(self, precision: str) -> float:
        """FLOP/s of one GPU that MFU divides by: the best measured matmul, else the datasheet's dense peak."""
        table = self._table(precision)
        if table:
            return max(r for plane in table["gflops"] for row in plane for r in row) * 1e9
        return (self.bf16_tflops if precision == "bf16" else self.fp32_tflops) * 1e12

    def matmul_seconds(self, m: int, k: int, n: int, precision: str) -> float:
        """Time of one [m, k] x [k, n] matmul: its measured rate (log-linear between the probed shapes, the edge
        rate outside them), else the peak times matmul_efficiency."""
        table = self._table(precision)
        if not table:
            return 2 * m * k * n / (self.peak_flops(precision) * self.matmul_efficiency)
        dims = [math.log2(d) for d in table["dims"]]
        corners = []  # per axis: the two probed sizes around this one, and their weights
        for size in (m, k, n):
            v = min(max(math.log2(size), dims[0]), dims[-1])
            i = min(bisect.bisect_right(dims, v), len(dims) - 1) - 1
            w = (v - dims[i]) / (dims[i + 1] - dims[i])
            corners.append(((i, 1 - w), (i + 1, w)))
        log_rate = sum(wa * wb * wc * math.log(table["gflops"][a][b][c])
                       for (a, wa), (b, wb), (c, wc) in itertools.product(*corners))
        return 2 * m * k * n / (math.exp(log_rate) * 1e9)

    def attention_seconds(self, head_dim: int, precision: str) -> tuple[float, float] | None:
        """(forward, backward) seconds per attention score at `head_dim` (log-linear between the probed head sizes,
        the edge's rate outside them), or None when this precision's attention was not measured."""
        table = self.attention.get(precision)
        if not table:
            return None
        dims, rates = [math.log2(d) for d in table["head_dims"]], table["seconds"]
        v = min(max(math.log2(head_dim), dims[0]), dims[-1])
        i = bisect.bisect_right(dims, v) - 1  # the probed size at or below, and the next one up
        j = min(i + 1, len(dims) - 1)
        w = (v - dims[i]) / (dims[j] - dims[i]) if j > i else 0.0
        return tuple(math.exp((1 - w) * math.log(rates[i][k]) + w * math.log(rates[j][k])) for k in (0, 1))


def _nearest(by_size: dict, group_size: int) -> str:
    """The measured group size (a key) nearest to `group_size` on a log scale."""
    return min(by_size, key=lambda s: abs(math.log(int(s) / group_size)))


def _interpolate(sizes: list[int], seconds: list[float], nbytes: int) -> float:
    """Seconds at `nbytes`, piecewise linear between measured payloads; below the smallest, its time; above the
    largest, its time plus the extra bytes at the last segment's rate (the whole range's when noise made that
    one fall)."""
    if nbytes <= sizes[0]:
        return seconds[0]
    i = bisect.bisect_left(sizes, nbytes)
    if i < len(sizes):
        w = (nbytes - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return (1 - w) * seconds[i - 1] + w * seconds[i]
    rate = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
    if rate <= 0:
        rate = max(seconds[-1] - seconds[0], 0.0) / (sizes[-1] - sizes[0]) or seconds[-1] / sizes[-1]
    return seconds[-1] + (nbytes - sizes[-1]) * rate


def machines() -> dict[str, dict]:
    return load_toml(MACHINES, "machine presets")


def load_network(machine: str | None = None, bandwidth: str | None = None, gpus_per_node: int | None = None,
                 gpu_memory_gb: float | None = None) -> Network:
    """A preset of machines.toml, then a bandwidth file (JSON from --measure, or TOML with the same keys) over it,
    then explicit values over both."""
    known = machines()
    name = machine or DEFAULT_MACHINE
    if name not in known:
        raise ValueError(f"unknown machine {name!r}: use one of {', '.join(known)}, or --bandwidth FILE")
    values = dict(known[name], name=name)
    if bandwidth:
        path = Path(bandwidth)
        if not path.is_file():
            raise FileNotFoundError(f"bandwidth table {str(path)!r} does not exist: write one with "
                                    "`torchrun ... -m memtrain plan --measure --out FILE`")
        loaded = _read_table(path)
        allowed = {f.name for f in fields(Network)}
        unknown = sorted(set(loaded) - allowed - {"backend", "world_size", "message_mb"})
        if unknown:
            raise ValueError(f"{str(path)!r}: unknown key {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
        values.update({k: v for k, v in loaded.items() if k in allowed and v is not None})
        values["unmeasured"] = tuple(k for k in ("inter_node_gbps", "gpu_memory_gb") if loaded.get(k) is None)
        _check_table(path, Network(**values))
    for key, value in (("gpus_per_node", gpus_per_node), ("gpu_memory_gb", gpu_memory_gb)):
        if value is not None:
            if value <= 0:
                raise ValueError(f"--{key.replace('_', '-')}={value} is invalid: it must be positive")
            values[key] = value
            values["unmeasured"] = tuple(k for k in values.get("unmeasured", ()) if k != key)
    return Network(**values)


def _read_table(path: Path) -> dict:
    """A bandwidth table's keys: JSON (what --measure writes) or TOML, one line naming the file if it is neither."""
    try:
        text = path.read_bytes().decode("utf-8")
        loaded = json.loads(text) if path.suffix == ".json" or text.lstrip().startswith("{") \
            else load_toml(path, "bandwidth table")
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
        raise ValueError(f"bandwidth table {str(path)!r} is not JSON or TOML ({e}): write one with "
                         "`memtrain plan --measure --out FILE`") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"bandwidth table {str(path)!r} holds {type(loaded).__name__}, not a table of keys: write one "
                         "with `memtrain plan --measure --out FILE`")
    return loaded


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 < x <= bounds.DEFAULT


def _check_table(path: Path, net: Network) -> None:
    """Every figure the planner divides by or interpolates in: finite and positive, the tables' shapes whole."""
    def bad(key, why):
        return ValueError(f"bandwidth table {str(path)!r}: {key} {why}: fix it, or measure again with "
                          "`memtrain plan --measure`")

    for key in ("gpu_memory_gb", "intra_node_gbps", "inter_node_gbps", "bf16_tflops", "fp32_tflops",
                "matmul_efficiency"):
        value = getattr(net, key)
        if not _positive(value) or key == "matmul_efficiency" and value > 1:
            raise bad(key, f"= {value!r} is not a finite number > 0" + " and <= 1" * (key == "matmul_efficiency"))
    if isinstance(net.gpus_per_node, bool) or not isinstance(net.gpus_per_node, int) \
            or not 1 <= net.gpus_per_node <= bounds.DEGREE:
        raise bad("gpus_per_node", f"= {net.gpus_per_node!r} is not an integer in [1, {bounds.DEGREE}]")
    if not (net.overlap == 0 or _positive(net.overlap) and net.overlap <= 1):
        raise bad("overlap", f"= {net.overlap!r} is not a fraction in [0, 1]")
    if not (net.op_overhead_s == 0 or _positive(net.op_overhead_s)):
        raise bad("op_overhead_s", f"= {net.op_overhead_s!r} is not a finite number >= 0")
    if not isinstance(net.elementwise, dict) or not all(
            k in ELEMENTWISE and (v == 0 or _positive(v)) for k, v in net.elementwise.items()):
        raise bad("elementwise", f"is not a table of {', '.join(ELEMENTWISE)} -> seconds per element >= 0")
    if not (net.optimizer == [] or isinstance(net.optimizer, list) and len(net.optimizer) == 2
            and all(v == 0 or _positive(v) for v in net.optimizer)):
        raise bad("optimizer", f"= {net.optimizer!r} is not [seconds per element, seconds per tensor], each >= 0")
    for key in ("collectives", "matmuls", "attention"):
        if not isinstance(getattr(net, key), dict) or not all(isinstance(v, dict) for v in getattr(net, key).values()):
            raise bad(key, "is not a table of tables")
    for op, places in net.collectives.items():
        for place, sizes in places.items():
            entries = sizes.items() if isinstance(sizes, dict) else [("?", sizes)]
            for size, entry in entries:
                if not (str(size).isdigit() and int(size) >= 1 and isinstance(entry, list) and len(entry) == 2
                        and _positive(entry[0]) and (entry[1] == 0 or _positive(entry[1]))):
                    raise bad(f"collectives.{op}.{place}", f"entry {size!r}: {entry!r} is not [GB/s > 0, latency us "
                              ">= 0] for a group size >= 1")
    if not isinstance(net.collective_curves, dict):
        raise bad("collective_curves", "is not a table of tables")
    for op, places in net.collective_curves.items():
        for place, curves in (places.items() if isinstance(places, dict) else [("?", None)]):
            for size, curve in (curves.items() if isinstance(curves, dict) else [("?", None)]):
                if not (str(size).isdigit() and int(size) >= 1 and _curve(curve)):
                    raise bad(f"collective_curves.{op}.{place}", f"entry {size!r} is not {{bytes: two or more "
                              "increasing sizes, isolated (and streamed, chained): seconds > 0 per size} for a group "
                              "size >= 1")
    for precision, table in net.matmuls.items():
        dims = table.get("dims")
        n = len(dims) if isinstance(dims, list) else 0
        if n < 2 or not all(_positive(d) and isinstance(d, int) for d in dims) or dims != sorted(set(dims)):
            raise bad(f"matmuls.{precision}.dims", "is not a list of two or more increasing sizes")
        rates = table.get("gflops")
        if not (isinstance(rates, list) and len(rates) == n and all(
                isinstance(plane, list) and len(plane) == n and all(
                    isinstance(row, list) and len(row) == n and all(map(_positive, row)) for row in plane)
                for plane in rates)):
            raise bad(f"matmuls.{precision}.gflops", f"is not a {n} x {n} x {n} table of GFLOP/s > 0")
    for precision, table in net.attention.items():
        dims, rates = table.get("head_dims"), table.get("seconds")
        if not (isinstance(dims, list) and dims and all(_positive(d) and isinstance(d, int) for d in dims)
                and dims == sorted(set(dims)) and isinstance(rates, list) and len(rates) == len(dims)
                and all(isinstance(r, list) and len(r) == 2 and all(map(_positive, r)) for r in rates)):
            raise bad(f"attention.{precision}", "is not increasing head_dims with one [forward, backward] seconds "
                      "per score > 0 each")


def _curve(curve) -> bool:
    """A collective curve's shape: increasing payloads, and a positive time for each in every series."""
    if not isinstance(curve, dict) or set(curve) - {"bytes", *SERIES} or "isolated" not in curve:
        return False
    sizes = curve.get("bytes")
    if not (isinstance(sizes, list) and len(sizes) >= 2 and all(_positive(b) and isinstance(b, int) for b in sizes)
            and sizes == sorted(set(sizes))):
        return False
    return all(isinstance(curve[k], list) and len(curve[k]) == len(sizes) and all(map(_positive, curve[k]))
               for k in SERIES if k in curve)


def inside_node(grid: Grid, axes, gpus_per_node: int) -> bool:
    """Whether every group over `axes` lies in one node. Rank = x + X*(y + Y*(z + Z*data)), so a group spans
    the contiguous block of ranks up to its slowest axis; it stays inside a node when nodes are whole such blocks."""
    if grid.world_size <= gpus_per_node:
        return True
    live = [i for i, a in enumerate(AXES) if a in axes and grid.size(a) > 1]
    span = grid.size(AXES[:max(live) + 1]) if live else 1
    return span <= gpus_per_node and gpus_per_node % span == 0
