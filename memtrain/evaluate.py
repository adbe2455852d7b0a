"""Evaluate a trained run's memorization of its canaries: extraction, exposure, MIA, validation loss.

    evaluate_after(cfg, result)        # right after `train` (collective, on the grid; rank 0 writes)
    evaluate_run("runs/my-run")        # `memtrain eval RUN_DIR`: again, from a checkpoint (torchrun: on a grid)

Each canary is scored as the model saw it in training, i.e. preceded by the EOS that opens it (with
document attention, the default, that is exactly its training context wherever it sat in its row; without
it, canaries placed mid-row are also extracted from their recorded row context, `in_row`); its held-out twin
is scored the same way as the non-member control. The final evaluation of a distributed run runs on its grid:
eval's metrics see the sharded model through `memtrain.hf.GridModel`, every rank decodes and scores its share of
the rows and gets every result, so no rank ever holds the whole model; one process evaluates the plain HF model.
(The per-pass scores during training are the trainer's probe: memtrain/training/probe.py.) Global rank 0
writes the results: eval.json (aggregates, also split by copies) and eval_canaries.jsonl (one row per canary
and twin, with the generated text).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

import eval as ev
import parallel
from memtrain.config import RunConfig
from memtrain.config import load as load_config
from memtrain.data import build_stream
from memtrain.data.canaries import render_secret
from memtrain.files import read_json, write_atomic
from memtrain.hf import GridModel
from memtrain.models import allow_remote_code, build_model
from memtrain.progress import note, seconds, stage
from memtrain.run_files import CONFIG, EVAL, EVAL_CANARIES, MANIFEST, RUN
from memtrain.training import TrainResult, checkpoint, setup


def _eval_canaries(canaries, eos: int, copies_seen: dict[str, int]) -> list[ev.Canary]:
    out = []
    for c in canaries:
        seen = copies_seen.get(c.id, c.copies)
        out.append(ev.Canary(tokens=[eos, *c.token_ids], id=c.id, kind=c.kind, copies=seen, inserted=True,
                             text=c.text))
        out.append(ev.Canary(tokens=[eos, *c.twin_token_ids], id=c.id + "-twin", kind=c.kind, copies=seen,
                             inserted=False, text=c.twin_text))
    return out


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
            out = []
            for i in indices:
                d = str(i).zfill(n_digits)
                secret = "-".join(d[g * 4:g * 4 + 4] for g in range(groups))
                out.append(tok(render_secret(name, secret), add_special_tokens=False)["input_ids"])
            return out

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
    rows = []
    for c in stream.canaries:
        if c.kind != "random":
            continue
        for tokens, member in ((c.token_ids, True), (c.twin_token_ids, False)):
            fn, size = _candidates(c, stream.tokenizer, twin=not member)
            if fn is None:
                break
            # Scored after the EOS that opens every canary copy, as in training.
            r = ev.exposure(model, [stream.eos_id], fn, size, true_tokens=list(tokens),
                            n_samples=cfg.eval.exposure_samples, batch_size=cfg.eval.batch_size, seed=0)
            rows.append({"id": c.id if member else c.id + "-twin", "inserted": member, "copies": c.copies,
                         "exposure": r.exposure, "exposure_method": r.method})
    return rows


def order_effect(stream, rows: list[dict], batch_size: int) -> dict:
    """Does the order of training show? Per copies level, the Spearman correlation of a member's last training
    step with its log-likelihood (MIA's 'loss' score, the mean log-probability of its tokens): later-seen text
    should be remembered better (positive). Levels with fewer than 4 members are left out; 'mean' weights the
    levels by their members."""
    last = {c.id: max(p.seq_index for p in c.placements) // batch_size for c in stream.canaries if c.placements}
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


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _in_row_canaries(stream, seen: dict[str, int]) -> list[ev.Canary]:
    """Each canary as its first copy was trained without document attention: after the text before it in its
    row (which ends with the EOS that opens it)."""
    out = []
    for c in stream.canaries:
        p = c.placements[0]
        context = stream.rows(p.seq_index, p.seq_index + 1)["input_ids"][0, :p.offset].tolist()
        out.append(ev.Canary(tokens=context + list(c.token_ids), id=c.id, kind=c.kind,
                             copies=seen.get(c.id, c.copies), inserted=True, text=c.text))
    return out


def evaluate(model, stream, cfg, run_dir: Path, steps: int, write: bool = True,
             val_loss: float | None = None) -> dict:
    """Score `model` on the stream's canaries; write the results when `write`.

    `model`: an HF causal LM on one process, or a `GridModel` (collective: every rank of the grid calls this,
    one of them with write=True). `val_loss`: the held-out loss of this model on the same documents, when the
    per-pass probe has measured it already (it is then not scored again)."""
    if isinstance(model, torch.nn.Module):
        model.eval()
    seen = stream.copies_seen(cfg.train.batch_size, steps)
    canaries = _eval_canaries(stream.canaries, stream.eos_id, seen)
    buried = not stream.document_attention and any(p.offset > 1 for c in stream.canaries for p in c.placements)
    t0 = time.perf_counter()
    n_random = sum(c.kind == "random" for c in stream.canaries)
    with torch.inference_mode():
        with stage(f"eval: extraction of {len(stream.canaries)} canaries and their twins (greedy, last "
                   f"{cfg.eval.suffix_len} tokens{'; Pythia 32/32' if cfg.eval.pythia else ''}"
                   f"{'; in-row context too' if buried else ''})"):
            ext = ev.extraction_eval(model, canaries, suffix_len=cfg.eval.suffix_len,
                                     batch_size=cfg.eval.batch_size, pythia=cfg.eval.pythia)
            in_row = ev.extraction_eval(model, _in_row_canaries(stream, seen), suffix_len=cfg.eval.suffix_len,
                                        batch_size=cfg.eval.batch_size, pythia=False) if buried else None
        with stage("eval: membership inference (canaries vs twins)"):
            mia = ev.mia_eval(model, canaries, batch_size=cfg.eval.batch_size) if canaries else None
        with stage(f"eval: exposure of {n_random} random canaries and their twins "
                   f"(up to {cfg.eval.exposure_samples:,} candidates each)"):
            expo = _exposures(model, stream, cfg)
        if val_loss is not None:  # the probe's, on these same documents: not tokenized or scored again
            val_loss = {"loss": val_loss, "perplexity": math.exp(val_loss)}
        elif val := stream.val_sequences(cfg.eval.val_docs, cfg.eval.val_tokens):
            with stage(f"eval: validation loss on {sum(len(v) - 1 for v in val):,} tokens of held-out documents"):
                val_loss = ev.validation_loss(model, val, batch_size=cfg.eval.batch_size)

    tok = stream.tokenizer
    mia_rows = {r["id"]: r for r in mia["rows"]} if mia else {}
    expo_rows = {r["id"]: r for r in expo}
    in_row_rows = {r["id"]: r for r in in_row.rows} if in_row else {}
    rows = []
    for c, r in zip(canaries, ext.rows):
        row = dict(r, **{k: v for k, v in mia_rows.get(c.id, {}).items() if k not in r})
        row["exposure"] = expo_rows.get(c.id, {}).get("exposure")
        row["generated_text"] = tok.decode(r["generated"]) if r["generated"] else None
        if r["generated"]:  # ROUGE-L on decoded text, as the Goldfish paper scores it
            row["rouge_l_text"] = ev.rouge_l_text(row["generated_text"], tok.decode(c.tokens[-cfg.eval.suffix_len:]))
        if c.inserted and c.id in in_row_rows:
            row["exact_match_in_row"] = in_row_rows[c.id]["exact_match"]
        rows.append(row)

    def summary(sel):
        members = [r for r in sel if r["inserted"]]
        done = [r for r in members if r["exact_match"] is not None]
        py = [r for r in members if r["pythia_score"] is not None]
        return {
            "n": len(members),
            "n_evaluated": len(done),
            "exact_count": sum(bool(r["exact_match"]) for r in done),
            "exact_match_rate": _mean([float(r["exact_match"]) for r in done]),
            "token_match": _mean([r["token_match"] for r in done]),
            "rougeL": _mean([r["rouge_l"] for r in done]),
            "rougeL_text": _mean([r.get("rouge_l_text") for r in done]),
            "longest_prefix": _mean([r["longest_prefix"] for r in done]),
            "pythia_32_score": _mean([r["pythia_score"] for r in py]),
            "exposure_mean": _mean([r["exposure"] for r in members]),
        }

    by_copies = {}
    for cp in sorted({r["copies"] for r in rows}):
        by_copies[str(cp)] = summary([r for r in rows if r["copies"] == cp])
        m = mia["by_copies"].get(cp) if mia else None
        by_copies[str(cp)]["mia_auc_loss"] = m["loss"]["auc"] if m else None
    cells = {f"{kind}/{cp}": summary([r for r in rows if r["kind"] == kind and r["copies"] == cp])
             for kind, cp in sorted({(r["kind"], r["copies"]) for r in rows})}
    twins = [dict(r, inserted=True) for r in rows if not r["inserted"]]
    result = dict(summary(rows),
                  mia_auc_loss=mia["metrics"]["loss"]["auc"] if mia else None,
                  mia=dict(mia["metrics"]) if mia else {},
                  val_loss=val_loss["loss"] if val_loss else None,
                  val_perplexity=val_loss["perplexity"] if val_loss else None,
                  unigram_entropy=stream.unigram_entropy(),
                  twins=summary(twins), by_copies=by_copies, cells=cells, skipped=ext.skipped, steps=steps,
                  suffix_len=cfg.eval.suffix_len, order_effect=order_effect(stream, rows, cfg.train.batch_size),
                  exposure_samples=cfg.eval.exposure_samples)
    if in_row is not None:
        result["in_row"] = {k: in_row.aggregates["overall"][k] for k in ("n_evaluated", "exact_match_rate",
                                                                        "token_match_mean", "rouge_l_mean")}
    if write:
        write_atomic(run_dir / EVAL_CANARIES, "".join(json.dumps(r) + "\n" for r in rows))
        write_atomic(run_dir / EVAL, json.dumps(result, indent=1))
        note(f"eval: done in {seconds(time.perf_counter() - t0)}: {run_dir / EVAL}")
    return result | {"rows": rows}


def _single_process_model(cfg: RunConfig, stream, state_dict: dict):
    model = build_model(cfg.model.name, vocab_size=stream.vocab_size, device="cpu",
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
        model = _single_process_model(cfg, result.stream, result.model.full_state_dict())
        scores = evaluate(model, result.stream, cfg, result.run_dir, result.steps, val_loss=result.final_val_loss)
    if not rank0:
        return None
    result.tracker.log_eval({k: v for k, v in scores.items() if k != "rows"}, scores["rows"])
    return scores


def evaluate_run(run_dir: Path, checkpoint_path: str | None = None, trust_remote_code: bool = False) -> dict | None:
    """`memtrain eval RUN_DIR`: evaluate a finished run again from its checkpoint.

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
    cfg = load_config(cfg_path)
    allow_remote_code(cfg, trust_remote_code, str(cfg_path))  # the command's flag decides, never the run's file
    fix = "restore it from a copy of the run, or evaluate another run"
    info = read_json(run_json, "run file", fix)
    steps = info.get("trained", {}).get("steps") if isinstance(info.get("trained"), dict) else None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"run file {str(run_json)!r} does not say how many steps the run trained (trained.steps): "
                         f"{fix}")
    source = Path(checkpoint_path) if checkpoint_path else run_dir
    if parallel.launch_world_size() > 1:
        p = cfg.parallel
        grid = parallel.init(data=-1, x=p.x, y=p.y, z=p.z, backend=p.backend, timeout_s=p.timeout_s or 600.0)
        try:
            stream, plm = setup(cfg, grid)
            _check_stream(run_dir, info, stream)
            with checkpoint.read_weights(source) as src:
                plm.load_hf_state_dict(src)
            scores = evaluate(GridModel(plm), stream, cfg, run_dir, steps, write=grid.rank == 0)
            return scores if grid.rank == 0 else None
        finally:
            parallel.shutdown()
    stream = build_stream(cfg.data, cfg.canaries, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    _check_stream(run_dir, info, stream)
    with checkpoint.read_weights(source) as src:
        weights = {k: src.read(k) for k in src.keys()}  # one process evaluates the whole model
    model = _single_process_model(cfg, stream, weights)
    return evaluate(model, stream, cfg, run_dir, steps)


def _check_stream(run_dir: Path, info: dict, stream) -> None:
    if info.get("stream_key") != stream.key:
        raise ValueError(f"{str(run_dir)!r} was trained on another stream (tokenizer or data changed): "
                         "evaluate with the data and tokenizer it was trained with")
