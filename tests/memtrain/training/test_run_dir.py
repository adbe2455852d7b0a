"""The run-directory and resume rules, through `memtrain train` as a user runs it.

One run per directory (a second trainer is refused while the first runs; --force starts clean with a new W&B
id), Ctrl-C exits 130 with a --resume hint, and --resume continues exactly: with a longer max_steps, from the
newest complete checkpoint when `latest` dangles, and on another grid. The recipe's learning rate is constant
(min_lr = lr), so a longer resumed run repeats the uninterrupted run's schedule; single-process resumes repeat
the same float32 operations on the same values and must be bitwise equal, a resume on another grid differs only
by summation order (1e-5 relative).
"""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.memtrain._helpers import CPU_RANKS, ENV, ROOT, cli, memtrain, stdlib_corpus, write_recipe


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    corpus = stdlib_corpus(tmp_path_factory.mktemp("corpus"), every=6, count=24, chars=5000)
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.toml", corpus, tmp_path_factory.mktemp("cache"),
                        model={"name": "width-32"}, canaries={"number": 1, "copies": [1]}, eval={"enabled": False},
                        train={"batch_size": 4, "min_lr": 3e-3, "warmup_steps": 0, "checkpoint_every": 2})


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def six_steps(recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("six") / "run"
    r = memtrain("train", "--config", recipe, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def four_steps(recipe, tmp_path_factory):
    """The same run stopped after 4 steps (max_steps=4). Read only: a test resumes a copy."""
    out = tmp_path_factory.mktemp("four") / "run"
    r = memtrain("train", "--config", recipe, "--out", out, "--set", "train.max_steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_longer_max_steps_resumes_exactly(recipe, six_steps, four_steps, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(four_steps, out, ignore=shutil.ignore_patterns(".lock"))
    first = (out / "metrics.jsonl").read_bytes()
    r = memtrain("train", "--config", recipe, "--out", out, "--resume")  # the recipe's max_steps=6
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "metrics.jsonl").read_bytes().startswith(first)
    assert losses(out) == losses(six_steps)


def test_dangling_latest_falls_back_to_the_newest_complete_checkpoint(recipe, six_steps, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(six_steps, out, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(out / "checkpoints" / "step_000006")  # `latest` names a directory a crash removed
    (out / "checkpoints" / ".step_000006.tmp-999").mkdir()  # and a save cut short left its temporary
    r = memtrain("train", "--config", recipe, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(out) == losses(six_steps)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000004",
                                                                       "step_000006"]


def test_resume_on_another_grid(recipe, six_steps, four_steps, tmp_path):
    """With another micro-batch too: a rank's share of the batch on another grid may need one, and accumulating
    gradients over micro-batches changes only their summation order."""
    out = tmp_path / "run"
    shutil.copytree(four_steps, out, ignore=shutil.ignore_patterns(".lock"))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "memtrain", "train", "--config", str(recipe), "--out", str(out), "--resume",
                        "--set", "parallel.data=1", "--set", "parallel.x=2", "--set", "train.micro_batch_size=2"],
                       capture_output=True, text=True, env=CPU_RANKS, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = losses(out), losses(six_steps)
    assert sorted(got) == sorted(want)
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
    assert json.loads((out / "run.json").read_text())["grid"]["x"] == 2


def _start(recipe, out, *args):
    """A trainer that runs long enough to be caught mid-run; returns once it has logged a step."""
    proc = subprocess.Popen([sys.executable, "-m", "memtrain", "train", "--config", str(recipe), "--out", str(out),
                             "--set", "train.max_steps=100000", "--set", "train.epochs=1000", "--set",
                             "train.checkpoint_every=0", *args],
                            env=ENV, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            # a pytest-xdist worker may ignore SIGINT, and an ignored signal stays ignored in a
                            # child: give the trainer Ctrl-C's default, as a shell would
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    return proc


def test_a_second_trainer_is_refused_while_the_first_runs(recipe, tmp_path):
    out = tmp_path / "run"
    first = _start(recipe, out)
    try:
        for extra in ([], ["--resume"], ["--force"]):
            r = cli("train", "--config", recipe, "--out", out, "--set", "train.max_steps=100000", *extra)
            assert r.returncode == 2 and "another trainer is writing" in r.stderr.splitlines()[-1], r.stderr[-2000:]
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()


def test_interrupt_exits_130_saying_what_a_resume_can_continue(recipe, tmp_path):
    proc = _start(recipe, tmp_path / "run")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)  # a loaded 2-core machine took over 120 s to wind the run down
    assert proc.returncode == 130, err[-3000:]
    # no checkpoint yet (checkpoint_every=0, the time-based one not due): the line says --resume cannot continue
    assert err.strip().splitlines()[-1].startswith("memtrain: interrupted: no checkpoint saved yet, so --resume "
                                                   "cannot continue this run: train it again with --force"), err[-3000:]
    assert "Traceback" not in err


def test_force_starts_clean_with_a_new_wandb_id(recipe, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "memtrain", "train", "--config", str(recipe), "--out", str(out), "--set",
           "train.max_steps=2", "--set", "wandb.mode='offline'"]
    env = dict(ENV, WANDB_MODE="offline", WANDB_SILENT="true")
    assert subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, timeout=600).returncode == 0
    first_id = json.loads((out / "wandb-run.json").read_text())["id"]
    (out / "notes.txt").write_text("mine")  # not a run output: kept
    r = subprocess.run([*cmd, "--force"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "wandb-run.json").read_text())["id"] != first_id
    assert sorted(losses(out)) == [1, 2] and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002"]
