"""Benchmarks, each against its named peer measured side by side in one run; none is part of the test suite.

    python -m experiments.bench.engine     # data mode vs DDP, Z mode vs FSDP2, 3D grids
    python -m experiments.bench.train      # memtrain train vs a plain PyTorch loop
    python -m experiments.bench.eval       # our KV-cache greedy decoder vs transformers generate
    python -m experiments.bench.goldfish   # the hashed mask's share of a training step
    python -m experiments.bench.planner    # the planner's predicted grid order vs measured
"""
