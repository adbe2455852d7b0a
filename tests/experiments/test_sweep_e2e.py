"""End to end with the real `memtrain train`: a tiny sweep (2 sizes x {standard, goldfish}) with base-model
pretraining, evaluation, W&B offline files, results.jsonl and the report; then --resume has nothing to do."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from experiments import sweep


def _corpus(root):
    words = ("the model reads every token of the stream once and the loss drops a hashed subset of "
             "targets so that no passage can be repeated verbatim from memory alone").split()
    root.mkdir()
    for i in range(40):
        text = " ".join(words[(i * 5 + j * (i % 7 + 1)) % len(words)] for j in range(90 + 3 * i))
        (root / f"doc{i:02d}.txt").write_text(f"# note {i}\n{text}\n")
    return root


def test_tiny_sweep_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    corpus = _corpus(tmp_path / "corpus")
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
        "model.name" = ["ladder-1m", "ladder-3m"]
        loss = [{{ kind = "standard" }}, {{ kind = "goldfish", k = 4 }}]
        [pretrain]
        steps = 3
        corpus = "disjoint"
    '''))
    out = tmp_path / "runs" / "tiny"
    assert sweep.main([str(spec_path), "--out", str(out), "--wandb", "offline"]) == 0

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["point"] for r in rows] == ["ladder-1m_standard", "ladder-1m_goldfish-k4", "ladder-3m_standard",
                                         "ladder-3m_goldfish-k4"]
    for r in rows:
        assert r["status"] == "ok", r["error"]
        ev = r["eval"]
        for key in ("exact_match_rate", "rougeL", "mia_auc_loss", "val_loss", "exposure_mean"):
            assert key in ev, key
        assert set(ev["by_copies"]) == {"1", "2", "4", "8"}
        assert r["params"] > 0 and r["train"]["tokens_per_s"] > 0 and r["canaries"]
        assert r["base_dir"] and Path(r["base_dir"]).parent == tmp_path / "cache" / "base"
        run_dir = out / r["point"]
        assert (run_dir / "eval.json").is_file() and not (run_dir / "checkpoints").exists()  # keep_checkpoints
        assert list((run_dir / "wandb").glob("offline-run-*"))
    assert rows[0]["params"] < rows[2]["params"]
    assert rows[1]["train"]["kept_fraction"] < 0.95 < rows[0]["train"]["kept_fraction"]
    assert len({r["base_dir"] for r in rows}) == 2
    md = (out / "report.md").read_text()
    assert all(f"| {r['point']} |" in md for r in rows)
    assert len(list((out / "figures").glob("*.png"))) == 7

    assert sweep.main([str(spec_path), "--out", str(out), "--resume", "--no-report"]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == 4
