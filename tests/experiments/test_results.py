"""The record of one run (experiments/results.py): what it reads from a run directory, quietly past a line a
killed trainer left torn, and how a run that exited 0 without its evaluation is recorded."""

from __future__ import annotations

import json

from experiments.results import RESULTS, arm_label, latest_by_point, make_record
from experiments.sweep import spec as specs
from memtrain.files import append_jsonl, read_jsonl


def _point():
    spec = specs.parse_spec({"sweep": {"name": "r"}, "axes": {"loss": [{"kind": "goldfish", "k": 4}]}})
    return specs.expand(spec)[0]


def test_record_of_a_run_directory_with_torn_lines(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    metrics = [{"step": s, "loss": 4.0 - s, "tokens_per_s": 100.0 * s, "kept_fraction": 0.75} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 4, "lo')
    (run / "passes.jsonl").write_text('{"pass": 1, "members": {}}\n{"pass": 2, "mem')
    (run / "eval_canaries.jsonl").write_text(json.dumps({"id": "c0", "exact_match": True, "generated_text": "x"})
                                             + "\n")
    (run / "eval.json").write_text(json.dumps({"exact_match_rate": 1.0}))
    corpus = {"source": "stdlib (Python 3.11.7)", "fingerprint": "ab" * 32, "documents": 240}
    (run / "run.json").write_text(json.dumps({"params": 123, "trained": {"steps": 3}, "corpus": corpus}))
    p = _point()
    record = make_record("r", p, run, None, "ok", None, "2024-01-01T00:00:00+00:00", 1.25)
    assert record["run"]["corpus"] == corpus  # which text the numbers are about
    assert capsys.readouterr().err == ""  # a run's own torn lines are not the sweep's news
    assert record["status"] == "ok" and record["point"] == p.id and record["loss"] == "goldfish k=4"
    assert record["train"]["step"] == 3 and record["train"]["tokens_per_s"] == 250.0
    assert record["train"]["kept_fraction"] == 0.75 and record["train"]["steps_planned"] == 3
    assert record["passes"] == [{"pass": 1, "members": {}}]
    assert record["canaries"] == [{"id": "c0", "exact_match": True}]  # no generated text in the record
    assert record["params"] == 123 and record["seconds"] == 1.2 and record["base"] is None


def test_a_run_without_its_evaluation_is_a_failure_and_the_last_line_wins(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    p = _point()
    record = make_record("r", p, run, None, "ok", None, "2024-01-01T00:00:00+00:00", 0.0)
    assert record["status"] == "failed" and record["error"] == "the run exited 0 but wrote no eval.json"
    results = tmp_path / RESULTS
    append_jsonl(results, record)
    append_jsonl(results, dict(record, status="ok", error=None))
    rows = read_jsonl(results)
    assert len(rows) == 2 and list(latest_by_point(rows).values()) == [rows[1]]


def test_a_named_axis_that_sets_the_loss_names_its_arm():
    arms = [{"label": "goldfish k=4", "loss.kind": "goldfish", "loss.k": 4},
            {"label": "goldfish k=4, 4/3 text", "loss.kind": "goldfish", "loss.k": 4, "data.max_text_tokens": 400}]
    spec = specs.parse_spec({"sweep": {"name": "r"}, "axes": {"arm": arms, "seeds": [1]}})
    points = specs.expand(spec)
    assert [arm_label(p) for p in points] == ["goldfish k=4", "goldfish k=4, 4/3 text"]  # not pooled in a report
    assert points[1].cfg.data.max_text_tokens == 400 and points[1].cfg.loss.k == 4
    plain = specs.expand(specs.parse_spec({"sweep": {"name": "r"}, "axes": {"seeds": [1, 2]}}))
    assert {arm_label(p) for p in plain} == {"standard"}  # no arm axis: the loss label
