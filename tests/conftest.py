"""What every test process shares.

Under pytest-xdist (`make test`: -n 2) each worker gets its share of the cores for torch's own threads: two workers
of two threads each on two cores leave OpenMP's threads waiting on each other at every small op (a tiny model's
forward pass measured 2.4 ms on one thread, 170 ms on two with the other worker busy). Forked ranks
(parallel.forked) and `memtrain` subprocesses (OMP_NUM_THREADS=1) run on one thread each already. Without xdist,
torch keeps its default.

Every test process runs under Linux's SCHED_BATCH policy, and so does all it forks or starts (the policy is
inherited): the 8-rank tests put 8 gloo ranks, each with a main thread, a TCP loop and two collective threads, on a
machine of 2 cores, and under the default policy every message's wake-up preempts a running rank. On a 2-core AMD
EPYC VM, an 8-rank all_reduce of 16 floats took 19 ms and 3.9 ms of CPU per rank under the default policy, 3.1 ms
and 0.7 ms under SCHED_BATCH; test_parallelize's training cases took 65 s against 29 s, the suite 561 s against
453 s. Only when things are scheduled changes, never what they compute. The benchmarks (experiments/bench) keep
the default policy, the one a user's processes run under: under SCHED_BATCH the planner's collective probes sped up
far more than the steps they predict (python -m experiments.bench.planner: median ratio error 0.43 sharded and 0.33
easy, against the 0.15 it holds under the default).
"""

import contextlib
import os


def pytest_configure(config):
    if hasattr(os, "sched_setscheduler"):  # Linux; no privilege is needed to leave SCHED_OTHER for SCHED_BATCH
        with contextlib.suppress(OSError):  # a sandbox that refuses it only makes the suite slower
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))
