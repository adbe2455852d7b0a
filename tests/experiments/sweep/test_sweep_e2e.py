"""End to end with the real `memtrain train`: a tiny sweep (2 sizes x {standard, goldfish}) with base-model
pretraining, evaluation, W&B offline files, results.jsonl and the report; then --resume has nothing to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from experiments.sweep import cli
from tests.experiments.sweep._helpers import write_corpus
from tests.memtrain._helpers import ENV

ROOT = Path(__file__).resolve().parents[3]


def test_tiny_sweep_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    corpus = write_corpus(tmp_path / "corpus")
    spec_path = tmp_path / "tiny.toml"
    spec_path.write_text(textwrap.dedent(f'''
        [sweep]
        name = "tiny"
        keep_checkpoints = false
        [base.data]
        corpus = "{corpus}"
        max_docs = 24
        vocab_size = 320
        seq_len = 64
        [base.canaries]
        number = 4
        copies = [1, 2, 4, 8]
        length = 24
        [base.train]
        batch_size = 8
        warmup_steps = 1
        [base.eval]
        suffix_len = 8
        batch_size = 16
        exposure_samples = 16
        val_docs = 4
        [axes]
        "model.name" = ["width-32", "width-64"]
        loss = [{{ kind = "standard" }}, {{ kind = "goldfish", k = 4 }}]
        [pretrain]
        steps = 3
        corpus = "disjoint"
    '''))
    out = tmp_path / "runs" / "tiny"
    assert cli.main([str(spec_path), "--out", str(out), "--wandb", "offline"]) == 0

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["point"] for r in rows] == ["width-32_standard", "width-32_goldfish-k4", "width-64_standard",
                                         "width-64_goldfish-k4"]
    for r in rows:
        assert r["status"] == "ok", r["error"]
        ev = r["eval"]
        for key in ("exact_match_rate", "rougeL", "mia_auc_loss", "val_loss", "exposure_mean"):
            assert key in ev, key
        run_dir = out / r["point"]
        # eval splits by copies SEEN: a copy in the rows after a pass's last full batch is not trained
        manifest = [json.loads(line) for line in (run_dir / "canaries.jsonl").read_text().splitlines()]
        trained_rows = json.loads((run_dir / "run.json").read_text())["trained"]["steps_per_pass"] * 8
        assert {c["copies"] for c in manifest} == {1, 2, 4, 8}
        assert set(ev["by_copies"]) == {str(sum(p["seq_index"] < trained_rows for p in c["placements"]))
                                        for c in manifest}
        assert r["params"] > 0 and r["train"]["tokens_per_s"] > 0 and r["canaries"]
        assert r["base_dir"] and Path(r["base_dir"]).parent == tmp_path / "cache" / "base"
        assert (run_dir / "eval.json").is_file()
        kept = [p.name for p in (run_dir / "checkpoints").glob("*/*")]  # keep_checkpoints = false: final weights only
        assert "state.json" in kept and not [name for name in kept if name.startswith("optimizer")]
        assert list((run_dir / "wandb").glob("offline-run-*"))
    assert rows[0]["params"] < rows[2]["params"]
    assert rows[1]["train"]["kept_fraction"] < 0.95 < rows[0]["train"]["kept_fraction"]
    assert len({r["base_dir"] for r in rows}) == 2
    md = (out / "report.md").read_text()
    assert all(f"| {r['point']} |" in md for r in rows)
    assert len(list((out / "figures").glob("*.png"))) == 7

    assert cli.main([str(spec_path), "--out", str(out), "--resume", "--no-report"]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == 4


def test_sweep_killed_with_sigkill_takes_its_trainer_along_and_resumes(tmp_path):
    """kill -9 of the sweep while a real trainer runs: the trainer dies with it (no orphan keeps writing the
    run directory), and --resume continues that point from its checkpoint to an ok result."""
    corpus = write_corpus(tmp_path / "corpus")
    spec_path = tmp_path / "one.toml"
    spec_path.write_text(textwrap.dedent(f'''
        [sweep]
        name = "one"
        [base.data]
        corpus = "{corpus}"
        vocab_size = 320
        seq_len = 64
        [base.canaries]
        number = 2
        copies = [1]
        length = 24
        [base.train]
        batch_size = 4
        epochs = 200
        max_steps = 400
        checkpoint_every = 5
        [base.eval]
        suffix_len = 8
        exposure_samples = 8
        val_docs = 2
        [axes]
        "model.name" = ["width-32"]
        [pretrain]
        steps = 0
    '''))
    out = tmp_path / "runs"
    env = dict(os.environ, PYTHONPATH=ENV["PYTHONPATH"], MEMTRAIN_CACHE=str(tmp_path / "cache"), WANDB_MODE="disabled",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "experiments.sweep", str(spec_path), "--out", str(out), "--no-report"]
    sweep_proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = out / "width-32" / "checkpoints"
    deadline = time.time() + 300
    while not list(checkpoints.glob("step_*")) and time.time() < deadline:
        time.sleep(0.2)
    assert list(checkpoints.glob("step_*")), "the trainer never saved a checkpoint"
    trainers = _trainers_of(out)
    assert trainers, "no trainer process found"
    sweep_proc.kill()
    sweep_proc.wait()
    deadline = time.time() + 30
    while _trainers_of(out) and time.time() < deadline:
        time.sleep(0.2)
    assert not _trainers_of(out), "the trainer outlived its sweep"

    r = subprocess.run([*cmd, "--resume"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "width-32: resuming" in r.stdout + r.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(row["point"], row["status"]) for row in rows] == [("width-32", "ok")]
    steps = [json.loads(line)["step"] for line in (out / "width-32" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 401))  # no step twice, none missing


def _trainers_of(out: Path) -> list[int]:
    """Live trainer processes writing under `out`: their stdout is a run's stdout.log there (from /proc: no extra
    dependency; a run forked from the sweep's warm server has that server's command line, not its own)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stdout = os.readlink(proc / "fd" / "1")
            status = (proc / "status").read_text()
        except OSError:
            continue
        if proc.name.isdigit() and stdout.startswith(str(out)) and "\nState:\tZ" not in status:
            pids.append(int(proc.name))
    return pids
