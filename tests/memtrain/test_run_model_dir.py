"""A run fine-tuned from a model directory (model.name=DIR) is self-contained.

The trainer keeps DIR's config.json (and the code files its auto_map names) in the run's model_dir/ at the start
of training; `memtrain export RUN`, `memtrain eval RUN` and `memtrain eval --model RUN` build the model from that
copy. Before, they rebuilt it from DIR: DIR deleted, they failed with "unknown model", which reads as a typo; DIR's
config.json edited (hidden_act, rope_theta, rms_norm_eps), they silently exported and scored another model than
the one trained. A run from before the copy still builds from DIR, and says so when DIR is gone.
"""

import json
import shutil
import subprocess

import pytest

from memtrain.config import load
from memtrain.data import build_stream
from memtrain.models import build_model
from memtrain.run_files import OUTPUTS, is_run
from memtrain.training import run_dir
from tests.memtrain._helpers import CPU_RANKS, ROOT, cli, memtrain, refused, stdlib_corpus, write_recipe
from tests.memtrain.test_cli import TORCHRUN

EDITS = {"hidden_act": "gelu", "rms_norm_eps": 0.5, "rope_parameters": {"rope_type": "default", "rope_theta": 3.0}}
"""What a user changes in DIR's config.json after training: every weight still fits, the model computes otherwise."""


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A model directory with weights (a 1-layer Llama at the corpus tokenizer's vocabulary and EOS, as a user's
    own checkpoint; initialized wide so that its outputs depend on the config edited), a 2-step evaluated run
    fine-tuned from it, and a canary file for `eval --model`."""
    root = tmp_path_factory.mktemp("byo")
    (root / "corpus").mkdir()
    corpus = stdlib_corpus(root / "corpus", every=12, count=12, chars=4000)
    recipe = write_recipe(root / "tiny.toml", corpus, root / "cache", train={"batch_size": 4, "max_steps": 2},
                          canaries={"number": 1, "copies": [1], "length": 16},
                          eval={"suffix_len": 4, "exposure_samples": 8, "val_docs": 2})
    cfg = load(recipe)
    stream = build_stream(cfg.data, cfg.canaries, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    base = build_model("ladder-1m", stream.vocab_size, num_hidden_layers=1, initializer_range=0.3)
    base.config.update(dict(eos_token_id=stream.eos_id, bos_token_id=None))
    base.save_pretrained(root / "base")
    r = memtrain("train", "--config", recipe, "--out", root / "run", "--set", f"model.name={root / 'base'}")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = ["The secret code is 4111 1111 1111 1111", "def main():\n    return 42"]
    (root / "canaries.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return root


def moved(ws, tmp_path):
    """A copy of the run and of its model directory, the copy's config.toml naming the copied directory: a run as
    if fine-tuned from tmp_path/base, which a test may then edit or delete."""
    run, base = tmp_path / "run", tmp_path / "base"
    shutil.copytree(ws / "run", run, ignore=shutil.ignore_patterns(".lock"))
    shutil.copytree(ws / "base", base)
    text = (run / "config.toml").read_text()
    assert f'name = "{ws / "base"}"' in text
    (run / "config.toml").write_text(text.replace(f'name = "{ws / "base"}"', f'name = "{base}"'))
    return run, base


def audited(run, ws, out):
    r = cli("eval", "--model", run, "--canaries", ws / "canaries.jsonl", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (out / "eval_canaries.jsonl").read_text().splitlines()]


def evaluated_val_loss(run, out):
    r = cli("eval", run, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "eval.json").read_text())["val_loss"]


def exported_config(run, out):
    r = cli("export", run, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "config.json").read_text())


def test_the_run_keeps_its_model_directorys_config(ws):
    kept = ws / "run" / "model_dir"
    assert (kept / "config.json").read_bytes() == (ws / "base" / "config.json").read_bytes()
    assert json.loads((kept / "source.json").read_text()) == {"model.name": str(ws / "base"), "weights": True}
    assert not list(kept.glob("*.safetensors"))  # the run's checkpoints hold its weights


def test_editing_the_model_directory_after_training_changes_nothing(ws, tmp_path):
    """Export, `eval RUN` and `eval --model RUN` give what they gave before DIR's config.json was edited (before:
    the edited values, another val_loss and other scores, without a word)."""
    run, base = moved(ws, tmp_path)
    before = audited(run, ws, tmp_path / "audit-before")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(dict(config, **EDITS)))

    exported = exported_config(run, tmp_path / "export")
    assert {k: exported[k] for k in EDITS} == {k: config[k] for k in EDITS}
    trained = json.loads((run / "eval.json").read_text())["val_loss"]  # the run's own, DIR as it trained
    assert evaluated_val_loss(run, tmp_path / "eval") == pytest.approx(trained, rel=1e-5, abs=1e-6)
    assert audited(run, ws, tmp_path / "audit-after") == before


def test_deleting_the_model_directory_after_training_changes_nothing(ws, tmp_path):
    """Before: each command failed with "unknown model '<DIR>': Named models: width-32, ...", as for a typo."""
    run, base = moved(ws, tmp_path)
    before = audited(run, ws, tmp_path / "audit-before")
    config = json.loads((base / "config.json").read_text())
    shutil.rmtree(base)

    exported = exported_config(run, tmp_path / "export")
    assert exported["hidden_act"] == config["hidden_act"] and exported["vocab_size"] == config["vocab_size"]
    trained = json.loads((run / "eval.json").read_text())["val_loss"]
    assert evaluated_val_loss(run, tmp_path / "eval") == pytest.approx(trained, rel=1e-5, abs=1e-6)
    assert audited(run, ws, tmp_path / "audit-after") == before


def test_on_a_grid_too_the_run_builds_from_its_copy(ws, tmp_path):
    """`eval RUN` and `eval --model RUN` on 2 ranks build the sharded model from the copy as well (each rank its
    meta model, then its slices of the checkpoint): DIR deleted, both score the run (before: "unknown model")."""
    run, base = moved(ws, tmp_path)
    shutil.rmtree(base)
    for argv in (["eval", run, "--out", tmp_path / "eval"],
                 ["eval", "--model", run, "--canaries", ws / "canaries.jsonl", "--out", tmp_path / "audit",
                  "--set", "parallel.x=2"]):
        r = subprocess.run([*TORCHRUN, *map(str, argv)], capture_output=True, text=True, env=CPU_RANKS, cwd=ROOT,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    trained = json.loads((run / "eval.json").read_text())["val_loss"]
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["val_loss"] == pytest.approx(trained, rel=1e-4)
    assert len((tmp_path / "audit" / "eval_canaries.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("command", ["export", "eval", "eval --model"])
def test_a_run_from_before_the_copy_names_its_missing_model_directory(ws, tmp_path, command):
    """A run made before runs kept model_dir/ still builds from DIR (export shows it works while DIR is there);
    DIR gone, the one line names DIR as the run's model directory and the fix, not an unknown model name."""
    run, base = moved(ws, tmp_path)
    shutil.rmtree(run / "model_dir", ignore_errors=True)  # (runs before the copy have none)
    argv = {"export": ["export", run, "--out", tmp_path / "export"], "eval": ["eval", run, "--out", tmp_path / "ev"],
            "eval --model": ["eval", "--model", run, "--canaries", ws / "canaries.jsonl", "--out", tmp_path / "au"]}
    if command == "export":
        assert exported_config(run, tmp_path / "with-dir")["hidden_act"] == "silu"
    shutil.rmtree(base)
    line = refused(cli(*argv[command]), "no longer exists")
    assert f"the run's model directory {str(base)!r} (model.name) no longer exists" in line
    assert "restore the directory" in line and "unknown model" not in line


def test_force_clears_the_copy_and_the_copy_marks_a_run(tmp_path):
    """model_dir/ is one of a run's outputs: --force removes it with the rest (a named model trained over the run
    must not inherit it), and a directory holding it beside config.toml is a run that no command writes into."""
    assert "model_dir" in OUTPUTS
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "model_dir").mkdir()
    (tmp_path / "model_dir" / "config.json").write_text("{}")
    assert is_run(tmp_path)
    run_dir.claim(tmp_path, resume=False, force=True)
    run_dir.release(tmp_path)
    assert not (tmp_path / "model_dir").exists()


def test_a_resume_builds_from_the_copy_too(ws, tmp_path):
    """--resume after DIR is gone trains on from the run's copy (before: "unknown model"), and the copy stays the
    one made when the run started (a resume never refreshes it from a DIR edited since)."""
    run = tmp_path / "run"
    shutil.copytree(ws / "run", run, ignore=shutil.ignore_patterns(".lock"))
    kept = (run / "model_dir" / "config.json").read_bytes()
    away = ws / "base-away"
    (ws / "base").rename(away)
    try:
        r = cli("train", "--config", run / "config.toml", "--out", run, "--resume", "--set", "train.max_steps=3",
                "--set", "eval.enabled=false")
    finally:
        away.rename(ws / "base")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (run / "model_dir" / "config.json").read_bytes() == kept
