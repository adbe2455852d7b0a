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


def test_a_run_directory_is_never_written_into(tmp_path, capsys):
    """A run's eval.json may be compared, but the figures go elsewhere: a run directory holds only what its own
    training writes (README), by default (the first path) or named as --out, itself or below it."""
    run = _eval_dir(tmp_path / "run", {"by_kind": {"pii": {"exact_count": 1, "n_evaluated": 2}}})
    (run / "config.toml").write_text("")
    (run / "metrics.jsonl").write_text("")  # a run writes its config.toml and then these
    other = _eval_dir(tmp_path / "audit", {"by_kind": {"pii": {"exact_count": 0, "n_evaluated": 2}}})
    before = sorted(p.name for p in run.iterdir())
    for argv in ([run, other], [other, run, "--out", run], [other, run, "--out", run / "cmp"]):
        assert main([str(a) for a in argv]) == 2
        assert "whose files only its own training writes" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == before
    assert main([str(run), str(other), "--out", str(tmp_path / "cmp")]) == 0
