"""parallel.peers: after a collective failed, which ranks are gone and how. A peer on this host is judged by its
process (ended, or stopped), any rank by whether it checks in; every answer within the wait. (Through a real
torchrun run with a killed rank: tests/memtrain/training/test_faults.py.)"""

import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from parallel import peers


@pytest.fixture
def store():
    s = dist.HashStore()
    peers.register(s, 0)
    yield s
    peers.forget()


def _pretend(store, rank: int, host: str, pid: int) -> None:
    """What rank `rank`'s parallel.init would have left in the store."""
    dist.PrefixStore("parallel/peers/", store).set(f"proc/{rank}", f"{host} {pid}")


def _check_in(store, rank: int) -> None:
    dist.PrefixStore("parallel/peers/", store).set(f"alive/{rank}", "1")


def test_a_peer_on_this_host_whose_process_ended_or_stopped_is_named_at_once(store):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        _pretend(store, 1, socket.gethostname(), ended.pid)
        _pretend(store, 2, socket.gethostname(), stopped.pid)
        t0 = time.monotonic()
        assert peers.lost(0, 3, wait_s=30) == (f"rank 1 (pid {ended.pid} on {socket.gethostname()}) ended, rank 2 "
                                               f"(pid {stopped.pid} on {socket.gethostname()}) is stopped")
        assert time.monotonic() - t0 < 5
    finally:
        stopped.kill()
        stopped.wait()


def test_a_rank_elsewhere_that_does_not_check_in_is_named_after_the_wait(store):
    _pretend(store, 1, "node-elsewhere", 4242)
    _pretend(store, 2, "node-elsewhere", 4243)
    _check_in(store, 2)  # its own collective failed too: it is alive
    t0 = time.monotonic()
    assert peers.lost(0, 3, wait_s=1) == "rank 1 did not answer within 1 s (gone, or stuck)"
    assert 1 <= time.monotonic() - t0 < 5
    _check_in(store, 1)
    assert peers.lost(0, 3, wait_s=1) is None  # everyone answered: nobody to name


def test_without_a_launcher_nothing_is_registered_and_nothing_named():
    peers.forget()
    assert peers.lost(0, 2) is None


def test_gloo_errors_and_torch_distributed_errors_are_peer_failures():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:20376: "
                        "Connection reset by peer")
    assert peers.is_peer_failure(gloo) and peers.is_peer_failure(dist.DistBackendError("NCCL error"))
    assert not peers.is_peer_failure(RuntimeError("shape mismatch")) and not peers.is_peer_failure(ValueError("x"))
