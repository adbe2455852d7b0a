"""`memtrain plan`: the grid to train a model with, chosen before launching.

cost.py         exact bytes of every collective of one training step and per-rank memory, from the model's shape
compute.py      per-rank FLOPs and matmul shapes of a step, their time, the non-matmul term, the step time with overlap
network.py      machine presets (machines.toml), measured collective, matmul and non-matmul tables, where ranks sit
collectives.py  the collective probe: every op's time per group size and payload, alone, queued and back to back
probes.py       `memtrain plan --measure`: the probes that fill those tables (collectives.py's too), on every rank
fake.py         fake tensors for the dry run: shapes and storage without memory
dryrun.py       the real engine on fake tensors for one rank: every collective and byte checked against cost.py
search.py       every (data, x, y, z) that runs and fits, ranked by predicted step time
cli.py          the command line
"""

from memtrain.plan.network import Network, load_network
from memtrain.plan.search import Plan, PlanConfig, plan

__all__ = ["Network", "Plan", "PlanConfig", "load_network", "plan"]
