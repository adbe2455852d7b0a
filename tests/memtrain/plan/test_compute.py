"""The planner's compute model (memtrain/plan/compute.py) and the step time it ranks grids by.

- FLOPs: torch.utils.flop_counter.FlopCounterMode counts what really runs: on one process, an HF model's forward and
  backward (the model FLOPs of MFU, and the per-rank count at the 1-rank grid); on 8 forked gloo ranks, the
  trainer's own step (train_step: two micro-batches, overlap, AdamW) of parallelized models, sharded and easy, with
  padded vocabulary, a transposed-layer-heavy X grid and activation checkpointing. Compared: the matmul FLOPs
  (aten.mm/addmm) and attention's (CPU flash SDPA, which the counter does not map by itself: mapped here with
  torch's own SDPA formulas), and on the ranks the shape (m, k, n) of every matmul, which the time model reads
  (FLOPs alone cannot tell a [t, 8] x [8, 64] shard from a [t, 64] x [64, 8] one). All integers from shapes:
  equal, exactly. Left out on both sides: the rotary table's bmm (b x head_dim x seq FLOPs, no weight or
  attention product).
- Kernels besides matmuls, attention and collectives (views, allocations and the optimizer's step excluded): the
  count the non-matmul term multiplies by its per-kernel rate, against what the dispatcher runs in those steps
  (probes.Kernels, the count the per-kernel probe divides by).
- The non-matmul term: each rate alone adds exactly its count's product; AdamW's elements follow the shards (Z
  halves them); kernels follow the grid (easy mode's re-layouts on x = 2 and more on x = y = 2); attention measured
  slower than its products adds the difference, measured faster adds nothing.
- Overlap arithmetic: cases each of which a plausible wrong formula gets wrong.
- Records by overlap class; the matmul rate table (interpolation, edges, a precision not measured); the search
  ranks by predicted step time, with MFU from it.
"""

import json
import math
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import parallel
from memtrain.config import RunConfig
from memtrain.hf import parallelize
from memtrain.models import build_model
from memtrain.plan import compute, cost, network, probes, search
from memtrain.training import build_optimizer, train_step
from parallel import Grid
from parallel.forked import run_ranks
from tests._helpers import GridCache, once_per_session
from tests.memtrain.plan._helpers import B, S, micro_batch, step_model  # the byte model's step: two micro-batches

aten = torch.ops.aten

# (grid, family, mode, activation checkpointing)
CASES = [((2, 2, 2, 1), "llama", "sharded", False), ((2, 2, 2, 1), "llama", "easy", False),
         ((1, 8, 1, 1), "llama", "sharded", False), ((1, 2, 2, 2), "llama", "sharded", True),
         ((1, 1, 8, 1), "gpt2", "sharded", False), ((2, 1, 2, 2), "neox", "easy", False)]


def counter() -> FlopCounterMode:
    """FlopCounterMode with CPU flash attention mapped to torch's SDPA formulas (2 products forward, 5 backward)."""
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_shape=None, **kw:
            sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda g, q, k, v, *a, out_shape=None, **kw:
            sdpa_backward_flop_count(g, q, k, v)})


def split(fc: FlopCounterMode) -> tuple[int, int]:
    """(matmul, attention) FLOPs counted."""
    got = fc.get_flop_counts()["Global"]
    matmul = got.get(aten.mm, 0) + got.get(aten.addmm, 0)
    return matmul, sum(v for op, v in got.items() if "attention" in str(op))


class MatmulShapes(TorchDispatchMode):
    """Counts the (m, k, n) of every [m, k] x [k, n] aten.mm."""

    def __init__(self):
        super().__init__()
        self.shapes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.mm.default:
            self.shapes[(*args[0].shape, args[1].shape[1])] += 1
        return func(*args, **(kwargs or {}))


class Kernels(probes.Kernels):
    """The probe's count of kernels, paused while `without`'s calls run."""

    on = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))

    @contextmanager
    def without(self, obj, name):
        """obj.name (the optimizer's step, the gradient clipping before it) runs uncounted inside."""
        fn = getattr(obj, name)

        def paused(*a, **kw):
            self.on = False
            try:
                return fn(*a, **kw)
            finally:
                self.on = True

        setattr(obj, name, paused)
        try:
            yield
        finally:
            setattr(obj, name, fn)


def _model(family, device):
    return step_model(family, (), device)


# --------------------------------------------------------------------------------------------------
# FLOPs against FlopCounterMode.


def test_one_process_model_flops_and_one_rank_count():
    """ladder-1m (6 layers, vocab 4096) forward + backward in HF's own code: the matmuls are 6 x parameters x tokens
    of MFU's numerator; with attention, the planner's per-rank count at the 1-rank grid."""
    model = build_model("ladder-1m")
    shape = cost.shape_of(model.config)
    batch, seq = 2, 16
    ids = torch.randint(0, shape.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    with counter() as fc:
        model(input_ids=ids, labels=ids).loss.backward()
    matmul, att = split(fc)
    grid = Grid(1, 1, 1, 1)
    attention_forward, _ = compute.attention(shape, grid, "sharded", batch, seq)
    assert matmul == compute.model_flops(shape, batch, seq) - 3 * attention_forward
    assert att == attention_forward * (1 + compute.FLASH_BACKWARD)
    net = network.Network()
    assert compute.step_compute(shape, grid, "sharded", batch, seq, None, net).flops == matmul + att


def _worker(rank, world):
    out, grids = {}, GridCache(rank)
    g = torch.Generator().manual_seed(3)
    for case in CASES:
        degrees, family, mode, recompute = case
        grid = grids[degrees]
        plm = parallelize(_model(family, "meta"), grid, mode, seed=1, device="cpu")
        if recompute:
            plm.enable_activation_checkpointing()
        opt = build_optimizer(plm, RunConfig())
        vocab = plm.config.vocab_size
        ids, labels = torch.randint(0, vocab, (B, S), generator=g), torch.randint(0, vocab, (B, S), generator=g)
        with counter() as fc, MatmulShapes() as mm, Kernels() as k, k.without(opt, "step"), \
                k.without(parallel, "clip_grad_norm_"):
            train_step(plm, grid, opt, ids, labels, labels != -100, micro_batch(degrees, mode), overlap=True)
        out[case] = (*split(fc), mm.shapes, k.n)
    return out


@pytest.fixture(scope="module")
def counted(request):
    return once_per_session(request, lambda: run_ranks(8, _worker))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0][0]}x{c[0][1]}y{c[0][2]}z{c[0][3]}-{c[1]}-{c[2]}"
                         + ("-recompute" if c[3] else ""))
def test_per_rank_flops_equal_the_counter(counted, case):
    degrees, family, mode, recompute = case
    shape, grid, micro = cost.shape_of(_model(family, "meta").config), Grid(*degrees), micro_batch(degrees, mode)
    n_micro = B // cost.rows_split(grid, mode) // micro
    mm = compute.micro_matmuls(shape, grid, mode, micro, S)
    shapes = Counter()
    for key, calls in mm.items():
        shapes.update({s: c * n_micro * (1 + (recompute and key == "blocks")) for s, c in calls.items()})
    matmul = sum(2 * m * k * n * c for (m, k, n), c in shapes.items())
    attention_forward, _ = compute.attention(shape, grid, mode, micro, S)
    att = n_micro * attention_forward * (1 + compute.FLASH_BACKWARD + recompute)
    for rank, got in enumerate(counted):
        assert got[case][:2] == (matmul, att), (rank, got[case][:2], (matmul, att))
        assert got[case][2] == shapes, (rank, sorted((got[case][2] - shapes).items()),
                                        sorted((shapes - got[case][2]).items()))
        kernels = compute.kernel_ops(shape, grid, mode, n_micro, recompute)
        assert kernels == pytest.approx(got[case][3], rel=0.05), (rank, kernels, got[case][3])
    assert compute.step_compute(shape, grid, mode, B, S, micro, network.Network(),
                                checkpointing=recompute).flops == matmul + att


# --------------------------------------------------------------------------------------------------
# Overlap.


@pytest.mark.parametrize("compute_s, last_backward, comm, optimizer, want, wrong", [
    (1.0, 0.5, {"blocking": 0.5, "weights": 0.0, "grads": 0.0}, 0.0, 1.5, "blocking hidden"),
    (10.0, 2.0, {"blocking": 2.0, "weights": 1.0, "grads": 0.0}, 0.0, 12.0, "blocking hidden"),
    (10.0, 2.0, {"blocking": 0.0, "weights": 4.0, "grads": 1.0}, 0.0, 10.0, "overlap not credited"),
    (10.0, 2.0, {"blocking": 0.0, "weights": 0.0, "grads": 3.0}, 0.0, 11.0, "gradients hidden behind all compute"),
    (10.0, 5.0, {"blocking": 0.0, "weights": 8.0, "grads": 4.0}, 0.0, 12.0, "each kind hidden on its own"),
    (10.0, 2.0, {"blocking": 1.0, "weights": 9.0, "grads": 5.0}, 0.0, 15.0, "the larger excess, not one or both"),
    (10.0, 2.0, {"blocking": 0.0, "weights": 7.0, "grads": 1.0}, 4.0, 12.0, "communication hidden behind AdamW"),
])
def test_step_time_overlap(compute_s, last_backward, comm, optimizer, want, wrong):
    assert compute.step_seconds(compute_s, last_backward, comm, optimizer) == pytest.approx(want), wrong


@pytest.mark.parametrize("comm, overlap, want", [
    ({"blocking": 1.0, "weights": 4.0, "grads": 1.0}, 1.0, 11.0),
    ({"blocking": 1.0, "weights": 4.0, "grads": 1.0}, 0.5, 13.5),
    ({"blocking": 1.0, "weights": 4.0, "grads": 1.0}, 0.0, 16.0),
    ({"blocking": 1.0, "weights": 9.0, "grads": 5.0}, 0.5, 20.0),  # 4 s exposed at full overlap, half of 10 hidden
])
def test_a_machine_hides_its_overlap_fraction_of_what_could_hide(comm, overlap, want):
    """Network.overlap scales what could hide (compute 10 s, last backward 2 s): 0 leaves every async
    collective on the step, as on CPU ranks whose collectives need the cores the compute runs on."""
    assert compute.step_seconds(10.0, 2.0, comm, 0.0, overlap) == pytest.approx(want)


def test_records_by_overlap_class():
    shape = cost.shape_of(_model("llama", "meta").config)
    grid = Grid(2, 2, 2, 2)
    log = cost.step_log(shape, grid, "sharded", B, S)
    records, oar = log.records, log.oar
    grads = cost.gradient_records(shape, grid, "sharded")
    assert {(r.op, r.axes) for r in grads} == {("all_reduce", "data"), ("all_reduce", "z+data")}
    assert {(r.op, r.axes) for r in oar} == {("all_reduce", "x"), ("all_reduce", "y")}  # each Linear's B axis
    # One second per isolated record, ten per streamed one (queued async, or OAR): counts, and which time each
    # class takes.
    got = compute.comm_seconds(records, grads, oar, lambda r, series: {"streamed": 10.0, "isolated": 1.0}[series])
    weights = sum(n for r, n in records.items() if r.axes == "z")
    assert got["weights"] == 10 * weights > 0 and got["grads"] == 20
    assert got["blocking"] == sum(records.values()) - weights - 2 + 9 * sum(oar.values())
    loss_sums = Counter({r: n for r, n in records.items() if r.axes == "z+data" and r.nbytes == 32})
    assert sum(loss_sums.values()) == 1 and not loss_sums & grads  # same op and axes as a gradient bucket


@pytest.mark.parametrize("mode", ["sharded", "easy"])
def test_easy_modes_re_layouts_are_chained_and_nothing_of_sharded_mode(mode):
    shape = cost.shape_of(_model("llama", "meta").config)
    grid = Grid(2, 2, 2, 2)
    records = cost.step_records(shape, grid, mode, B, S)
    grads = cost.gradient_records(shape, grid, mode)
    by_series = Counter()
    for r in records:
        by_series[compute.series(r, grads), r.op, r.axes] += 1
    assert all(by_series["streamed", op, "z"] for op in ("all_gather", "reduce_scatter"))
    chained = {(op, axes) for s, op, axes in by_series if s == "chained"}
    if mode == "sharded":  # its all-reduces follow matmuls and norms; its gathers are the weights' over Z
        assert not chained
    else:  # every edge of an easy-mode Linear, over x and over y
        assert chained == {(op, axes) for op in ("all_to_all", "all_gather", "reduce_scatter") for axes in "xy"}
        assert all(s != "chained" for s, op, _ in by_series if op == "all_reduce")


# --------------------------------------------------------------------------------------------------
# The non-matmul term.


def _ladder():
    return cost.shape_of(search.load_config("ladder-1m"))


def _work(net, degrees, mode="sharded", micro=None, **kw):
    """One step of ladder-1m, 16 sequences of 64 tokens."""
    return compute.step_compute(_ladder(), Grid(*degrees), mode, 16, 64, micro, net, **kw)


def test_each_rate_adds_its_count_times_it():
    shape, degrees = _ladder(), (2, 2, 2, 1)
    grid, micro, n_micro = Grid(*degrees), 2, 4  # 8 sequences per rank
    base = _work(network.Network(), degrees, micro=micro)
    params = cost.parameters(shape, grid, "sharded")
    for net, want in [
        (network.Network(op_overhead_s=1e-5), 1e-5 * compute.kernel_ops(shape, grid, "sharded", n_micro)),
        (network.Network(elementwise={"loss": 1e-9}),
         1e-9 * n_micro * compute.micro_elements(shape, grid, "sharded", micro, 64)["loss"]),
        (network.Network(optimizer=[1e-9, 1e-6]), 1e-9 * sum(v for v, _ in params) + 1e-6 * len(params)),
    ]:
        work = _work(net, degrees, micro=micro)
        assert want > 0 and work.other_seconds == pytest.approx(want)
        assert work.seconds == pytest.approx(base.seconds + want) and work.flops == base.flops
    adamw = network.Network(optimizer=[1e-9, 1e-6])
    assert _work(adamw, degrees).optimizer_seconds == _work(adamw, degrees).other_seconds  # AdamW is all of it
    assert _work(adamw, degrees, offload=True).other_seconds == 0  # offloaded: on the host, not counted


def test_adamw_follows_the_shards():
    """Over Z a rank updates half the matrices' values of data = 2 (norms stay whole over Z): about half the time."""
    net = network.Network(optimizer=[1e-9, 0.0])
    data, z = (_work(net, g).optimizer_seconds for g in ((2, 1, 1, 1), (1, 1, 1, 2)))
    assert 0.5 < z / data < 0.55


@pytest.mark.parametrize("family, mode", [("llama", "sharded"), ("llama", "easy"), ("gpt2", "sharded"),
                                          ("neox", "easy")])
def test_kernels_of_a_one_rank_step_equal_the_counter(family, mode):
    """Without tensor parallelism the Linears and the embedding are torch's own ops (parallel/linear.py): the
    count follows them, within the 5% of the 8-rank cases."""
    grid = Grid(1, 1, 1, 1)
    plm = parallelize(step_model(family, (), "meta"), grid, mode, seed=1, device="cpu")
    opt = build_optimizer(plm, RunConfig())
    ids = torch.randint(0, plm.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    with Kernels() as k, k.without(opt, "step"), k.without(parallel, "clip_grad_norm_"):
        train_step(plm, grid, opt, ids, ids, ids != -100, B, overlap=True)
    assert compute.kernel_ops(cost.shape_of(plm.config), grid, mode) == pytest.approx(k.n, rel=0.05)


def test_kernels_follow_the_grid():
    """Easy mode: an x = 2 grid re-lays every Linear's rows (more kernels than data = 2), more still when y splits
    too. Sharded mode (as the dispatcher counts it): over x = 2 each norm statistic is a sum, a division and an
    all-reduce that clones its input, forward and backward, where y = 2 leaves x = 1 and torch's mean (5 more per
    statistic); data = 2 copies every gradient out of its bucket (1 per tensor), and with no tensor parallelism
    its embedding is torch's lookup."""
    shape = _ladder()
    kernels = {(mode, g): compute.kernel_ops(shape, Grid(*g), mode) for mode in ("sharded", "easy")
               for g in ((2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 2, 2, 1))}
    x, data, plane = (kernels["easy", g] for g in ((1, 2, 1, 1), (2, 1, 1, 1), (1, 2, 2, 1)))
    assert data < x < plane and plane - x > x - data
    statistics = 2 * shape.layers + 1  # ladder-1m: two RMSNorms a block, and the final one
    assert kernels["sharded", (1, 2, 1, 1)] - kernels["sharded", (1, 1, 2, 1)] == 5 * statistics
    lookup = compute.EMBEDDING_KERNELS[False] - compute.EMBEDDING_KERNELS[True]
    assert kernels["sharded", (2, 1, 1, 1)] - kernels["sharded", (1, 1, 2, 1)] == len(cost.parameters(
        shape, Grid(2, 1, 1, 1), "sharded")) - lookup


def test_attention_counts_only_beyond_its_products():
    """A measured attention kernel twice as slow as its products at the matmul rate adds the difference; one
    faster adds nothing."""
    shape, degrees = _ladder(), (2, 2, 2, 1)
    forward, _ = compute.attention(shape, Grid(*degrees), "sharded", 4, 64)
    forward_s = forward / 2e9  # one micro-batch's, at the matmul rate
    scores = 4 * 64 * 64 * shape.heads // 2 * shape.layers
    for factor, want in [(2.0, 2 * forward_s * (1 + compute.FLASH_BACKWARD)), (0.01, 0.0)]:  # two micro-batches
        net = _net((2.0, 2.0))
        net.attention = {"fp32": {"head_dims": [shape.head_dim], "seconds": [
            [factor * forward_s / scores, factor * compute.FLASH_BACKWARD * forward_s / scores]]}}
        assert _work(net, degrees, micro=4).other_seconds == pytest.approx(want)


# --------------------------------------------------------------------------------------------------
# The matmul rate, and the search.


def _net(rates=(1.0, 4.0)):
    """A measured machine whose only probed sizes are 8 and 32; the rate depends on k only."""
    return network.Network(name="probe", matmuls={"fp32": {"dims": [8, 32], "gflops": [
        [[rates[0]] * 2, [rates[1]] * 2]] * 2}})


def test_matmul_rate_interpolates_in_log_size():
    net = _net()
    rate = lambda m, k, n: 2 * m * k * n / net.matmul_seconds(m, k, n, "fp32") / 1e9  # noqa: E731
    assert rate(8, 8, 8) == pytest.approx(1.0) and rate(8, 32, 8) == pytest.approx(4.0)
    assert rate(8, 16, 8) == pytest.approx(2.0)  # halfway in log2(k): the geometric mean
    assert rate(4, 4, 4) == pytest.approx(1.0) and rate(100, 1000, 100) == pytest.approx(4.0)  # edges held
    assert net.peak_flops("fp32") == 4e9
    with pytest.raises(ValueError, match="no measured bf16 matmuls"):
        net.matmul_seconds(8, 8, 8, "bf16")
    preset = network.load_network("dgx-h100")
    assert preset.matmul_seconds(1024, 1024, 1024, "bf16") == pytest.approx(2 * 1024**3 / (989e12 * 0.80))


def test_measured_matmul_table_is_filled_and_read(monkeypatch, tmp_path):
    """The probe's table (shapes beyond the budget take the best rate timed inside them) through a JSON file."""
    monkeypatch.setattr(probes, "MATMUL_DIMS", (8, 16))
    monkeypatch.setattr(probes, "MATMUL_BUDGET", {"cpu": 8 * 16 * 16})
    table = probes.measure_matmuls(("fp32",), min_seconds=0.0)["fp32"]
    assert table["dims"] == [8, 16]
    g = table["gflops"]
    assert all(r > 0 for plane in g for row in plane for r in row)
    assert g[1][1][1] == max(g[a][b][c] for a in (0, 1) for b in (0, 1) for c in (0, 1) if a + b + c < 3)
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"matmuls": {"fp32": table}}))
    net = network.load_network(bandwidth=str(path))
    assert net.matmul_seconds(8, 8, 8, "fp32") == pytest.approx(2 * 8**3 / (g[0][0][0] * 1e9))


def test_plans_rank_by_predicted_step_time():
    """A machine on which thin matmuls (k = 8) run 16x slower than the rest, and communication is fast: the best grid
    keeps whole features (x = y = 1), not the one whose communication takes least time (it splits heads over Y)."""
    net = _net((1.0, 16.0))
    net.gpu_memory_gb = 1e3
    plans, _ = search.plan(search.PlanConfig("ladder-1m", 8, batch=16, seq=16, mode="sharded", precision="fp32"), net)
    steps = [p.step_seconds for p in plans]
    assert steps == sorted(steps) and len(set(steps)) > 1
    least_comm = min(plans, key=lambda p: p.comm_seconds)
    assert plans[0].x == plans[0].y == 1 and least_comm.y > 1 and least_comm.step_seconds > plans[0].step_seconds
    shape = cost.shape_of(search.load_config("ladder-1m"))
    for p in plans:
        assert p.compute_seconds <= p.step_seconds <= p.compute_seconds + p.comm_seconds + 1e-12
        assert p.mfu == pytest.approx(compute.model_flops(shape, 16, 16) / (p.step_seconds * 8 * 16e9))
        assert math.isfinite(p.flops) and p.flops > 0
