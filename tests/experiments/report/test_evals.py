"""`memtrain plot DIR [DIR ...]` on evaluations: each eval.json's kinds side by side, with Wilson intervals, twins
and AUC, as a figure (PNG, PDF, SVG), a CSV and a markdown table; a run's older eval.json (cells only) too."""

import csv
import json

from experiments.report import main
from experiments.report.stats import wilson


def _eval_dir(path, result):
    path.mkdir()
    (path / "eval.json").write_text(json.dumps(result))
    return path


def test_two_audits_and_an_old_run_side_by_side(tmp_path, capsys):
    a = _eval_dir(tmp_path / "a", {"by_kind": {
        "pii": {"exact_count": 3, "n_evaluated": 4, "twins_exact_count": 0, "twins_evaluated": 4, "mia_auc_loss": 0.9},
        "qa": {"exact_count": 0, "n_evaluated": 2, "twins_exact_count": None, "twins_evaluated": 0,
               "mia_auc_loss": None}}})
    b = _eval_dir(tmp_path / "b", {"by_kind": {
        "pii": {"exact_count": 1, "n_evaluated": 4, "twins_exact_count": 1, "twins_evaluated": 4,
                "mia_auc_loss": 0.6}}})
    old = _eval_dir(tmp_path / "old", {"cells": {"random/1": {"exact_count": 1, "n_evaluated": 2},
                                                 "random/4": {"exact_count": 2, "n_evaluated": 2}}})
    assert main([str(a), str(b), str(old), "--out", str(tmp_path / "cmp")]) == 0
    assert "evaluations: 3" in capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "cmp" / "evals.csv").open()))
    got = {(r["eval"], r["kind"]): r for r in rows}
    assert set(got) == {("a", "pii"), ("a", "qa"), ("b", "pii"), ("old", "random")}
    assert (got["old", "random"]["exact"], got["old", "random"]["n"]) == ("3", "4")
    assert float(got["a", "pii"]["lo95"]) == wilson(3, 4)[0] and float(got["a", "pii"]["hi95"]) == wilson(3, 4)[1]
    for suffix in ("png", "pdf", "svg"):
        assert (tmp_path / "cmp" / f"evals.{suffix}").stat().st_size > 0
    assert "| b | pii | 1/4 |" in (tmp_path / "cmp" / "evals.md").read_text()


def test_a_sweep_and_evaluations_do_not_mix(tmp_path, capsys):
    a = _eval_dir(tmp_path / "a", {"by_kind": {}})
    assert main([str(a), str(tmp_path)]) == 2
    assert "several paths must all be evaluation directories" in capsys.readouterr().err
