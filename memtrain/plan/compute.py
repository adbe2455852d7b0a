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
Not counted: the embedding lookup, norms, activations, rotary, the loss's softmax, AdamW, and framework overhead.
They are memory-bound or fixed costs, a small share of a large model's step on GPUs but not of a tiny model's on
a CPU, where the prediction falls short by them (experiments/bench/planner.py reports by how much).

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
kinds sharing one link:
    step = compute + blocking + max(0, grads - last backward, weights + grads - compute)
i.e. the gradient all-reduce hides behind the last backward at most, and the two together behind all compute.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from memtrain.hf.architectures import Matrix, Shape
from memtrain.plan import cost
from memtrain.plan.network import Network
from parallel import Grid
from parallel.comm import Record

FLASH_BACKWARD = 2.5
"""Attention's backward over its forward: dS, dV, dQ, dK and the recomputed scores, 5 products for 2."""


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
    params = shape.layers * sum(m.rows * m.cols for m in shape.block if isinstance(m, Matrix))
    params += shape.vocab * shape.hidden
    tokens = batch * seq
    return 6.0 * params * tokens + 12.0 * shape.layers * shape.heads * shape.head_dim * seq * tokens


def step_compute(shape: Shape, grid: Grid, mode: str, batch: int, seq: int, micro: int | None, net: Network,
                 precision: str = "fp32", checkpointing: bool = False) -> Compute:
    """FLOPs and seconds of one optimizer step on this rank, at `net`'s matmul rates."""
    local = batch // cost.rows_split(grid, mode)
    micro = micro or local
    n_micro = local // micro
    mm = micro_matmuls(shape, grid, mode, micro, seq)
    flops = {key: sum(2.0 * m * k * n * c for (m, k, n), c in calls.items()) for key, calls in mm.items()}
    secs = {key: sum(net.matmul_seconds(m, k, n, precision) * c for (m, k, n), c in calls.items())
            for key, calls in mm.items()}
    att, (m, k, n) = attention(shape, grid, mode, micro, seq)
    att_s = att * net.matmul_seconds(m, k, n, precision) / (2.0 * m * k * n)
    redo = 1 if checkpointing else 0  # the blocks' forward again in backward
    backward_flops = flops["blocks_backward"] + flops["head_backward"] + att * (FLASH_BACKWARD + redo) \
        + flops["blocks"] * redo
    backward_s = secs["blocks_backward"] + secs["head_backward"] + att_s * (FLASH_BACKWARD + redo) \
        + secs["blocks"] * redo
    forward_flops, forward_s = flops["blocks"] + flops["head"] + att, secs["blocks"] + secs["head"] + att_s
    return Compute(n_micro * (forward_flops + backward_flops), n_micro * (forward_s + backward_s), backward_s,
                   model_flops(shape, batch, seq))


# ---------------------------------------------------------------------------------------------------
# Overlap.


def comm_seconds(records: Counter, gradients: Counter, seconds) -> dict[str, float]:
    """Seconds of a step's records (cost.step_records) by what overlap can do with them: "weights" (Z all-gathers
    and reduce-scatters), "grads" (the gradient all-reduce, cost.gradient_records), "blocking" (the rest).
    `seconds(record)` is one record's time."""
    out = {"blocking": 0.0, "weights": 0.0, "grads": 0.0}
    for r, n in gradients.items():
        out["grads"] += n * seconds(r)
    for r, n in (records - gradients).items():
        out["weights" if _weights(r) else "blocking"] += n * seconds(r)
    return out


def _weights(r: Record) -> bool:
    return r.axes == "z" and r.op in ("all_gather", "reduce_scatter")


def step_seconds(compute: float, last_backward: float, comm: dict[str, float]) -> float:
    """Predicted step time: compute + blocking communication + what overlap leaves exposed (module docstring)."""
    weights, grads = comm["weights"], comm["grads"]
    return compute + comm["blocking"] + max(0.0, grads - last_backward, weights + grads - compute)
