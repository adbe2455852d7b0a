"""memtrain.commandline.run_command in this process: how a command that raised ends (the command line's own cases
run as processes in test_cli.py and test_cli_bad_input.py)."""

import pytest
import torch.distributed as dist

import parallel
from memtrain.commandline import run_command
from tests.memtrain._helpers import _isolated


@pytest.mark.parametrize("raised, code", [(ValueError("a bad value: the fix"), 2), (KeyboardInterrupt(), 130)],
                         ids=["bad-input", "ctrl-c"])
def test_an_ending_command_destroys_a_lone_ranks_process_group_before_its_line(raised, code, capsys):
    """A lent GPU showed NCCL's exit warning (destroy_process_group was not called) after the error line, which
    must be the last line on stderr. Gloo prints nothing, so the group's state is what is checked here."""
    def command():
        parallel.init(backend="gloo")
        assert dist.is_initialized()
        raise raised

    with _isolated():
        assert run_command(command) == code
        assert not dist.is_initialized()
    assert capsys.readouterr().err.startswith("memtrain: ")
