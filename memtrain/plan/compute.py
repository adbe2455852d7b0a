"""Compute of one optimizer step per rank, and the step time it makes with the communication overlap cannot hide.

FLOPs are counted as torch.utils.flop_counter counts them (a [m, k] x [k, n] product is 2mkn), per rank:
- every Linear of every block and the LM head: one matmul per micro-batch forward and two in backward (dx and
  dW), on this rank's block [out/|B|, in/|A|] of the weight (cost.feature_axes; parallel/linear.py):
  sharded mode: rows = this rank's tokens (the batch splits over data x z), k = in/|A|, n = out/|B|;
  easy mode: the edges gather the x*y plane's rows first, so rows = |x||y| x this rank's tokens (the batch
  splits over every rank), with the same k and n: each rank does the unsharded model's matmuls on its own rows.
  The LM head's vocabulary is the padded one (cost.vocab_rows): padded rows are multiplied too.
- attention's score and value products (SDPA): 4 x tokens x seq x head_dim per query head forward over the full
  S x S square (torch's counter and PaLM's MFU convention; a causal kernel skips about half of it), 2.5x that in
  backward (flash kernels recompute the scores: 5 products for the forward's 2). Sharded mode: this rank's tokens,
  heads over Y, so X members repeat the same attention; easy mode: the rank's own tokens, every head.
- activation checkpointing runs each block's forward (matmuls and attention) again in backward.
Besides matmuls (the non-matmul term, at the rates `memtrain plan --measure` probes; probes.py says how), per rank:
- kernels: a training step's time per kernel beyond the kernel's work (op_overhead_s: dispatch, allocation, views,
  modules' Python, autograd, probed as a tiny real step's time per kernel) times the kernels a step dispatches
  besides its matmuls, attention and collectives (`kernel_ops`): per block its norms, biases, activation, residual
  adds, rotary and attention's re-layouts, counted with torch's dispatcher on the three families (test_compute.py
  compares the total with a real step's), plus easy mode's re-layouts around each Linear on a grid with x or y > 1
  and the sharded norms' all-reduces on x > 1;
- elementwise work: per kind, seconds per element times the activation elements this rank puts through such
  layers (`micro_elements`): norms, SiLU x mul, rotary on q and k, adds and copies (residual adds, biases,
  attention's output, easy mode's re-layouts), and the loss's softmax over this rank's vocabulary rows;
- AdamW with the gradient clipping before it: per element and per tensor of this rank's shards
  (cost.parameters: sharding over Z halves its elements). It runs after the last collective, so no communication
  hides behind it; with optimizer offload it runs on the host, and is not counted (search.py passes offload
  only where the host is not the rank itself: CPU ranks run it in their step);
- attention: where its kernel was measured, the larger of its products at the matmul rate and the measured
  seconds per score (at tiny head sizes a CPU spends them on the softmax, not the products).
Why these terms: on a CPU rank of a tiny model a step is mostly not matmuls, and timing one phase at a time
(ladder-1m, 8 ranks on 2 cores, data = 8) found a fixed ~50 ms of forward + backward at 8 tokens (kernels), AdamW
and clipping ~20 ms, and flash attention's backward at head size 8 several times its products; each grows with
something the grid sets (kernels with re-layouts, elements with the shard's widths and rows, AdamW with the
shards, scores with the local heads). A fixed model: rates are probed, never fitted to steps. The elementwise
rates are slopes between two sizes, so the fixed cost per kernel counts once; backward is taken as two thirds of
each forward + backward (BACKWARD_SHARE), the part the gradient all-reduce can hide behind and whose complement
recomputation repeats. Still not counted: the embedding lookup's and the ends' re-layouts, host work between
steps, and ranks waiting for one another beyond the probes. A machine without these rates (a preset, an older
table) counts no non-matmul time.

Each matmul takes `Network.matmul_seconds` for its shape (a measured GFLOP/s table, or peak x efficiency):
small shards run below peak. Attention runs at the rate of one [rows x local heads, head_dim] x [head_dim, seq]
product (a batched kernel over every head and sequence).

Model FLOPs (MFU's numerator) are the unsharded model's: 6 x matmul parameters x tokens + 12 x layers x heads x
head_dim x seq x tokens, no recomputation, no padding; MFU = model FLOPs / (step time x GPUs x peak).

Step time. The engine overlaps two kinds of communication (train_step with overlap=True, grad_sync="overlap"):
the weights' Z all-gathers (prefetched one layer ahead) and reduce-scatters (deferred) run beside any
micro-batch's compute; the gradient all-reduce (buckets launched as gradients become final) runs beside the last
micro-batch's backward. Everything else (X/Y reductions and re-layouts of activations, norm statistics, the loss,
the gradient norm) is on the critical path; OAR's window, one dW matmul per layer, is not credited. With both
kinds sharing one link, at full overlap:
    exposed = max(0, grads - last backward, weights + grads - (compute - optimizer))
i.e. the gradient all-reduce hides behind the last backward at most, and the two together behind all compute
before the optimizer (which needs the summed gradients). Of what could hide, the machine's `overlap` fraction does
(Network.overlap: 1 for a GPU preset; measured, CPU ranks hide little, their collectives needing the cores):
    step = compute + blocking + weights + grads - overlap x (weights + grads - exposed)
The weights' and gradients' collectives are issued async, each queued behind the one before, so they take a
measured machine's streamed times; easy mode's re-layouts, which follow one another, its times of blocking calls
back to back; the rest its times of one call after compute (`series`, network.Network.seconds), but for sharded
mode's OAR all-reduces (cost.Log.oar): issued async and waited only after the weight gradient's matmul (part of
the members' arrival skew passes behind it), they take the streamed time too, on the critical path. Chosen
on two runs of bench.planner (ladder-1m, 8 gloo ranks on 2 cores), where charged the time after compute the
grids with two tensor axes were predicted at 1.15-1.3x their measured time (sharded median ratio error 0.117 and
0.154; 0.100 and 0.114 with the streamed time); in three more runs 0.083, 0.097 and 0.092 against 0.131, 0.116
and 0.139 the old way. The cost: an OAR over all 8 ranks, (1, 1, 8, 1), took more than its streamed time, that
grid now predicted at 0.75-0.8x, and the sharded Spearman fell from 0.971-0.983 to 0.943-0.958.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from memtrain.hf.architectures import Matrix, Norm, Shape
from memtrain.plan import cost
from memtrain.plan.network import CHAINED_OPS, Network
from parallel import Grid
from parallel.comm import Record

FLASH_BACKWARD = 2.5
"""Attention's backward over its forward: dS, dV, dQ, dK and the recomputed scores, 5 products for 2."""
BACKWARD_SHARE = 2 / 3
"""Backward's share of an elementwise layer's or a kernel's forward + backward (two passes for the forward's one)."""

# Kernels of one forward + backward, counted with torch's dispatcher (views excluded) at one rank on the tiny
# llama, gpt2 and neox models.
NORM_KERNELS = {("sharded", 1): 19, ("sharded", 2): 26, ("easy", 1): 21, ("easy", 2): 3}
"""(mode, statistics) -> kernels of a norm: the engine's RMSNorm (1) or LayerNorm (2) in sharded mode at x = 1,
transformers' own in easy mode (Llama's RMSNorm as separate ops, torch's fused layer_norm)."""
SPLIT_NORM_KERNELS = {1: 5, 2: 9}
"""statistics -> a sharded-mode norm's further kernels over x > 1: each statistic a sum and a division where
x = 1 takes torch's mean, and its all-reduce's clones of the input, forward and backward."""
BIAS_KERNELS = 3
"""A bias: its add, and in backward the sum over rows and the gradient's accumulation."""
ACTIVATION_KERNELS = {True: 6, False: 3}
"""The MLP's activation: SiLU(gate) x up (gated), or one GELU."""
RESIDUAL_KERNELS = 4
"""The block's two residual adds and the sums of their gradients."""
ATTENTION_KERNELS = 11
"""Around SDPA: q, k and v to heads, the output back to rows (a copy), and their gradients."""
ROTARY_KERNELS = 16
"""Rotary embedding of q and k (products with cos and sin, rotate_half's negation and concatenation), and backward."""
END_KERNELS = 74
"""Per micro-batch outside the blocks, the final norm and the embedding: rotary's tables, the LM head's loss (7 of
them check its labels' range) and its sums."""
EMBEDDING_KERNELS = {False: 18, True: 2}
"""Whether the grid has no tensor parallelism -> the embedding's kernels: the engine's lookup (5 of them check the
ids' range), or torch's (parallel/embedding.py)."""


@dataclass
class Compute:
    """One rank's compute in one optimizer step."""

    flops: float
    """FLOPs this rank runs per step (recomputation and padded vocabulary included)."""
    seconds: float
    """Their time at the machine's matmul rates."""
    last_backward_seconds: float
    """The last micro-batch's backward: what the gradient all-reduce can hide behind."""
    model_flops: float
    """The unsharded model's FLOPs per step, all ranks together (MFU's numerator)."""
    other_seconds: float = 0.0
    """The non-matmul term (included in `seconds`): kernels' fixed cost, elementwise work, AdamW and attention's time
    beyond its products at the matmul rate."""
    optimizer_seconds: float = 0.0
    """AdamW's share of `other_seconds`: it runs after every collective, so none hides behind it."""


def micro_matmuls(shape: Shape, grid: Grid, mode: str, micro: int, seq: int) -> dict[str, Counter]:
    """Matmul shapes (m, k, n) -> calls of one micro-batch on this rank: "blocks" (the forward of every block),
    "head" (the LM head's forward), and "blocks_backward" / "head_backward" (dx and dW of each)."""
    t = micro * seq
    scale = grid.x * grid.y if mode == "easy" else 1  # easy mode: the plane's rows
    out = {key: Counter() for key in ("blocks", "blocks_backward", "head", "head_backward")}

    def add(key: str, rows: int, k: int, n: int, times: int) -> None:
        out[key][(rows, k, n)] += times  # y = x W^T
        out[key + "_backward"][(rows, n, k)] += times  # dx = dy W
        out[key + "_backward"][(n, rows, k)] += times  # dW = dy^T x

    for m in shape.block:
        if isinstance(m, Matrix):
            a, b = cost.feature_axes(m, mode)
            add("blocks", t * scale, m.cols // grid.size(a), m.rows // grid.size(b), shape.layers)
    add("head", t * scale, shape.hidden // grid.x, cost.vocab_rows(shape, grid) // grid.y, 1)
    return out


def attention(shape: Shape, grid: Grid, mode: str, micro: int, seq: int) -> tuple[float, tuple[int, int, int]]:
    """Forward FLOPs of every block's attention for one micro-batch on this rank, and the shape it runs at."""
    heads = shape.heads // grid.y if mode == "sharded" else shape.heads
    t = micro * seq
    return 4.0 * t * seq * shape.head_dim * heads * shape.layers, (t * heads, shape.head_dim, seq)


def model_flops(shape: Shape, batch: int, seq: int) -> float:
    """The unsharded model's training FLOPs per step: 6 x matmul parameters x tokens + attention (forward x 3)."""
    return shape.flops_per_token(seq) * batch * seq


def _relayouts(grid: Grid, m: Matrix, mode: str) -> tuple[int, int]:
    """(size of A, size of B) of an easy-mode Linear whose edges re-lay rows (1, 1: none, sharded mode)."""
    if mode != "easy":
        return 1, 1
    a, b = cost.feature_axes(m, mode)
    return grid.size(a), grid.size(b)


def _norm_kernels(n: Norm, grid: Grid, mode: str) -> int:
    """A norm's kernels (NORM_KERNELS, SPLIT_NORM_KERNELS)."""
    return NORM_KERNELS[(mode, n.stats)] + (SPLIT_NORM_KERNELS[n.stats] if mode == "sharded" and grid.x > 1 else 0)


def kernel_ops(shape: Shape, grid: Grid, mode: str, n_micro: int = 1, checkpointing: bool = False) -> float:
    """Kernels one optimizer step dispatches on this rank besides matmuls, attention, collectives and AdamW: per
    micro-batch every block's and the ends' (recomputation repeats a block's forward share), then per step the
    gradients' copies out of their all-reduce buckets and the accumulation of every micro-batch after the first.
    Over Z each Linear's weight gradient also lands from its deferred reduce-scatter (one kernel)."""
    block = ACTIVATION_KERNELS[shape.gated_mlp] + RESIDUAL_KERNELS + ATTENTION_KERNELS
    block += 0 if shape.positions else ROTARY_KERNELS
    for part in shape.block:
        if isinstance(part, Norm):
            block += _norm_kernels(part, grid, mode)
        else:  # an easy-mode Linear's edges: a copy each way per re-layout, two more when both axes split
            a, b = _relayouts(grid, part, mode)
            block += BIAS_KERNELS * part.bias + 2 * (a > 1) + 2 * (b > 1) + 4 * (a > 1 and b > 1) + (grid.z > 1)
    block *= 1 + (1 - BACKWARD_SHARE) * checkpointing
    params = cost.parameters(shape, grid, mode)
    synced = sum(1 for _, axes in params if grid.size(axes) > 1)
    ends = _norm_kernels(shape.final_norm, grid, mode) + END_KERNELS + EMBEDDING_KERNELS[grid.tensor_parallel_size == 1]
    return n_micro * (shape.layers * block + ends) + synced + (n_micro - 1) * len(params)


def micro_elements(shape: Shape, grid: Grid, mode: str, micro: int, seq: int) -> dict[str, float]:
    """Activation elements one micro-batch puts through each kind of elementwise layer (network.ELEMENTWISE) on
    this rank, counted once for its forward and backward. Sharded mode: this rank's tokens at its shard's widths;
    easy mode: its own tokens at full width (transformers' layers), plus the copies of the re-layouts around each
    Linear on the plane (features -> rows over A, rows -> features over B, and when both split the output's plane
    rows reordered before their reduce-scatter over A), and the loss over the plane column's rows (|y| x its
    tokens, each over V/|y|)."""
    t = micro * seq
    x, y = (grid.x, grid.y) if mode == "sharded" else (1, 1)
    h, i = shape.hidden // x, shape.intermediate // y
    q, kv = shape.heads * shape.head_dim // y, shape.kv_heads * shape.head_dim // y
    norms = shape.layers * sum(n.stats for n in shape.block if isinstance(n, Norm)) + shape.final_norm.stats
    adds = h * (2 * shape.layers + 1) + q * shape.layers  # residual adds, the embedding's output, attention's
    for m in shape.block:
        if isinstance(m, Matrix):
            a, b = _relayouts(grid, m, mode)
            out = m.rows // grid.size(cost.feature_axes(m, mode)[1]) if mode == "sharded" else m.rows
            adds += shape.layers * (out * m.bias + m.cols * (a > 1) + m.rows * (b > 1) + a * m.rows * (a > 1 and b > 1))
    vocab = cost.vocab_rows(shape, grid)
    if mode == "easy" and grid.x > 1:  # the LM head's edge: features -> rows, its plane's logits reordered
        adds += shape.hidden + grid.x * vocab * (grid.y > 1)
    return {"norm": t * h * norms, "act": t * i * shape.layers, "add": t * adds,
            "rotary": 0 if shape.positions else t * (q + kv) * shape.layers,
            "loss": t * vocab // (1 if mode == "easy" else grid.y)}


def step_compute(shape: Shape, grid: Grid, mode: str, batch: int, seq: int, micro: int | None, net: Network,
                 precision: str = "fp32", checkpointing: bool = False, offload: bool = False) -> Compute:
    """FLOPs and seconds of one optimizer step on this rank: matmuls at `net`'s rates and the non-matmul term (module
    docstring; zero where `net` has no rates for it). offload: AdamW runs on a host apart from the rank, not
    counted."""
    local = batch // cost.rows_split(grid, mode)
    micro = micro or local
    n_micro = local // micro
    mm = micro_matmuls(shape, grid, mode, micro, seq)
    flops = {key: sum(2.0 * m * k * n * c for (m, k, n), c in calls.items()) for key, calls in mm.items()}
    secs = {key: sum(net.matmul_seconds(m, k, n, precision) * c for (m, k, n), c in calls.items())
            for key, calls in mm.items()}
    att, (m, k, n) = attention(shape, grid, mode, micro, seq)
    att_s = att * net.matmul_seconds(m, k, n, precision) / (2.0 * m * k * n)  # forward, at the matmul rate
    att_fwd, att_back = att_s, att_s * FLASH_BACKWARD
    measured = net.attention_seconds(shape.head_dim, precision)
    if measured:  # per score of the full square, as the probe counts them: this rank's heads, every layer
        scores = micro * seq * seq * (shape.heads // grid.y if mode == "sharded" else shape.heads) * shape.layers
        att_fwd, att_back = max(att_fwd, scores * measured[0]), max(att_back, scores * measured[1])
    redo = 1 if checkpointing else 0  # the blocks' forward again in backward
    backward_flops = flops["blocks_backward"] + flops["head_backward"] + att * (FLASH_BACKWARD + redo) \
        + flops["blocks"] * redo
    backward_s = secs["blocks_backward"] + secs["head_backward"] + att_back + (att_fwd + secs["blocks"]) * redo
    forward_flops, forward_s = flops["blocks"] + flops["head"] + att, secs["blocks"] + secs["head"] + att_fwd
    elementwise = sum(net.elementwise.get(kind, 0.0) * count * (1 + (1 - BACKWARD_SHARE) * redo * (kind != "loss"))
                      for kind, count in micro_elements(shape, grid, mode, micro, seq).items())
    # The per-step kernels (a few per parameter tensor) spread over the micro-batches with the rest.
    per_micro = net.op_overhead_s * kernel_ops(shape, grid, mode, n_micro, checkpointing) / n_micro + elementwise
    params = cost.parameters(shape, grid, mode)
    per_element, per_tensor = net.optimizer or (0.0, 0.0)
    optimizer = 0.0 if offload else per_element * sum(v for v, _ in params) + per_tensor * len(params)
    attention_beyond = att_fwd * (1 + redo) + att_back - att_s * (1 + FLASH_BACKWARD + redo)
    return Compute(n_micro * (forward_flops + backward_flops),
                   n_micro * (forward_s + backward_s + per_micro) + optimizer,
                   backward_s + BACKWARD_SHARE * per_micro, model_flops(shape, batch, seq),
                   n_micro * (per_micro + attention_beyond) + optimizer, optimizer)


# ---------------------------------------------------------------------------------------------------
# Overlap.


def issued(records: Counter, gradients: Counter, oar: Counter):
    """A step's records (cost.step_records, whose `gradients` and `oar` are parts of it) as (record, times, class,
    series): the class by what overlap can do with them, "weights" (Z all-gathers and reduce-scatters), "grads"
    (the gradient all-reduce, cost.gradient_records) or "blocking" (the rest, `oar`'s records among them at their
    streamed time: module docstring); the series how they are issued (network.SERIES)."""
    for r, n in gradients.items():
        yield r, n, "grads", "streamed"
    for r, n in oar.items():
        yield r, n, "blocking", "streamed"
    for r, n in (records - gradients - oar).items():
        yield r, n, "weights" if weights(r) else "blocking", series(r, gradients)


def comm_seconds(records: Counter, gradients: Counter, oar: Counter, seconds) -> dict[str, float]:
    """Seconds of a step's records per class of `issued`; `seconds(record, series)` is one record's time, issued
    as `series` says."""
    out = {"blocking": 0.0, "weights": 0.0, "grads": 0.0}
    for r, n, kind, how in issued(records, gradients, oar):
        out[kind] += n * seconds(r, how)
    return out


def weights(r: Record) -> bool:
    """Whether a record is a weight's Z all-gather or reduce-scatter (the engine prefetches and defers them)."""
    return r.axes == "z" and r.op in ("all_gather", "reduce_scatter")


def series(r: Record, gradients=()) -> str:
    """How the engine issues a record (network.SERIES): "streamed", async and queued behind others of its class (a
    gradient bucket or a weight's Z collective); "chained", blocking right after another (an activation's
    re-layout: network.CHAINED_OPS, which sharded mode issues only over Z); else "isolated", blocking after
    compute."""
    if r in gradients or weights(r):
        return "streamed"
    return "chained" if r.op in CHAINED_OPS else "isolated"


def step_seconds(compute: float, last_backward: float, comm: dict[str, float], optimizer: float = 0.0,
                 overlap: float = 1.0) -> float:
    """Predicted step time: compute + blocking communication + what overlap leaves exposed (module docstring);
    `optimizer`, part of `compute`, runs after every collective; `overlap`, the fraction of what could hide that
    does (Network.overlap)."""
    async_s = comm["weights"] + comm["grads"]
    exposed = max(0.0, comm["grads"] - last_backward, async_s - (compute - optimizer))
    return compute + comm["blocking"] + async_s - overlap * (async_s - exposed)
