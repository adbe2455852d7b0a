"""How a sweep launches runs: the command prefix (local, torchrun, a custom runner) and error lines."""

from pathlib import Path

from experiments.sweep import launch


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
