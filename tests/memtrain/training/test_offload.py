"""Optimizer offload (memtrain/training/offload.py, train.optimizer_offload) against torch's AdamW on the device.

Tolerance: bitwise. On a CPU the offloaded update is torch's own single-tensor AdamW (the path torch.optim.AdamW
takes for CPU tensors) on the same fp32 values in the same order, the clipping coefficient multiplies the same
gradients in their own dtype, and the buckets' sums are the very buffers the device's gradients are copied from:
nothing may differ, over 20 steps of the trainer's train_step (warm-up and cosine schedule, two micro-batches).
(On a GPU the device's AdamW runs foreach kernels with fused multiply-adds that the host's does not: ~1e-6
relative per step; not measured here.) Under bf16 the reference is the same mixed precision on the device: bf16
parameters, torch AdamW on fp32 master copies of them.

Cases: one process (clipping on and off, fp32 and bf16); a data=2 grid on forked gloo ranks with the gradient
all-reduce in several buckets (GradSync), where the offloaded optimizer takes buckets to the host as they
complete (and, unclipped, updates them then), and with the blocking sync. Checkpoints: an offloaded run saved
and resumed equals the uninterrupted one bitwise (masters, moments, parameters); its checkpoint files are a
non-offloaded run's, bit for bit, so each loads into the other; end to end, the trainer killed and resumed
under bf16.
"""

import pytest
import torch

import parallel
from memtrain.config import RunConfig
from memtrain.hf import parallelize
from memtrain.training import build_optimizer, build_schedule, checkpoint, train_step
from memtrain.training.offload import OffloadAdamW
from parallel.forked import run_ranks
from tests.memtrain._helpers import checkpoint_files, stdlib_corpus, write_recipe
from tests.memtrain._models import tiny

STEPS, B, S, VOCAB = 20, 8, 16, 128


def _cfg(offload: bool) -> RunConfig:
    cfg = RunConfig()
    cfg.train.optimizer_offload = offload
    cfg.train.lr, cfg.train.warmup_steps = 1e-2, 3
    return cfg


class _DeviceMasters:
    """The bf16 reference: torch AdamW on fp32 master copies on the device, bf16 parameters read by the model."""

    def __init__(self, plm, cfg):
        self.adamw = build_optimizer(plm, cfg)
        self.masters = {}
        for group in self.adamw.param_groups:
            group["params"] = [self.masters.setdefault(p, p.detach().clone().requires_grad_()) for p in group["params"]]
        for p in self.masters:
            p.data = p.data.to(torch.bfloat16)
        self.param_groups = self.adamw.param_groups

    def zero_grad(self, set_to_none=True):
        for p, m in self.masters.items():
            p.grad = m.grad = None

    @torch.no_grad()
    def step(self):
        for p, m in self.masters.items():
            m.grad = None if p.grad is None else p.grad.float()
        self.adamw.step()
        for p, m in self.masters.items():
            p.copy_(m)


def _build(grid, offload: bool, amp=None, *, buckets: bool = False, seed: int = 1):
    plm = parallelize(tiny("llama", "meta", num_hidden_layers=2), grid, "sharded", seed=seed, device="cpu")
    cfg = _cfg(offload)
    opt = _DeviceMasters(plm, cfg) if amp and not offload else build_optimizer(plm, cfg, amp)
    if buckets:  # after the optimizer: GradSync buckets by the parameters' dtype
        parallel.grad_sync(plm, grid, first_bucket_bytes=512, bucket_bytes=2048)
    sched = build_schedule(opt.adamw if isinstance(opt, _DeviceMasters) else opt, cfg, STEPS)
    return plm, opt, sched


def _steps(plm, grid, opt, sched, steps, *, amp=None, grad_clip=1.0, grad_sync="overlap"):
    """Run steps `steps` (a range) of train_step; their loss sums and gradient norms."""
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ids, labels = torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)
        labels[:, :3] = -100
        micro = B // grid.size(("z", "data")) // 2
        sums, norm = train_step(plm, grid, opt, ids, labels, labels != -100, micro, amp=amp, grad_sync=grad_sync,
                                grad_clip=grad_clip)
        sched.step()
        out.append((torch.stack(list(sums)), float(norm)))
    return out


def _weights(plm, opt) -> list[torch.Tensor]:
    """Each parameter's fp32 value (the master where the optimizer keeps one), then its moments."""
    masters = getattr(opt, "masters", {})
    params = parallel.unique_parameters(plm)
    adamw = opt.adamw if isinstance(opt, _DeviceMasters) else opt
    state = [adamw.state[masters.get(p, p) if isinstance(opt, _DeviceMasters) else p] for p in params]
    return ([masters.get(p, p).detach().clone() for p in params] + [s["exp_avg"].clone() for s in state]
            + [s["exp_avg_sq"].clone() for s in state])


def _compare(grid, *, amp=None, grad_clip=1.0, grad_sync="overlap", buckets=False) -> dict:
    """An offloaded and a device run of STEPS steps: whether everything is bitwise equal."""
    runs = {}
    for offload in (False, True):
        plm, opt, sched = _build(grid, offload, amp, buckets=buckets)
        streamed = []
        if offload:
            stream = opt.stream

            def spy(sync, *, update, stream=stream, opt=opt, streamed=streamed):
                stream(sync, update=update)
                streamed.append(len(opt._seen))  # gradients taken to the host before the sync's exit

            opt.stream = spy
        history = _steps(plm, grid, opt, sched, range(STEPS), amp=amp, grad_clip=grad_clip, grad_sync=grad_sync)
        device = [p.detach().clone() for p in parallel.unique_parameters(plm)]
        runs[offload] = history, _weights(plm, opt), device, streamed
    (ref, ref_w, ref_dev, _), (got, w, dev, streamed) = runs[False], runs[True]
    return {"losses": all(torch.equal(a[0], b[0]) for a, b in zip(got, ref)),
            "norms": [a[1] for a in got] == [b[1] for b in ref],
            "clipped": sum(b[1] > grad_clip for b in ref) if grad_clip else None,
            "weights": all(torch.equal(a, b) for a, b in zip(w, ref_w)),
            "device": all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(dev, ref_dev)),
            "streamed": max(streamed, default=0)}


@pytest.mark.parametrize("amp, grad_clip", [(None, 1.0), (None, 0.0), (torch.bfloat16, 1.0)],
                         ids=["fp32-clipped", "fp32-unclipped", "bf16-clipped"])
def test_offloaded_adamw_equals_device_adamw_on_one_process(amp, grad_clip):
    r = _compare(parallel.Grid(1, 1, 1, 1), amp=amp, grad_clip=grad_clip)
    assert r["losses"] and r["norms"] and r["weights"] and r["device"], r
    assert r["clipped"] is None or r["clipped"] > 0, "no step clipped: the clipped path went untested"


DP_CASES = [("overlap", 1.0), ("overlap", 0.0), ("blocking", 1.0)]


def _dp_worker(rank, world):
    grid = parallel.Grid(2, 1, 1, 1, rank=rank)
    grid.build_groups()
    out = {case: _compare(grid, grad_sync=case[0], grad_clip=case[1], buckets=True) for case in DP_CASES}
    out["buckets"] = len(parallel.grad_sync(_build(grid, True, buckets=True)[0], grid).buckets)
    grid.release_groups()
    return out


def test_offloaded_adamw_equals_device_adamw_on_a_data_parallel_grid():
    for res in run_ranks(2, _dp_worker):
        assert res.pop("buckets") > 1
        for (sync, clip), r in res.items():
            assert r["losses"] and r["norms"] and r["weights"] and r["device"], (sync, clip, r)
            assert (r["streamed"] > 0) == (sync == "overlap"), (sync, clip, r)  # buckets taken as they completed


def _matrix_worker(rank, world, grad_clip):
    """Two steps of a 2-D plain replica (GPT-2's wpe, any easy-mode model) offloaded, against torch's AdamW on the
    same summed gradients; a small first bucket puts the matrix in a bucket that completes inside the sync."""
    grid = parallel.Grid(2, 1, 1, 1, rank=rank)
    grid.build_groups()
    init = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    m, ref = torch.nn.Module(), torch.nn.Module()
    m.w, m.b, ref.w, ref.b = (torch.nn.Parameter(t.clone()) for t in (init, init[0], init, init[0]))
    opt = OffloadAdamW([{"params": [m.w, m.b]}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sync = parallel.grad_sync(m, grid, first_bucket_bytes=16, bucket_bytes=16)
    for step in range(2):
        opt.zero_grad()
        with sync:
            ((m.w * (rank + step + 1)).sum() + (m.b * m.b).sum()).backward()
            opt.stream(sync, update=grad_clip == 0)
            streamed = len(opt._seen)
        opt.finish(m, grid, grad_clip)
        ref_opt.zero_grad()
        ((ref.w * (rank + step + 1)).sum() + (ref.b * ref.b).sum()).backward()
        parallel.sync_gradients(ref, grid)
        if grad_clip:
            parallel.clip_grad_norm_(ref, grad_clip, grid)
        ref_opt.step()
    grid.release_groups()
    return streamed, [torch.equal(a, b) for a, b in ((m.w, ref.w), (m.b, ref.b), (opt.masters[m.w], ref.w))]


@pytest.mark.parametrize("grad_clip", [0.0, 1.0], ids=["unclipped", "clipped"])
def test_a_matrix_taken_from_a_completed_bucket_updates_as_torch_adamw(grad_clip):
    """A bucket's buffer is flat: its slice for a [3, 4] parameter once reached AdamW as [12] and failed on the
    shape (a sharded model's parameters are all flat shards, so the model tests never met a matrix)."""
    for streamed, equal in run_ranks(2, _matrix_worker, grad_clip, timeout=60):
        assert streamed > 0 and all(equal), (streamed, equal)


# ------------------------------------------------------------------------------------------------------------
# Checkpoints.


def _resumed(tmp_path, grid, saved_by: bool, resumed_by: bool, amp=None):
    """10 steps by an offloaded (or not) run, saved; a fresh model loads it into an offloaded (or not) optimizer
    and runs the other 10. Its weights, and the checkpoint directory."""
    plm, opt, sched = _build(grid, saved_by, amp)
    _steps(plm, grid, opt, sched, range(10), amp=amp)
    root = tmp_path / f"{saved_by}-{resumed_by}"
    path = checkpoint.save(root, plm, opt, sched, 10, {})
    plm, opt, sched = _build(grid, resumed_by, amp, seed=99)  # another seed: everything from the file
    state = checkpoint.load(path, plm, opt)
    sched.load_state_dict(state["scheduler"])
    for group, lr in zip(opt.param_groups, sched.get_last_lr()):
        group["lr"] = lr
    _steps(plm, grid, opt, sched, range(10, STEPS), amp=amp)
    return _weights(plm, opt), path


def _uninterrupted(grid, offload: bool, amp=None):
    plm, opt, sched = _build(grid, offload, amp)
    _steps(plm, grid, opt, sched, range(STEPS), amp=amp)
    return _weights(plm, opt)


def test_offloaded_run_resumes_bitwise_and_checkpoints_load_either_way(tmp_path):
    grid = parallel.Grid(1, 1, 1, 1)
    full = _uninterrupted(grid, True)
    assert all(torch.equal(a, b) for a, b in zip(full, _uninterrupted(grid, False)))
    paths = {}
    for saved_by, resumed_by in [(True, True), (True, False), (False, True)]:
        weights, paths[saved_by] = _resumed(tmp_path, grid, saved_by, resumed_by)
        assert all(torch.equal(a, b) for a, b in zip(weights, full)), (saved_by, resumed_by)
    a, b = checkpoint_files(paths[True]), checkpoint_files(paths[False])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # one format, the same values


def test_bf16_offloaded_run_resumes_bitwise_from_its_fp32_masters(tmp_path):
    grid, amp = parallel.Grid(1, 1, 1, 1), torch.bfloat16
    full = _uninterrupted(grid, True, amp)
    weights, path = _resumed(tmp_path, grid, True, True, amp)
    assert all(torch.equal(a, b) for a, b in zip(weights, full))
    files = checkpoint_files(path)
    assert files and all(t.dtype == torch.float32 for t in files.values())  # masters and moments, not bf16
    plm = parallelize(tiny("llama", "meta", num_hidden_layers=2), grid, "sharded", seed=99, device="cpu")
    checkpoint.load(path, plm)  # a non-offloaded model takes the fp32 masters as its weights
    plm2, opt, _ = _build(grid, True, amp, seed=98)
    checkpoint.load(path, plm2, opt)
    for p, q in zip(parallel.unique_parameters(plm), parallel.unique_parameters(plm2)):
        assert p.dtype == torch.float32 and q.dtype == torch.bfloat16
        assert torch.equal(opt.masters[q], p) and torch.equal(q, p.to(torch.bfloat16))


class _Killed(Exception):
    pass


def _train(rank, world, recipe, out, resume: bool, kill_at: int | None) -> str:
    """`memtrain.training.train` of the recipe into `out`, killed (an exception out of its loop) once step
    `kill_at` ran, before that step's checkpoint could be saved."""
    from memtrain.config import load
    from memtrain.training import train

    def on_step(record):
        if record["step"] == kill_at:
            raise _Killed

    try:
        train(load(recipe), out, resume=resume, on_step=on_step)
    except _Killed:
        return "killed"
    return "done"


def test_train_resumes_an_offloaded_bf16_run_bitwise(tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus = stdlib_corpus(tmp_path / "corpus", every=8, count=16, chars=4000)
    recipe = write_recipe(tmp_path / "r.toml", corpus, tmp_path / "cache",
                          train={"optimizer_offload": True, "precision": "bf16", "max_steps": 6,
                                 "checkpoint_every": 3},
                          eval={"enabled": False})
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_ranks(1, _train, recipe, full, False, None) == ["done"]
    assert run_ranks(1, _train, recipe, cut, False, 5) == ["killed"]
    assert checkpoint.latest(cut).name == "step_000003"
    assert run_ranks(1, _train, recipe, cut, True, None) == ["done"]
    a = checkpoint_files(full / "checkpoints" / "step_000006")
    b = checkpoint_files(cut / "checkpoints" / "step_000006")
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.float32 for t in a.values())  # the fp32 masters and moments


def _evaluated(rank, world, recipe, out) -> tuple[float, float]:
    """eval.json's held-out loss of a trained run, and the per-pass probe's on the weights evaluation holds."""
    from memtrain.config import load
    from memtrain.evaluate import evaluate_after
    from memtrain.training import train
    from memtrain.training.probe import pass_scores

    cfg = load(recipe)
    result = train(cfg, out)
    return evaluate_after(cfg, result)["val_loss"], pass_scores(result.model, result.stream, cfg)["val_loss"]


def test_an_offloaded_bf16_run_evaluates_its_fp32_masters_after_every_pass_probes(tmp_path):
    """The last pass's probe scores the bf16 copies training ran on; eval.json's held-out loss is the fp32
    masters' (what `memtrain eval` of the checkpoint scores), not that probe's figure reused."""
    (tmp_path / "corpus").mkdir()
    corpus = stdlib_corpus(tmp_path / "corpus", every=8, count=8, chars=3000)
    recipe = write_recipe(tmp_path / "r.toml", corpus, tmp_path / "cache",
                          train={"optimizer_offload": True, "precision": "bf16", "max_steps": None, "epochs": 1,
                                 "warmup_steps": 1},
                          eval={"every_pass": True, "val_docs": 4, "exposure_samples": 8})
    (evaluated, fp32), = run_ranks(1, _evaluated, recipe, tmp_path / "run")
    assert evaluated == pytest.approx(fp32, rel=1e-6)


def test_host_memory_is_pinned_only_for_parameters_on_a_gpu(monkeypatch):
    """A visible GPU alone pins nothing: CPU ranks (gloo) on a GPU machine keep pageable memory, which a forked
    rank can allocate without touching CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _, opt, _ = _build(parallel.Grid(1, 1, 1, 1), True)
    assert isinstance(opt, OffloadAdamW) and opt.pin is False


def test_offload_without_bf16_keeps_fp32_parameters():
    plm, opt, _ = _build(parallel.Grid(1, 1, 1, 1), True)
    assert isinstance(opt, OffloadAdamW)
    assert all(p.dtype == torch.float32 and opt.masters[p] is not p for p in parallel.unique_parameters(plm))
