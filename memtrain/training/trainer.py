"""One training run: build the stream and the model, parallelize it over the grid, train, checkpoint.

    result = train(cfg, "runs/my-run")          # a TrainResult; evaluate with memtrain.evaluate

The same code runs as one process and under torchrun/SLURM. The step itself (normalization, micro-batches,
gradient sync, clipping) is memtrain/training/step.py; this file is the loop around it: run directory,
resume, schedule, metrics, progress, checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

import parallel
from memtrain import signals
from memtrain.config import RunConfig, to_toml
from memtrain.data import TrainStream, build_stream
from memtrain.files import append_jsonl, atomic_dir, read_jsonl, write_atomic
from memtrain.hf import ParallelLM, parallelize
from memtrain.losses import keep_mask
from memtrain.model_copy import keep_model_dir, run_model_name
from memtrain.models import build_model
from memtrain.run_files import CONFIG, METRICS, PASSES, RUN, TOKENIZER
from memtrain.training import checkpoint, perf, run_dir
from memtrain.training.probe import pass_scores
from memtrain.training.step import autocast_dtype, build_optimizer, build_schedule, peak_lr, train_step
from memtrain.training.tracking import Tracker


@dataclass
class TrainResult:
    """What a finished `train` leaves for evaluation (every rank holds its own, rank 0 the reduced metrics)."""

    run_dir: Path
    steps: int
    """Optimizer steps trained in all (the schedule's length)."""
    last: dict
    """The final step's metrics record (as written to metrics.jsonl)."""
    grid: parallel.Grid
    model: ParallelLM
    stream: TrainStream
    tracker: Tracker
    tokens_per_s: float | None = None
    """Median training throughput over the steps this process ran (None when it ran none: a finished run resumed)."""
    final_val_loss: float | None = None
    """Held-out loss of the final model as the per-pass probe scored it (None when no probe scored the last
    step, or it scored other weights than evaluation does: an offloaded bf16 run's bf16 copies): evaluation reuses
    it rather than scoring the same documents again."""


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """On resume, keep the lines of steps the checkpoint covers (later lines came from the lost run; a line cut
    short by the kill is dropped with a warning)."""
    if path.is_file():
        kept = [r for r in read_jsonl(path) if isinstance(r.get("step"), int) and r["step"] <= last_step]
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def _memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def setup(cfg: RunConfig, grid: parallel.Grid):
    """The run's stream and its model parallelized over the grid, at the seeded initialization."""
    stream = _build_stream_once_per_node(cfg, grid)
    hf = build_model(cfg.model.name, vocab_size=stream.vocab_size, device="meta",
                     trust_remote_code=cfg.model.trust_remote_code, eos_token_id=stream.eos_id)
    if cfg.model.fan_in_init:  # read by parallelize when it draws the seeded init
        hf.config.initializer_range = hf.config.hidden_size ** -0.5
    plm = parallelize(hf, grid, mode=cfg.parallel.mode, seed=cfg.train.seed, loaded_next=bool(cfg.model.init))
    return stream, plm


def _build_stream_once_per_node(cfg: RunConfig, grid: parallel.Grid):
    """Local rank 0 builds the stream (tokenizer training, tokenization, packing) into the cache first; the
    node's other ranks then read it. Built by every rank at once, the same work ran N times over on the
    node's cores (4 ranks on 2 cores: minutes instead of seconds for the default corpus). The build ends
    with a vote instead of a bare barrier: when a first rank fails (bad corpus), every rank stops at once
    rather than waiting out the collective timeout."""
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    stream, error = None, None
    if first:
        try:
            stream = _build(cfg)
        except (ValueError, OSError) as e:
            error = e
    if grid.world_size > 1:
        ok = torch.tensor([0.0 if error else 1.0], device=grid.device)
        parallel.comm.all_reduce(ok, grid, parallel.AXES, op=dist.ReduceOp.MIN)
        if error is None and ok.item() == 0.0:
            raise ValueError("building the data stream failed on another node's first rank: see its error")
    if error is not None:
        raise error
    return stream if first else _build(cfg)


def _build(cfg: RunConfig) -> TrainStream:
    return build_stream(cfg.data, cfg.canaries, seed=cfg.train.seed, batch_size=cfg.train.batch_size)


def train(cfg: RunConfig, out_dir: str | Path, *, resume: bool = False, force: bool = False,
          on_setup: Callable[[TrainStream, ParallelLM], None] | None = None,
          on_step: Callable[[dict], None] | None = None) -> TrainResult:
    """Train one run into `out_dir` (run_dir.py: a fresh run refuses another run's files unless `force`; the
    directory is locked for this process; `resume` continues from the newest complete checkpoint). SIGTERM, once
    commandline.run_command handles it (memtrain/signals.py), stops the loop after the step in flight, saved.

    on_setup(stream, model): called once the parallelized model holds its initial weights (before resuming).
    on_step(record): called after every step with its metrics record (benchmarks interleave their own work).
    """
    p = cfg.parallel
    timeout = p.timeout_s or (600.0 if torch.cuda.is_available() else 120.0)
    grid = parallel.init(data=p.data, x=p.x, y=p.y, z=p.z, backend=p.backend, timeout_s=timeout)
    out = Path(out_dir)
    t = cfg.train
    if grid.rank == 0:
        if out.exists() and not out.is_dir():
            raise FileExistsError(f"--out {str(out)!r} is a file: name a directory")
        out.mkdir(parents=True, exist_ok=True)
        run_dir.claim(out, resume=resume, force=force)
    ckpt = run_dir.check_resume(out, cfg) if resume else None  # before anything in `out` is written
    if grid.rank == 0:
        write_atomic(out / CONFIG, to_toml(cfg))
    if t.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # else cuBLAS refuses deterministic mode
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(t.seed)
    parallel.tune_matmul(p.tune_matmul, p.tune_matmul_cache or out / "gemm_tuning.json")

    built = run_model_name(out, cfg.model.name) if resume else cfg.model.name  # model_copy: as it trained
    stream, plm = setup(replace(cfg, model=replace(cfg.model, name=built)), grid)
    if plm.config._attn_implementation == "flex_attention" and grid.device.type == "cpu":
        raise ValueError(f"{type(plm.model).__name__} asks for flex attention (attn_implementation in its "
                         "config.json), which torch cannot train on a CPU (its FlexAttention has no CPU backward): "
                         "train on GPUs, or remove attn_implementation from config.json (memtrain then picks SDPA "
                         "where transformers has it)")
    if stream.document_attention and not plm.isolate_documents():  # before compiling: it runs tiny rows
        raise ValueError(f"{type(plm.model).__name__} lets the documents packed in a row see each other (neither "
                         "position ids nor a block-causal mask passed in keep them apart, as with flex or flash "
                         "attention or a state-space recurrence), which data.document_attention forbids: set "
                         "data.document_attention=false (attention across the row, as classic packing; evaluation "
                         "then scores canaries in their in-row context too)")
    if cfg.model.init:
        with checkpoint.read_weights(cfg.model.init) as weights:
            plm.load_hf_state_dict(weights)
    if on_setup is not None:
        on_setup(stream, plm)
    if t.activation_checkpointing:
        plm.enable_activation_checkpointing()
    if t.compile:
        plm.compile_blocks()
    B = t.batch_size
    if B % grid.size(("z", "data")) or (plm.mode == "easy" and B % grid.world_size):
        raise ValueError(f"train.batch_size={B} does not split over the grid ({plm.mode} mode, "
                         f"data={grid.data} z={grid.z} world={grid.world_size}): use a multiple of "
                         f"{grid.world_size if plm.mode == 'easy' else grid.size(('z', 'data'))}")
    rows = plm.local_rows(B)
    n_local = rows.stop - rows.start
    mb = t.micro_batch_size or n_local
    if n_local % mb:
        fits = [d for d in range(1, n_local + 1) if n_local % d == 0]
        raise ValueError(f"train.micro_batch_size={mb} does not divide this rank's {n_local} sequences per step: "
                         f"use one of {fits}")
    steps_per_epoch = len(stream) // B  # the stream's rows are whole batches of B
    if steps_per_epoch < 1:
        raise ValueError(f"the stream has {len(stream)} sequences, fewer than train.batch_size={B}: "
                         "use a smaller batch or a larger corpus")
    total = steps_per_epoch * t.epochs
    if t.max_steps is not None:
        total = min(total, t.max_steps)

    device = next(plm.parameters()).device
    amp = autocast_dtype(cfg, device, grid)
    began = checkpoint.read_state(ckpt).get("precision") if resume else None
    if began:  # 'auto' is a timing probe: a loaded machine could decide otherwise
        amp = torch.bfloat16 if began == "bf16" else None  # the run keeps the dtype it started in
    opt = build_optimizer(plm, cfg, amp)  # offloaded under bf16, the parameters become bf16 here
    sched = build_schedule(opt, cfg, total)
    start = 0
    metrics_path, passes_path = out / METRICS, out / PASSES
    if resume:
        state = checkpoint.load(ckpt, plm, opt)
        sched.load_state_dict(state["scheduler"])
        # The next step's lr from this run's schedule (max_steps or epochs may have changed since the save), as
        # LambdaLR computes it: load_state_dict leaves the groups stale and restores the old schedule's last lr.
        for group, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(sched.last_epoch)
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
        start = state["step"]
        if grid.rank == 0:
            for path in (metrics_path, passes_path):
                _truncate_jsonl(path, start)
    peak = perf.mfu_peak(device, amp or torch.float32)
    flops_per_token = perf.flops_per_token(plm.config, plm.num_params(), stream.seq_len)
    if grid.rank == 0:
        trained = {"steps": total, "epochs": t.epochs, "steps_per_pass": steps_per_epoch}
        stream.write_manifest(out, B, grid.data if plm.mode == "sharded" else grid.world_size)
        write_atomic(out / RUN, json.dumps({
            "stream_key": stream.key, "corpus": stream.corpus, "trained": trained,
            "grid": {a: getattr(grid, a) for a in parallel.AXES},
            "mode": plm.mode, "params": plm.num_params(), "hidden_size": plm.config.hidden_size,
            "lr": peak_lr(cfg, plm.config.hidden_size), "precision": "bf16" if amp else "fp32",
            "mfu_peak": {"flop_s": peak.flops, "source": peak.source}, "flops_per_token": flops_per_token,
            "config": cfg.to_dict()}))  # what a resume checks config.toml against (run_dir.check_resume)
        with atomic_dir(out / TOKENIZER) as tmp:  # `memtrain export` then needs neither cache nor corpus
            stream.tokenizer.save_pretrained(tmp)
        if built == cfg.model.name:  # a resume builds from the copy it made (a run from before copies: now)
            keep_model_dir(cfg.model.name, out)  # export, eval and resume build from it: DIR may change or go

    last: dict = {}
    rates: list[float] = []
    tracker = Tracker.start(cfg, out, grid.rank)
    saved_at = _clock()
    save_s = None  # how long the last save took: whether one on SIGTERM is cheap

    def save(step: int) -> float:
        """Collective: checkpoint `step` (keeping the newest train.keep_checkpoints); its duration in seconds."""
        t0 = time.perf_counter()
        extra = {"config_digest": cfg.digest(), "precision": "bf16" if amp else "fp32"}
        checkpoint.save(out, plm, opt, sched, step, extra, keep=t.keep_checkpoints)
        return time.perf_counter() - t0

    probed: dict = {}  # step -> held-out loss the probe measured

    def probe(step: int) -> None:
        """Score the model after `step` steps (a whole number of passes; 0: the starting model)."""
        scores = {"pass": step // steps_per_epoch, "step": step, **pass_scores(plm, stream, cfg)}
        probed[step] = scores.get("val_loss")
        if grid.rank == 0:
            append_jsonl(passes_path, scores)
            tracker.log({"pass": {k: v for k, v in scores.items() if k != "canaries"}}, step)

    if cfg.eval.every_pass and start == 0:
        probe(0)
    # SIGTERM: stop at a step boundary, saved; Ctrl-C: stop at once, saying what a resume can start from
    with signals.deferred(), _progress(grid, start, total) as progress, _say_what_was_saved(out):
        for step in range(start, total):
            t0 = time.perf_counter()
            batch = stream.batch(step % steps_per_epoch, B)
            keep = keep_mask(batch["labels"], batch["doc_pos"], cfg.loss)
            lr = opt.param_groups[0]["lr"]  # what this step trains with
            sums, norm = train_step(plm, grid, opt, batch["input_ids"], batch["labels"], keep, mb,
                                    position_ids=batch.get("position_ids"), amp=amp, overlap=p.overlap,
                                    grad_sync=p.grad_sync, grad_clip=t.grad_clip)
            sched.step()
            if device.type == "cuda":  # kernels run asynchronously: time the step, not its launch
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            tokens = B * stream.seq_len
            record = {
                "step": step + 1, "loss": sums.kept_mean(), "lr": lr,
                "tokens": tokens * (step + 1), "tokens_per_s": tokens / dt, "step_time_s": dt,
                "grad_norm": float(norm), "kept_fraction": sums.kept_fraction(), "loss_dropped": sums.dropped_mean(),
                "mfu": flops_per_token * tokens / dt / (peak.flops * grid.world_size), "memory_mb": _memory_mb(device),
                "epoch": step // steps_per_epoch,
            }
            last = record
            rates.append(record["tokens_per_s"])
            if grid.rank == 0 and ((step + 1) % t.log_every == 0 or step + 1 == total):
                append_jsonl(metrics_path, record)
                tracker.log(record, step + 1)
            progress(record)
            if on_step is not None:
                on_step(record)
            if cfg.eval.every_pass and (step + 1) % steps_per_epoch == 0:
                probe(step + 1)
            by_steps = bool(t.checkpoint_every) and (step + 1) % t.checkpoint_every == 0
            now = agree(grid, device, saved_at, t.checkpoint_every_min, save_s)
            stop = now.stop
            saved = step + 1 < total and (by_steps or now.due or stop and now.cheap)
            if saved:
                save_s = save(step + 1)
                saved_at = _clock()
            if stop and step + 1 < total:
                raise signals.Terminated(f"terminated by SIGTERM after step {step + 1}, " + (
                    "its checkpoint saved" if saved else f"not saved (a save takes over {SIGTERM_SAVE_S:.0f} s, "
                    "longer than a scheduler waits after SIGTERM)") + f": {signals.RESUME_HINT} (--out {out})")
        if total > start:  # a finished run resumed (to evaluate it again) has its final checkpoint already
            save(total)
        if agree(grid, device, saved_at, 0, save_s).stop:
            raise signals.Terminated(f"terminated by SIGTERM after the last step, its checkpoint saved: evaluation did "
                                     f"not run; {signals.RESUME_HINT} (--out {out}), which runs it")
    final_val_loss = probed.get(total)
    if t.optimizer_offload:
        opt.restore_params()  # fp32 weights for evaluation, as a non-offloaded run leaves them
        if amp is not None:  # the last probe scored the bf16 copies trained on: evaluation scores the fp32 masters
            final_val_loss = None
    return TrainResult(out, total, last, grid, plm, stream, tracker,
                       statistics.median(rates) if rates else None, final_val_loss)


@contextlib.contextmanager
def _say_what_was_saved(out: Path):
    """Ctrl-C inside the block ends with the checkpoint --resume would continue from, or that there is none."""
    try:
        yield
    except KeyboardInterrupt:
        ckpt = checkpoint.latest(out)
        sigterm = "SIGTERM (kill -TERM), unlike Ctrl-C, saves the step a run is at before it stops"
        if ckpt is None:
            raise KeyboardInterrupt(f"no checkpoint saved yet, so --resume cannot continue this run: train it again "
                                    f"with --force ({sigterm})") from None
        raise KeyboardInterrupt(f"--resume continues this run from its last checkpoint, {ckpt.name}, not from the "
                                f"step it was at ({sigterm})") from None


_clock = time.monotonic  # the time-based checkpoints' clock (tests replace it)
SIGTERM_SAVE_S = 20.0
"""On SIGTERM a run saves its step unless its last save took longer: SLURM's KillWait and torchrun's grace, the
time between SIGTERM and SIGKILL, are 30 s by default (a save cut short by SIGKILL leaves the previous one)."""


class Agreed(NamedTuple):
    """What every rank decides alike after a step (one all-reduce a step, not one per question)."""

    due: bool
    """`checkpoint_every_min` minutes have passed since the last save, by global rank 0's clock (clocks differ
    between hosts, and a rank deciding alone would hang the others in the collective save; 0 minutes: never)."""
    stop: bool
    """SIGTERM reached some rank (signals.pending), even when the launcher signalled only some of them."""
    cheap: bool
    """No rank's last save took over SIGTERM_SAVE_S seconds: saving on SIGTERM fits the scheduler's grace."""


def agree(grid, device: torch.device, saved_at: float, minutes: float, save_s: float | None) -> Agreed:
    """The step's decisions, the same on every rank: they stop after the same step and enter a save together or
    not at all. Bookkeeping: not in the communication ledger. Saving changes nothing trained."""
    due = grid.rank == 0 and minutes > 0 and _clock() - saved_at >= minutes * 60
    flags = [due, signals.pending(), save_s is not None and save_s > SIGTERM_SAVE_S]
    if grid.world_size > 1:
        t = torch.tensor([float(f) for f in flags], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # rank 0 alone may set `due`: its clock decides
        flags = [bool(f) for f in t.tolist()]
    return Agreed(due=flags[0], stop=flags[1], cheap=not flags[2])


@contextlib.contextmanager
def _progress(grid, start: int, total: int):
    """A tqdm bar on global rank 0 only (other ranks stay silent), cleared when the block ends, by an error too:
    the error's line then starts where the bar was instead of after it."""
    if grid.rank != 0:
        yield lambda record: None
        return
    from tqdm import tqdm

    with tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, leave=False) as bar:

        def update(record):
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if record["step"] == total:
                bar.close()

        yield update
