"""A sweep's runs leave what `memtrain export` needs and one W&B mirror of the whole sweep, with the real trainer.

One tiny sweep (one point: width-64 memorizing 2 random and 2 document canaries at 2 and 8 copies in 30 passes,
from a 2-step base model, W&B offline) with the presets' `keep_checkpoints = false`. Its run keeps only its final
weights (keep_final_weights = "auto": a small model), `memtrain export` works on it without re-running, and the
export, loaded with transformers alone, re-scores every canary and twin as eval_canaries.jsonl and eval.json say:
greedy `generate` of the suffix from [EOS] + prefix (the context memtrain scores) gives the same ids. Where the
weights were dropped (keep_final_weights = false), export names the command that retrains the run, and that command,
run as printed, gives back the weights the sweep kept, bit for bit.

W&B: the sweep's last line is one `wandb sync` command whose globs name every offline run it made (the point's, the
report's, the base model's); the report run's config is the spec; the training run defines the pass axis (its
.wandb files read back: tests/memtrain/training/_wandb_files.py).
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from experiments.sweep import cli as sweep_cli
from memtrain.training.tracking import PASS_AXIS
from tests.memtrain._helpers import ENV, checkpoint_files, cli, refused, stdlib_corpus
from tests.memtrain.training._wandb_files import of_type, records

ROOT = Path(__file__).resolve().parents[3]
POINT = "width-64"


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The workspace: environment (W&B offline, everything in tmp), corpus and spec; the first sweep run."""
    tmp = tmp_path_factory.mktemp("sweep-export")
    corpus = stdlib_corpus(tmp_path_factory.mktemp("corpus"), every=4, count=40, chars=6000)
    env = {"MEMTRAIN_CACHE": str(tmp / "cache"), "WANDB_MODE": "offline", "WANDB_DIR": str(tmp / "wandb-dir"),
           "WANDB_CONFIG_DIR": str(tmp / "wandb-config"), "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp / "wandb-data"), "WANDB_SILENT": "true", "HOME": str(tmp / "home"),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    spec = tmp / "exp.toml"
    spec.write_text(textwrap.dedent(f'''
        [sweep]
        name = "exp"
        description = "export and W&B of a sweep"
        keep_checkpoints = false
        [base.model]
        name = "{POINT}"
        [base.train]
        batch_size = 8
        epochs = 30
        lr = 2e-2
        warmup_steps = 2
        [base.data]
        corpus = "{corpus}"
        vocab_size = 512
        seq_len = 64
        max_text_tokens = 500
        [base.canaries]
        number = 2
        copies = [2, 8]
        length = 24
        secret_groups = 2
        [base.eval]
        suffix_len = 8
        exposure_samples = 64
        val_docs = 8
        every_pass = true
        [axes]
        "model.name" = ["{POINT}"]
        [pretrain]
        steps = 2
        corpus = "same"
    '''))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("WANDB_API_KEY", raising=False)
        out = tmp / "runs" / "exp"
        printed = _sweep(spec, out)
        yield {"tmp": tmp, "spec": spec, "out": out, "run": out / POINT, "printed": printed}


def _sweep(spec: Path, out: Path, *args: str) -> list[str]:
    """`memtrain sweep SPEC --out OUT ARGS` in this process; its stdout lines."""
    handler, buf = signal.getsignal(signal.SIGTERM), io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = sweep_cli.main([str(spec), "--out", str(out), *args])
    finally:
        signal.signal(signal.SIGTERM, handler)  # the sweep's own, for Ctrl-C-like SIGTERM
    assert rc == 0, buf.getvalue()[-3000:]
    return buf.getvalue().splitlines()


def test_a_sweep_run_keeps_only_its_final_weights(ws):
    steps = json.loads((ws["run"] / "run.json").read_text())["trained"]["steps"]
    kept = [p.name for p in (ws["run"] / "checkpoints").iterdir() if p.name != "latest"]
    assert kept == [f"step_{steps:06d}"]
    files = sorted(p.name for p in (ws["run"] / "checkpoints" / kept[0]).iterdir())
    assert files == ["model-00000.safetensors", "state.json"]  # no optimizer state


def test_export_of_a_sweep_run_rescores_its_canaries_in_plain_transformers(ws):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, hf = ws["run"], ws["tmp"] / "hf"
    r = cli("export", run, "--out", hf)
    assert r.returncode == 0, r.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True).eval()
    eos = AutoTokenizer.from_pretrained(hf, local_files_only=True).eos_token_id
    summary = json.loads((run / "eval.json").read_text())
    n = summary["suffix_len"]
    manifest = {c["id"]: c for c in map(json.loads, (run / "canaries.jsonl").read_text().splitlines())}
    members = []
    for row in map(json.loads, (run / "eval_canaries.jsonl").read_text().splitlines()):
        tokens = manifest[row["id"].removesuffix("-twin")]["token_ids" if row["inserted"] else "twin_token_ids"]
        context = torch.tensor([[eos, *tokens[:-n]]])
        with torch.no_grad():
            out = model.generate(context, attention_mask=torch.ones_like(context), max_new_tokens=n, do_sample=False)
        generated = out[0, context.shape[1]:].tolist()
        # generate stops at EOS, memtrain's extraction decodes all n tokens: compare what generate produced
        assert generated == row["generated"][:len(generated)], row["id"]
        assert len(generated) == n or generated[-1] == eos, row["id"]
        assert (generated == tokens[-n:]) == row["exact_match"], row["id"]
        if row["inserted"]:
            members.append(generated == tokens[-n:])
    assert len(members) == 4 and any(members) and not all(members)  # a mixed result: both outcomes compared
    assert sum(members) / len(members) == summary["exact_match_rate"]


def test_dropped_weights_name_the_command_that_gets_them_back(ws, tmp_path):
    """The run as keep_final_weights = false leaves it (test_keep_weights.py: the sweep deletes them): export says
    so in one line, and the `memtrain train` it names, run as printed, retrains the weights the sweep kept, bit for
    bit (the run's config.toml starts from the same cached base model). `eval` of it names the same command, not
    a config key the user never set."""
    run = tmp_path / "exp" / POINT
    shutil.copytree(ws["run"], run, ignore=shutil.ignore_patterns("checkpoints", "wandb*"))
    error = refused(cli("eval", run, "--set", "eval.exposure_samples=8", "--out", tmp_path / "again"),
                    "its weights were deleted once it was evaluated")
    assert "evaluate that directory" in error and f"--out {run}-weights" in error
    r = cli("export", run, "--out", tmp_path / "hf")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("memtrain: error:"), r.stderr[-2000:]
    exe, *args = shlex.split(lines[0].split("`")[1])
    assert exe == "memtrain" and args == ["train", "--config", str(run / "config.toml"), "--out", f"{run}-weights"]
    done = subprocess.run([sys.executable, "-m", "memtrain", *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ENV["PYTHONPATH"], WANDB_MODE="disabled"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    final = next(p for p in (ws["run"] / "checkpoints").iterdir() if p.name != "latest")
    kept = checkpoint_files(final)
    again = {k: v for k, v in checkpoint_files(Path(f"{run}-weights") / "checkpoints" / final.name).items()
             if k.startswith("model")}  # beside its optimizer files, which a kept run drops
    assert again.keys() == kept.keys() and all(torch.equal(again[k], kept[k]) for k in kept)
    assert cli("export", f"{run}-weights", "--out", tmp_path / "hf").returncode == 0


def test_one_wandb_sync_command_names_every_offline_run_of_the_sweep(ws):
    line = ws["printed"][-1]
    assert line.startswith("W&B: 3 offline run(s) of this sweep; upload them all with: "), ws["printed"][-3:]
    exe, sync, *globs = shlex.split(line.split("upload them all with: ")[1])
    assert Path(exe).name == "wandb" and sync == "sync"
    named = {Path(p) for g in globs for p in glob.glob(g)}
    made = {Path(d) for d, _, _ in os.walk(ws["tmp"]) if Path(d).name.startswith("offline-run-")}
    base = Path(json.loads((ws["out"] / "results.jsonl").read_text())["base_dir"])
    assert named == made and {p.parent.parent for p in made} == {ws["run"], ws["out"] / "report", base}
    # wandb itself finds a run in every directory the command names
    dry = subprocess.run([exe, "sync", "--dry-run", *map(str, sorted(named))], capture_output=True, text=True,
                         timeout=120, env=os.environ)
    assert dry.returncode == 0 and f"Would sync {len(made)} run(s)" in dry.stdout + dry.stderr, dry.stderr


def test_report_run_logs_the_spec_and_the_training_run_the_pass_axis(ws):
    (report,) = of_type(records(ws["out"] / "report"), "run")
    config = {u.key: json.loads(u.value_json) for u in report.config.update}
    assert config["name"] == "exp" and config["axes"] == {"model.name": [POINT]}
    assert config["base"]["train"]["epochs"] == 30 and config["pretrain"]["steps"] == 2
    assert config["keep_checkpoints"] is False and config["keep_final_weights"] == "auto"

    train = records(ws["run"])
    metrics = [(m.name, m.glob_name, m.step_metric) for m in of_type(train, "metric")]
    assert (PASS_AXIS, "", "") in metrics and ("", "train/pass/*", PASS_AXIS) in metrics
    passes = [json.loads(i.value_json) for h in of_type(train, "history") for i in h.item
              if "/".join(i.nested_key or [i.key]) == PASS_AXIS]
    assert passes == list(range(31))  # the starting model, then every pass
