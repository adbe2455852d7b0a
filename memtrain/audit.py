"""`memtrain eval --model MODEL --canaries FILE --out DIR`: score your canaries against any causal LM.

MODEL is a local transformers directory (weights in safetensors; its Python code runs only with
--trust-remote-code) or a memtrain run or checkpoint. Its own tokenizer turns the file's texts into ids once
(memtrain/data/canary_file.py), and memtrain/scoring.py scores them as it scores a run's canaries: greedy
extraction of each suffix, and membership inference against the twins the file gives. One process loads the
plain model; under torchrun or srun the processes form a grid (`--set parallel.x=2` ...; a run keeps its own
degrees) and each loads only its shards, so a model too big for one device can be audited. Rank 0 writes
DIR/eval.json and DIR/eval_canaries.jsonl, as a run's evaluation does, and prints a table per kind.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import AutoTokenizer

import parallel
from memtrain.api import evaluate
from memtrain.config import RunConfig, apply_overrides, from_dict
from memtrain.config import load as load_config
from memtrain.data import canary_file
from memtrain.evaluate import check_launched, eval_grid, run_model
from memtrain.export import resolve, run_tokenizer
from memtrain.files import write_atomic
from memtrain.hf import GridModel, parallelize
from memtrain.model_copy import run_model_name
from memtrain.models import allow_remote_code, build_model
from memtrain.progress import note, seconds
from memtrain.run_files import CONFIG, EVAL, EVAL_CANARIES, check_output
from memtrain.scoring import start_ids
from memtrain.training import checkpoint


def _model_tokenizer(model: str, trust_remote_code: bool):
    """(tokenizer, run config, run directory, checkpoint; the last three None for an HF directory) of MODEL: a
    memtrain run/checkpoint or an HF directory."""
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"--model {model!r} is not a directory: name a transformers model directory or a "
                                "memtrain run")
    if (path / CONFIG).is_file() or (path / "state.json").is_file():
        run, ckpt = resolve(path, then="evaluate")
        cfg = load_config(run / CONFIG)
        allow_remote_code(cfg, trust_remote_code, str(run / CONFIG))
        return run_tokenizer(run, cfg), cfg, run, ckpt
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {model!r} has no config.json: name a directory written by "
                                "save_pretrained (or `memtrain export`), or a memtrain run")
    if not any(path.glob("*.safetensors")):  # pickled weights (.bin) can run code when loaded
        raise FileNotFoundError(f"--model {model!r} holds no *.safetensors weights: save the model with "
                                "save_pretrained (safetensors is its default), then audit that directory")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a missing or foreign tokenizer
        raise ValueError(f"--model {model!r}: its tokenizer does not load ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:160]}): save the tokenizer beside the model") from None
    return tok, None, None, None


def _config(cfg: RunConfig | None, overrides: list[str]) -> RunConfig:
    """The run's config (or the defaults, for a model from elsewhere) with the command's eval.*/parallel.* keys."""
    return from_dict(apply_overrides(cfg.to_dict() if cfg is not None else {}, overrides))


def _check_vocab(tok, config, model: str) -> None:
    """A tokenizer that emits ids the model has no embedding row for would crash mid-evaluation, or (ids past a
    padded table) score garbage: refuse first."""
    if len(tok) > config.vocab_size:
        raise ValueError(f"--model {model!r}: its tokenizer has {len(tok):,} tokens but the model only "
                         f"{config.vocab_size:,} embedding rows: save the tokenizer the model was trained with")


def _load_one_process(model: str, cfg: RunConfig | None, run, ckpt, tok, trust_remote_code: bool):
    if cfg is not None:
        with checkpoint.read_weights(ckpt) as src:
            weights = {k: src.read(k) for k in src.keys()}
        return run_model(cfg, len(tok), weights, run)
    hf = build_model(model, device="cpu", trust_remote_code=trust_remote_code)
    _check_vocab(tok, hf.config, model)
    return hf


def _load_on_grid(model: str, cfg: RunConfig, run_cfg: RunConfig | None, run, ckpt, tok, trust_remote_code: bool):
    """The model sharded over a grid of the launched processes, each reading only its slices of the weights."""
    grid = eval_grid(cfg)
    if run_cfg is not None:  # from the run's copy of its model directory, as it trained (model_copy.run_model_name)
        hf = build_model(run_model_name(run, run_cfg.model.name), vocab_size=len(tok), device="meta",
                         trust_remote_code=trust_remote_code)
        plm = parallelize(hf, grid, mode=cfg.parallel.mode, weights="seed")
        with checkpoint.read_weights(ckpt) as src:
            plm.load_hf_state_dict(src)
    else:
        hf = build_model(model, device="meta", trust_remote_code=trust_remote_code)
        _check_vocab(tok, hf.config, model)
        plm = parallelize(hf, grid, mode=cfg.parallel.mode)  # loads the directory's safetensors, slice by slice
    return grid, GridModel(plm)


def audit(model: str, canaries: str, out: str | Path, overrides: list[str] | None = None,
          trust_remote_code: bool = False) -> dict | None:
    """Score the canary file against MODEL and write OUT/eval.json and OUT/eval_canaries.jsonl; the result on
    global rank 0 (None on the other ranks of a grid). `overrides`: eval.* and parallel.* keys."""
    out = check_output(out)
    if (out / EVAL).exists():
        raise FileExistsError(f"--out {str(out)!r} holds an earlier evaluation ({EVAL}): name a new directory")
    if Path(model).is_dir():  # a directory even where a built-in model has its name (./gpt2): build_model takes names
        model = str(Path(model).resolve())
    tok, run_cfg, run, ckpt = _model_tokenizer(model, trust_remote_code)
    cfg = _config(run_cfg, overrides or [])
    check_launched(cfg, overrides or [])
    manifest = canary_file.to_canaries(canary_file.read(canaries), tok, str(canaries))
    start = start_ids(tok)
    out.mkdir(parents=True, exist_ok=True)  # the input read: an --out that cannot be written is told before scoring
    t0 = time.perf_counter()
    grid = None
    try:
        if parallel.launch_world_size() > 1:
            grid, lm = _load_on_grid(model, cfg, run_cfg, run, ckpt, tok, trust_remote_code)
        else:
            lm = _load_one_process(model, run_cfg, run, ckpt, tok, trust_remote_code)
        result = evaluate(lm, tok, manifest, suffix_len=cfg.eval.suffix_len, batch_size=cfg.eval.batch_size,
                          pythia=cfg.eval.pythia, start=start)
    finally:
        if grid is not None:
            parallel.shutdown()
    if grid is not None and grid.rank != 0:
        return None
    rows_out = result.pop("rows")
    result.update(model=str(model), canaries_file=str(canaries),
                  canaries_sha256=canary_file.file_digest(canaries), start_ids=start, tokenizer_size=len(tok),
                  world_size=grid.world_size if grid is not None else 1,
                  seconds=round(time.perf_counter() - t0, 2))
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / EVAL_CANARIES, "".join(json.dumps(r) + "\n" for r in rows_out))
    write_atomic(out / EVAL, json.dumps(result, indent=1))
    note(f"eval: done in {seconds(result['seconds'])}: {out / EVAL}")
    return result | {"rows": rows_out}


def table(result: dict) -> str:
    """The terminal table: one line per kind."""
    head = f"{'kind':<14} {'canaries':>8} {'exact match':>12} {'token match':>11} {'twins exact':>11} {'MIA AUC':>8}"
    lines = [head]
    for kind, k in result["by_kind"].items():
        exact = f"{k['exact_count']}/{k['n_evaluated']}"
        tm = "-" if k["token_match"] is None else f"{k['token_match']:.3f}"
        twins = "-" if not k["twins"] else f"{k['twins_exact_count']}/{k['twins_evaluated']}"
        auc = "-" if k["mia_auc_loss"] is None else f"{k['mia_auc_loss']:.3f}"
        lines.append(f"{str(kind):<14} {k['n']:>8} {exact:>12} {tm:>11} {twins:>11} {auc:>8}")
    if result["not_scored"]:
        missed = result["not_scored"]
        lines.append(f"not scored ({len(missed)}: too short for a suffix of {result['suffix_len']} tokens; lower "
                     f"--suffix-len or give prefix/suffix): {', '.join(map(str, missed[:8]))}")
    return "\n".join(lines)
