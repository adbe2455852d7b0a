"""Probes of this machine for the planner's table: what `memtrain plan --measure` runs, on every rank at once.

Ranks that share a CPU's cores (or a node's memory bandwidth) share them in the probes as in training, so every
rate is one rank's while all run: each timing's windows end at the same deadlines on every rank (`_timed`), and
matmuls take operands no cache holds (MATMUL_OPERAND_BYTES), as a step's do. In a process group each rank returns
the mean over ranks of every timing.
- collectives: `collectives.measure_collectives` (each op's time per group size and payload: alone, streamed, chained);
- matmuls: GFLOP/s per shape (`measure_matmuls`);
- what a step spends besides matmuls (`measure_other`), each rate timed on the torch ops a step runs, at sizes
  like a step's (compute.py's module docstring says what each rate multiplies):
  op_overhead_s  a training step at a size where its work is nothing (transformers' Llama through the engine
                 at one rank: 2 blocks of width 16, 8 tokens), forward and backward, less its matmuls timed
                 alone, per kernel the dispatcher runs in it (`Kernels`, the count compute.kernel_ops makes).
                 Not a chain of bare ops: those take the dispatcher and autograd alone (a fifth of a step's
                 time per kernel on a CPU), where a step's kernels also bring its views, its modules' Python
                 and its autograd Functions;
  elementwise    per kind, forward + backward of the engine's RMSNorm, SiLU(a) x b, a + b, rotary embedding and
                 the vocabulary-parallel cross-entropy, each at two sizes: the slope, seconds per element beyond
                 the fixed cost op_overhead_s already counts;
  optimizer      torch AdamW's step as the trainer builds it, after the gradient clipping it runs
                 (parallel.clip_grad_norm_), over one large tensor (per element) and 64 tiny ones (per tensor);
  attention      causal SDPA forward, and forward + backward, at head sizes 8, 32 and 128 (seconds per score:
                 one element of a head's seq x seq square), per precision the matmuls were measured in.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import parallel
from memtrain.files import write_atomic
from memtrain.hf import parallelize
from memtrain.plan.collectives import measure_collectives
from memtrain.plan.network import ELEMENTWISE, Network
from parallel.norm import RMSNorm

MATMUL_DIMS = (8, 32, 128, 512, 2048)
"""Sizes of m, k and n the matmul probe crosses (on GPUs 8192 too): the shard shapes of small and large models."""
MATMUL_BUDGET = {"cpu": 2**28, "cuda": 2**36}
"""Largest m*k*n timed per device type; a larger shape takes the best rate timed at a shape inside it."""
MATMUL_OPERAND_BYTES = {"cpu": 2**25, "cuda": 0}
"""Per device type, the bytes of distinct operands each shape's calls take in turn (at least one pair). A step's
matmuls each meet operands no cache holds (weights read once per pass, activations other kernels wrote), and on a
CPU whose cores several ranks share, the operands of one pair called again stay cached across the ranks' turns:
on 8 ranks sharing 2 cores (Intel Xeon, 4 MiB of L2 in all) a ladder-1m step's 129 matmuls on operands of their
own took 1.45x what the same calls took on one pair per shape (one rank alone: 1.09x). 32 MiB exceeds a CPU
core's L2; on a GPU, whose large products are compute-bound, one pair."""
MATMUL_OPERAND_PAIRS = 256
"""At most this many pairs per shape: more would only cost setup at the sizes where a call's fixed cost is its time."""
ELEMENTS = {"cpu": (2**14, 2**17), "cuda": (2**20, 2**24)}
"""The two sizes (elements) each elementwise kind is timed at: a tiny model's activations on a CPU rank, a large
model's on a GPU."""
OPTIMIZER_ELEMENTS = {"cpu": 2**20, "cuda": 2**24}
"""The large tensor of the optimizer probe: 4 MiB of fp32 on a CPU (a tiny model's shard), 64 MiB on a GPU."""
ATTENTION_HEAD_DIMS = (8, 32, 128)
ATTENTION_SHAPE = {"cpu": (32, 128), "cuda": (64, 1024)}
"""(batch x heads, seq) of the attention probe: 2^19 scores on a CPU, 2^26 on a GPU."""


def _mean_over_ranks(seconds: list[float], device) -> list[float]:
    """Each timing's mean over the process group's ranks (the timings themselves outside one)."""
    if not dist.is_initialized():
        return seconds
    t = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def measure_matmuls(precisions=("fp32", "bf16"), device=None, min_seconds: float = 0.02) -> dict:
    """GFLOP/s of [m, k] x [k, n] for m, k, n over MATMUL_DIMS, per precision (`Network.matmuls`).

    Run it on every rank at once, as training runs: ranks sharing a CPU's cores share them here too, so the rates
    are what one rank gets. Each shape is timed as `_timed` says, its calls taking the operand pairs of
    MATMUL_OPERAND_BYTES in turn.
    In a process group every rank returns the same table, from the mean over ranks of each shape's seconds."""
    device = torch.device(device or "cpu")
    cuda = device.type == "cuda"
    dims = MATMUL_DIMS + ((8192,) if cuda else ())
    where = "cuda" if cuda else "cpu"
    shapes = [s for s in itertools.product(dims, repeat=3) if math.prod(s) <= MATMUL_BUDGET[where]]
    largest = max(m * k + k * n for m, k, n in shapes)
    g = torch.Generator().manual_seed(0)
    out = {}
    for precision in precisions:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        pool = torch.randn(max(largest, MATMUL_OPERAND_BYTES[where] // dtype.itemsize), generator=g).to(device, dtype)
        seconds = []
        for m, k, n in shapes:
            size = m * k + k * n
            count = max(1, min(MATMUL_OPERAND_PAIRS, MATMUL_OPERAND_BYTES[where] // (size * dtype.itemsize)))
            pairs = [(pool[i * size:i * size + m * k].view(m, k), pool[i * size + m * k:(i + 1) * size].view(k, n))
                     for i in range(count)]
            seconds.append(_timed(_in_turn(torch.mm, pairs), cuda, min_seconds))
        rate = {s: 2 * math.prod(s) / t / 1e9 for s, t in zip(shapes, _mean_over_ranks(seconds, device))}
        out[precision] = {"dims": list(dims), "gflops": [[[_rate_at(rate, (m, k, n)) for n in dims] for k in dims]
                                                         for m in dims]}
    return out


def _in_turn(fn, operands: list):
    """A call of fn on the next of `operands` (tuples of arguments) each time, round and round."""
    turn = itertools.cycle(operands)
    return lambda: fn(*next(turn))


def _rate_at(rate: dict, shape: tuple) -> float:
    """The timed rate of `shape`, or (beyond the budget) the best rate timed at a shape no larger in any size."""
    if shape in rate:
        return rate[shape]
    return max(r for s, r in rate.items() if all(a <= b for a, b in zip(s, shape)))


def _timed(fn, cuda: bool, min_seconds: float) -> float:
    """Seconds per call of fn: a warm-up call, then the median of 3 windows of at least `min_seconds` each.

    On a CPU the windows end at the same deadlines on every rank of a process group (counted from a barrier), each
    rank calling fn until then, so that every rank keeps its share of the cores busy for the whole window, as all
    ranks do in a step. Loops of a count each rank sized from one timed call ended at different times instead, and
    the ranks done early left the rest the cores: on 8 ranks sharing 2 cores (Intel Xeon, 2026-11-28) the shapes of
    a ladder-1m step's matmuls then took 3.1x their time on one rank alone, less than the 4x that sharing 2 cores
    among 8 ranks must cost; timed to deadlines, 4.1x. A GPU is each rank's own: a count of calls sized from one,
    synchronised once."""
    sync = torch.cuda.synchronize if cuda else lambda: None
    fn()  # warm-up
    sync()
    if dist.is_initialized():
        dist.barrier()  # every rank runs the probe at the same time
    start = time.perf_counter()
    if cuda:
        fn()
        sync()
        calls = max(1, math.ceil(min_seconds / max(time.perf_counter() - start, 1e-9)))
    samples = []
    for window in range(1, 4):
        begin, done = time.perf_counter(), 0
        if cuda:
            for _ in range(calls):
                fn()
            sync()
            done = calls
        else:
            while not done or time.perf_counter() < start + window * min_seconds:
                fn()
                done += 1
        samples.append((time.perf_counter() - begin) / done)
    return statistics.median(samples)


# ---------------------------------------------------------------------------------------------------
# What a step spends besides matmuls.


class Kernels(TorchDispatchMode):
    """Counts the kernels compute.kernel_ops predicts: aten ops that run one (not a view, whose result aliases its
    input, nor an allocation without values), other than matmuls and attention; collectives are no aten ops.
    Keeps each matmul's op and argument shapes, to time them apart."""

    SKIP = frozenset({"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh",
                      "_local_scalar_dense", "is_same_size"})
    MATMULS = frozenset({"mm", "addmm", "bmm"})

    def __init__(self):
        super().__init__()
        self.n, self.matmuls = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name in self.MATMULS:
            self.matmuls.append((func, [a.shape if isinstance(a, torch.Tensor) else a for a in args]))
        elif func.namespace == "aten" and name not in self.SKIP and "attention" not in name and not any(
                r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _tiny_step(device):
    """Forward and backward of transformers' Llama through the engine at one rank, at a size where the work is
    nothing: 2 blocks of width 16 (2 heads), a vocabulary of 64, 8 tokens."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    plm = parallelize(model, parallel.Grid(1, 1, 1, 1, rank=0), "sharded", device=device, weights="seed")
    ids = torch.arange(8, device=device).view(1, 8)

    def step():
        for p in plm.parameters():
            p.grad = None  # as the trainer's zero_grad(set_to_none=True)
        plm.token_losses(ids, ids).sum().backward()

    return step


def _replay(calls, device):
    """The recorded matmuls again, on fresh operands of their shapes."""
    g = torch.Generator().manual_seed(0)
    ops = [(func, [torch.randn(a, generator=g).to(device) if isinstance(a, torch.Size) else a for a in args])
           for func, args in calls]
    return lambda: [func(*args) for func, args in ops]


def _forward_backward(fn, *shapes, device, dtype=torch.float32, params=(), backward: bool = True):
    """A call of fn on fresh inputs of `shapes`, forward and backward (autograd.grad: nothing accumulates), or
    forward only (still recording for autograd, as in training)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(*s, generator=g).to(device, dtype).requires_grad_() for s in shapes]
    if not backward:
        return lambda: fn(*xs)
    grad = torch.ones_like(fn(*xs))
    return lambda: torch.autograd.grad(fn(*xs), xs + list(params), grad)


def _elementwise_layers(device) -> dict:
    """kind -> (fn(n) -> a forward + backward over n elements of that kind)."""
    one = parallel.Grid(1, 1, 1, 1, rank=0)  # a 1-member group: the engine's layers without collectives
    width, vocab = 256, 1024

    def norm(n):
        layer = RMSNorm(width, grid=one, device=device)
        return _forward_backward(layer, (n // width, width), device=device, params=layer.parameters())

    def rotary(n):  # transformers' apply_rotary_pos_emb on one of q, k: cos and sin broadcast over the heads
        cos, sin = (torch.rand(n // width, 1, 32, device=device) for _ in range(2))
        return _forward_backward(lambda x: x * cos + torch.cat((-x[..., 16:], x[..., :16]), -1) * sin,
                                 (n // width, width // 32, 32), device=device)

    def loss(n):
        labels = torch.randint(0, vocab, (n // vocab,), device=device)
        return _forward_backward(lambda z: parallel.vocab_parallel_cross_entropy(z, labels, one, "y"),
                                 (n // vocab, vocab), device=device)

    return {"norm": norm, "rotary": rotary, "loss": loss,
            "act": lambda n: _forward_backward(lambda a, b: F.silu(a) * b, (n,), (n,), device=device),
            "add": lambda n: _forward_backward(torch.add, (n,), (n,), device=device)}


def _optimizer_step(tensors: int, numel: int, device):
    """The trainer's clipping and AdamW step over `tensors` parameters of `numel` values each."""
    params = [torch.nn.Parameter(torch.zeros(numel, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel, device=device)
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}  # as the trainer builds it on CUDA
    opt = torch.optim.AdamW([{"params": params, "weight_decay": 0.1}], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, **fused)
    one = parallel.Grid(1, 1, 1, 1, rank=0)

    def step():
        parallel.clip_grad_norm_(params, 1.0, one)
        opt.step()

    return step


def _attention(bh: int, seq: int, head_dim: int, dtype, device, backward: bool):
    shape = (1, bh, seq, head_dim)
    return _forward_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                             shape, shape, shape, device=device, dtype=dtype, backward=backward)


def measure_other(precisions=("fp32",), device=None, min_seconds: float = 0.02) -> dict:
    """The rates of what a step spends besides matmuls: `Network.op_overhead_s`, `elementwise`, `optimizer`
    and `attention` (the module docstring says how each is timed).

    Two sizes per elementwise kind give its slope, so the fixed cost per kernel, measured on its own, is not
    counted twice. Where noise makes a difference negative, the larger of its two timings stands in for it."""
    device = torch.device(device or "cpu")
    cuda = device.type == "cuda"
    where = "cuda" if cuda else "cpu"
    step = _tiny_step(device)
    with Kernels() as kernels:
        step()
    small, large = ELEMENTS[where]
    layers = _elementwise_layers(device)
    big = OPTIMIZER_ELEMENTS[where]
    bh, seq = ATTENTION_SHAPE[where]
    timings = [_timed(step, cuda, min_seconds), _timed(_replay(kernels.matmuls, device), cuda, min_seconds)]
    for name in ELEMENTWISE:
        timings += [_timed(layers[name](n), cuda, min_seconds) for n in (small, large)]
    timings += [_timed(_optimizer_step(1, big, device), cuda, min_seconds),
                _timed(_optimizer_step(64, 64, device), cuda, min_seconds)]
    for precision in precisions:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for d in ATTENTION_HEAD_DIMS:
            timings += [_timed(_attention(bh, seq, d, dtype, device, backward), cuda, min_seconds)
                        for backward in (False, True)]
    t = iter(_mean_over_ranks(timings, device))

    def slope(n0, n1):
        t0, t1 = next(t), next(t)
        return (t1 - t0) / (n1 - n0) if t1 > t0 else t1 / n1

    whole, matmuls = next(t), next(t)
    out = {"op_overhead_s": (whole - matmuls if whole > matmuls else whole) / kernels.n,
           "elementwise": {name: slope(small, large) for name in ELEMENTWISE}}
    one, many = next(t), next(t)
    per_tensor = many / 64
    out["optimizer"] = [(one - per_tensor) / big if one > per_tensor else one / big, per_tensor]
    scores = bh * seq * seq
    out["attention"] = {}
    for precision in precisions:
        rates = []
        for _ in ATTENTION_HEAD_DIMS:
            forward, both = next(t), next(t)
            rates.append([forward / scores, (both - forward if both > forward else both) / scores])
        out["attention"][precision] = {"head_dims": list(ATTENTION_HEAD_DIMS), "seconds": rates}
    return out


def measure(out: str, sizes_mb, iters: int) -> None:
    """`memtrain plan --measure`: run under torchrun/srun; rank 0 writes a table `--bandwidth` reads."""
    grid = parallel.init()
    world = grid.world_size
    if world < 2:
        raise ValueError("--measure needs at least 2 processes: run it under torchrun --nproc-per-node G "
                         "(or srun), one process per GPU")
    gpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = grid.device
    measured = measure_collectives(grid.rank, world, gpn, sizes_mb, iters, device)
    # bf16 only where it beats fp32, as train.precision="auto" decides (on an AVX2-only CPU it is 15-40x slower:
    # minutes of probing for a precision no run would choose); every rank must agree, the probe all-reduces.
    from memtrain.training.perf import bf16_faster

    fast = torch.tensor([float(bf16_faster(device))], device=device)
    torch.distributed.all_reduce(fast, op=torch.distributed.ReduceOp.MIN)
    precisions = ("fp32", "bf16") if fast.item() else ("fp32",)
    matmuls = measure_matmuls(precisions, device=device)
    other = measure_other(precisions, device=device)
    if grid.rank == 0:
        def best(place):
            rates = [v[0] for v in measured["collectives"]["all_reduce"].get(place, {}).values()]
            return min(rates) if rates else None

        doc = {"name": f"measured-{os.uname().nodename}", "backend": torch.distributed.get_backend(),
               "world_size": world, "gpus_per_node": gpn, "intra_node_gbps": best("intra"),
               "inter_node_gbps": best("inter"), "message_mb": list(sizes_mb), **measured,
               "matmuls": matmuls, **other, "source": "memtrain plan --measure"}
        write_atomic(out, json.dumps(doc, indent=1) + "\n")
        net = Network(matmuls=matmuls)
        print(f"wrote {out}: all-reduce " + ", ".join(f"{place} {doc[f'{place}_node_gbps']:.3g} GB/s"
              for place in ("intra", "inter") if doc[f"{place}_node_gbps"]) + " (slowest group size); best matmul "
              + ", ".join(f"{p} {net.peak_flops(p) / 1e9:.3g} GFLOP/s" for p in matmuls) + " per rank; "
              + f"{other['op_overhead_s'] * 1e6:.3g} us per kernel, AdamW {other['optimizer'][0] * 1e9:.3g} ns "
              "per parameter")
    parallel.shutdown()
