"""What every test process shares.

Under pytest-xdist (`make test`: -n 2) each worker gets its share of the cores for torch's own threads: two workers
of two threads each on two cores leave OpenMP's threads waiting on each other at every small op (a tiny model's
forward pass measured 2.4 ms on one thread, 170 ms on two with the other worker busy). Forked ranks
(parallel.forked) and `memtrain` subprocesses (OMP_NUM_THREADS=1) run on one thread each already. Without xdist,
torch keeps its default.
"""

import os


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))
