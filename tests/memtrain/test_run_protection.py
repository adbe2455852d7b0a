"""A finished run is never damaged, and never runs code, whatever a user types (issue 24).

Two rules, each enforced at one place: a run directory's files are written by its own training only
(memtrain/run_files.py check_output for every command's output path, memtrain/training/run_dir.py check_resume
for --resume, experiments/sweep/point.py for a sweep's point directories), and a model directory's Python runs only
with the --trust-remote-code flag of the command being run, never because a file says so (memtrain/models.py
allow_remote_code). Every refusal is one `memtrain: error:` line naming the path or key, with no traceback, and
leaves every file that existed before byte-identical.
"""

import json
import shutil
import subprocess
import sys

import pytest

from memtrain.files import file_lock
from tests.memtrain._helpers import ENV, ROOT, cli, memtrain, refused, snapshot, stdlib_corpus, unchanged, write_recipe


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4), its recipe, and a model directory whose config.json
    asks (auto_map) for a Python file that leaves a marker file when imported."""
    root = tmp_path_factory.mktemp("protect")
    (root / "corpus").mkdir()
    corpus = stdlib_corpus(root / "corpus", every=12, count=12, chars=4000)
    recipe = write_recipe(root / "tiny.toml", corpus, root / "cache", eval={"enabled": False},
                          train={"batch_size": 4, "max_steps": 4, "checkpoint_every": 2},
                          canaries={"number": 1, "copies": [1], "length": 16})
    r = memtrain("train", "--config", recipe, "--out", root / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    evil = root / "evil_model"
    evil.mkdir()
    marker = root / "code_ran"
    (evil / "config.json").write_text(json.dumps({"model_type": "evilcfg", "vocab_size": 512, "auto_map": {
        "AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}))
    (evil / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                  "from transformers import PretrainedConfig\n"
                                  "class EvilConfig(PretrainedConfig):\n    model_type = 'evilcfg'\n")
    return root


def copy_run(ws, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(ws / "run", out, ignore=shutil.ignore_patterns(".lock"))
    return out


def crafted_run(ws, tmp_path):
    """A copy of the run whose config.toml names the code-asking model directory and says trust_remote_code."""
    out = copy_run(ws, tmp_path)
    text = (out / "config.toml").read_text()
    assert 'name = "ladder-1m"' in text and "trust_remote_code = false" in text
    (out / "config.toml").write_text(text.replace('name = "ladder-1m"', f'name = "{ws / "evil_model"}"')
                                     .replace("trust_remote_code = false", "trust_remote_code = true"))
    return out


# -- a run directory never runs code ------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["export", "eval"])
def test_a_run_directory_never_runs_its_model_code(ws, tmp_path, command):
    run = crafted_run(ws, tmp_path)
    before = snapshot(tmp_path)
    argv = [command, run, "--out", tmp_path / "exported"] if command == "export" else [command, run]
    r = cli(*argv)
    refused(r, "--trust-remote-code")
    assert "trust_remote_code = true in" in r.stderr and "is ignored" in r.stderr  # the warning says why
    assert not (ws / "code_ran").exists()
    assert unchanged(before, tmp_path)


def test_a_recipe_never_runs_model_code_without_the_flag(ws, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text((ws / "tiny.toml").read_text().replace('name = "ladder-1m"', f'name = "{ws / "evil_model"}"')
                      .replace("trust_remote_code = false", "trust_remote_code = true"))
    refused(cli("train", "--config", recipe, "--out", tmp_path / "fresh"), "--trust-remote-code")
    assert not (ws / "code_ran").exists()


def test_a_run_tokenizer_asking_for_code_is_refused(ws, tmp_path):
    run = copy_run(ws, tmp_path)
    config = run / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), tokenizer_class="EvilTokenizer",
                                      auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})))
    shutil.copy(ws / "evil_model" / "evil.py", run / "tokenizer" / "evil.py")
    before = snapshot(tmp_path)
    refused(cli("export", run, "--out", tmp_path / "exported"), "tokenizer")
    assert not (ws / "code_ran").exists()
    assert unchanged(before, tmp_path)


def test_the_flag_on_the_command_line_does_run_it(ws, tmp_path):
    """The flag is the one way in (and says so); in a new process, with transformers' module cache kept here."""
    run = crafted_run(ws, tmp_path)
    marker = ws / "code_ran"
    env = dict(ENV, HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    r = subprocess.run([sys.executable, "-m", "memtrain", "export", str(run), "--out", str(tmp_path / "exported"),
                        "--trust-remote-code"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    try:
        assert marker.exists(), r.stderr[-3000:]
        assert "warning: --trust-remote-code" in r.stderr
    finally:
        marker.unlink(missing_ok=True)


# -- outputs never land in a run --------------------------------------------------------------------------------

def run_paths(ws, tmp_path):
    run = copy_run(ws, tmp_path)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    return {"run": run, "recipe": ws / "tiny.toml", "dangling": dangling}


EXPORT = ["export", "{run}", "--out"]
CASES = [
    ("export-into-its-tokenizer", [*EXPORT, "{run}/tokenizer"], "lies inside the run directory"),
    ("export-onto-the-run", [*EXPORT, "{run}"], "is a run directory"),
    ("export-into-a-checkpoint", [*EXPORT, "{run}/checkpoints/step_000004"], "lies inside the run directory"),
    ("export-out-empty", [*EXPORT, ""], "--out is empty"),
    ("export-out-dangling-link", [*EXPORT, "{dangling}"], "{dangling}"),
    ("train-out-empty", ["train", "--config", "{recipe}", "--out", ""], "--out is empty"),
    ("train-out-dangling-link", ["train", "--config", "{recipe}", "--out", "{dangling}"], "{dangling}"),
    ("train-into-a-run", ["train", "--config", "{recipe}", "--out", "{run}/checkpoints"],
     "lies inside the run directory"),
    ("sweep-onto-a-run", ["sweep", "quick", "--out", "{run}"], "is a run directory"),
    ("sweep-out-empty", ["sweep", "quick", "--out", ""], "--out is empty"),
]


@pytest.mark.parametrize("argv, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_output_inside_or_onto_a_run_is_refused(ws, tmp_path, argv, expect):
    paths = run_paths(ws, tmp_path)
    before = snapshot(tmp_path)
    refused(cli(*[a.format(**paths) for a in argv]), expect.format(**paths))
    assert unchanged(before, tmp_path)


# -- --resume continues the same run and only appends ------------------------------------------------------------

def resume(ws, run, *sets):
    overrides = [x for s in sets for x in ("--set", s)]
    return cli("train", "--config", ws / "tiny.toml", "--out", run, "--resume", *overrides)


def test_resume_with_max_steps_below_the_saved_step_is_refused(ws, tmp_path):
    run = copy_run(ws, tmp_path)
    before = snapshot(run)
    line = refused(resume(ws, run, "train.max_steps=3"), "train.max_steps=3")
    assert "step 4" in line
    assert unchanged(before, run)


def test_resume_with_fewer_epochs_than_trained_is_refused(ws, tmp_path):
    run = copy_run(ws, tmp_path)
    info = json.loads((run / "run.json").read_text())
    info["trained"]["steps_per_pass"] = 2  # as if a pass were 2 steps: the 4 saved ones made two passes
    (run / "run.json").write_text(json.dumps(info))
    before = snapshot(run)
    refused(resume(ws, run, "train.max_steps=100", "train.epochs=1"), "train.epochs=1")
    assert unchanged(before, run)


def test_resume_without_optimizer_state_is_refused(ws, tmp_path):
    run = copy_run(ws, tmp_path)
    (run / "checkpoints" / "step_000004" / "optimizer-00000.safetensors").unlink()
    before = snapshot(run)
    line = refused(resume(ws, run, "train.max_steps=6"), "optimizer-00000.safetensors")
    assert "model.init=" in line  # the way to start again from the weights alone
    assert unchanged(before, run)


def test_resume_after_config_toml_was_edited_is_refused(ws, tmp_path):
    run = copy_run(ws, tmp_path)
    text = (run / "config.toml").read_text()
    assert "seed = 0" in text
    (run / "config.toml").write_text(text.replace("seed = 0", "seed = 7", 1))  # and the command line agrees
    before = snapshot(run)
    line = refused(resume(ws, run, "train.max_steps=6", "train.seed=7"), "train.seed (0 -> 7)")
    assert "was edited" in line
    assert unchanged(before, run)


def test_resume_that_would_rewrite_later_checkpoints_is_refused(ws, tmp_path):
    run = copy_run(ws, tmp_path)
    (run / "checkpoints" / "latest").write_text("step_000002")
    before = snapshot(run)
    refused(resume(ws, run, "train.max_steps=6"), "step_000004")
    assert unchanged(before, run)


def test_resuming_a_finished_run_leaves_its_checkpoints_as_they_were(ws, tmp_path):
    run = copy_run(ws, tmp_path)
    before = snapshot(run / "checkpoints")
    r = memtrain("train", "--config", ws / "tiny.toml", "--out", run, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert snapshot(run / "checkpoints") == before  # no step saved again, none added


def test_force_never_deletes_folders_that_are_not_a_runs(ws, tmp_path):
    """A project directory with its own wandb/ and checkpoints/ but no run's config.toml: refused, and --force is
    not offered (it deleted them before)."""
    out = tmp_path / "project"
    (out / "wandb" / "offline-run-mine").mkdir(parents=True)
    (out / "checkpoints" / "my-finetune").mkdir(parents=True)
    before = snapshot(out)
    for force in ([], ["--force"]):
        r = cli("train", "--config", ws / "tiny.toml", "--out", out, *force)
        refused(r, "but no run's config.toml: they are not a memtrain run's files")
        assert "--force replaces" not in r.stderr
    assert unchanged(before, out)


def test_force_removes_a_linked_output_and_not_what_it_points_to(ws, tmp_path):
    """checkpoints/ a link to scratch space: --force removes the link (it stopped half-way before, the metrics
    deleted and the run unusable), never the files it points to."""
    run = copy_run(ws, tmp_path)
    scratch = tmp_path / "scratch"
    shutil.move(run / "checkpoints", scratch)
    (run / "checkpoints").symlink_to(scratch)
    kept = snapshot(scratch)
    r = memtrain("train", "--config", ws / "tiny.toml", "--out", run, "--force")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (run / "checkpoints").is_symlink() and (run / "checkpoints" / "step_000004").is_dir()
    assert unchanged(kept, scratch)


# -- a sweep never replaces a run it did not make ------------------------------------------------------------------

@pytest.fixture()
def sweep_spec(tmp_path):
    from experiments.sweep.spec import load_spec, points_of

    spec = tmp_path / "guard.toml"
    spec.write_text('[sweep]\nname = "guard"\n[base.train]\nbatch_size = 4\n[base.wandb]\nmode = "disabled"\n'
                    '[axes]\n"model.name" = ["ladder-1m"]\n')
    _, points = points_of(load_spec(spec))
    return spec, points[0]


def test_a_sweep_refuses_a_point_directory_holding_another_run(ws, tmp_path, sweep_spec):
    spec, point = sweep_spec
    out = tmp_path / "sweep"
    shutil.copytree(ws / "run", out / point.id, ignore=shutil.ignore_patterns(".lock"))  # `train --out` made it
    before = snapshot(out)
    refused(cli("sweep", spec, "--out", out, "--runner", "false", "--no-report"), str(out / point.id))
    assert unchanged(before, out)


def test_a_sweep_clears_its_own_point_only_under_the_trainers_lock(ws, tmp_path, sweep_spec):
    from experiments.sweep.point import claim_run_dir
    from memtrain.config import to_toml

    _, point = sweep_spec
    run = tmp_path / "sweep" / point.id
    shutil.copytree(ws / "run", run, ignore=shutil.ignore_patterns(".lock"))
    (run / "config.toml").write_text(to_toml(point.cfg).replace("seed = 0", "seed = 1"))  # an older run of it
    before = snapshot(run)
    with file_lock(run / ".lock", blocking=False), pytest.raises(FileExistsError, match="a trainer is writing"):
        claim_run_dir(run, point.cfg, resume=False)  # a live trainer holds it
    assert unchanged(before, run)
    assert claim_run_dir(run, point.cfg, resume=False) is False  # no trainer: this point's leftovers go
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.toml"]
