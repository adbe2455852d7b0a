"""The report is drawn from results.jsonl alone: synthetic results in an empty directory."""

from __future__ import annotations

import csv
import json
import struct

import pytest

from experiments import report
from experiments.results import latest_by_point
from memtrain.files import read_jsonl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MODELS = [("ladder-1m", 1_100_000), ("ladder-3m", 3_200_000), ("ladder-10m", 9_800_000), ("ladder-30m", 31_000_000)]
COPIES = [1, 2, 4, 8]


def _metrics(em, seed_shift=0.0):
    return {"n": 4, "exact_match_rate": em, "token_match": min(1.0, em + 0.2), "rougeL": min(1.0, em + 0.3),
            "pythia_32_score": em, "exposure_mean": 3.0 + 20 * em + seed_shift, "mia_auc_loss": 0.5 + em / 2}


def synthetic_row(model, params, loss, seed=0, status="ok"):
    goldfish = loss.startswith("goldfish")
    scale = (params / 31e6) ** 0.7
    by_copies = {}
    canaries = []
    for c in COPIES:
        em = 0.0 if goldfish else min(1.0, scale * c / 8)
        by_copies[str(c)] = _metrics(em, seed * 0.1)
        for i in range(3):
            canaries.append({"id": f"r{c}{i}", "kind": "random", "copies": c, "inserted": True,
                             "exact_match": em > 0.5, "rouge_l": min(1.0, em + 0.1 * i), "exposure": 5.0})
            canaries.append({"id": f"r{c}{i}-twin", "kind": "random", "copies": c, "inserted": False,
                             "exact_match": False, "rouge_l": 0.1 + 0.05 * i, "exposure": 1.0})
    em = sum(m["exact_match_rate"] for m in by_copies.values()) / len(by_copies)
    ev = dict(_metrics(em), val_loss=4.0 - scale, val_perplexity=50.0, by_copies=by_copies,
              twins=_metrics(0.0), mia={"loss": {"auc": 0.5 + em / 2}}, steps=10, suffix_len=32)
    point = f"{model}_{'goldfish-k4' if goldfish else 'standard'}_seed{seed}"
    row = {"sweep": "synthetic", "point": point, "status": status, "error": None, "axes": {"model.name": model},
           "model": model, "loss": loss, "seed": seed, "params": params, "run_dir": f"runs/synthetic/{point}",
           "base_dir": None, "train": {"loss": 3.0, "tokens_per_s": 1000.0}, "eval": ev, "canaries": canaries,
           "config": {"loss": {"kind": "goldfish" if goldfish else "standard", "k": 4}}}
    if status != "ok":
        row.update(error="RuntimeError: boom", eval=None, canaries=[], params=None)
    return row


def synthetic_results(path, failed=True):
    rows = []
    for model, params in MODELS:
        for loss in ("standard", "goldfish k=4"):
            for seed in (0, 1):
                rows.append(synthetic_row(model, params, loss, seed))
    if failed:
        rows.append(synthetic_row("ladder-30m", 31_000_000, "standard", seed=2, status="failed"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_from_results_alone(tmp_path, capsys):
    work = tmp_path / "copy"
    work.mkdir()
    rows = synthetic_results(work / "results.jsonl")
    assert report.main([str(work)]) == 0
    out = capsys.readouterr().out
    assert "report.md" in out and "figures" in out

    figs = sorted((work / "figures").glob("*.png"))
    names = {f.name for f in figs}
    for expected in ("exact_match_vs_size.png", "exact_match_by_copies.png", "rougeL_distribution.png",
                     "exposure_vs_copies.png", "mia_auc_vs_size.png", "val_loss_vs_size.png",
                     "metrics_by_loss.png"):
        assert expected in names
    for f in figs:
        w, h = png_size(f)
        assert 300 <= w <= 4000 and 300 <= h <= 3000, (f.name, w, h)
        assert f.stat().st_size > 5_000, f"{f.name} looks empty"

    md = (work / "report.md").read_text()
    for r in rows:
        assert f"| {r['point']} |" in md, r["point"]
    assert "failed" in md and "RuntimeError: boom" in md
    for f in figs:
        assert f"(figures/{f.name})" in md


def test_the_never_trained_twins_sit_beside_every_exact_match_figure_and_table(tmp_path):
    """The control: twins asked as their canaries are. Here ladder-30m's standard runs give back half their twins
    (2 of 4 per seed), which the figures' CSVs and the by-copies table must show beside the members."""
    rows = synthetic_results(tmp_path / "results.jsonl", failed=False)
    for r in rows:
        if (r["model"], r["loss"]) == ("ladder-30m", "standard"):
            r["eval"]["twins"] = dict(_metrics(0.5), exact_count=2, n_evaluated=4)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = report.build_report(tmp_path)
    for name in ("exact_match_vs_size", "exact_match_by_copies"):
        table = list(csv.DictReader((tmp_path / "figures" / f"{name}.csv").open()))
        twins = {(t["loss"], t["model"]): t for t in table if t["loss"].endswith("(never-trained twins)")}
        assert len(twins) == 2 * len(MODELS), name  # every (loss, size) has its control
        big = twins[("standard (never-trained twins)", "ladder-30m")]
        assert (float(big["value"]), big["k"], big["n"]) == (0.5, "4", "8"), name
    md = made["report"].read_text()
    assert "twins (never trained) |" in md
    assert [line for line in md.splitlines() if line.startswith("| standard | ladder-30m |")][0].endswith("(4/8) |")


def test_report_results_file_and_out_dir(tmp_path):
    src = tmp_path / "results.jsonl"
    synthetic_results(src, failed=False)
    made = report.build_report(src, tmp_path / "elsewhere")
    assert made["report"] == tmp_path / "elsewhere" / "report.md"
    assert len(made["figures"]) == 7 and all(f.is_file() for f in made["figures"])
    assert made["runs"] == 16 and len(made["table"]) == 16


def test_every_figure_is_also_pdf_and_svg_with_its_numbers_as_csv(tmp_path):
    rows = synthetic_results(tmp_path / "results.jsonl", failed=False)
    made = report.build_report(tmp_path)
    for png in made["figures"]:
        assert png.with_suffix(".pdf").read_bytes()[:4] == b"%PDF", png.name
        assert "<svg" in png.with_suffix(".svg").read_text(), png.name
        assert png.with_suffix(".csv").read_text().splitlines()[1:], f"{png.name}: its CSV holds no numbers"
    by_copies = list(csv.DictReader((tmp_path / "figures" / "exact_match_by_copies.csv").read_text().splitlines()))
    top = {r["loss"]: r for r in by_copies if r["copies"] == "8" and r["model"] == "ladder-30m"}
    assert (top["standard"]["k"], top["standard"]["n"], float(top["standard"]["value"])) == ("8", "8", 1.0)
    assert (top["goldfish k=4"]["k"], float(top["goldfish k=4"]["value"])) == ("0", 0.0)
    rouge = list(csv.DictReader((tmp_path / "figures" / "rougeL_distribution.csv").read_text().splitlines()))
    drawn = sorted(float(r["rouge_l"]) for r in rouge if r["model"] == "ladder-1m" and r["loss"] == "standard")
    given = sorted(c["rouge_l"] for r in rows if r["model"] == "ladder-1m" and r["loss"] == "standard"
                   for c in r["canaries"] if c["inserted"])
    assert drawn == pytest.approx(given)


def test_last_line_per_point_wins_and_torn_lines_are_skipped(tmp_path):
    path = tmp_path / "results.jsonl"
    failed = synthetic_row("ladder-1m", 1_100_000, "standard", status="failed")
    ok = synthetic_row("ladder-1m", 1_100_000, "standard")
    path.write_text(json.dumps(failed) + "\n" + '{"point": "torn", "sta' + "\n" + "[1, 2]\n" + json.dumps(ok) + "\n")
    rows = list(latest_by_point(read_jsonl(path)).values())
    assert len(rows) == 1 and rows[0]["status"] == "ok"
    made = report.build_report(path)
    assert "| ok |" in made["report"].read_text()


def test_only_failures_and_missing_metrics_still_draw(tmp_path):
    path = tmp_path / "results.jsonl"
    rows = [synthetic_row("ladder-1m", 1e6, "standard", status="failed")]
    partial = synthetic_row("ladder-3m", 3e6, "goldfish k=4")
    partial["eval"] = {"exact_match_rate": 0.0, "by_copies": {}}  # an older eval.json without most metrics
    partial.pop("canaries")
    rows.append(partial)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = report.build_report(path)
    for f in made["figures"]:
        png_size(f)


def test_missing_results_is_a_clear_error(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "results.jsonl" in capsys.readouterr().err
    (tmp_path / "results.jsonl").write_text("")
    with pytest.raises(ValueError, match="no results"):
        report.build_report(tmp_path)


def test_results_whose_points_all_failed_are_refused_not_drawn_empty(tmp_path, capsys):
    rows = [synthetic_row("ladder-1m", 1e6, loss, status="failed") for loss in ("standard", "goldfish k=4")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main([str(tmp_path)]) == 2
    assert "none of its 2 point(s) succeeded, so there is nothing to plot" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]  # no report.md, no empty figures


def _with_corpus(row, source, fingerprint):
    return {**row, "run": {"corpus": {"source": source, "fingerprint": fingerprint, "documents": 240}}}


def test_runs_in_two_dtypes_are_named_with_the_fix(tmp_path):
    """train.precision "auto" decides per machine: a sweep resumed on another one can train some points in fp32 and
    the rest in bf16. The report names the minority's points and the setting that gives one dtype; one dtype says
    nothing beyond the header."""
    rows = [dict(synthetic_row(model, params, "standard", seed), point=f"{model}_s{seed}", precision="bf16")
            for model, params in MODELS[:2] for seed in (0, 1, 2)]
    for name, precisions in (("one", ["bf16"] * 6), ("two", ["bf16"] * 4 + ["fp32"] * 2)):
        out = tmp_path / name
        out.mkdir()
        mixed = [dict(r, precision=p) for r, p in zip(rows, precisions)]
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
        report.build_report(out / "results.jsonl", out)
        md = (out / "report.md").read_text()
        if name == "one":
            assert "precision bf16." in md and "**Precision" not in md
            continue
        assert "precision bf16, fp32." in md
        fp32 = ", ".join(r["point"] for r in mixed[4:])
        assert (f"**Precision: 2 different ones across these runs** (bf16: 4 point(s), fp32: 2 point(s); fp32: {fp32})"
                in md)
        assert "--set train.precision=bf16) and rerun those points" in md


def test_the_report_names_the_corpus_and_refuses_to_pool_two(tmp_path):
    """The built-in corpus is the running Python's sources: a report says which text its numbers are about."""
    rows = [synthetic_row(model, params, "standard", seed) for model, params in MODELS[:2] for seed in (0, 1)]
    one = tmp_path / "one"
    one.mkdir()
    (one / "results.jsonl").write_text("".join(json.dumps(_with_corpus(r, "stdlib (Python 3.11.7)", "ab" * 32)) + "\n"
                                               for r in rows))
    report.build_report(one / "results.jsonl", one)
    md = (one / "report.md").read_text()
    assert "Corpus: stdlib (Python 3.11.7), 240 documents, sha256 abababababab;" in md
    assert "another Python version trains and tests on other text" in md

    two = tmp_path / "two"
    two.mkdir()
    mixed = [_with_corpus(r, "stdlib (Python 3.12.3)" if i % 2 else "stdlib (Python 3.11.7)", "cd" * 32 if i % 2
                          else "ab" * 32) for i, r in enumerate(rows)]
    (two / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    report.build_report(two / "results.jsonl", two)
    md = (two / "report.md").read_text()
    assert "**Corpus: 2 different ones across these runs**" in md and "do not pool" in md
    assert "stdlib (Python 3.12.3) (cdcdcdcdcdcd)" in md
