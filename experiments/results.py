"""A sweep's results file and the record of one finished run: the one schema between the sweep that writes it
(experiments.sweep) and the report that reads it (experiments.report); neither reaches past it into the other.

results.jsonl is only ever appended to (one fsync'd line per finished or failed run, `memtrain.files.append_jsonl`),
never rewritten; a line cut short by a kill is skipped with a warning when read (`memtrain.files.read_jsonl`), and
the last line of a point wins when it was retried (`latest_by_point`). Reading it needs no torch (`memtrain plot`
starts fast).
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from memtrain.files import read_jsonl
from memtrain.run_files import EVAL, EVAL_CANARIES, METRICS, PASSES, RUN

if TYPE_CHECKING:
    from memtrain.config import RunConfig

RESULTS = "results.jsonl"
BASE_INFO = "base.json"
"""What a cached base model's directory says of it (written by experiments.sweep.base_models)."""

_CANARY_KEYS = ("id", "kind", "copies", "inserted", "exact_match", "token_match", "rouge_l", "rouge_l_text",
                "longest_prefix", "exposure", "exact_match_in_row")


def latest_by_point(rows: list[dict]) -> dict[str, dict]:
    """The last record of every point, in order of first appearance (records without a point id stand alone)."""
    out = {}
    for i, r in enumerate(rows):
        out[r.get("point") or f"#{i}"] = r
    return out


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _median(xs):
    xs = sorted(x for x in xs if isinstance(x, (int, float)) and math.isfinite(x))
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


# A run's own JSONL files are read quietly: a line a killed trainer left torn is not the sweep's news (its
# record says how the run ended), and results.jsonl's reader already warns about its own torn lines.


def train_summary(run_dir: Path) -> dict:
    """Final training metrics of a run from its metrics.jsonl (loss at the end, median throughput)."""
    recs = read_jsonl(run_dir / METRICS, quiet=True)
    if not recs:
        return {}
    last = recs[-1]
    tail = recs[-max(1, len(recs) // 10):]
    out = {k: last.get(k) for k in ("step", "loss", "tokens", "lr", "loss_dropped", "epoch")}
    out["loss_tail_mean"] = sum(r.get("loss", 0.0) for r in tail) / len(tail)
    out["tokens_per_s"] = _median([r.get("tokens_per_s") for r in recs[1:] or recs])
    out["mfu"] = _median([r.get("mfu") for r in recs[1:] or recs])
    out["kept_fraction"] = _median([r.get("kept_fraction") for r in recs])
    mems = [r.get("memory_mb") for r in recs if isinstance(r.get("memory_mb"), (int, float))]
    out["memory_mb"] = max(mems) if mems else None
    return out


def canary_rows(run_dir: Path) -> list[dict]:
    """The per-canary rows of a run's evaluation, without the generated text (the record stays small)."""
    return [{k: r[k] for k in _CANARY_KEYS if k in r} for r in read_jsonl(run_dir / EVAL_CANARIES, quiet=True)]


def passes(run_dir: Path) -> list[dict]:
    """The per-pass scores of a run (passes.jsonl)."""
    return read_jsonl(run_dir / PASSES, quiet=True)


def loss_label(cfg: RunConfig) -> str:
    loss = cfg.loss
    if loss.kind != "goldfish":
        return loss.kind
    extra = "" if loss.h == 13 else f" h={loss.h}"
    extra += "" if loss.mask == "hashed" else f" {loss.mask}"
    return f"goldfish k={loss.k}{extra}"


def make_record(spec_name: str, point, run_dir: Path, base_dir: Path | None, status: str,
                error: str | None, started: str, seconds: float) -> dict:
    """The results line of a sweep point (experiments.sweep.spec.Point) that ran into `run_dir`."""
    run = _read_json(run_dir / RUN) or {}
    ev = _read_json(run_dir / EVAL)
    base = _read_json(base_dir / BASE_INFO) if base_dir else None
    if status == "ok" and ev is None and point.cfg.eval.enabled:
        status, error = "failed", f"the run exited 0 but wrote no {EVAL}"
    return {
        "sweep": spec_name, "point": point.id, "status": status, "error": error,
        "axes": point.axes, "model": point.cfg.model.name, "loss": loss_label(point.cfg),
        "seed": point.cfg.train.seed, "params": run.get("params"), "hidden_size": run.get("hidden_size"),
        "lr": run.get("lr"), "precision": run.get("precision"), "run_dir": str(run_dir),
        "base_dir": str(base_dir) if base_dir else None, "config_digest": point.digest,
        "started": started, "finished": now(), "seconds": round(seconds, 1),
        "train": train_summary(run_dir) | {"steps_planned": (run.get("trained") or {}).get("steps")},
        "eval": ev, "canaries": canary_rows(run_dir), "passes": passes(run_dir),
        "base": {k: base.get(k) for k in ("steps", "seconds", "val_loss", "unigram_entropy")} if base else None,
        "run": {k: run.get(k) for k in ("grid", "mode", "trained")},
        "config": point.cfg.to_dict(),
    }
