"""The step's ingredients: the learning-rate rule across widths, the schedule of a run shorter than its warm-up,
precision 'auto' (a probe, not a guess), AdamW's implementation per device, and the gradient sync overlapped with
backward (parallel.grad_sync) against the blocking one."""

import pytest
import torch

import parallel
from memtrain.config import RunConfig
from memtrain.hf import parallelize
from memtrain.training import autocast_dtype, build_optimizer, build_schedule
from memtrain.training.perf import bf16_faster, matmul_peak_flops
from memtrain.training.step import adamw_kwargs, peak_lr
from tests.memtrain._models import tiny


def _cfg(**train):
    cfg = RunConfig()
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def test_learning_rate_rule_scales_with_width():
    assert peak_lr(_cfg(lr=6e-3), 384) == 6e-3  # no rule: lr as given, whatever the width
    rule = _cfg(lr=6e-3, lr_width=32)
    assert [peak_lr(rule, w) for w in (32, 64, 384)] == pytest.approx([6e-3, 3e-3, 5e-4])
    sqrt = _cfg(lr=8e-3, lr_width=32, lr_width_exponent=0.5)
    assert peak_lr(sqrt, 128) == pytest.approx(4e-3)
    assert peak_lr(_cfg(lr=6e-3, lr_width=32, lr_scale=2.0), 64) == pytest.approx(6e-3)


def _lrs(cfg, steps):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    sched = build_schedule(opt, cfg, steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_a_run_shorter_than_its_warmup_reaches_its_lr_at_its_last_step():
    """warmup_steps=10 (the default) on a 5-step run: the ramp is cut to the run, peaking at the last step, rather
    than training 5 steps at 9% to 45% of lr; a run longer than its warm-up keeps it as set."""
    assert _lrs(_cfg(lr=1e-3, min_lr=1e-4, warmup_steps=10), 5) == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3])
    long = _lrs(_cfg(lr=1e-3, min_lr=1e-4, warmup_steps=3), 20)
    assert long[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3]) and long[-1] > 1e-4 and long[4] < 1e-3


def test_auto_precision_follows_the_probe_and_leaves_the_rng_alone():
    cpu = torch.device("cpu")
    torch.manual_seed(123)
    before = torch.get_rng_state()
    faster = bf16_faster.__wrapped__(cpu)  # measured now, not the cached answer
    matmul_peak_flops.__wrapped__(cpu, torch.float32, 64, 1)
    assert torch.equal(torch.get_rng_state(), before)  # a resumed run's restored RNG state stays as saved
    assert autocast_dtype(_cfg(precision="auto"), cpu) == (torch.bfloat16 if bf16_faster(cpu) else None)
    assert autocast_dtype(_cfg(precision="fp32"), cpu) is None
    assert autocast_dtype(_cfg(precision="bf16"), cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="train.precision='fp16'"):
        autocast_dtype(_cfg(precision="fp16"), cpu)
    assert isinstance(faster, bool)


def test_adamw_is_fused_only_when_every_parameter_is_on_cuda():
    assert adamw_kwargs(["cuda", "cuda"]) == {"fused": True}
    for types in (["cpu"], ["cpu", "cuda"], ["meta"], []):
        assert adamw_kwargs(types) == {}, types


def test_cpu_optimizer_is_torch_default_adamw_bit_for_bit():
    """On a CPU build_optimizer is still the AdamW it was before fused came in on CUDA (torch's default, the
    single-tensor loop): the same gradients over 3 steps leave the same parameters and moments, bitwise."""
    cfg = RunConfig()
    cfg.train.lr, cfg.train.weight_decay = 1e-2, 0.1
    ours, theirs = (parallelize(tiny("llama", "meta"), parallel.Grid(1, 1, 1, 1), seed=1, device="cpu")
                    for _ in range(2))
    twin = dict(zip(parallel.unique_parameters(ours), parallel.unique_parameters(theirs), strict=True))
    opt = build_optimizer(ours, cfg)
    assert (opt.defaults["fused"], opt.defaults["foreach"]) == (None, None)
    ref = torch.optim.AdamW([{"params": [twin[p] for p in g["params"]], "weight_decay": g["weight_decay"]}
                             for g in opt.param_groups], lr=opt.defaults["lr"], betas=opt.defaults["betas"], eps=1e-8)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in twin.items():
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in twin.items():
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], ref.state[q][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


# ------------------------------------------------------------------------------------------------------------
# parallel.grad_sync: 'overlap' (bucketed all-reduces launched during the last micro-batch's backward) against
# 'blocking' (sync_gradients after it), through train_step itself on 4 forked gloo ranks: a tiny Llama with tied
# embeddings, two micro-batches per step, 3 AdamW steps. Buckets are made tiny (several per model) by building
# the model's GradSync before the first step. Tolerances: the step's loss sums and gradient norms 1e-6 relative
# (the overlapped path's gradients may differ from the blocking path's in the last bits: other bucket boundaries,
# another ring summation order; measured: losses 8e-9, norms equal); parameters after 3 steps 1e-2 * lr (AdamW
# with eps 1e-8 can turn a last-bit difference of a near-zero gradient entry into a visible update; measured
# 5.2e-7 absolute on data=4, and the two grids with a tensor axis bitwise equal).
# Bytes per (operation, axes) of every step are equal (buckets cut messages, they add none).

SYNC_CASES = [((4, 1, 1, 1), "sharded", False), ((2, 1, 1, 2), "sharded", True), ((2, 2, 1, 1), "easy", True)]
SYNC_STEPS, SYNC_LR = 3, 1e-3


def _sync_worker(rank, world):
    import parallel
    from memtrain.hf import parallelize
    from memtrain.training import build_optimizer, train_step
    from tests.memtrain._models import tiny

    out = {}
    for degrees, mode, overlap in SYNC_CASES:
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        runs = {}
        for path in ("blocking", "overlap"):
            plm = parallelize(tiny("llama", "meta", tie_word_embeddings=True, num_hidden_layers=2), grid, mode,
                              seed=1, device="cpu")
            if path == "overlap":
                parallel.grad_sync(plm, grid, first_bucket_bytes=512, bucket_bytes=2048)
            opt = build_optimizer(plm, RunConfig())
            split = grid.world_size if mode == "easy" else grid.size(("z", "data"))
            steps = []
            for step in range(SYNC_STEPS):
                g = torch.Generator().manual_seed(step)
                ids, labels = torch.randint(0, 128, (8, 8), generator=g), torch.randint(0, 128, (8, 8), generator=g)
                labels[:, :2] = -100
                parallel.LEDGER.reset()
                sums, norm = train_step(plm, grid, opt, ids, labels, labels != -100, 8 // split // 2,
                                        overlap=overlap, grad_sync=path)
                steps.append((torch.stack(list(sums)), float(norm), parallel.LEDGER.totals()))
            buckets = len(parallel.grad_sync(plm, grid).buckets) if path == "overlap" else 0
            runs[path] = steps, [p.detach().clone() for p in parallel.unique_parameters(plm)], buckets
        (ref, ref_params, _), (got, params, buckets) = runs["blocking"], runs["overlap"]
        out[(degrees, mode, overlap)] = {
            "loss": max(float(((a[0] - b[0]).abs() / b[0].abs().clamp_min(1e-30)).max()) for a, b in zip(got, ref)),
            "norm": max(abs(a[1] - b[1]) / b[1] for a, b in zip(got, ref)),
            "ledger": all(a[2] == b[2] for a, b in zip(got, ref)),
            "params": max(float((a - b).abs().max()) for a, b in zip(params, ref_params)),
            "buckets": buckets}
        grid.release_groups()
    return out


def test_overlapped_grad_sync_trains_as_the_blocking_path():
    from parallel.forked import run_ranks

    for res in run_ranks(4, _sync_worker):
        for case, r in res.items():
            assert r["buckets"] > 1, case
            assert r["loss"] < 1e-6 and r["norm"] < 1e-6, (case, r)
            assert r["params"] < 1e-2 * SYNC_LR, (case, r)
            assert r["ledger"], case


def test_grad_sync_choice_is_validated():
    from memtrain.config import load
    from memtrain.training import train_step

    assert RunConfig().parallel.grad_sync == "overlap"
    assert load(overrides=["parallel.grad_sync=blocking"]).parallel.grad_sync == "blocking"
    with pytest.raises(ValueError, match="parallel.grad_sync='sometimes' is invalid"):
        load(overrides=["parallel.grad_sync=sometimes"])
    with pytest.raises(ValueError, match="parallel.grad_sync"):
        train_step(None, None, None, torch.zeros(1), torch.zeros(1), torch.zeros(1), 1, grad_sync="async")
