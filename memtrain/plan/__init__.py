"""`memtrain plan`: the grid to train a model with, chosen before launching.

cost.py     exact bytes of every collective of one training step and per-rank memory, from the model's shape
compute.py  per-rank FLOPs and matmul shapes of a step, their time, the non-matmul term, and the step time with overlap
network.py  machine presets (machines.toml), measured bandwidth, matmul and non-matmul tables, where a group's ranks sit
probes.py   `memtrain plan --measure`: the probes that fill those tables, on every rank at once
fake.py     fake tensors for the dry run: shapes and storage without memory
dryrun.py   the real engine on fake tensors for one rank: every collective and byte checked against cost.py
search.py   every (data, x, y, z) that runs and fits, ranked by predicted step time
cli.py      the command line
"""

from memtrain.plan.network import Network, load_network
from memtrain.plan.search import Plan, PlanConfig, plan

__all__ = ["Network", "Plan", "PlanConfig", "load_network", "plan"]
