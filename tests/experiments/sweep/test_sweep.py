"""Sweep mechanics with a fake `memtrain` (no training): one results line per point, failures recorded
while the others finish, --resume after a kill runs only the missing points and loses no line, base
models pretrained once and reused. (Specs and presets: test_spec.py; launch commands: test_launchers.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from experiments.results import latest_by_point
from experiments.sweep import cli
from experiments.sweep import spec as specs
from experiments.sweep.run import run_sweep
from memtrain.config import tomllib  # tomllib, or tomli on Python 3.10
from memtrain.files import read_jsonl
from tests.experiments.sweep._helpers import IDS, launched, results, write_corpus
from tests.memtrain._helpers import ENV

ROOT = Path(__file__).resolve().parents[3]

def test_failure_is_recorded_and_the_sweep_goes_on(env, capsys):
    out = env["tmp"] / "runs" / "mini"
    os.environ["FAKE_FAIL"] = "ladder-3m_standard"
    rc = cli.main([str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--wandb", "disabled"])
    assert rc == 1  # some point failed
    rows = results(out)
    assert [r["point"] for r in rows] == IDS
    bad = [r for r in rows if r["status"] != "ok"]
    assert len(bad) == 1 and bad[0]["point"] == "ladder-3m_standard"
    assert bad[0]["error"] == "ValueError: planned failure of ladder-3m_standard"
    good = rows[0]
    assert good["status"] == "ok" and good["params"] == 1_000_000 and good["model"] == "ladder-1m"
    assert good["loss"] == "standard" and rows[1]["loss"] == "goldfish k=4"
    assert good["eval"]["by_copies"]["8"]["exposure_mean"] == 16.0
    assert good["train"]["loss"] == 2.0 and good["train"]["tokens_per_s"] == 1002.5
    assert len(good["canaries"]) == 4 and "generated_text" not in good["canaries"][0]
    assert good["config"]["model"]["name"] == "ladder-1m" and good["run_dir"] == str(out / IDS[0])
    assert (out / IDS[0] / "config.toml").is_file() and (out / IDS[0] / "stderr.log").is_file()
    # the report was drawn at the end, from results.jsonl
    assert (out / "report.md").is_file() and (out / "figures" / "exact_match_vs_size.png").is_file()
    printed = capsys.readouterr().out
    assert "FAILED" in printed and "report:" in printed

    # without --resume an existing sweep is never mixed into
    assert cli.main([str(env["spec"]), "--out", str(out), "--runner", env["runner"]]) == 2

    # --resume retries only the failed point; every earlier line stays as it was
    before = (out / "results.jsonl").read_bytes()
    os.environ["FAKE_FAIL"] = ""
    n_launched = len(launched(env["log"]))
    assert cli.main([str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--resume",
                       "--no-report"]) == 0
    assert (out / "results.jsonl").read_bytes().startswith(before)
    assert [x["name"] for x in launched(env["log"])[n_launched:]] == ["ladder-3m_standard"]
    latest = latest_by_point(results(out))
    assert all(r["status"] == "ok" for r in latest.values()) and len(results(out)) == len(IDS) + 1


def test_a_sweep_whose_every_point_failed_draws_no_report(env, capsys, monkeypatch):
    """No report of nothing (a table of dashes, empty figures): one line saying how many points failed and where
    their logs are, exit 1, the results file as the failures left it."""
    out = env["tmp"] / "runs" / "mini"
    monkeypatch.setenv("FAKE_FAIL", "ladder-1m_standard,ladder-1m_goldfish-k4")
    rc = cli.main([str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--only", "ladder-1m_"])
    assert rc == 1
    assert [r["status"] for r in results(out)] == ["failed", "failed"]
    assert not (out / "report.md").exists() and not (out / "figures").exists()
    printed = capsys.readouterr()
    assert f"no report: no point in {out / 'results.jsonl'} succeeded" in printed.out
    assert printed.err == (f"memtrain: error: all 2 point(s) failed (ladder-1m_goldfish-k4, ladder-1m_standard): "
                           f"their logs are in {out}/<point>/, their errors in {out / 'results.jsonl'}; --resume "
                           "retries them\n")
    assert (out / "ladder-1m_standard" / "stderr.log").is_file()
    (out / "report.md").write_text("an earlier draw")  # as a sweep that once succeeded left it
    assert cli.main([str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--only", "ladder-1m_",
                     "--resume"]) == 1
    assert "(the report.md there is an earlier draw's, of results since failed)" in capsys.readouterr().out


def test_resume_after_kill_runs_only_missing_points(env):
    out = env["tmp"] / "killed"
    env_vars = dict(os.environ, FAKE_KILL="ladder-3m_goldfish-k4", FAKE_KILL_MARK=str(env["tmp"] / "mark"),
                    PYTHONPATH=ENV["PYTHONPATH"])
    cmd = [sys.executable, "-m", "experiments.sweep", str(env["spec"]), "--out", str(out), "--runner",
           env["runner"], "--wandb", "disabled", "--no-report"]
    proc = subprocess.run(cmd, env=env_vars, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    done = results(out)
    assert [r["point"] for r in done] == IDS[:3]
    with open(out / "results.jsonl", "a") as f:
        f.write('{"sweep": "mini", "point": "ladder-10m_standard", "sta')  # a line torn by the kill
    before = (out / "results.jsonl").read_bytes()
    n_launched = len(launched(env["log"]))

    proc = subprocess.run(cmd + ["--resume"], env=env_vars, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert (out / "results.jsonl").read_bytes().startswith(before)  # appended only, nothing rewritten
    again = [x["name"] for x in launched(env["log"])[n_launched:]]
    assert again == IDS[3:]  # only the missing points, the killed one included
    rows = read_jsonl(out / "results.jsonl")
    assert [r["point"] for r in rows] == IDS and all(r["status"] == "ok" for r in rows)
    assert "is not a complete JSON record" in proc.stderr  # the torn line was noticed and skipped


def test_resume_continues_a_run_with_a_checkpoint(env):
    out = env["tmp"] / "ckpt"
    spec = specs.load_spec(env["spec"])
    calls = []

    def run_fn(cmd, run_dir):
        calls.append(cmd)
        return subprocess.run(cmd, capture_output=True).returncode, None

    run_sweep(spec, out, runner=env["runner"], run_fn=run_fn, report=False, log=lambda *a: None)
    # pretend the last point was interrupted after its final checkpoint but before the results line
    rows = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(rows[:-1]) + "\n")
    calls.clear()
    run_sweep(spec, out, runner=env["runner"], run_fn=run_fn, resume=True, report=False,
                    log=lambda *a: None)
    assert len(calls) == 1 and calls[0][-1] == "--resume" and IDS[-1] in calls[0][calls[0].index("--out") + 1]


def test_changed_config_reruns_on_resume(env):
    out = env["tmp"] / "changed"
    spec = specs.load_spec(env["spec"])
    quiet = {"runner": env["runner"], "report": False, "log": lambda *a: None}
    run_sweep(spec, out, **quiet)
    n = len(launched(env["log"]))
    run_sweep(spec, out, resume=True, **quiet)
    assert len(launched(env["log"])) == n  # nothing to do
    run_sweep(spec, out, resume=True, overrides=["train.lr=0.5"], **quiet)
    assert len(launched(env["log"])) == n + len(IDS)  # every point's config changed
    assert len(results(out)) == 2 * len(IDS)


def _two_sizes_with_bases(tmp_path: Path) -> Path:
    """A spec of two ladder sizes x {standard, goldfish}, each size fine-tuned from a base pretrained 5 steps on a
    corpus disjoint from its fine-tuning documents."""
    corpus = write_corpus(tmp_path / "corpus", 40)
    spec_path = tmp_path / "pre.toml"
    spec_path.write_text(textwrap.dedent(f'''
        [sweep]
        name = "pre"
        [base.data]
        corpus = "{corpus}"
        max_docs = 12
        vocab_size = 300
        seq_len = 64
        [base.wandb]
        mode = "disabled"
        [axes]
        "model.name" = ["ladder-1m", "ladder-3m"]
        loss = [{{ kind = "standard" }}, {{ kind = "goldfish", k = 4 }}]
        [pretrain]
        steps = 5
        corpus = "disjoint"
        max_docs = 20
    '''))
    return spec_path


def test_side_by_side_a_point_starts_while_a_bigger_base_still_pretrains(env, tmp_path, monkeypatch):
    """Two at a time: the big size's base pretrains (6 s here) while the other worker builds the small base and
    starts its points; no point waits for a base other than its own."""
    monkeypatch.setenv("FAKE_SLOW", "base-ladder-3m")
    summary = run_sweep(specs.load_spec(_two_sizes_with_bases(tmp_path)), tmp_path / "out", runner=env["runner"],
                        report=False, jobs=2, log=lambda *a: None)
    assert summary["ok"] == 4
    order = [("base" if c["pretrain"] else "point", c["config"]["model"]["name"]) for c in launched(env["log"])]
    points = [model for kind, model in order if kind == "point"]
    assert points[0] == "ladder-1m"  # waiting for every base, ladder-3m's points came first
    assert sorted(points) == ["ladder-1m"] * 2 + ["ladder-3m"] * 2
    started = {model: order.index(("base", model)) for model in ("ladder-1m", "ladder-3m")}
    assert all(started[model] < i for i, (kind, model) in enumerate(order) if kind == "point")


def test_base_models_pretrained_once_on_a_disjoint_corpus_and_reused(env, tmp_path):
    spec_path = _two_sizes_with_bases(tmp_path)
    quiet = {"runner": env["runner"], "report": False, "log": lambda *a: None}
    run_sweep(specs.load_spec(spec_path), tmp_path / "first", **quiet)
    calls = launched(env["log"])
    pre = [c for c in calls if c["pretrain"]]
    assert [c["config"]["model"]["name"] for c in pre] == ["ladder-1m", "ladder-3m"]  # one base per size
    rows = results(tmp_path / "first")
    bases = {r["model"]: r["base_dir"] for r in rows}
    assert all(Path(b).parent == tmp_path / "cache" / "base" for b in bases.values())
    assert bases["ladder-1m"] != bases["ladder-3m"]
    for c in calls:
        if not c["pretrain"]:
            assert c["init"] == bases[c["config"]["model"]["name"]]
    p = pre[0]["config"]
    assert p["canaries"]["number"] == 0 and p["loss"]["kind"] == "standard" and not p["eval"]["every_pass"]
    assert p["train"]["max_steps"] == 5 and "max_text_tokens" not in p["data"]
    base = json.loads((Path(bases["ladder-1m"]) / "base.json").read_text())
    assert base["steps"] == 5 and base["val_loss"] == 4.5 and base["unigram_entropy"] == 6.0
    assert rows[0]["base"]["val_loss"] == 4.5  # the results record carries its base model's quality

    # the pretraining corpus is the rest of the source: no fine-tuning document (canaries, twins, val) in it
    from memtrain.config import load
    from memtrain.data import load_corpus

    ft = load_corpus(load(tmp_path / "first" / rows[0]["point"] / "config.toml").data)
    pre_docs = sorted(Path(p["data"]["corpus"]).glob("*.txt"))
    assert len(pre_docs) == 20
    assert not {d.read_text() for d in pre_docs} & {d.text for d in ft.docs}
    # ... read with the fine-tuning tokenizer (same ids)
    from transformers import AutoTokenizer

    from memtrain.data import load_tokenizer

    tok_ft = load_tokenizer(load(tmp_path / "first" / rows[0]["point"] / "config.toml").data, ft)
    tok_pre = AutoTokenizer.from_pretrained(p["data"]["tokenizer"])
    sample = ft.docs[0].text[:300]
    assert tok_pre(sample)["input_ids"] == tok_ft(sample)["input_ids"]
    assert tok_pre.eos_token_id == tok_ft.eos_token_id and len(tok_pre) == len(tok_ft)

    # a second sweep finds the bases in the cache
    run_sweep(specs.load_spec(spec_path), tmp_path / "second", **quiet)
    assert not [c for c in launched(env["log"])[len(calls):] if c["pretrain"]]
    assert {r["base_dir"] for r in results(tmp_path / "second")} == set(bases.values())

    # two points at a time, on a fresh cache: each base still built once, before the points that need it
    n = len(launched(env["log"]))
    os.environ["MEMTRAIN_CACHE"] = str(tmp_path / "cache2")
    run_sweep(specs.load_spec(spec_path), tmp_path / "parallel", jobs=2, **quiet)
    calls = launched(env["log"])[n:]
    assert sorted(c["config"]["model"]["name"] for c in calls if c["pretrain"]) == ["ladder-1m", "ladder-3m"]
    started = {c["config"]["model"]["name"]: i for i, c in enumerate(calls) if c["pretrain"]}
    assert all(started[c["config"]["model"]["name"]] < i for i, c in enumerate(calls) if not c["pretrain"])
    rows = results(tmp_path / "parallel")
    assert sorted(r["point"] for r in rows) == sorted(r["point"] for r in results(tmp_path / "first"))
    assert all(r["status"] == "ok" for r in rows)


def test_failed_pretraining_fails_its_points_only(env, tmp_path):
    spec = specs.parse_spec({"sweep": {"name": "pf"}, "base": {"wandb": {"mode": "disabled"}},
                             "axes": {"model.name": ["ladder-1m", "ladder-3m"]},
                             "pretrain": {"steps": 3, "corpus": "same"}})
    os.environ["FAKE_FAIL"] = "base-ladder-1m"

    def runner(cmd, run_dir):
        cfg = tomllib.loads(Path(cmd[cmd.index("--config") + 1]).read_text())
        if cfg["wandb"].get("name", "").startswith("base-ladder-1m"):
            return 1, "RuntimeError: pretraining exploded"
        return subprocess.run(cmd, capture_output=True).returncode, None

    corpus = write_corpus(tmp_path / "stdlib-free", 6)
    spec.base["data"] = {"corpus": str(corpus), "vocab_size": 300, "seq_len": 32}
    summary = run_sweep(spec, tmp_path / "pf", runner=env["runner"], run_fn=runner, report=False,
                              log=lambda *a: None)
    rows = results(tmp_path / "pf")
    assert [r["status"] for r in rows] == ["failed", "ok"] and summary["failed"] == 1
    assert "pretraining ladder-1m failed" in rows[0]["error"] and "exploded" in rows[0]["error"]
