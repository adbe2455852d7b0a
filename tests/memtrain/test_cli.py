"""The `memtrain` command as a user runs it: every command's own --help, and what `memtrain train` says while it
works and when it ends (progress lines on stderr from global rank 0 only, quiet when the data is cached, one
summary line on stdout whose numbers are the run's own files')."""

import json
import re
import statistics
import subprocess
import sys

import pytest

from tests.memtrain.training._helpers import ENV, ROOT, memtrain, stdlib_corpus, write_recipe

COMMANDS = ["train", "eval", "models", "config", "plan", "sweep", "plot", "demo"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_the_commands_own(command):
    r = memtrain(command, "--help", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(f"usage: memtrain {command} "), r.stdout[:300]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The tiny recipe of test_train.py, over a corpus with two files that are not UTF-8, and a fresh cache."""
    corpus = stdlib_corpus(tmp_path_factory.mktemp("corpus"), every=4, count=40, chars=6000)
    (corpus / "zz_latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    (corpus / "zz_koi8.txt").write_bytes("привет мир".encode("koi8-r"))
    cache = tmp_path_factory.mktemp("cache")
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.toml", corpus, cache), corpus


def _lines(stderr: str) -> list[str]:
    """stderr as lines; tqdm redraws its bar with carriage returns, so those end lines too."""
    return [x.strip() for x in re.split(r"[\r\n]+", stderr) if x.strip()]


def _starting(lines: list[str], prefix: str) -> list[str]:
    return [x for x in lines if x.startswith(prefix)]


def _expected_summary(out, with_eval: bool) -> str:
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    line = (f"done: trained 6 steps, final loss {metrics[-1]['loss']:.4f}, "
            f"{statistics.median(m['tokens_per_s'] for m in metrics):,.0f} tokens/s (median)")
    if with_eval:
        e = json.loads((out / "eval.json").read_text())
        line += f"; eval: exact match {e['exact_count']}/{e['n_evaluated']}, val loss {e['val_loss']:.4f}"
    return line


def test_train_reports_progress_and_ends_with_one_summary_line(recipe, tmp_path):
    path, corpus = recipe
    skipped = f"data: skipped 2 files that are not UTF-8, e.g. {corpus / 'zz_koi8.txt'} ("  # first by path

    r = memtrain("train", "--config", path, "--out", tmp_path / "first")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = _lines(r.stderr)
    assert len(_starting(lines, "data: skipped")) == 1 and _starting(lines, "data: skipped")[0].startswith(skipped)
    stage = r"\.\.\. \d+\.\d s$"  # a stage line ends with its duration
    assert [x for x in lines if re.match(r"data: corpus '.*': 40 documents, [\d,.M]+ chars; training a byte-level "
                                         rf"BPE tokenizer \(vocab 512\){stage}", x)], lines[:10]
    assert [x for x in lines if re.match(rf"data: tokenizing 40 documents and packing .* of 64 tokens{stage}", x)]
    for what in ("extraction of 4 canaries", "membership inference", "exposure of 2 random canaries",
                 "validation loss"):
        found = _starting(lines, f"eval: {what}")
        assert len(found) == 1 and re.search(stage, found[0]), (what, lines[-12:])
    assert len(_starting(lines, "eval: done in")) == 1
    first = tmp_path / "first"
    assert r.stdout.splitlines() == [_expected_summary(first, True), f"run directory: {first}"]

    # Everything cached: no data line but the skipped files' (every run reads the corpus), no eval without eval.
    r = memtrain("train", "--config", path, "--out", tmp_path / "again", "--set", "eval.enabled=false")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = _lines(r.stderr)
    data = _starting(lines, "data:")
    assert len(data) == 1 and data[0].startswith(skipped), data
    assert not _starting(lines, "eval:")
    assert r.stdout.splitlines()[0] == _expected_summary(tmp_path / "again", False)


def test_only_global_rank_0_reports(recipe, tmp_path):
    """Two ranks under torchrun: the corpus is read on both (skipped files found on both), every line once. The
    time-based checkpoint every step (rank 0's clock, broadcast) runs the collective save on both ranks alike."""
    path, _ = recipe
    out = tmp_path / "tp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "memtrain",
           "train", "--config", str(path), "--out", str(out), "--set", "parallel.x=2",
           "--set", "train.checkpoint_every_min=1e-9", "--set", "eval.enabled=false"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert len(_starting(_lines(r.stderr), "data: skipped 2 files")) == 1, r.stderr[-3000:]
    assert [x for x in r.stdout.splitlines() if x.startswith("done: ")] == [_expected_summary(out, False)]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_00000{i}" for i in range(1, 7)]


def _rows(out):
    return [json.loads(x) for x in (out / "eval_canaries.jsonl").read_text().splitlines()]


def _assert_same_eval(got, want):
    """Greedy tokens and their metrics equal; losses and MIA scores within 1e-5 relative (sharded matmuls and the
    vocabulary-parallel softmax sum in another order than the plain model's)."""
    a, b = json.loads((want / "eval.json").read_text()), json.loads((got / "eval.json").read_text())
    assert (b["exact_count"], b["n_evaluated"], b["mia_auc_loss"]) == (a["exact_count"], a["n_evaluated"],
                                                                        a["mia_auc_loss"])
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
    for x, y in zip(_rows(want), _rows(got), strict=True):
        assert (y["generated"], y["token_match"], y["rouge_l"]) == (x["generated"], x["token_match"], x["rouge_l"])
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["min_k_pp"] == pytest.approx(x["min_k_pp"],
                                                                                                   rel=1e-5)


def test_a_distributed_run_evaluates_on_its_grid(recipe, tmp_path):
    """`memtrain train` on 2 ranks (x=2) evaluates on its grid; `memtrain eval` under torchrun evaluates again on a
    grid of the run's x from the sharded checkpoint; both equal `memtrain eval` on one process, each printed once."""
    path, _ = recipe
    out, torchrun = tmp_path / "run", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc-per-node", "2", "-m", "memtrain"]
    r = subprocess.run([*torchrun, "train", "--config", str(path), "--out", str(out), "--set", "parallel.x=2"],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert [x for x in r.stdout.splitlines() if x.startswith("done: ")] == [_expected_summary(out, True)]
    on_grid = tmp_path / "grid"
    on_grid.mkdir()
    for name in ("eval.json", "eval_canaries.jsonl"):
        (on_grid / name).write_bytes((out / name).read_bytes())
    r = memtrain("eval", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_eval(on_grid, out)
    one = json.loads((out / "eval.json").read_text())
    r = subprocess.run([*torchrun, "eval", str(out)], capture_output=True, text=True, env=ENV, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert len([x for x in r.stdout.splitlines() if x.startswith("exact_match_rate=")]) == 1, r.stdout
    assert json.loads((out / "eval.json").read_text())["exact_count"] == one["exact_count"]
    (on_grid / "eval.json").write_bytes((out / "eval.json").read_bytes())
    (on_grid / "eval_canaries.jsonl").write_bytes((out / "eval_canaries.jsonl").read_bytes())
    r = memtrain("eval", "--run", str(out), timeout=600)  # the single-process files back, for the comparison
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_eval(on_grid, out)
