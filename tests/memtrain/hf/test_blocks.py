"""memtrain/hf/blocks.py (ParallelLM.compile_blocks, train.compile): torch.compile'd transformer blocks against
the eager ones.

Reference: the same model, seed and batches run eagerly, through the trainer's train_step (AdamW, clipping,
micro-batches of two rows, packed documents whose position_ids restart, so attention is block-diagonal).
Tolerance: inductor fuses each block's elementwise work and reductions (RMSNorm's mean of squares, the rotary
embedding, SiLU * up) into its own kernels with their own summation order, so results agree to rounding, not
bitwise. Compared: the loss sums of STEPS steps, and the first step's gradients (later ones are not: AdamW
divides each update by the root of the gradient's own square, so a rounding difference in a near-zero gradient
moves its weight by up to the learning rate). Relative to the largest value, measured on a CPU (AMD EPYC):
fp32 loss sums 8.4e-8, gradients 4.8e-7 (tolerance 1e-5 both); bf16 loss sums 2.8e-4 (tolerance 2e-3),
gradients 8.3e-3 (tolerance 3e-2: bf16 keeps 8 significant bits, so one reordered sum moves a product by up to
4e-3 of itself). A wrong attention mask or a gradient all-reduce that never ran moves them by 1e-1 and more.
"""

import pytest
import torch

import parallel
from memtrain.config import RunConfig
from memtrain.hf import parallelize
from memtrain.training import build_optimizer, train_step
from parallel.forked import run_ranks
from tests.memtrain._models import tiny

STEPS, B, S, VOCAB = 3, 8, 16, 128
MICRO = 2  # rows per micro-batch on every grid: one shape, so the tests share their compiled kernels


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch.compiler.reset()  # every test traces its own graphs (inductor's kernels stay cached on disk)
    yield
    torch.compiler.reset()


def _graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    ids, labels = torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)
    labels[:, :2] = -100
    pos = torch.cat([torch.arange(6), torch.arange(S - 6)]).expand(B, S)  # two documents per row
    return ids, labels, pos


def _train(grid, *, compiled: bool, amp=None, checkpointing: bool = False,
           mode: str = "sharded") -> tuple[list[torch.Tensor], list]:
    """STEPS steps of train_step; the loss sums of each step and the first step's gradients (this rank's shards)."""
    plm = parallelize(tiny("llama", "meta", num_hidden_layers=2), grid, mode, seed=3, device="cpu")
    if checkpointing:
        plm.enable_activation_checkpointing()
    if compiled:
        assert plm.compile_blocks() == 2
    cfg = RunConfig()
    cfg.train.lr = 1e-2
    opt = build_optimizer(plm, cfg)
    sums = []
    for step in range(STEPS):
        ids, labels, pos = _batch(step)
        s, _ = train_step(plm, grid, opt, ids, labels, labels != -100, MICRO, position_ids=pos, amp=amp)
        sums.append(torch.stack(list(s)))
        if step == 0:
            grads = [p.grad.clone() for p in parallel.unique_parameters(plm)]
    return sums, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("amp, checkpointing, loss_tol, grad_tol", [(None, False, 1e-5, 1e-5),
                                                                    (None, True, 1e-5, 1e-5),
                                                                    (torch.bfloat16, False, 2e-3, 3e-2)],
                         ids=["fp32", "fp32-checkpointed", "bf16"])
def test_compiled_blocks_train_as_the_eager_ones(amp, checkpointing, loss_tol, grad_tol):
    grid = parallel.Grid(1, 1, 1, 1)
    before = _graphs()
    ref_sums, ref_grads = _train(grid, compiled=False, amp=amp, checkpointing=checkpointing)
    assert _graphs() == before
    sums, grads = _train(grid, compiled=True, amp=amp, checkpointing=checkpointing)
    assert _graphs() > before  # the compiled forward ran, not a silent fallback to the eager one
    assert max(_rel(a, b) for a, b in zip(sums, ref_sums)) <= loss_tol
    assert max(_rel(a, b) for a, b in zip(grads, ref_grads)) <= grad_tol


def test_inference_runs_the_eager_blocks():
    """Scoring and decoding (inference mode, prompts of any length) never compile: with recompilation made an
    error, a length never trained on still scores, and equals the eager model's scores bitwise."""
    grid = parallel.Grid(1, 1, 1, 1)
    eager = parallelize(tiny("llama", "meta", num_hidden_layers=2), grid, "sharded", seed=3, device="cpu")
    plm = parallelize(tiny("llama", "meta", num_hidden_layers=2), grid, "sharded", seed=3, device="cpu")
    plm.compile_blocks()
    ids, labels, pos = (t[:MICRO] for t in _batch(0))
    before = _graphs()
    plm.token_losses(ids, labels, pos).sum().backward()
    graphs = _graphs()
    assert graphs > before
    with torch.compiler.set_stance("fail_on_recompile"):
        plm.token_losses(ids, labels, pos).sum().backward()  # the trained shape: its graph, no recompilation
        got = plm.token_scores(ids[:3, :11], labels[:3, :11])
    want = eager.token_scores(ids[:3, :11], labels[:3, :11])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _graphs() == graphs


def test_every_block_shares_its_graphs():
    """Sixteen blocks (llama-3.2-1b's count) compile two graphs, packed documents' mask and none: not one per
    block, which past torch's recompile limit (8) would leave the later blocks silently eager."""
    plm = parallelize(tiny("llama", "meta", num_hidden_layers=16), parallel.Grid(1, 1, 1, 1), "sharded", seed=3,
                      device="cpu")
    assert plm.compile_blocks() == 16
    ids, labels, pos = (t[:MICRO] for t in _batch(0))
    before = _graphs()
    for p in (pos, None, pos, None):
        plm.token_losses(ids, labels, p).sum().backward()
    assert _graphs() - before == 2


def _dp_worker(rank, world):
    grid = parallel.Grid(2, 1, 1, 1, rank=rank)
    grid.build_groups()
    out = _train(grid, compiled=True)
    grid.release_groups()
    return out


def test_compiled_blocks_on_a_data_parallel_grid_train_as_one_eager_process():
    """The gradient all-reduce starts from hooks on the parameters, outside the compiled graphs: two ranks with
    compiled blocks equal one eager process (a hook that never fired would leave each rank half the batch's
    gradient)."""
    ref_sums, ref_grads = _train(parallel.Grid(1, 1, 1, 1), compiled=False)
    for sums, grads in run_ranks(2, _dp_worker):
        assert max(_rel(a, b) for a, b in zip(sums, ref_sums)) <= 1e-5
        assert max(_rel(a, b) for a, b in zip(grads, ref_grads)) <= 1e-5


def _one_step_graphs(grid, mode: str, layers: int) -> int:
    """Graphs compiled by one forward and backward of a freshly compiled model of `layers` blocks."""
    torch.compiler.reset()
    plm = parallelize(tiny("llama", "meta", num_hidden_layers=layers), grid, mode, seed=3, device="cpu")
    plm.compile_blocks()
    ids, labels, pos = (t[:MICRO] for t in _batch(0))
    before = _graphs()
    plm.token_losses(ids, labels, pos).sum().backward()
    return _graphs() - before


def _tensor_parallel_worker(rank, world, mode, degrees):
    grid = parallel.Grid(1, *degrees, rank=rank)
    grid.build_groups()
    eager = _train(grid, compiled=False, mode=mode)
    before = _graphs()
    compiled = _train(grid, compiled=True, mode=mode)
    graphs = _graphs() - before
    shared = _one_step_graphs(grid, mode, 2), _one_step_graphs(grid, mode, 4)
    grid.release_groups()
    return eager, compiled, graphs, shared


@pytest.mark.parametrize("mode, degrees", [("sharded", (2, 1, 1)), ("easy", (1, 2, 1))], ids=["sharded-x2", "easy-y2"])
def test_compiled_blocks_under_tensor_parallelism_train_as_the_eager_ones(mode, degrees):
    """On a tensor-parallel grid the engine's Linears and its norms' all-reduce run eagerly between the compiled
    pieces of a block (graph breaks): loss sums equal one eager process, and each rank's gradient shards equal
    the eager run's on the same grid, within fp32's 1e-5 (above). A collective skipped by the compiled code
    would leave each rank a part of a product, a loss off by far more. The pieces are shared by every block:
    four blocks compile no more graphs than two."""
    ref_sums, _ = _train(parallel.Grid(1, 1, 1, 1), compiled=False)
    for (_, eager_grads), (sums, grads), graphs, shared in run_ranks(2, _tensor_parallel_worker, mode, degrees):
        assert graphs > 0
        assert max(_rel(a, b) for a, b in zip(sums, ref_sums)) <= 1e-5
        assert max(_rel(a, b) for a, b in zip(grads, eager_grads)) <= 1e-5
        assert shared[0] == shared[1] > 0, shared


def test_compiled_blocks_with_gemm_tuning_train_as_the_eager_ones(tmp_path):
    """parallel.tune_matmul times each GEMM in Python; under compile those products run eagerly too, with the
    layouts the eager run chose (read from its cache file, so both runs multiply alike): fp32's 1e-5."""
    cache = tmp_path / "gemm.json"
    grid = parallel.Grid(1, 1, 1, 1)
    try:
        parallel.tune_matmul(True, cache_file=cache)
        ref_sums, ref_grads = _train(grid, compiled=False)
        chosen = parallel.gemm_tuning.choices()
        before = _graphs()
        sums, grads = _train(grid, compiled=True)
        assert _graphs() > before and parallel.gemm_tuning.choices() == chosen and chosen
    finally:
        parallel.tune_matmul(None, layouts=None)
    assert max(_rel(a, b) for a, b in zip(sums, ref_sums)) <= 1e-5
    assert max(_rel(a, b) for a, b in zip(grads, ref_grads)) <= 1e-5


def _refusals_worker(rank, world):
    grid = parallel.Grid(1, 2, 1, 1, rank=rank)
    grid.build_groups()
    errors = []
    for compile_first in (False, True):
        plm = parallelize(tiny("llama", "meta"), grid, "sharded", seed=0)
        steps = [plm.enable_activation_checkpointing, plm.compile_blocks]
        try:
            for step in steps[::-1] if compile_first else steps:
                step()
        except ValueError as e:
            errors.append(str(e))
    grid.release_groups()
    return errors


def test_compiled_checkpointed_blocks_are_refused_where_the_products_run_eagerly():
    """torch.compile traces a checkpointed block whole, and falls back to running it eagerly where the engine's
    products break its graph (measured: no graph compiled): refused in either order, not left silently eager."""
    for errors in run_ranks(2, _refusals_worker):
        assert len(errors) == 2
        assert all("train.activation_checkpointing=true on a grid with tensor parallelism (x=2 y=1 z=1)" in e
                   for e in errors)
    try:
        parallel.tune_matmul(True, layouts=("given",))
        for compile_first in (False, True):
            plm = parallelize(tiny("llama", "meta"), parallel.Grid(1, 1, 1, 1), "sharded", seed=0)
            steps = [plm.enable_activation_checkpointing, plm.compile_blocks]
            with pytest.raises(ValueError, match="activation_checkpointing=true on parallel.tune_matmul=true"):
                for step in steps[::-1] if compile_first else steps:
                    step()
    finally:
        parallel.tune_matmul(None, layouts=None)


def test_compile_is_refused_where_a_model_names_no_block():
    plm = parallelize(tiny("llama", "meta"), parallel.Grid(1, 1, 1, 1), "sharded", seed=0)
    plm.model._no_split_modules = None
    with pytest.raises(ValueError, match="names no transformer block class"):
        plm.compile_blocks()
