"""How a sweep launches runs: the command prefix (local, torchrun, a custom runner), error lines, and the warm
runner's forks."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from experiments.sweep import launch, warm
from tests.experiments.sweep._helpers import write_corpus
from tests.memtrain._helpers import write_recipe


def test_launch_commands():
    assert launch.default_command()[1:] == ["-m", "memtrain"]
    cmd = launch.default_command("torchrun", 4)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert cmd[-2:] == ["-m", "memtrain"]
    assert launch.default_command("torchrun", 4, runner="srun -n 4 python -m memtrain") == \
        ["srun", "-n", "4", "python", "-m", "memtrain"]
    assert launch.last_line("a\n 10%|#| 1/10\rValueError: x\n\n") == "ValueError: x"
    run = Path("runs/x")
    assert launch.train_tail(run) == ["train", "--config", str(run / "config.toml"), "--out", str(run)]
    assert launch.train_tail(run, resume=True)[-1] == "--resume"


def test_a_forked_run_trains_bitwise_as_the_command_line_does(tmp_path, monkeypatch):
    """The warm runner's fork of `python -m memtrain train` gives the cold command's losses and scores bit for bit,
    fails as the command does, runs in the caller's working directory (its server started in another), and in the
    caller's environment of the moment (another environment, another server)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    prefix = launch.default_command()
    rc, line = warm.warm_runner(prefix + ["train", "--config", "missing.toml"], tmp_path / "failed")
    assert rc == 2 and "missing.toml" in line  # the one-line error, as the command prints it
    started_elsewhere = warm._server

    write_recipe(tmp_path / "tiny.toml", write_corpus(tmp_path / "corpus"), tmp_path / "cache",
                 model={"name": "width-32"}, data={"vocab_size": 320}, canaries={"copies": [1]},
                 train={"batch_size": 4, "max_steps": 12}, eval={"exposure_samples": 8, "val_docs": 2},
                 wandb={"mode": "auto"})  # W&B as the environment says
    monkeypatch.chdir(tmp_path)  # relative paths from here on
    for name, runner in (("cold", launch.subprocess_runner), ("warm", warm.warm_runner)):
        assert runner(prefix + ["train", "--config", "tiny.toml", "--out", name], Path(name)) == (0, None)
    losses = [[json.loads(line)["loss"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
              for run in ("cold", "warm")]
    assert len(losses[0]) == 12 and losses[0] == losses[1]
    scores = [json.loads((Path(run) / "eval.json").read_text()) for run in ("cold", "warm")]
    assert scores[0]["val_loss"] == scores[1]["val_loss"] and scores[0]["exposure_mean"] == scores[1]["exposure_mean"]
    assert "done: trained 12 steps" in Path("warm/stdout.log").read_text()
    assert warm._server is started_elsewhere  # the same environment, the same server: its fork moved here
    assert not Path("warm/wandb").exists()

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert warm.warm_runner(prefix + ["train", "--config", "tiny.toml", "--out", "offline"], Path("offline")) == \
        (0, None)
    assert list(Path("offline/wandb").glob("offline-run-*"))
    assert warm._server is not started_elsewhere


def test_the_warm_servers_imports_leave_it_forkable():
    """What the server imports starts no Python thread (a fork keeps only the forking one: a lock another held
    stays held in the child) and initializes no CUDA (a forked child could not use it)."""
    probe = ("import threading, torch; from experiments.sweep.warm import IF_INSTALLED, MODULES, preload\n"
             "preload(MODULES, IF_INSTALLED)\n"
             "print(threading.active_count(), torch.cuda.is_initialized())")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=launch.run_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1", "False"]


def test_the_server_preloads_what_is_installed_of_what_a_run_may_import():
    """wandb is imported by runs that track to W&B only: where it is missing the server starts all the same (a
    cold run with W&B off would), where a module every run needs is missing it does not. A submodule of a missing
    package (wandb's launch inputs without wandb) is skipped alike."""
    sys.modules.pop("colorsys", None)
    warm.preload(["colorsys"], ["memtrain_no_such_module", "memtrain_no_such_module.inputs.internal"])
    assert "colorsys" in sys.modules
    with pytest.raises(ModuleNotFoundError, match="memtrain_no_such_module"):
        warm.preload(["memtrain_no_such_module"], [])


def test_sigterm_to_a_sweep_with_runs_side_by_side_stops_every_run(tmp_path):
    """SIGTERM (a scheduler, `kill PID`) reaches the sweep's main thread only, while worker threads wait for their
    runs: every run in flight is stopped at once, and no further point starts."""
    from types import SimpleNamespace

    from experiments.sweep.cli import _terminate
    from experiments.sweep.run import _side_by_side

    ended = []

    def run_point(p):
        ended.append((p.id, *launch.subprocess_runner(["sleep", "30"], tmp_path / p.id)))

    points = [SimpleNamespace(id=f"p{i}", cfg=None) for i in range(4)]
    previous = signal.signal(signal.SIGTERM, _terminate)  # as cli.main installs it
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    start = time.monotonic()
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            _side_by_side(points, SimpleNamespace(need=lambda cfg: None), run_point, 2)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert time.monotonic() - start < 20  # not the runs' 30 s
    assert sorted(p for p, _, _ in ended) == ["p0", "p1"] and all(rc == -signal.SIGTERM for _, rc, _ in ended)
    assert not launch.RUNNING
