"""Progress lines: global rank 0 only (torch.distributed's rank, else the launcher's), silenced by quiet(), a
stage's duration on its own line, and a failing stage leaves the error a line of its own."""

import re
import sys

import pytest

from memtrain import progress


@pytest.fixture()
def no_process_group(monkeypatch):
    """Rank from the environment only, whatever process group an earlier test in this worker left behind."""
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    for var in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, prints", [({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False),
                                         ({"SLURM_PROCID": "3"}, False), ({"SLURM_PROCID": "0"}, True)])
def test_only_rank_0_prints(no_process_group, capsys, env, prints):
    for k, v in env.items():
        no_process_group.setenv(k, v)
    progress.note("data: hello")
    with progress.stage("eval: work"):
        pass
    err = capsys.readouterr().err
    assert (err.splitlines()[0] == "data: hello" and re.fullmatch(r"eval: work\.\.\. \d\.\d s", err.splitlines()[1])
            if prints else err == ""), err


def test_rank_of_the_process_group_wins(monkeypatch, capsys):
    class Dist:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def get_rank():
            return 1

    monkeypatch.setitem(sys.modules, "torch.distributed", Dist)
    monkeypatch.setenv("RANK", "0")
    progress.note("data: hello")
    assert capsys.readouterr().err == ""


def test_quiet_and_a_failing_stage(no_process_group, capsys):
    with progress.quiet():
        progress.note("data: hidden")
    progress.note("data: shown")
    with pytest.raises(ValueError), progress.stage("data: packing"):
        raise ValueError("bad")
    assert capsys.readouterr().err == "data: shown\ndata: packing...\n"


def test_counts_and_durations():
    assert [progress.count(n) for n in (7, 1234, 5_600_000, 2.5e9)] == ["7", "1,234", "5.6M", "2.5G"]
    assert [progress.seconds(s) for s in (0.04, 41.26, 75)] == ["0.0 s", "41.3 s", "1 min 15 s"]
    # rounded before the units are chosen: never '60.0 s', '1 min 60 s' or '1000.0M'
    assert [progress.seconds(s) for s in (59.97, 119.7)] == ["1 min 00 s", "2 min 00 s"]
    assert progress.count(999_999_999) == "1.0G"
