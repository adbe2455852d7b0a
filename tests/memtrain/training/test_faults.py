"""Faults as a scheduler and a cluster deliver them, through `memtrain train` as a user runs it: SIGTERM (SLURM at
a time limit, scancel, torchrun passing its own on), a rank of a torchrun run killed, a disk full during a
checkpoint save. Each ends in one line on stderr and its exit code (commandline.py), no traceback, and nothing
half-written where a resume reads: the resumed run's final weights equal an uninterrupted run's, bitwise (the
recipe's learning rate is constant, min_lr = lr, so a run's length does not change its schedule)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import parallel
from memtrain import signals
from memtrain.training import trainer
from parallel.forked import run_ranks
from tests.memtrain._helpers import CPU_RANKS, ENV, ROOT, checkpoint_files, memtrain, stdlib_corpus, write_recipe

LONG = ["--set", "train.max_steps=100000", "--set", "train.epochs=1000", "--set", "train.checkpoint_every=0"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    corpus = stdlib_corpus(tmp_path_factory.mktemp("corpus"), every=6, count=24, chars=5000)
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.toml", corpus, tmp_path_factory.mktemp("cache"),
                        model={"name": "width-32"}, canaries={"number": 1, "copies": [1]}, eval={"enabled": False},
                        train={"batch_size": 4, "min_lr": 3e-3, "warmup_steps": 0, "checkpoint_every": 2,
                               "precision": "fp32"})  # 'auto' is a timing probe: two runs on a loaded machine
                                                      # may pick different dtypes, and the weights then differ


def _wait_for_steps(out: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]


def _memtrain_lines(err: str) -> list[str]:
    """The lines memtrain itself printed (a progress bar's carriage returns end lines too)."""
    return [line for line in err.splitlines() if line.startswith("memtrain:")]


def _same_weights(a: Path, b: Path) -> bool:
    x, y = checkpoint_files(a), checkpoint_files(b)
    return bool(x) and x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_sigterm_saves_the_step_says_so_and_resumes_exactly(recipe, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "memtrain", "train", "--config", str(recipe), "--out", str(out),
                             *LONG], env=ENV, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(out, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and len(_memtrain_lines(err)) == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    step = int(re.search(r"terminated by SIGTERM after step (\d+), its checkpoint saved: .*--resume", line)[1])
    assert (out / "checkpoints" / "latest").read_text() == f"step_{step:06d}"

    end = ["--set", f"train.max_steps={step + 2}", "--set", "train.epochs=1000", "--set", "train.checkpoint_every=0"]
    r = memtrain("train", "--config", recipe, "--out", out, "--resume", *end)
    assert r.returncode == 0, r.stderr[-3000:]
    r = memtrain("train", "--config", recipe, "--out", tmp_path / "whole", *end)
    assert r.returncode == 0, r.stderr[-3000:]
    final = f"checkpoints/step_{step + 2:06d}"
    assert _same_weights(out / final, tmp_path / "whole" / final)


def _sigterm_decisions(rank, world):
    """SIGTERM reaches rank 0 only, and rank 1's last save was slow: both ranks learn both."""
    grid = parallel.init(data=world)
    cpu = torch.device("cpu")
    signals.handle()
    with signals.deferred():
        before = trainer.agree(grid, cpu, 0.0, 0.0, 1.0)
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        after = trainer.agree(grid, cpu, 0.0, 0.0, trainer.SIGTERM_SAVE_S + 1 if rank == 1 else 1.0)
    return (before.stop, before.cheap), (after.stop, after.cheap)


def test_every_rank_stops_at_the_same_step_and_saves_or_not_alike():
    """A rank deciding alone would leave the others waiting in the next step's collectives, or in the save."""
    assert run_ranks(2, _sigterm_decisions) == [((False, True), (True, False))] * 2


def _children(parent: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes torchrun `parent` started."""
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = [v[5:] for v in env if v.startswith(b"RANK=")]
        if ppid == parent and rank:
            ranks[int(rank[0])] = int(stat.parent.name)
    return ranks


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_is_named_in_one_line_by_the_survivor(recipe, tmp_path, victim):
    """Two ranks under torchrun, one killed mid-run (SIGKILL: no word from it). The survivor's collective fails
    with gloo's connection error, and torchrun sends it SIGTERM at once: it prints one line naming the lost rank
    and exits 1, without a traceback. Each rank's stderr goes to its own file (torchrun --log-dir)."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--log-dir", str(logs), "--redirects", "3", "-m", "memtrain", "train", "--config",
                             str(recipe), "--out", str(out), *LONG, "--set", "parallel.data=1", "--set",
                             "parallel.x=2"], env=CPU_RANKS, cwd=ROOT, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    _wait_for_steps(out, proc)
    ranks = _children(proc.pid)
    assert sorted(ranks) == [0, 1], ranks
    survivor = 1 - victim
    subprocess.run(["kill", "-9", str(ranks[victim])], check=True)
    _, launcher = proc.communicate(timeout=120)
    assert proc.returncode != 0
    exit_codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", launcher))
    assert exit_codes.get(str(survivor)) == "1", launcher[-3000:]
    (err,) = logs.glob(f"*/attempt_0/{survivor}/stderr.log")
    text = err.read_text()
    assert "Traceback" not in text and "RuntimeError" not in text, text[-3000:]
    (line,) = _memtrain_lines(text)
    assert line.startswith(f"memtrain: error: rank {survivor} lost contact with the other ranks: rank {victim} "
                           f"(pid {ranks[victim]} on "), line
    assert line.endswith("--resume"), line


INJECT = '''
import sys
from pathlib import Path

from safetensors import SafetensorError

from memtrain.cli import main
from memtrain.training import checkpoint

real = checkpoint.save_file


def full_disk(tensors, path, metadata=None):
    """The disk fills up during step 4's save: half a file written, then safetensors' own error for ENOSPC."""
    if ".step_000004." not in path:
        return real(tensors, path, metadata=metadata)
    Path(path).with_name(".tmpXYZ").write_bytes(b"\\0" * 1000)
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


checkpoint.save_file = full_disk
sys.exit(main(sys.argv[1:]))
'''


def test_a_full_disk_during_a_save_is_one_line_and_the_resume_is_clean(recipe, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", INJECT, "train", "--config", str(recipe), "--out", str(out)],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and _memtrain_lines(r.stderr) == [r.stderr.strip().splitlines()[-1]]
    line = r.stderr.strip().splitlines()[-1]
    assert "model-00000.safetensors: No space left on device: the checkpoint of step 4 was not saved" in line, line
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002"]  # no temporary, no step 4
    assert (ckpts / "latest").read_text() == "step_000002"

    r = memtrain("train", "--config", recipe, "--out", out, "--resume")  # space is back
    assert r.returncode == 0, r.stderr[-3000:]
    r = memtrain("train", "--config", recipe, "--out", tmp_path / "whole")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _same_weights(out / "checkpoints" / "step_000006", tmp_path / "whole" / "checkpoints" / "step_000006")
