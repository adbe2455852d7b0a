"""Exact communication and per-rank memory of one training step, from the model's shape and the grid.

memtrain's trainer (memtrain/training/step.py) runs, per optimizer step: for each micro-batch the forward and
backward of the parallelized model (memtrain/hf decides which HF layer becomes which engine layer, in which
mode), then `sync_gradients`, the global gradient norm of clipping, and one all-reduce of the step's loss
sums. Every collective of that goes through parallel.comm and is recorded in parallel.LEDGER as a
`parallel.comm.Record` (op, axes label, group size, payload bytes). `step_records` predicts that multiset
without running anything, one function per layer kind, each transcribing its layer's code path
(parallel/linear.py, embedding.py, norm.py, grads.py), from the block list the architecture object gives
(memtrain/hf/architectures.py) and the engine's own Grid; tests/memtrain/plan/test_cost.py compares it with the
ledger record for record. With optimizer offload (train.optimizer_offload) the AdamW state leaves the device:
`state_bytes(offload=True)`, `host_bytes` and `offload_traffic` give what stays, what the host holds and what
crosses between them, tested against OffloadAdamW's own tensors (tests/memtrain/plan/test_offload.py).

Dtypes, as the code casts them (pb = parameter bytes, cb = matmul bytes: 2 under bf16 autocast):
- weight all-gathers over Z of Linear and LM head: the matmul dtype when narrower, min(pb, cb) (the shard is
  cast before the gather); the embedding's Z all-gather (its lookup stays in the table's dtype), the weight
  reduce-scatters over Z and the gradient buckets: the parameter dtype;
- matmul outputs and their gradients (Linear and LM-head reductions, easy-mode output edges): cb;
- the embedding output and the residual stream (the input edge of an easy-mode layer fed by it): pb;
  norm statistics and the vocabulary-parallel loss: fp32; token ids and labels: int64.
"""

from __future__ import annotations

from collections import Counter

from memtrain.hf.architectures import Matrix, Norm, Shape, architecture_of
from parallel import AXES, Grid, padded_vocab
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
    """A predicted ledger: how many times each `Record` is issued."""

    def __init__(self, grid: Grid):
        self.grid, self.records = grid, Counter()

    def add(self, op: str, axes, nbytes: int, times: int = 1) -> None:
        p = self.grid.size(axes)
        if p > 1 and times:  # groups of one member record nothing (parallel.comm)
            self.records[Record(op, self.grid.label(axes), p, int(nbytes))] += times


def linear(log: Log, m: Matrix, mode: str, t: int, pb: int, cb: int, fwd: int, bwd: int) -> None:
    A, B = feature_axes(m, mode)
    a, b = log.grid.size(A), log.grid.size(B)
    block = m.rows // b * (m.cols // a)
    gathered = block * min(pb, cb)  # ShardedWeight.gather_dtype: the shard is cast before the Z gather
    if mode == "sharded":  # linear.py: gather Z; y = x W^T, all-reduce A | dx all-reduce B; dW reduce-scatter Z
        log.add("all_gather", "z", gathered, fwd)
        log.add("all_reduce", A, t * m.rows // b * cb, fwd)
        log.add("all_gather", "z", gathered, bwd)
        log.add("all_reduce", B, t * m.cols // a * cb, bwd)
        log.add("reduce_scatter", "z", block * pb, bwd)
        return
    ib = cb if m.compute_input else pb
    plane = t * a * b  # rows the x*y plane multiplies
    log.add("all_to_all", A, t * m.cols * ib, fwd + bwd)  # features -> rows, and back in backward
    log.add("all_gather", B, plane * m.cols // a * ib, fwd)
    log.add("all_gather", "z", gathered, fwd + bwd)
    log.add("reduce_scatter", A, plane * m.rows // b * cb, fwd)
    log.add("all_to_all", B, t * m.rows * cb, fwd + bwd)  # rows -> features, and back in backward
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
        log.add("all_reduce", "y", t * h // g.x * cb, bwd)
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
# Parameters per rank: what sync_gradients buckets, what the optimizer holds.


def parameters(shape: Shape, grid: Grid, mode: str) -> list[tuple[int, tuple[str, ...]]]:
    """(values on this rank, gradient reduce axes) of every distinct parameter (parallel.sharding tags)."""
    g, vocab, h = grid, vocab_rows(shape, grid), shape.hidden
    out = []
    table = (vocab // g.y * (h // g.x) // g.z, ("data",))
    out += [table] * (1 if shape.tied else 2)  # embedding, LM head
    for _ in range(shape.layers):
        for m in shape.block:
            if isinstance(m, Matrix):
                a, b = feature_axes(m, mode)
                out.append((m.rows // g.size(b) * (m.cols // g.size(a)) // g.z, ("data",)))
                if m.bias:
                    out.append((m.rows // g.size(b), ("z", "data") if mode == "sharded" else (a, "z", "data")))
    norms = [n for n in shape.block if isinstance(n, Norm)] * shape.layers + [shape.final_norm]
    local, reduce = (h // g.x, ("z", "data")) if mode == "sharded" else (h, AXES)  # easy: HF's, untagged
    for n in norms:
        out += [(local, reduce)] * (2 if n.bias else 1)
    if shape.positions:
        out.append((shape.positions * local, reduce))
    return out


def step_records(shape: Shape, grid: Grid, mode: str, batch: int, seq: int, micro: int | None = None, *,
                 precision: str = "fp32", param_bytes: int = 4, checkpointing: bool = False) -> Counter:
    """The ledger of one optimizer step of memtrain's trainer, record for record.

    micro: sequences per rank per forward/backward (None: all of the rank's rows, the trainer's default).
    checkpointing: each block's forward runs again in backward (HF-style per-block recomputation), so its
        forward collectives count twice (train.activation_checkpointing).
    """
    pb, cb = param_bytes, (2 if precision == "bf16" else param_bytes)
    split = rows_split(grid, mode)
    local = batch // split
    micro = micro or local
    n_micro, t = local // micro, micro * seq
    vocab = vocab_rows(shape, grid)
    log = Log(grid)
    L, redo = shape.layers, 2 if checkpointing else 1
    embedding(log, shape, vocab, mode, t, pb, n_micro, n_micro)
    for part in shape.block:
        if isinstance(part, Matrix):
            linear(log, part, mode, t, pb, cb, n_micro * L * redo, n_micro * L)
        else:
            norm(log, part, mode, t, n_micro * L * redo, n_micro * L)
    norm(log, shape.final_norm, mode, t, n_micro, n_micro)
    lm_head(log, shape, vocab, mode, t, pb, cb, n_micro, n_micro)
    log.records.update(gradient_records(shape, grid, mode, pb))
    log.add("all_reduce", AXES, 8)  # grad_norm: one float64 over the world (clipping or not)
    log.add("all_reduce", AXES if mode == "easy" else ("z", "data"), 4 * 8)  # the step's loss sums (float64)
    return log.records


def gradient_records(shape: Shape, grid: Grid, mode: str, param_bytes: int = 4) -> Counter:
    """The gradient sync of `step_records`: one flat all-reduce per distinct set of live reduce axes (grads.py;
    the overlapped bucketed sync moves the same bytes)."""
    log, buckets = Log(grid), Counter()
    for numel, axes in parameters(shape, grid, mode):
        buckets[grid.label(axes)] += numel
    for lab, numel in buckets.items():
        if lab != "none":
            log.add("all_reduce", tuple(lab.split("+")), numel * param_bytes)
    return log.records


# ---------------------------------------------------------------------------------------------------
# Memory per rank.


def state_bytes(shape: Shape, grid: Grid, mode: str, param_bytes: int = 4, offload: bool = False) -> dict[str, int]:
    """Device bytes of parameters, gradients (same dtype) and torch AdamW state: exp_avg and exp_avg_sq in the
    parameter dtype plus one fp32 `step` scalar per parameter tensor. With optimizer offload
    (memtrain/training/offload.py) the optimizer holds nothing on the device (see `host_bytes`)."""
    params = parameters(shape, grid, mode)
    n = sum(v for v, _ in params) * param_bytes
    return {"params": n, "grads": n, "optimizer": 0 if offload else 2 * n + FP32 * len(params)}


def host_bytes(shape: Shape, grid: Grid, mode: str, param_bytes: int = 4) -> dict[str, int]:
    """Host bytes of an offloaded optimizer (OffloadAdamW): fp32 master weights, fp32 exp_avg and exp_avg_sq, a
    `step` scalar per parameter tensor, and a staging buffer per gradient in the device's parameter dtype."""
    params = parameters(shape, grid, mode)
    n = sum(v for v, _ in params)
    return {"masters": FP32 * n, "moments": 2 * FP32 * n, "steps": FP32 * len(params), "grads": n * param_bytes}


def offload_traffic(shape: Shape, grid: Grid, mode: str, param_bytes: int = 4, host_is_device: bool = False) -> int:
    """Bytes an offloaded optimizer moves between device and host per step: every gradient down, every updated
    weight up, in the device's parameter dtype (the cast to bf16 happens on the host). Zero where the devices
    are CPUs: host memory is device memory."""
    if host_is_device:
        return 0
    return 2 * param_bytes * sum(v for v, _ in parameters(shape, grid, mode))


def activation_bytes(shape: Shape, grid: Grid, mode: str, tokens: int, *, precision: str = "fp32",
                     param_bytes: int = 4, checkpointing: bool = False) -> int:
    """An estimate of the tensors autograd keeps for one micro-batch of `tokens` rows on this rank.

    Counted per token and block: norm inputs and outputs, each distinct matmul input, q/k/v before and after
    rotary, attention output (a fused kernel: no S x S scores), the MLP hidden tensors; then the loss's fp32
    softmax over this rank's vocabulary slice. Easy mode holds HF's layers at full width, and on a grid with
    x*y > 1 each engine Linear saves its own plane rows (|y| x its input). With checkpointing a block keeps
    only its input, and one block's tensors live again while it is recomputed. Allocator slack and
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
    if checkpointing:
        blocks = tokens * h * pb * shape.layers + tokens * per_token
    else:
        blocks = tokens * per_token * shape.layers
    return blocks + tokens * h * pb + head
