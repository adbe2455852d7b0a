"""A sweep's results file and the record of one finished run.

results.jsonl is only ever appended to (one flushed line per finished or failed run), never rewritten;
the last line of a point wins when it was retried. Reading it needs no torch (`memtrain plot` starts fast).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memtrain.config import RunConfig

RESULTS = "results.jsonl"


def read_results(path: Path) -> list[dict]:
    """Every record of a results.jsonl (a line cut by a kill, or anything but a JSON object, is skipped with a
    warning)."""
    rows = []
    if not path.is_file():
        return rows
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            print(f"warning: {path}:{n} is not valid JSON (an interrupted write?); ignored", file=sys.stderr)
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            print(f"warning: {path}:{n} is not a JSON object (a result record); ignored", file=sys.stderr)
    return rows


def append_result(path: Path, record: dict) -> None:
    """Append one line and flush it to disk; a previous line cut short by a kill is left alone."""
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line  # never glue our line onto a torn one
        f.seek(0, os.SEEK_END)
        f.write(line.encode())
        f.flush()
        os.fsync(f.fileno())


def latest_by_point(rows: list[dict]) -> dict[str, dict]:
    """The last record of every point, in order of first appearance (records without a point id stand alone)."""
    out = {}
    for i, r in enumerate(rows):
        out[r.get("point") or f"#{i}"] = r
    return out


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")



_CANARY_KEYS = ("id", "kind", "copies", "inserted", "exact_match", "token_match", "rouge_l", "rouge_l_text",
                "longest_prefix", "exposure", "exact_match_in_row")


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


def train_summary(run_dir: Path) -> dict:
    """Final training metrics of a run from its metrics.jsonl (loss at the end, median throughput)."""
    recs = []
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                recs.append(json.loads(line))
    if not recs:
        return {}
    last = recs[-1]
    tail = recs[-max(1, len(recs) // 10):]
    out = {k: last.get(k) for k in ("step", "loss", "tokens", "lr", "loss_kept", "loss_dropped", "epoch")}
    out["loss_tail_mean"] = sum(r.get("loss", 0.0) for r in tail) / len(tail)
    out["tokens_per_s"] = _median([r.get("tokens_per_s") for r in recs[1:] or recs])
    out["mfu"] = _median([r.get("mfu") for r in recs[1:] or recs])
    out["kept_fraction"] = _median([r.get("kept_fraction") for r in recs])
    mems = [r.get("memory_mb") for r in recs if isinstance(r.get("memory_mb"), (int, float))]
    out["memory_mb"] = max(mems) if mems else None
    return out


def canary_rows(run_dir: Path) -> list[dict]:
    rows = []
    path = run_dir / "eval_canaries.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                r = json.loads(line)
                rows.append({k: r[k] for k in _CANARY_KEYS if k in r})
    return rows


def loss_label(cfg: RunConfig) -> str:
    loss = cfg.loss
    if loss.kind != "goldfish":
        return loss.kind
    extra = "" if loss.h == 13 else f" h={loss.h}"
    extra += "" if loss.mask == "hashed" else f" {loss.mask}"
    return f"goldfish k={loss.k}{extra}"


def passes(run_dir: Path) -> list[dict]:
    """The per-pass scores of a run (passes.jsonl)."""
    rows = []
    path = run_dir / "passes.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def make_record(spec_name: str, point, run_dir: Path, base_dir: Path | None, status: str,
                error: str | None, started: str, seconds: float) -> dict:
    run = _read_json(run_dir / "run.json") or {}
    ev = _read_json(run_dir / "eval.json")
    base = _read_json(base_dir / "base.json") if base_dir else None
    if status == "ok" and ev is None and point.cfg.eval.enabled:
        status, error = "failed", "the run exited 0 but wrote no eval.json"
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


