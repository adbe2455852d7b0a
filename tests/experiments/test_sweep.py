"""Sweep mechanics with a fake `memtrain` (no training): one results line per point, failures recorded
while the others finish, --resume after a kill runs only the missing points and loses no line, base
models pretrained once and reused. (Specs and presets: test_spec.py; launch commands: test_launch.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from experiments import spec as specs
from experiments import sweep
from experiments.results import latest_by_point, read_results
from memtrain.config import tomllib  # tomllib, or tomli on Python 3.10
from tests.experiments._helpers import IDS, SPEC

ROOT = Path(__file__).resolve().parents[2]

# Stands in for `python -m memtrain`: `train --config C --out D [--resume]` writes the files of a run.
FAKE = textwrap.dedent('''
    import json, os, signal, sys, time
    from pathlib import Path
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    args = sys.argv[1:]
    assert args[0] == "train", args
    cfg = tomllib.loads(Path(args[args.index("--config") + 1]).read_text())
    out = Path(args[args.index("--out") + 1])
    name = cfg["wandb"].get("name") or out.name
    pretrain = cfg["canaries"].get("number", 8) == 0  # base models train on text alone
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"name": name, "pretrain": pretrain, "resume": "--resume" in args,
                            "rank": os.environ.get("SLURM_PROCID", os.environ.get("RANK")),
                            "init": cfg["model"].get("init"), "config": cfg}) + "\\n")
    if os.environ.get("FAKE_SLEEP") and "--resume" not in args:  # a long run: a checkpoint first, then time
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints" / "latest").write_text("step_000001")
        time.sleep(float(os.environ["FAKE_SLEEP"]))
    if name in os.environ.get("FAKE_FAIL", "").split(","):
        print("  5%|##  | 1/20 [00:01<00:19, loss=7.1]\\rTraceback (most recent call last):", file=sys.stderr)
        print(f"ValueError: planned failure of {name}", file=sys.stderr)
        sys.exit(1)
    kill = Path(os.environ.get("FAKE_KILL_MARK", "/nonexistent"))
    if name == os.environ.get("FAKE_KILL") and not kill.exists():
        kill.write_text("killed")
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)  # a half-done run: no checkpoint pointer
        os.kill(os.getppid(), signal.SIGKILL)  # the sweep dies mid-run, as with `kill -9` or a lost node
        sys.exit(1)
    sizes = {"ladder-1m": 1_000_000, "ladder-3m": 3_000_000, "ladder-10m": 10_000_000}
    params = sizes.get(cfg["model"]["name"], 123)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "loss": 5.0 - step, "lr": 1e-3, "tokens": 2048 * step,
                                "tokens_per_s": 1000.0 + step, "mfu": 0.01, "memory_mb": 100.0,
                                "kept_fraction": 1.0}) + "\\n")
    (out / "run.json").write_text(json.dumps({"stream_key": "k", "trained": {"steps": 3, "epochs": 1},
                                              "grid": {"data": 1}, "mode": "sharded", "params": params}))
    ck = out / "checkpoints" / "step_000003"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "model.safetensors").write_bytes(b"weights")
    (out / "checkpoints" / "latest").write_text("step_000003")
    if pretrain:
        (out / "eval.json").write_text(json.dumps({"val_loss": 4.5, "unigram_entropy": 6.0}))
    else:
        goldfish = cfg["loss"].get("kind") == "goldfish"
        em = 0.0 if goldfish else params / 1e7
        by = {str(c): {"n": 2, "exact_match_rate": min(1.0, em * c), "rougeL": 0.5, "exposure_mean": 2.0 * c,
                       "mia_auc_loss": 0.6} for c in (1, 2, 4, 8)}
        (out / "eval.json").write_text(json.dumps({"exact_match_rate": em, "token_match": 0.5, "rougeL": 0.5,
                                                   "pythia_32_score": 0.1, "exposure_mean": 4.0,
                                                   "mia_auc_loss": 0.6, "val_loss": 3.0, "by_copies": by}))
        rows = [{"id": f"c{i}", "kind": "random", "copies": 1, "inserted": i % 2 == 0, "exact_match": False,
                 "rouge_l": 0.1 * i, "generated_text": "x", "exposure": 1.0} for i in range(4)]
        (out / "eval_canaries.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
''')

@pytest.fixture
def env(tmp_path, monkeypatch):
    fake = tmp_path / "fake_memtrain.py"
    fake.write_text(FAKE)
    spec = tmp_path / "mini.toml"
    spec.write_text(SPEC)
    log = tmp_path / "fake_log.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for var in ("FAKE_FAIL", "FAKE_KILL", "FAKE_KILL_MARK", "FAKE_SLEEP"):
        monkeypatch.delenv(var, raising=False)
    return {"tmp": tmp_path, "runner": f"{sys.executable} {fake}", "spec": spec, "log": log}


def launched(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def test_failure_is_recorded_and_the_sweep_goes_on(env, capsys):
    out = env["tmp"] / "runs" / "mini"
    os.environ["FAKE_FAIL"] = "ladder-3m_standard"
    rc = sweep.main([str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--wandb", "disabled"])
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
    assert sweep.main([str(env["spec"]), "--out", str(out), "--runner", env["runner"]]) == 2

    # --resume retries only the failed point; every earlier line stays as it was
    before = (out / "results.jsonl").read_bytes()
    os.environ["FAKE_FAIL"] = ""
    n_launched = len(launched(env["log"]))
    assert sweep.main([str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--resume",
                       "--no-report"]) == 0
    assert (out / "results.jsonl").read_bytes().startswith(before)
    assert [x["name"] for x in launched(env["log"])[n_launched:]] == ["ladder-3m_standard"]
    latest = latest_by_point(results(out))
    assert all(r["status"] == "ok" for r in latest.values()) and len(results(out)) == len(IDS) + 1


def test_resume_after_kill_runs_only_missing_points(env):
    out = env["tmp"] / "killed"
    env_vars = dict(os.environ, FAKE_KILL="ladder-3m_goldfish-k4", FAKE_KILL_MARK=str(env["tmp"] / "mark"),
                    PYTHONPATH=str(ROOT))
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
    rows = read_results(out / "results.jsonl")
    assert [r["point"] for r in rows] == IDS and all(r["status"] == "ok" for r in rows)
    assert "not valid JSON" in proc.stderr  # the torn line was noticed and skipped


def test_resume_continues_a_run_with_a_checkpoint(env):
    out = env["tmp"] / "ckpt"
    spec = specs.load_spec(env["spec"])
    calls = []

    def run_fn(cmd, run_dir):
        calls.append(cmd)
        return subprocess.run(cmd, capture_output=True).returncode, None

    sweep.run_sweep(spec, out, runner=env["runner"], run_fn=run_fn, report=False, log=lambda *a: None)
    # pretend the last point was interrupted after its final checkpoint but before the results line
    rows = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(rows[:-1]) + "\n")
    calls.clear()
    sweep.run_sweep(spec, out, runner=env["runner"], run_fn=run_fn, resume=True, report=False,
                    log=lambda *a: None)
    assert len(calls) == 1 and calls[0][-1] == "--resume" and IDS[-1] in calls[0][calls[0].index("--out") + 1]


def test_changed_config_reruns_on_resume(env):
    out = env["tmp"] / "changed"
    spec = specs.load_spec(env["spec"])
    quiet = {"runner": env["runner"], "report": False, "log": lambda *a: None}
    sweep.run_sweep(spec, out, **quiet)
    n = len(launched(env["log"]))
    sweep.run_sweep(spec, out, resume=True, **quiet)
    assert len(launched(env["log"])) == n  # nothing to do
    sweep.run_sweep(spec, out, resume=True, overrides=["train.lr=0.5"], **quiet)
    assert len(launched(env["log"])) == n + len(IDS)  # every point's config changed
    assert len(results(out)) == 2 * len(IDS)


def test_base_models_pretrained_once_on_a_disjoint_corpus_and_reused(env, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    for i in range(40):
        text = " ".join(words[(i * 7 + j) % len(words)] + str((i * j) % 13) for j in range(120))
        (corpus / f"doc{i:02d}.txt").write_text(f"document {i}: {text}\n")
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
    quiet = {"runner": env["runner"], "report": False, "log": lambda *a: None}
    sweep.run_sweep(specs.load_spec(spec_path), tmp_path / "first", **quiet)
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
    sweep.run_sweep(specs.load_spec(spec_path), tmp_path / "second", **quiet)
    assert not [c for c in launched(env["log"])[len(calls):] if c["pretrain"]]
    assert {r["base_dir"] for r in results(tmp_path / "second")} == set(bases.values())

    # two points at a time, on a fresh cache: each base still built once, before the points that need it
    n = len(launched(env["log"]))
    os.environ["MEMTRAIN_CACHE"] = str(tmp_path / "cache2")
    sweep.run_sweep(specs.load_spec(spec_path), tmp_path / "parallel", jobs=2, **quiet)
    calls = launched(env["log"])[n:]
    assert sorted(c["config"]["model"]["name"] for c in calls if c["pretrain"]) == ["ladder-1m", "ladder-3m"]
    assert [c["pretrain"] for c in calls] == [True, True, False, False, False, False]
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

    monkey_base = tmp_path / "stdlib-free"
    monkey_base.mkdir()
    for i in range(6):
        (monkey_base / f"d{i}.txt").write_text(f"text number {i} " * 50)
    spec.base["data"] = {"corpus": str(monkey_base), "vocab_size": 300, "seq_len": 32}
    summary = sweep.run_sweep(spec, tmp_path / "pf", runner=env["runner"], run_fn=runner, report=False,
                              log=lambda *a: None)
    rows = results(tmp_path / "pf")
    assert [r["status"] for r in rows] == ["failed", "ok"] and summary["failed"] == 1
    assert "pretraining ladder-1m failed" in rows[0]["error"] and "exploded" in rows[0]["error"]
