"""parallel.forked: ranks forked from the test process, or from a fork server on a machine with a GPU."""

import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils._triton import has_triton

from parallel.forked import run_ranks


def _sum_of_ranks_after_backward(rank, world_size):
    x = torch.tensor([float(rank)], requires_grad=True)
    (x * 2).sum().backward()
    dist.all_reduce(x.grad)
    return float(x.grad), os.getppid()


def test_ranks_are_forked_from_this_process_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results = run_ranks(2, _sum_of_ranks_after_backward)
    assert results == [(4.0, os.getpid())] * 2


def test_with_a_gpu_the_ranks_come_from_a_fork_server_and_run_autograd_after_the_parent_did(monkeypatch):
    """A GPU machine's parent that ran backward once has autograd's device threads; children forked from it refuse
    autograd. The fork server is a clean process: its children are not this process's, and backward works there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (torch.ones(1, requires_grad=True) * 3).sum().backward()
    results = run_ranks(2, _sum_of_ranks_after_backward)
    assert [grad for grad, _ in results] == [4.0, 4.0]
    assert all(parent != os.getpid() for _, parent in results)


def _compile_a_new_kernel(rank, world_size):
    return float(torch.compile(lambda x: x.cos() * (rank + 2))(torch.ones(3)).sum())


def test_ranks_compile_after_the_parent_compiled(monkeypatch, tmp_path):
    """A parent whose torch.compile has started its compile threads forks ranks that compile kernels of their own
    (an empty kernel cache makes both compile for real): without parallel.forked's reset they waited forever."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")
    try:
        assert float(torch.compile(lambda x: x.sin() + 1)(torch.zeros(3)).sum()) == 3.0
    finally:
        # inductor keeps, per process, whether Triton can compile for a device, here answered with the GPU hidden:
        # a later test of this worker compiling for a GPU (flex attention's block mask) then met TritonMissing
        has_triton.cache_clear()
    results = run_ranks(2, _compile_a_new_kernel, timeout=60)
    assert results == pytest.approx([6 * math.cos(1), 9 * math.cos(1)], rel=1e-6)


def _exit_without_reporting(rank, world_size):
    os._exit(3)


def test_a_rank_that_dies_without_reporting_fails_the_run_at_once():
    """A rank killed by the OOM killer (or os._exit, a segfault) sends nothing: the parent waited out the whole
    `timeout` (600 s by default) and then blamed a hang. Now it sees the exit code within parallel.forked.POLL_S."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"\nrank 0 exited with code 3 without reporting$"):
        run_ranks(1, _exit_without_reporting, timeout=20)
    assert time.monotonic() - t0 < 5
