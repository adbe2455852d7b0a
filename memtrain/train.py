"""One training run: build the stream and the model, parallelize it over the grid, train, checkpoint.

The same code runs as one process and under torchrun/SLURM. Normalization is what makes grids
interchangeable: every rank reads the whole global batch's labels (cheap), so the number of
supervised tokens N of the step is known everywhere without communication; each micro-batch
back-propagates sum(kept token losses) / N and gradients are summed over ranks. Gradient
accumulation, data parallelism and Goldfish dropping therefore never change the result.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import parallel
from memtrain import checkpoint
from memtrain.config import RunConfig, to_toml
from memtrain.data import build_stream
from memtrain.files import write_atomic
from memtrain.losses import keep_mask, loss_sums
from memtrain.models import build_model
from memtrain.parallelize import parallelize
from memtrain.perf import matmul_peak_flops
from memtrain.tracking import Tracker


def _precision(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    p = cfg.train.precision
    if p not in ("auto", "fp32", "bf16"):
        raise ValueError(f"train.precision={p!r} is invalid: use 'auto', 'fp32' or 'bf16'")
    if p == "bf16" or (p == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def _optimizer(plm, cfg: RunConfig):
    params = list({id(p): p for p in plm.parameters() if p.requires_grad}.values())
    # Matrices (every engine weight is a matrix shard) decay; norms and biases do not.
    decay = [p for p in params if parallel.spec_of(p).shard_axes == ("x", "y", "z") or p.dim() >= 2]
    rest = [p for p in params if all(p is not q for q in decay)]
    t = cfg.train
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)


def _schedule(opt, cfg: RunConfig, total_steps: int):
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return (t.min_lr + (t.lr - t.min_lr) * cosine) / t.lr

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, keep metrics of steps the checkpoint covers (later lines came from the lost run)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    write_atomic(path, "".join(line + "\n" for line in kept))


def _memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def setup(cfg: RunConfig, grid: parallel.Grid):
    """Stream, parallelized model and the steps of the run (shared by train and eval entry points)."""
    stream = _build_stream_once_per_node(cfg, grid)
    hf = build_model(cfg.model.name, vocab_size=stream.vocab_size, device="meta",
                     trust_remote_code=cfg.model.trust_remote_code)
    plm = parallelize(hf, grid, mode=cfg.parallel.mode, seed=cfg.train.seed)
    return stream, plm


def _build_stream_once_per_node(cfg: RunConfig, grid: parallel.Grid):
    """Local rank 0 builds the stream (tokenizer training, tokenization, packing) into the cache first; the
    node's other ranks then read it. Built by every rank at once, the same work ran N times over on the
    node's cores (4 ranks on 2 cores: minutes instead of seconds for the default corpus)."""
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    stream = build_stream(cfg.data, cfg.canaries, seed=cfg.train.seed) if first else None
    if grid.world_size > 1:
        torch.distributed.barrier()
    return stream if first else build_stream(cfg.data, cfg.canaries, seed=cfg.train.seed)


def train(cfg: RunConfig, out_dir: str | Path, *, resume: bool = False) -> dict:
    """Train one run into `out_dir`; returns a summary (rank 0 has the reduced metrics)."""
    p = cfg.parallel
    grid = parallel.init(data=p.data, x=p.x, y=p.y, z=p.z, backend=p.backend)
    out = Path(out_dir)
    t = cfg.train
    if grid.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if resume:
        saved = out / "config.toml"
        if not saved.is_file():
            raise FileNotFoundError(f"--resume: {str(out)!r} has no config.toml: it is not a run directory")
        from memtrain.config import load as load_config

        if load_config(saved).digest() != cfg.digest():
            raise ValueError(f"--resume with a different config than {str(saved)!r}: resume with the same "
                             "config, or train into a new --out directory")
    elif grid.rank == 0:
        write_atomic(out / "config.toml", to_toml(cfg))
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(t.seed)

    stream, plm = setup(cfg, grid)
    if t.activation_checkpointing:
        plm.enable_activation_checkpointing()
    B = t.batch_size
    if B % grid.size(("z", "data")) or (plm.mode == "easy" and B % grid.world_size):
        raise ValueError(f"train.batch_size={B} does not split over the grid ({plm.mode} mode, "
                         f"data={grid.data} z={grid.z} world={grid.world_size}): use a multiple of "
                         f"{grid.world_size if plm.mode == 'easy' else grid.size(('z', 'data'))}")
    rows = plm.local_rows(B)
    n_local = rows.stop - rows.start
    mb = t.micro_batch_size or n_local
    if n_local % mb:
        raise ValueError(f"train.micro_batch_size={mb} does not divide this rank's {n_local} sequences per step")
    steps_per_epoch = len(stream) // B  # a short last batch would not split over the grid: dropped
    if steps_per_epoch < 1:
        raise ValueError(f"the stream has {len(stream)} sequences, fewer than train.batch_size={B}: "
                         "use a smaller batch or a larger corpus")
    total = steps_per_epoch * t.epochs
    if t.max_steps is not None:
        total = min(total, t.max_steps)

    if cfg.model.init:
        model_sd = checkpoint.read_weights(cfg.model.init)
        plm.load_hf_state_dict(model_sd)
    opt = _optimizer(plm, cfg)
    sched = _schedule(opt, cfg, total)
    start = 0
    metrics_path = out / "metrics.jsonl"
    if resume:
        ckpt = checkpoint.latest(out)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {str(out / 'checkpoints')!r}")
        model_sd, opt_sd, state = checkpoint.read(ckpt)
        plm.load_hf_state_dict(model_sd)
        checkpoint.scatter_optimizer(plm, opt, opt_sd, state["step"])
        sched.load_state_dict(state["scheduler"])
        for group, lr in zip(opt.param_groups, sched.get_last_lr()):  # load_state_dict leaves these stale
            group["lr"] = lr
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
        start = state["step"]
        if grid.rank == 0:
            _truncate_metrics(metrics_path, start)
    if grid.rank == 0:
        trained = {"steps": total, "epochs": t.epochs}
        stream.write_manifest(out, B, grid.data if plm.mode == "sharded" else grid.world_size)
        (out / "run.json").write_text(json.dumps({"stream_key": stream.key, "trained": trained,
                                                   "grid": {a: getattr(grid, a) for a in parallel.AXES},
                                                   "mode": plm.mode, "params": plm.num_params()}))

    device = next(plm.parameters()).device
    amp = _precision(cfg, device)
    peak = matmul_peak_flops(device, amp or torch.float32)
    flops_per_token = 6 * plm.num_params()
    summary: dict = {}
    progress = _progress(grid, start, total)
    tracker = Tracker.start(cfg, out, grid.rank)
    for step in range(start, total):
        t0 = time.perf_counter()
        batch = stream.batch(step % steps_per_epoch, B)
        keep = keep_mask(batch["labels"], batch["doc_pos"], cfg.loss)
        lr = sched.get_last_lr()[0]
        sums, norm = train_step(plm, grid, opt, batch["input_ids"], batch["labels"], keep, mb, amp=amp,
                                overlap=p.overlap, grad_clip=t.grad_clip)
        sched.step()
        dt = time.perf_counter() - t0
        tokens = B * stream.seq_len
        record = {
            "step": step + 1, "loss": float(sums[0] / max(sums[1], 1)), "lr": lr,
            "tokens": tokens * (step + 1), "tokens_per_s": tokens / dt, "step_time_s": dt,
            "grad_norm": float(norm), "kept_fraction": float(sums[1] / max(sums[1] + sums[3], 1)),
            "loss_kept": float(sums[0] / max(sums[1], 1)),
            "loss_dropped": float(sums[2] / sums[3]) if sums[3] > 0 else None,
            "mfu": flops_per_token * tokens / dt / (peak * grid.world_size), "memory_mb": _memory_mb(device),
            "epoch": step // steps_per_epoch,
        }
        summary = record
        if grid.rank == 0 and ((step + 1) % t.log_every == 0 or step + 1 == total):
            _append_jsonl(metrics_path, record)
            tracker.log(record, step + 1)
        progress(record)
        if t.checkpoint_every and (step + 1) % t.checkpoint_every == 0 and step + 1 < total:
            checkpoint.save(out, plm, opt, sched, step + 1, {"config_digest": cfg.digest()})
    checkpoint.save(out, plm, opt, sched, total, {"config_digest": cfg.digest()})
    return summary | {"run_dir": str(out), "steps": total, "grid": grid, "plm": plm, "stream": stream,
                      "tracker": tracker}


def train_step(plm, grid: parallel.Grid, opt, input_ids: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor,
               micro_batch: int, *, amp: torch.dtype | None = None, overlap: bool = True,
               grad_clip: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on a global batch (every rank passes the whole batch and takes its own rows).

    Returns the step's global loss sums [kept loss, kept tokens, dropped loss, dropped tokens] (float64,
    all-reduced) and the global gradient norm before clipping. The planner's byte model is tested against
    the collectives of exactly this function.
    """
    device = next(plm.parameters()).device
    n_kept = keep.sum().clamp(min=1)  # the global count: every rank sees the whole batch's labels
    rows = plm.local_rows(input_ids.shape[0])
    ids, labels, keep = input_ids[rows], labels[rows], keep[rows]
    opt.zero_grad(set_to_none=True)
    sums = torch.zeros(4, dtype=torch.float64)
    for i in range(0, ids.shape[0], micro_batch):
        sl = slice(i, i + micro_batch)
        ov = parallel.overlap(plm) if overlap else nullcontext()
        ac = torch.autocast(device.type, dtype=amp) if amp else nullcontext()
        with ov:
            with ac:
                token_losses = plm.token_losses(ids[sl].to(device), labels[sl].to(device))
            s = loss_sums(token_losses.float(), keep[sl].to(device), labels[sl].to(device))
            (s.kept_sum / n_kept).backward()
        sums += torch.stack([x.detach().double().cpu() for x in s])
    parallel.sync_gradients(plm, grid)
    norm = parallel.clip_grad_norm_(plm, grad_clip, grid) if grad_clip > 0 else parallel.grad_norm(plm, grid)
    opt.step()
    parallel.comm.all_reduce(sums, grid, plm.loss_reduce_axes)
    return sums, norm


def _progress(grid, start: int, total: int):
    """A tqdm bar on global rank 0 only; other ranks stay silent."""
    if grid.rank != 0:
        return lambda record: None
    from tqdm import tqdm

    bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, leave=False)

    def update(record):
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if record["step"] == total:
            bar.close()

    return update


def _single_process_model(cfg: RunConfig, stream, state_dict: dict):
    model = build_model(cfg.model.name, vocab_size=stream.vocab_size, device="cpu",
                        trust_remote_code=cfg.model.trust_remote_code)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied]:
        raise ValueError(f"checkpoint does not fit model {cfg.model.name!r} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}): evaluate with the config it was trained with")
    return model


def evaluate_after(cfg: RunConfig, summary: dict) -> dict | None:
    """Collective: gather the trained model, evaluate on global rank 0."""
    from memtrain.evaluate import evaluate

    plm, stream = summary["plm"], summary["stream"]
    state = plm.full_state_dict()
    if summary["grid"].rank != 0:
        return None
    model = _single_process_model(cfg, stream, state)
    result = evaluate(model, stream, cfg, Path(summary["run_dir"]), summary["steps"])
    summary["tracker"].log_eval({k: v for k, v in result.items() if k != "rows"}, result["rows"])
    return result


def evaluate_run(run_dir: Path, checkpoint_path: str | None = None) -> dict:
    """`memtrain eval --run DIR`: evaluate a finished run again from its checkpoint (one process)."""
    from memtrain.config import load as load_config
    from memtrain.evaluate import evaluate

    run_dir = Path(run_dir)
    cfg_path, run_json = run_dir / "config.toml", run_dir / "run.json"
    if not cfg_path.is_file() or not run_json.is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a finished run directory (no config.toml/run.json): "
                                "pass the --out directory of `memtrain train`")
    if not (run_dir / "canaries.jsonl").is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} has no canaries.jsonl manifest: nothing to evaluate")
    cfg = load_config(cfg_path)
    stream = build_stream(cfg.data, cfg.canaries, seed=cfg.train.seed)
    info = json.loads(run_json.read_text())
    if info.get("stream_key") != stream.key:
        raise ValueError(f"{str(run_dir)!r} was trained on another stream (tokenizer or data changed): "
                         "evaluate with the data and tokenizer it was trained with")
    weights = checkpoint.read_weights(Path(checkpoint_path) if checkpoint_path else run_dir)
    model = _single_process_model(cfg, stream, weights)
    return evaluate(model, stream, cfg, run_dir, info["trained"]["steps"])
