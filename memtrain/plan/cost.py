"""Exact communication and per-rank memory of one training step, from the model's shape and the grid.

memtrain's trainer (memtrain/training/step.py) runs, per optimizer step: for each micro-batch the forward and
backward of the parallelized model (memtrain/hf decides which HF layer becomes which engine layer, in which
mode), the gradient sync (parallel.GradSync's buckets during the last backward by default, or one
`sync_gradients` after it), the global gradient norm of clipping, and one all-reduce of the step's loss sums.
Every collective of that goes through parallel.comm and is recorded in parallel.LEDGER as a
`parallel.comm.Record` (op, axes label, group size, payload bytes). `step_records` predicts that multiset
without running anything, one function per layer kind, each transcribing its layer's code path
(parallel/linear.py, embedding.py, norm.py, grads.py, bucketed.py), from the block list the architecture object
gives (memtrain/hf/architectures.py) and the engine's own Grid; tests/memtrain/plan/test_cost.py compares it
with the ledger record for record. With optimizer offload (train.optimizer_offload) the AdamW state leaves the
device: `state_bytes(offload=True)`, `host_bytes` and `offload_traffic` give what stays, what the host holds and
what crosses between them, tested against OffloadAdamW's own tensors (tests/memtrain/plan/test_offload.py).

Dtypes, as the code casts them (pb = parameter bytes, cb = matmul bytes: 2 under bf16 autocast):
- weight all-gathers over Z of Linear and LM head: the matmul dtype when narrower, min(pb, cb) (the shard is
  cast before the gather); the embedding's Z all-gather (its lookup stays in the table's dtype), the weight
  reduce-scatters over Z and the gradient buckets: the parameter dtype;
- matmul outputs and their gradients (Linear and LM-head reductions, easy-mode output edges): cb;
- the embedding output and the residual stream (the input edge of an easy-mode layer fed by it): pb;
  norm statistics and the vocabulary-parallel loss: fp32; token ids and labels: int64.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

from memtrain.hf.architectures import Matrix, Norm, Shape, architecture_of
from parallel import AXES, GRAD_SYNCS, Grid, padded_vocab
from parallel.bucketed import BUCKET_BYTES, FIRST_BUCKET_BYTES, cut_buckets
from parallel.comm import Record

FP32, INT64 = 4, 8


def shape_of(config) -> Shape:
    """The engine's view of a transformers config (its architecture object's block list)."""
    return architecture_of(config).shape(config)


def vocab_rows(shape: Shape, grid: Grid) -> int:
    return padded_vocab(shape.vocab, shape.hidden, grid)


def rows_split(grid: Grid, mode: str) -> int:
    """Groups the global batch's rows are split over: every rank (easy) or data x z (sharded)."""
    return grid.world_size if mode == "easy" else grid.size(("z", "data"))


# ---------------------------------------------------------------------------------------------------
# Validity: the divisibility rules Architecture.check_sizes and BlockLayout.check enforce.


def feature_axes(m: Matrix, mode: str) -> tuple[str, str]:
    """(in-feature axis A, out-feature axis B) of a Linear."""
    return ("y", "x") if m.transpose and mode == "sharded" else ("x", "y")


def check(shape: Shape, grid: Grid, mode: str, batch: int, micro: int | None = None) -> str | None:
    """Why the grid cannot run this model and batch (the first rule that fails), or None."""
    rules = [("hidden_size", shape.hidden, "x")]
    if mode == "sharded":
        rules = [("num_attention_heads", shape.heads, "y"), ("num_key_value_heads", shape.kv_heads, "y"),
                 *rules, ("intermediate_size", shape.intermediate, "y")]
    for what, value, axis in rules:
        if value % grid.size(axis):
            return f"{what}={value} is not divisible by parallel.{axis}={grid.size(axis)}"
    for m in shape.block:
        if isinstance(m, Matrix):
            in_axis, out_axis = feature_axes(m, mode)
            a, b = grid.size(in_axis), grid.size(out_axis)
            for n, axis, dim in ((m.rows, out_axis, "rows"), (m.cols, in_axis, "columns")):
                if n % grid.size(axis):
                    return f"{m.name}: {dim} {n} are not divisible by parallel.{axis}={grid.size(axis)}"
            if (m.rows // b * (m.cols // a)) % grid.z:
                return f"{m.name}: a {m.rows // b}x{m.cols // a} block does not split over parallel.z={grid.z}"
    split = rows_split(grid, mode)
    if batch % split:
        what = "data*x*y*z" if mode == "easy" else "data*z"
        return f"batch {batch} is not divisible by {what}={split}"
    if micro and (batch // split) % micro:
        return f"micro-batch {micro} does not divide the {batch // split} sequences per rank"
    return None


# ---------------------------------------------------------------------------------------------------
# Collectives, one function per layer kind. `fwd`/`bwd` multiply the forward/backward records (micro-batches,
# layers, recomputation); `t` is the number of token rows this rank feeds the model per micro-batch.


class Log:
    """A predicted ledger: how many times each `Record` is issued; `oar`, those of them that are sharded mode's
    input-gradient all-reduces, which train_step's overlap issues async while the weight gradient's matmul runs
    (OAR, parallel/linear.py)."""

    def __init__(self, grid: Grid):
        self.grid, self.records, self.oar = grid, Counter(), Counter()

    def add(self, op: str, axes, nbytes: int, times: int = 1, oar: bool = False) -> None:
        p = self.grid.size(axes)
        if p > 1 and times:  # groups of one member record nothing (parallel.comm)
            r = Record(op, self.grid.label(axes), p, int(nbytes))
            self.records[r] += times
            if oar:
                self.oar[r] += times


def linear(log: Log, m: Matrix, mode: str, t: int, pb: int, cb: int, fwd: int, bwd: int,
           out_fwd: int | None = None) -> None:
    """out_fwd: forward count of easy mode's output re-layout when it differs from `fwd` (`step_records`)."""
    A, B = feature_axes(m, mode)
    a, b = log.grid.size(A), log.grid.size(B)
    block = m.rows // b * (m.cols // a)
    gathered = block * min(pb, cb)  # ShardedWeight.gather_dtype: the shard is cast before the Z gather
    if mode == "sharded":  # linear.py: gather Z; y = x W^T, all-reduce A | dx all-reduce B; dW reduce-scatter Z
        log.add("all_gather", "z", gathered, fwd)
        log.add("all_reduce", A, t * m.rows // b * cb, fwd)
        log.add("all_gather", "z", gathered, bwd)
        log.add("all_reduce", B, t * m.cols // a * cb, bwd, oar=True)
        log.add("reduce_scatter", "z", block * pb, bwd)
        return
    ib = cb if m.compute_input else pb
    plane = t * a * b  # rows the x*y plane multiplies
    log.add("all_to_all", A, t * m.cols * ib, fwd + bwd)  # features -> rows, and back in backward
    log.add("all_gather", B, plane * m.cols // a * ib, fwd)
    log.add("all_gather", "z", gathered, fwd + bwd)
    log.add("reduce_scatter", A, plane * m.rows // b * cb, fwd)
    log.add("all_to_all", B, t * m.rows * cb, (fwd if out_fwd is None else out_fwd) + bwd)  # rows -> features
    log.add("all_gather", A, plane * m.rows // b * cb, bwd)
    log.add("reduce_scatter", B, plane * m.cols // a * cb, bwd)
    log.add("reduce_scatter", "z", block * pb, bwd)


def embedding(log: Log, shape: Shape, vocab: int, mode: str, t: int, pb: int, fwd: int, bwd: int) -> None:
    """parallel.Embedding: vocabulary over Y (its in-feature axis A), hidden over X (B). The backward needs
    no weight, so the table is gathered once per micro-batch, in the parameter dtype under autocast too."""
    g, h = log.grid, shape.hidden
    block = vocab // g.y * (h // g.x) * pb
    log.add("all_gather", "z", block, fwd)
    log.add("reduce_scatter", "z", block, bwd)
    if mode == "sharded":
        log.add("all_reduce", "y", t * h // g.x * pb, fwd)  # each Y member holds a slice of the vocabulary
        return
    plane = t * g.x * g.y
    log.add("all_gather", "y", t * g.y * INT64, fwd)  # ids
    log.add("all_gather", "x", plane * INT64, fwd)
    log.add("reduce_scatter", "y", plane * h // g.x * pb, fwd)
    log.add("all_to_all", "x", t * h * pb, fwd + bwd)
    log.add("all_gather", "y", plane * h // g.x * pb, bwd)


def lm_head(log: Log, shape: Shape, vocab: int, mode: str, t: int, pb: int, cb: int, fwd: int, bwd: int) -> None:
    """parallel.LMHead + vocabulary-parallel cross-entropy: hidden over X (A), vocabulary over Y (B)."""
    g, h = log.grid, shape.hidden
    block = vocab // g.y * (h // g.x)
    log.add("all_gather", "z", block * min(pb, cb), fwd + bwd)  # a Linear's matmul: gathered in its dtype
    log.add("reduce_scatter", "z", block * pb, bwd)
    if mode == "sharded":
        log.add("all_reduce", "x", t * vocab // g.y * cb, fwd)
        log.add("all_reduce", "y", t * FP32, fwd)  # max
        log.add("all_reduce", "y", 2 * t * FP32, fwd)  # sum of exp, target logit
        log.add("all_reduce", "y", t * h // g.x * cb, bwd, oar=True)  # a Linear's backward: OAR
        return
    plane, rows = t * g.x * g.y, t * g.y  # the loss runs on this X column's plane rows
    log.add("all_to_all", "x", t * h * pb, fwd + bwd)
    log.add("all_gather", "y", plane * h // g.x * pb, fwd)
    log.add("reduce_scatter", "x", plane * vocab // g.y * cb, fwd)
    log.add("all_gather", "y", rows * INT64, fwd)  # labels
    log.add("all_reduce", "y", rows * FP32, fwd)
    log.add("all_reduce", "y", 2 * rows * FP32, fwd)
    log.add("all_gather", "y", rows * FP32, bwd)  # each member's chunk of the per-token loss gradient
    log.add("all_gather", "x", plane * vocab // g.y * cb, bwd)
    log.add("reduce_scatter", "y", plane * h // g.x * cb, bwd)


def norm(log: Log, n: Norm, mode: str, t: int, fwd: int, bwd: int) -> None:
    """Sharded mode: each statistic is a partial sum over X, all-reduced forward and backward (fp32).
    Easy mode keeps HF's replicated norm: no communication."""
    if mode == "sharded":
        log.add("all_reduce", "x", t * FP32, n.stats * (fwd + bwd))


# ---------------------------------------------------------------------------------------------------
# Parameters per rank: what the gradient sync sends, what the optimizer holds.

_BLOCK_ORDER = {  # a block's parts in module registration order (HF's __init__), then in forward order (its forward)
    "llama": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"),
              ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    "gpt_neox": (("input_layernorm", "post_attention_layernorm", "attention.query_key_value", "attention.dense",
                  "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
                 ("input_layernorm", "attention.query_key_value", "attention.dense", "post_attention_layernorm",
                  "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")),
    "gpt2": (("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"),) * 2,
}


class Param(NamedTuple):
    """A distinct parameter on this rank."""

    numel: int
    reduce_axes: tuple[str, ...]
    """The axes its gradient is summed over (parallel.sharding tags; HF's untagged parameters: every axis).
    ("data",): a Z-sharded weight, whose gradient its reduce-scatter has summed over Z already."""


def ordered_parameters(shape: Shape, grid: Grid, mode: str) -> tuple[list[Param], list[int]]:
    """Every distinct parameter in registration order, as unique_parameters lists them, and the order (indices
    into that list) in which one backward makes their gradients final.

    That order follows autograd's: one thread runs the graph's nodes latest-created first and a parameter's
    accumulation as soon as its last consumer, its first use in forward, has run. So: the reverse of the forward
    order of first uses, within a layer too (y = x W^T, then + b: the bias first), except HF's LayerNorm (easy
    mode): one op feeds both, and autograd runs their accumulations in its input order, weight then bias. A tied
    table is first used by the embedding: last."""
    g, vocab, h = grid, vocab_rows(shape, grid), shape.hidden
    local, reduce = (h // g.x, ("z", "data")) if mode == "sharded" else (h, AXES)  # easy: HF's, untagged
    params: list[Param] = []

    def add(*entries) -> list[int]:
        params.extend(entries)
        return list(range(len(params) - len(entries), len(params)))

    def part(p) -> list[int]:
        """A module's parameters, registered (weight, bias); returned in the order backward finishes them."""
        if isinstance(p, Matrix):
            a, b = feature_axes(p, mode)
            bias = Param(p.rows // g.size(b), ("z", "data") if mode == "sharded" else (a, "z", "data"))
            return add(Param(p.rows // g.size(b) * (p.cols // g.size(a)) // g.z, ("data",)),
                       *([bias] if p.bias else []))[::-1]
        idx = add(*[Param(local, reduce)] * (2 if p.bias else 1))
        return idx if mode == "easy" else idx[::-1]

    registered, forward = _BLOCK_ORDER[shape.family]
    by_name = {p.name: p for p in shape.block}
    if sorted(registered) != sorted(by_name) or sorted(forward) != sorted(by_name):
        raise ValueError(f"{shape.family}: the block order the planner knows does not name its block's parts")
    table = Param(vocab // g.y * (h // g.x) // g.z, ("data",))
    embedding = add(table)
    positions = add(Param(shape.positions * local, reduce)) if shape.positions else []
    blocks = []
    for _ in range(shape.layers):
        done = {name: part(by_name[name]) for name in registered}
        blocks.append([i for name in reversed(forward) for i in done[name]])
    final = part(shape.final_norm)
    head = [] if shape.tied else add(table)
    return params, head + final + [i for b in reversed(blocks) for i in b] + positions + embedding


def parameters(shape: Shape, grid: Grid, mode: str) -> list[Param]:
    """Every distinct parameter on this rank, in registration order."""
    return ordered_parameters(shape, grid, mode)[0]


def step_records(shape: Shape, grid: Grid, mode: str, batch: int, seq: int, micro: int | None = None,
                 **kw) -> Counter:
    """The ledger of one optimizer step of memtrain's trainer, record for record (`step_log`'s records)."""
    return step_log(shape, grid, mode, batch, seq, micro, **kw).records


def step_log(shape: Shape, grid: Grid, mode: str, batch: int, seq: int, micro: int | None = None, *,
             precision: str = "fp32", param_bytes: int = 4, checkpointing: bool = False, **sync) -> Log:
    """The ledger of one optimizer step of memtrain's trainer, record for record, with its OAR records apart.

    micro: sequences per rank per forward/backward (None: all of the rank's rows, the trainer's default).
    checkpointing: each block's forward runs again in backward (HF-style per-block recomputation), so its
        forward collectives count twice (train.activation_checkpointing), up to its last saved tensor: see below.
    sync: how the gradients are synced, `gradient_buckets`' keywords (default: the trainer's overlapped sync on
        any step but a run's first).
    """
    pb, cb = param_bytes, (2 if precision == "bf16" else param_bytes)
    split = rows_split(grid, mode)
    local = batch // split
    micro = micro or local
    n_micro, t = local // micro, micro * seq
    vocab = vocab_rows(shape, grid)
    log = Log(grid)
    L, redo = shape.layers, 2 if checkpointing else 1
    # Non-reentrant recomputation stops as soon as the block's last saved tensor is rebuilt (torch.utils.checkpoint's
    # early stop), so what a block's forward issues after that never runs again. The last tensor saved is the last
    # Linear's (MatmulFn saves when it returns; the bias and residual adds after it save none, nor does dropout at
    # p = 0, memtrain's models'): easy mode's output re-layout of that Linear runs once per forward.
    matrices = {m.name for m in shape.block if isinstance(m, Matrix)}
    last = [name for name in _BLOCK_ORDER[shape.family][1] if name in matrices][-1]
    embedding(log, shape, vocab, mode, t, pb, n_micro, n_micro)
    for part in shape.block:
        if isinstance(part, Matrix):
            linear(log, part, mode, t, pb, cb, n_micro * L * redo, n_micro * L,
                   n_micro * L if part.name == last else None)
        else:
            norm(log, part, mode, t, n_micro * L * redo, n_micro * L)
    norm(log, shape.final_norm, mode, t, n_micro, n_micro)
    lm_head(log, shape, vocab, mode, t, pb, cb, n_micro, n_micro)
    log.records.update(gradient_records(shape, grid, mode, pb, **sync))
    log.add("all_reduce", AXES, 8)  # grad_norm: one float64 over the world (clipping or not)
    log.add("all_reduce", AXES if mode == "easy" else ("z", "data"), 4 * 8)  # the step's loss sums (float64)
    return log


def gradient_buckets(shape: Shape, grid: Grid, mode: str, param_bytes: int = 4, *, grad_sync: str = "overlap",
                     first_step: bool = False, first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                     bucket_bytes: int = BUCKET_BYTES) -> dict[tuple[str, ...], list[int]]:
    """Payload bytes of each gradient all-reduce, in launch order, per group of parameters (their live reduce axes;
    one dtype: the parameters').

    grad_sync "blocking" (grads.sync_gradients): one flat message per group. "overlap" (the trainer's default,
    parallel.GradSync): each group cut into buckets, a bucket closed once it holds `first_bucket_bytes` (the
    group's first) or `bucket_bytes` (the next ones), over the parameters in the order their gradients are
    expected to become final. On the step that builds the GradSync (`first_step`, the first of a run) that is
    the reverse registration order; from the next one on, the order the first step's backward made them final
    (`ordered_parameters`). Those whose gradient was not final then go last in reverse registration order: with
    z > 1 under ORS (train_step's `overlap`), every Z-sharded weight, a group of its own (reduce axes "data")
    whose backward order is its reverse registration order already: the same buckets. Always the same bytes."""
    if grad_sync not in GRAD_SYNCS:
        raise ValueError(f"grad_sync={grad_sync!r} is invalid: use one of {', '.join(map(repr, GRAD_SYNCS))}")
    params, ready = ordered_parameters(shape, grid, mode)
    order = range(len(params) - 1, -1, -1) if first_step else ready
    caps = (first_bucket_bytes, bucket_bytes) if grad_sync == "overlap" else (math.inf, math.inf)
    entries = ((live, i, params[i].numel * param_bytes) for i in order
               if (live := tuple(a for a in params[i].reduce_axes if grid.size(a) > 1)))  # none: not synced
    return {axes: [sum(params[i].numel * param_bytes for i in b) for b in buckets]
            for axes, buckets in cut_buckets(entries, *caps).items()}


def gradient_records(shape: Shape, grid: Grid, mode: str, param_bytes: int = 4, **sync) -> Counter:
    """The gradient sync of `step_records`: one all-reduce per bucket of `gradient_buckets` (its keywords: the
    trainer's default, the overlapped sync, unless grad_sync="blocking")."""
    log = Log(grid)
    for axes, buckets in gradient_buckets(shape, grid, mode, param_bytes, **sync).items():
        for nbytes in buckets:
            log.add("all_reduce", axes, nbytes)
    return log.records


# ---------------------------------------------------------------------------------------------------
# Memory per rank.


def state_bytes(shape: Shape, grid: Grid, mode: str, param_bytes: int = 4, offload: bool = False,
                grad_sync: str = "overlap") -> dict[str, int]:
    """Device bytes of parameters, gradients (same dtype) and torch AdamW state: exp_avg and exp_avg_sq in the
    parameter dtype plus one fp32 `step` scalar per parameter tensor. With optimizer offload
    (memtrain/training/offload.py) the optimizer holds nothing on the device (see `host_bytes`).
    grad_buckets: the overlapped sync (grad_sync "overlap", the trainer's default) keeps a flat buffer per bucket,
    in the parameter dtype, from one step to the next: every gradient it syncs (those with a live reduce axis, data = 1
    too: the norms over z > 1, easy mode's over any axis) once more. The blocking sync's are temporaries."""
    params = parameters(shape, grid, mode)
    n = sum(p.numel for p in params) * param_bytes
    if grad_sync not in GRAD_SYNCS:
        raise ValueError(f"grad_sync={grad_sync!r} is invalid: use one of {', '.join(map(repr, GRAD_SYNCS))}")
    synced = sum(p.numel for p in params if any(grid.size(a) > 1 for a in p.reduce_axes)) * param_bytes  # the buckets'
    return {"params": n, "grads": n, "optimizer": 0 if offload else 2 * n + FP32 * len(params),
            "grad_buckets": synced if grad_sync == "overlap" else 0}


def host_bytes(shape: Shape, grid: Grid, mode: str, param_bytes: int = 4) -> dict[str, int]:
    """Host bytes of an offloaded optimizer (OffloadAdamW): fp32 master weights, fp32 exp_avg and exp_avg_sq, a
    `step` scalar per parameter tensor, and a staging buffer per gradient in the device's parameter dtype."""
    params = parameters(shape, grid, mode)
    n = sum(p.numel for p in params)
    return {"masters": FP32 * n, "moments": 2 * FP32 * n, "steps": FP32 * len(params), "grads": n * param_bytes}


def offload_traffic(shape: Shape, grid: Grid, mode: str, param_bytes: int = 4, host_is_device: bool = False) -> int:
    """Bytes an offloaded optimizer moves between device and host per step: every gradient down, every updated
    weight up, in the device's parameter dtype (the cast to bf16 happens on the host). Zero where the devices
    are CPUs: host memory is device memory."""
    if host_is_device:
        return 0
    return 2 * param_bytes * sum(p.numel for p in parameters(shape, grid, mode))


def activation_bytes(shape: Shape, grid: Grid, mode: str, tokens: int, *, precision: str = "fp32",
                     param_bytes: int = 4, checkpointing: bool = False) -> int:
    """An estimate of the tensors autograd keeps for one micro-batch of `tokens` rows on this rank.

    Counted per token and block: norm inputs and outputs, each distinct matmul input, q/k/v before and after
    rotary, attention output (a fused kernel: no S x S scores), the MLP hidden tensors; then the loss's fp32
    softmax over this rank's vocabulary slice. Easy mode holds HF's layers at full width, and on a grid with
    x*y > 1 each engine Linear saves its own plane rows (|y| x its input). With checkpointing a block keeps
    only its input, and one block's tensors live again while it is recomputed. With z = 1 under bf16 autocast
    over wider parameters, each matmul weight's bf16 copy is kept for backward too (parallel/linear.py), a
    block's only while the block's tensors are. Allocator slack and
    temporaries are not counted. Against autograd's saved tensors on one process at 512 tokens: +8% for
    ladder-10m/30m, -4%/+5% for pythia-70m, -25% for gpt2 (its attention keeps the S x S scores).
    """
    pb, cb = param_bytes, (2 if precision == "bf16" else param_bytes)
    x, y = (grid.x, grid.y) if mode == "sharded" else (1, 1)
    h, q, kv = shape.hidden // x, shape.heads * shape.head_dim // y, shape.kv_heads * shape.head_dim // y
    i = shape.intermediate // y
    mlp = (4 if shape.gated_mlp else 2) * i
    per_token = 2 * h * (pb + FP32) + 2 * h * cb + (3 * q + 3 * kv) * cb + mlp * cb
    if mode == "easy" and grid.x * grid.y > 1:  # each engine Linear saves its own plane rows, |y| x in
        per_token += sum(grid.y * m.cols * cb for m in shape.block if isinstance(m, Matrix)) - 2 * h * cb
    head = tokens * vocab_rows(shape, grid) // grid.y * FP32  # the loss keeps its fp32 softmax
    if mode == "easy":
        head *= grid.y  # easy mode's loss runs on the |y| x rows of this rank's plane column
    if grid.z == 1 and cb < pb:
        per_block = sum(m.rows // grid.size(b) * (m.cols // grid.size(a)) * cb
                        for m in shape.block if isinstance(m, Matrix) for a, b in [feature_axes(m, mode)])
        head += vocab_rows(shape, grid) // grid.y * (shape.hidden // grid.x) * cb
    else:
        per_block = 0
    if checkpointing:
        blocks = tokens * h * pb * shape.layers + tokens * per_token + per_block
    else:
        blocks = (tokens * per_token + per_block) * shape.layers
    return blocks + tokens * h * pb + head
