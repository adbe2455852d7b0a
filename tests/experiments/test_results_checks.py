"""results.jsonl as the report and `sweep --resume` read it (experiments/results.py): a record of the wrong shape is
one ValueError naming the file, the record and the field, never a traceback from deep inside the report."""

from __future__ import annotations

import copy
import json

import pytest

from experiments.report import build_report
from experiments.results import latest_by_point, read_results

BLOCK = {"n_evaluated": 4, "exact_count": 1, "exact_match_rate": 0.25, "rougeL": 0.5}


def _record(point: str, model: str, params: float) -> dict:
    """A finished run's line, with every part the report reads: eval summaries, canary rows, per-pass scores."""
    columns = {"id": ["c0", "c0-twin"], "inserted": [True, False], "kind": ["random"] * 2, "copies": [1, 1],
               "exact": [True, False], "suffix_loss": [4.0, 4.5]}
    return {"sweep": "t", "point": point, "status": "ok", "model": model, "params": params, "loss": "standard",
            "seed": 1, "lr": 1e-3, "error": None, "axes": {"model.name": model},
            "eval": dict(BLOCK, val_loss=3.0, by_copies={"1": dict(BLOCK)}, cells={"random/1": dict(BLOCK)}),
            "canaries": [{"id": "c0", "kind": "random", "copies": 1, "inserted": True, "exact_match": True}],
            "passes": [{"pass": p, "canaries": columns, "val_loss": 4.0,
                        "members": {"cells": {"random/1": {"k": p, "n": 4}}}} for p in (0, 1, 2)],
            "train": {"loss": 3.0}, "base": {"val_loss": 4.0}, "config": {"loss": {"kind": "standard"}}}


def _set(record: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(record)
    target = out
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return out


DAMAGE = [
    (("point",), [1, 2], "point is list"),
    (("point",), KeyError, "point is missing"),
    (("status",), 3, "status is int"),
    (("seed",), float("nan"), "seed is float"),
    (("eval",), [1], "eval is list"),
    (("eval", "n_evaluated"), -3, "n_evaluated"),
    (("eval", "exact_count"), 9, "counts 9 exact of 4"),
    (("eval", "by_copies", "1"), "x", "eval.by_copies.1"),
    (("eval", "cells", "random/1"), None, "eval.cells.random/1 is null"),
    (("canaries",), 5, "canaries is int"),
    (("canaries", 0), None, "canaries[0] is null"),
    (("canaries", 0, "copies"), KeyError, "canaries[0] has no id or copies"),
    (("passes", 0, "pass"), KeyError, "passes[0].pass is missing"),
    (("passes", 0, "canaries", "suffix_loss"), [4.0], "lists of different lengths"),
    (("passes", 0, "canaries", "exact"), KeyError, "lacks its id, inserted or exact column"),
    (("passes", 1, "members", "cells"), [1], "passes[1].members.cells is list"),
    (("passes", 1, "members", "cells", "random/1"), {"k": 1}, "has no n"),
]


@pytest.mark.parametrize("path, value, expect", DAMAGE, ids=[f"{'.'.join(map(str, d[0]))}={d[1]!r}" for d in DAMAGE])
def test_a_damaged_record_is_one_error_naming_the_file_and_field(tmp_path, path, value, expect):
    good = _record("a", "small", 1e5)
    assert latest_by_point([good], tmp_path / "results.jsonl") == {"a": good}
    with pytest.raises(ValueError) as e:
        latest_by_point([good, _set(good, path, value)], tmp_path / "results.jsonl")
    assert "results.jsonl" in str(e.value) and "record 2" in str(e.value) and expect in str(e.value), str(e.value)


def test_a_binary_results_file_is_named_and_a_missing_one_is_empty(tmp_path):
    assert read_results(tmp_path / "results.jsonl") == {}
    (tmp_path / "results.jsonl").write_bytes(json.dumps(_record("a", "m", 1.0)).encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match="results.jsonl' is not a results file"):
        read_results(tmp_path / "results.jsonl")


def test_what_the_checks_accept_the_report_draws(tmp_path):
    """Fields the checks leave free (figures of any type, empty parts, a failed run's nulls) still draw."""
    rows = [_record(f"{m}_{s}", m, p) for m, p in (("small", 1e5), ("large", 4e6)) for s in (1, 2)]
    rows[0] = _set(rows[0], ("eval", "rougeL"), "high")
    rows[1] = _set(_set(rows[1], ("train",), {}), ("base",), {"val_loss": [1]})
    rows[2] = _set(_set(rows[2], ("passes", 0, "val_loss"), "x"), ("canaries", 0, "exact_match"), None)
    rows.append({"point": "broken", "model": "small", "status": "failed", "error": "boom", "eval": None,
                 "canaries": None, "passes": None})
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = build_report(tmp_path)
    assert made["runs"] == 5 and made["report"].is_file()
