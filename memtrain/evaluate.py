"""Evaluate a trained run's memorization of its canaries: extraction, exposure, MIA, validation loss.

    evaluate_after(cfg, result)        # right after `train` (collective, on the grid; rank 0 writes)
    evaluate_run("runs/my-run")        # `memtrain eval RUN_DIR`: again, from a checkpoint (torchrun: on a grid)

Extraction and MIA are the library's `memtrain.api.evaluate` (every evaluation's); a run adds what only it has:
exposure over each secret's candidate space, in-row contexts, held-out loss, training order, canaries the
steps never reached.

Each canary is scored as the model saw it in training, i.e. preceded by the EOS that opens it (with
document attention, the default, that is exactly its training context wherever it sat in its row; without
it, canaries placed mid-row are also extracted from their recorded row context, `in_row`); its held-out twin
is scored the same way as the non-member control. The final evaluation of a distributed run runs on its grid:
eval's metrics see the sharded model through `memtrain.hf.GridModel`, every rank decodes and scores its share of
the rows and gets every result, so no rank ever holds the whole model; one process evaluates the plain HF model.
(The per-pass scores during training are the trainer's probe: memtrain/training/probe.py.) Global rank 0
writes the results: eval.json (aggregates, also split by copies and kind) and eval_canaries.jsonl (one row per canary
and twin, with the generated text).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

import eval as ev
import parallel
from memtrain import api
from memtrain.config import RunConfig
from memtrain.config import load as load_config
from memtrain.data import build_stream
from memtrain.data.canaries import render_secret
from memtrain.export import resolve
from memtrain.files import read_json, read_jsonl, write_atomic
from memtrain.hf import GridModel
from memtrain.model_copy import run_model_name
from memtrain.models import allow_remote_code, build_model
from memtrain.progress import note, seconds, stage
from memtrain.run_files import CHECKPOINTS, CONFIG, EVAL, EVAL_CANARIES, MANIFEST, RUN, check_output
from memtrain.scoring import prefix_lens
from memtrain.training import TrainResult, checkpoint, setup


def _candidates(c, tok, twin: bool = False):
    """(candidates_fn, |R|) over alternative secrets with the scored sequence's own context fixed: the canary's
    name, or for its twin the twin's (candidates carrying the member's name would put the twin outside its own
    candidate space and score it as never seen by construction)."""
    space = c.candidate_space
    if c.format == "secret":
        n_digits = round(math.log10(space["size"]))
        groups = n_digits // 4
        name = space["twin_slots" if twin else "slots"]["name"]

        def fn(indices):
            digits = [str(i).zfill(n_digits) for i in indices]
            texts = [render_secret(name, "-".join(d[g * 4:g * 4 + 4] for g in range(groups))) for d in digits]
            return tok(texts, add_special_tokens=False)["input_ids"]  # one call: a chunk is thousands of candidates

        return fn, space["size"]
    if c.format == "tokens":
        special = set(tok.all_special_ids)
        alphabet = [i for i in range(len(tok)) if i not in special]
        slots = ev.SlotSpace(len(c.token_ids), alphabet)

        def fn(indices):
            return slots.render(indices)

        return fn, slots.size
    return None, None


def _exposures(model, stream, cfg) -> list[dict]:
    # On a grid every forward pass is rounds of collectives: a pass of candidates may hold as many tokens as a
    # validation-loss batch. One process keeps batch_size rows (on a CPU larger ones only add memory traffic).
    tokens = cfg.eval.batch_size * cfg.data.seq_len if isinstance(model, GridModel) else 0
    rows = []
    for c in stream.canaries:
        if c.kind != "random":
            continue
        for secret, member in ((c.token_ids, True), (c.twin_token_ids, False)):
            fn, size = _candidates(c, stream.tokenizer, twin=not member)
            if fn is None:
                break
            # Scored after the EOS that opens every canary copy, as in training.
            r = ev.exposure(model, [stream.eos_id], fn, size, true_tokens=list(secret),
                            n_samples=cfg.eval.exposure_samples, batch_size=cfg.eval.batch_size,
                            batch_tokens=tokens, seed=0)
            rows.append({"id": c.id if member else c.id + "-twin", "inserted": member, "copies": c.copies,
                         "exposure": r.exposure, "exposure_method": r.method,
                         "resolution_bits": r.resolution_bits, "ceiling_bits": r.ceiling_bits})
    return rows


def order_effect(stream, rows: list[dict], batch_size: int, steps: int) -> dict:
    """Does the order of training show? Per copies level, the Spearman correlation of a member's last training
    step (of the `steps` the run took: an early stop or a later epoch moves it) with its log-likelihood (MIA's
    'loss' score, the mean log-probability of its tokens): later-seen text should be remembered better (positive).
    Canaries no step reached are left out, and levels with fewer than 4 members; 'mean' weights the levels by their
    members."""
    last = stream.last_steps(batch_size, steps)
    out: dict = {}
    for cp in sorted({r["copies"] for r in rows}):
        pts = [(last[r["id"]], r["loss"]) for r in rows if r["inserted"] and r["copies"] == cp
               and r["id"] in last and r.get("loss") is not None]
        if len(pts) >= 4 and len({p[0] for p in pts}) > 1:
            rho = spearmanr([p[0] for p in pts], [p[1] for p in pts]).statistic
            out[str(cp)] = {"rho": None if np.isnan(rho) else float(rho), "n": len(pts)}
    valid = [v for v in out.values() if v["rho"] is not None]
    n = sum(v["n"] for v in valid)
    return {"by_copies": out, "mean": sum(v["rho"] * v["n"] for v in valid) / n if n else None, "n": n}


def _in_row_canaries(stream, seen: dict[str, int], suffix_len: int) -> list[ev.Canary]:
    """Each canary as its first copy was trained without document attention: after the text before it in its
    row (which ends with the EOS that opens it), asked for what the main extraction asks it (its own split)."""
    out = []
    for c in stream.canaries:
        p = c.placements[0]
        context = stream.rows(p.seq_index, p.seq_index + 1)["input_ids"][0, :p.offset].tolist()
        prefix = prefix_lens(c, stream.tokenizer, suffix_len)[0]
        out.append(ev.Canary(tokens=context + list(c.token_ids), id=c.id, kind=c.kind,
                             copies=seen.get(c.id, c.copies), inserted=True, text=c.text,
                             prefix_len=None if prefix is None else len(context) + prefix))
    return out


def evaluate(model, stream, cfg, run_dir: Path, steps: int, write: bool = True,
             val_loss: float | None = None) -> dict:
    """Score `model` on the stream's canaries; write the results when `write`.

    `model`: an HF causal LM on one process, or a `GridModel` (collective: every rank of the grid calls this,
    one of them with write=True). `val_loss`: the held-out loss of this model on the same documents, when the
    per-pass probe has measured it already (it is then not scored again)."""
    seen = stream.copies_seen(cfg.train.batch_size, steps)
    buried = not stream.document_attention and any(p.offset > 1 for c in stream.canaries for p in c.placements)
    t0 = time.perf_counter()
    n_random = sum(c.kind == "random" for c in stream.canaries)
    if isinstance(model, torch.nn.Module):
        model.eval()
    with torch.inference_mode():
        with stage(f"eval: exposure of {n_random} random canaries and their twins "
                   f"(up to {cfg.eval.exposure_samples:,} candidates each)"):
            expo = _exposures(model, stream, cfg)
        result = api.evaluate(model, stream.tokenizer, stream.canaries, suffix_len=cfg.eval.suffix_len,
                              batch_size=cfg.eval.batch_size, pythia=cfg.eval.pythia, start=[stream.eos_id],
                              copies_seen=seen, exposures={r["id"]: r["exposure"] for r in expo})
        if buried:
            with stage("eval: extraction from each canary's in-row context"):
                in_row = ev.extraction_eval(model, _in_row_canaries(stream, seen, cfg.eval.suffix_len),
                                            suffix_len=cfg.eval.suffix_len, batch_size=cfg.eval.batch_size,
                                            pythia=False)
        if val_loss is not None:  # the probe's, on these same documents: not tokenized or scored again
            val_loss = {"loss": val_loss, "perplexity": math.exp(val_loss)}
        elif val := stream.val_sequences(cfg.eval.val_docs, cfg.eval.val_tokens):
            with stage(f"eval: validation loss on {sum(len(v) - 1 for v in val):,} tokens of held-out documents"):
                val_loss = ev.validation_loss(model, val, batch_size=cfg.eval.batch_size)

    rows = result.pop("rows")
    if buried:
        in_row_rows = {r["id"]: r for r in in_row.rows}
        for row in rows:
            if row["inserted"] and row["id"] in in_row_rows:
                row["exact_match_in_row"] = in_row_rows[row["id"]]["exact_match"]
    not_reached = [c.id for c in stream.canaries if seen.get(c.id, c.copies) == 0]
    result.update(val_loss=val_loss["loss"] if val_loss else None,
                  val_perplexity=val_loss["perplexity"] if val_loss else None,
                  unigram_entropy=stream.unigram_entropy(), steps=steps, not_reached=not_reached,
                  order_effect=order_effect(stream, rows, cfg.train.batch_size, steps),
                  exposure_samples=cfg.eval.exposure_samples,  # counts show <= log2(n + 1) bits; none > log2 |R|
                  exposure_resolution_bits=min((r["resolution_bits"] for r in expo), default=None),
                  exposure_ceiling_bits=max((r["ceiling_bits"] for r in expo), default=None))
    if buried:
        result["in_row"] = {k: in_row.aggregates["overall"][k] for k in ("n_evaluated", "exact_match_rate",
                                                                        "token_match_mean", "rouge_l_mean")}
    if write:
        write_atomic(run_dir / EVAL_CANARIES, "".join(json.dumps(r) + "\n" for r in rows))
        write_atomic(run_dir / EVAL, json.dumps(result, indent=1))
        note(f"eval: done in {seconds(time.perf_counter() - t0)}: {run_dir / EVAL}")
    return result | {"rows": rows}


def run_model(cfg: RunConfig, vocab_size: int, state_dict: dict, run_dir: Path):
    """Run `run_dir`'s plain HF model on one process, with `state_dict`'s weights (refused when they do not fit);
    built from the run's copy of its model directory, as it trained (model_copy.run_model_name)."""
    model = build_model(run_model_name(run_dir, cfg.model.name), vocab_size=vocab_size, device="cpu",
                        trust_remote_code=cfg.model.trust_remote_code)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied]:
        raise ValueError(f"checkpoint does not fit model {cfg.model.name!r} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}): evaluate with the config it was trained with")
    return model


def evaluate_after(cfg: RunConfig, result: TrainResult) -> dict | None:
    """Collective: evaluate the trained model on its grid (one process: the plain HF model with its weights);
    the scores on global rank 0, None elsewhere."""
    rank0 = result.grid.rank == 0
    if result.grid.world_size > 1:
        scores = evaluate(GridModel(result.model), result.stream, cfg, result.run_dir, result.steps, write=rank0,
                          val_loss=result.final_val_loss)
    else:
        model = run_model(cfg, result.stream.vocab_size, result.model.full_state_dict(), result.run_dir)
        scores = evaluate(model, result.stream, cfg, result.run_dir, result.steps, val_loss=result.final_val_loss)
    if not rank0:
        return None
    result.tracker.log_eval({k: v for k, v in scores.items() if k != "rows"}, scores["rows"])
    return scores


def evaluate_run(run_dir: Path, checkpoint_path: str | None = None, trust_remote_code: bool = False,
                 overrides: list[str] | None = None, out: str | Path | None = None) -> dict | None:
    """`memtrain eval RUN_DIR`: evaluate a finished run again from its final checkpoint, into the run directory, or
    with `overrides` (eval.* and parallel.* keys) or another of its checkpoints (`checkpoint_path`: copies counted up
    to its step) into `out`, so the run's own results stay those of its config and its last step.

    One process evaluates the plain HF model. Under torchrun or srun the processes form a grid with the run's
    x, y and z (data takes the remaining ranks), each reads only its shards of the checkpoint, and they evaluate
    on the grid (collective); the scores on global rank 0, None elsewhere. Only `trust_remote_code` (the command's
    flag) lets the model directory's code run, whatever the run's config.toml says."""
    run_dir = Path(run_dir)
    cfg_path, run_json = run_dir / CONFIG, run_dir / RUN
    if not cfg_path.is_file() or not run_json.is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a finished run directory (no config.toml/run.json): "
                                "pass the --out directory of `memtrain train`")
    if not (run_dir / MANIFEST).is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} has no canaries.jsonl manifest: nothing to evaluate")
    if overrides and out is None:
        raise ValueError("memtrain eval RUN_DIR --set ... needs --out DIR: the run's own eval.json stays the one its "
                         "config made")
    if out is not None:
        out = check_output(out)
        if (out / EVAL).exists():
            raise FileExistsError(f"--out {str(out)!r} holds an earlier evaluation ({EVAL}): name a new directory")
    cfg = load_config(cfg_path, overrides)
    check_launched(cfg, overrides or [])
    allow_remote_code(cfg, trust_remote_code, str(cfg_path))  # the command's flag decides, never the run's file
    fix = "restore it from a copy of the run, or evaluate another run"
    info = read_json(run_json, "run file", fix)
    steps = info.get("trained", {}).get("steps") if isinstance(info.get("trained"), dict) else None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"run file {str(run_json)!r} does not say how many steps the run trained (trained.steps): "
                         f"{fix}")
    source, step = _checkpoint(run_dir, checkpoint_path)
    if step != steps and out is None:
        raise ValueError(f"checkpoint {str(source)!r} is step {step} of a {steps}-step run: add --out DIR (the run's "
                         "own eval.json stays its final model's)")
    steps = step  # copies are counted up to the model scored
    dest = run_dir if out is None else out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if parallel.launch_world_size() > 1:
        grid = eval_grid(cfg)
        try:
            built = run_model_name(run_dir, cfg.model.name)  # the model as it trained: its copy of model.name
            stream, plm = setup(replace(cfg, model=replace(cfg.model, name=built)), grid)
            _check_stream(run_dir, info, stream)
            with checkpoint.read_weights(source) as src:
                plm.load_hf_state_dict(src)
            scores = evaluate(GridModel(plm), stream, cfg, dest, steps, write=grid.rank == 0)
            return scores if grid.rank == 0 else None
        finally:
            parallel.shutdown()
    stream = build_stream(cfg.data, cfg.canaries, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    _check_stream(run_dir, info, stream)
    with checkpoint.read_weights(source) as src:
        weights = {k: src.read(k) for k in src.keys()}  # one process evaluates the whole model
    model = run_model(cfg, stream.vocab_size, weights, run_dir)
    return evaluate(model, stream, cfg, dest, steps)


def _checkpoint(run_dir: Path, named: str | None) -> tuple[Path, int]:
    """(checkpoint, its step) that `memtrain eval RUN_DIR [--checkpoint C]` scores: the run's latest, or C, which
    must be one of the run's own (a checkpoint of another run would be scored on this run's canaries)."""
    if named is None:
        _, ckpt = resolve(run_dir, then="evaluate")
        return ckpt, checkpoint.read_state(ckpt)["step"]
    ckpt, own = Path(named), run_dir / CHECKPOINTS
    if not (ckpt / "state.json").is_file():
        raise FileNotFoundError(f"--checkpoint {named!r} is not a checkpoint (no state.json): name one of "
                                f"{str(own)!r}'s step_* directories")
    step = checkpoint.read_state(ckpt)["step"]
    if ckpt.resolve().parent != own.resolve():
        raise ValueError(f"--checkpoint {named!r} is not one of {str(run_dir)!r}'s checkpoints ({str(own)!r}): name "
                         "one of them, or evaluate the run it belongs to")
    return ckpt, step


def check_launched(cfg: RunConfig, overrides: list[str]) -> None:
    """A grid asked for on the command line (--set parallel.x=2) needs as many launched processes: one process
    would score on its own, and say nothing of the grid it was asked for."""
    p, asked = cfg.parallel, [o.split("=", 1)[0] for o in overrides if o.startswith("parallel.")]
    need = p.x * p.y * p.z * max(p.data, 1)
    if asked and need > 1 and parallel.launch_world_size() == 1:
        raise ValueError(f"--set {', '.join(asked)} asks for a grid of {need} processes, and this is one: launch it "
                         f"with torchrun --nproc-per-node {need} -m memtrain eval ..., or leave the grid out")


def eval_grid(cfg: RunConfig) -> parallel.Grid:
    """The grid of the launched processes for an evaluation: cfg's x, y and z, data taking the remaining ranks."""
    p = cfg.parallel
    return parallel.init(data=-1, x=p.x, y=p.y, z=p.z, backend=p.backend, timeout_s=p.timeout_s or 600.0)


def _check_stream(run_dir: Path, info: dict, stream) -> None:
    """The rebuilt stream must be the one the run trained on: the same key, or, where a newer memtrain keys streams
    by more than it did (the key names every setting a stream depends on, and grows), the same corpus content and the
    same canaries, twins and placements as the run's manifest recorded: all that its evaluation reads."""
    if info.get("stream_key") == stream.key:
        return
    recorded = info.get("corpus", {}).get("fingerprint") if isinstance(info.get("corpus"), dict) else None
    if recorded is not None and recorded == stream.corpus["fingerprint"] and _placed(
            read_jsonl(run_dir / MANIFEST, quiet=True)) == _placed([c.to_dict() for c in stream.canaries]):
        note(f"{str(run_dir)!r}: its stream's key predates this memtrain's; its corpus and canaries are the ones it "
             "trained on")
        return
    raise ValueError(f"{str(run_dir)!r} was trained on another stream (tokenizer or data changed): "
                     "evaluate with the data and tokenizer it was trained with")


def _placed(canaries: list[dict]) -> list[dict]:
    """Canary records as JSON holds them, without the step and rank of each copy (which follow the grid)."""
    out = json.loads(json.dumps(canaries))
    for c in out:
        c["placements"] = [{k: v for k, v in p.items() if k not in ("step", "dp_rank")} for p in c["placements"]]
    return out
