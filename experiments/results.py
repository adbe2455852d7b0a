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


def read_results(path: str | Path) -> dict[str, dict]:
    """A results.jsonl's records, the last of each point (`latest_by_point`; {} when the file is missing). A file
    that is not one (binary, a record of the wrong shape) is a ValueError naming it: the sweep writes ASCII."""
    path = Path(path)
    if path.is_file():
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{str(path)!r} is not a results file (not text: byte {e.start} is "
                             f"{e.object[e.start]:#x}): restore it, or name another sweep directory") from None
    return latest_by_point(read_jsonl(path), path)


def latest_by_point(rows: list[dict], source: str | Path = RESULTS) -> dict[str, dict]:
    """The last record of every point, in order of first appearance (records without a point id stand alone).
    A record that is not a sweep's (a field of the wrong type, say) is a ValueError naming `source` and the field:
    the report and --resume read every field they use as the sweep wrote it."""
    out = {}
    for i, r in enumerate(rows):
        problem = _problem(r, _RECORD, "")
        if problem:
            raise ValueError(f"{str(source)!r}: record {i + 1} (point {str(r.get('point'))[:60]!r}) is not a sweep's "
                             f"result: {problem}; remove or restore that line")
        out[r.get("point") or f"#{i}"] = r
    return out


# What a record's fields must be, as far as the report and the sweep read them: a type, a check (a function
# saying what is wrong), a table ({} of fields, "*" for any other key, "!" the fields that must be there, "?" a
# check of the whole table) or a list ([item]). None is allowed wherever a field is not required (a failed run has
# no eval).
_ANY, _TEXT, _NUMBER, _COUNT = "anything", "a string", "a number", "a finite number >= 0"


def _columns(value) -> str | None:
    """A pass's canary columns (memtrain/training/probe.py): equal-length lists, the ids strings."""
    if not isinstance(value, dict) or not all(isinstance(v, list) for v in value.values()):
        return "is not a table of lists"
    if value and not {"id", "inserted", "exact"} <= set(value):
        return "lacks its id, inserted or exact column"
    if len({len(v) for v in value.values()}) > 1 or not all(isinstance(i, str) for i in value.get("id", [])):
        return "has lists of different lengths, or ids that are not strings"
    return None


def _scored_canary(value: dict) -> str | None:
    """A canary row scored as inserted: the report pools it by its id and copies."""
    scored = value.get("inserted") and value.get("exact_match") is not None
    return "has no id or copies" if scored and (value.get("id") is None or value.get("copies") is None) else None


def _block(*required: str):
    """An eval summary (n_evaluated, exact_count) or a pass's cell (n, k): counts >= 0, no more exact than scored."""
    def check(value) -> str | None:
        if not isinstance(value, dict):
            return f"is {type(value).__name__}, not an object"
        counts = {key: value.get(key) for key in ("n_evaluated", "n", "exact_count", "k")}
        for key in required:
            if counts[key] is None:
                return f"has no {key}"
        for key, v in counts.items():
            if v is not None and _problem(v, _COUNT, key):
                return f"has {key} = {v!r}, not {_COUNT}"
        rate = value.get("exact_match_rate")
        if isinstance(rate, (int, float)) and math.isfinite(rate) and not 0 <= rate <= 1:
            return f"has exact_match_rate = {rate!r}, not a rate in [0, 1]"
        n = counts["n_evaluated"] if counts["n_evaluated"] is not None else counts["n"]
        k = counts["exact_count"] if counts["exact_count"] is not None else counts["k"]
        return f"counts {k} exact of {n}" if n is not None and k is not None and k > n else None
    return check


_RECORD = {
    "!": ("point", "model"),
    **dict.fromkeys(("sweep", "point", "status", "error", "model", "loss", "precision", "run_dir", "base_dir",
                     "config_digest", "started", "finished"), _TEXT),
    "seed": _COUNT, "params": _NUMBER, "hidden_size": _NUMBER, "lr": _NUMBER, "seconds": _NUMBER,
    "axes": {"*": _ANY}, "job": {"*": _ANY}, "run": {"*": _ANY}, "base": {"*": _ANY}, "train": {"*": _ANY},
    "config": {"loss": {"*": _ANY}, "train": {"*": _ANY}, "*": _ANY},
    "eval": {"by_copies": {"*": _block()}, "cells": {"*": _block()}, "in_row": _block(), "*": _ANY, "?": _block()},
    "canaries": [{"id": _TEXT, "copies": _COUNT, "*": _ANY, "?": _scored_canary}],
    "passes": [{"!": ("pass",), "pass": _COUNT, "canaries": _columns,
                "members": {"cells": {"*": _block("n", "k")}, "*": _ANY}, "*": _ANY}],
    "*": _ANY,
}


def _problem(value, schema, where: str) -> str | None:
    """What is wrong with `value` against `schema` (the field's path first), None when nothing is."""
    if value is None or schema is _ANY:
        return None
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{where or 'the line'} is {type(value).__name__}, not an object"
        missing = [key for key in schema.get("!", ()) if value.get(key) is None]
        if missing:
            return f"{where + '.' if where else ''}{missing[0]} is missing"
        for key, item in value.items():
            named = key in schema and key not in ("!", "?")
            sub = schema[key] if named else schema.get("*", _ANY)
            if item is None and not named and sub is not _ANY:  # a named field may be null, a map's entry not
                return f"{where}.{key} is null".lstrip(".")
            found = _problem(item, sub, f"{where}.{key}".lstrip("."))
            if found:
                return found
        found = schema["?"](value) if "?" in schema else None
        return f"{where} {found}" if found else None
    if isinstance(schema, list):
        if not isinstance(value, list):
            return f"{where} is {type(value).__name__}, not a list"
        for i, item in enumerate(value):
            found = f"{where}[{i}] is null" if item is None else _problem(item, schema[0], f"{where}[{i}]")
            if found:
                return found
        return None
    if callable(schema):
        found = schema(value)
        return f"{where} {found}" if found else None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if (schema is _TEXT and not isinstance(value, str) or schema is _NUMBER and not number
            or schema is _COUNT and not (number and math.isfinite(value) and value >= 0)):
        return f"{where} is {type(value).__name__} {str(value)[:40]!r}, not {schema}"
    return None


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


def arm_label(point) -> str:
    """The name reports group a run under: its loss label, or the label of a named axis that sets the loss (an
    arm such as a Goldfish run given more fresh text, which must not be pooled with the plain Goldfish runs)."""
    for value in point.axes.values():
        if isinstance(value, dict) and "label" in value and any(str(k).startswith("loss.") for k in value):
            return str(value["label"])
    return loss_label(point.cfg)


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
        "axes": point.axes, "model": point.cfg.model.name, "loss": arm_label(point),
        "seed": point.cfg.train.seed, "params": run.get("params"), "hidden_size": run.get("hidden_size"),
        "lr": run.get("lr"), "precision": run.get("precision"), "run_dir": str(run_dir),
        "base_dir": str(base_dir) if base_dir else None, "config_digest": point.digest,
        "started": started, "finished": now(), "seconds": round(seconds, 1),
        "train": train_summary(run_dir) | {"steps_planned": (run.get("trained") or {}).get("steps")},
        "eval": ev, "canaries": canary_rows(run_dir), "passes": passes(run_dir),
        "base": {k: base.get(k) for k in ("steps", "seconds", "val_loss", "unigram_entropy")} if base else None,
        "run": {k: run.get(k) for k in ("grid", "mode", "trained", "corpus")},
        "config": point.cfg.to_dict(),
    }
