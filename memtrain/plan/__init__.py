"""`memtrain plan`: the grid to train a model with, chosen before launching.

cost.py     exact bytes of every collective of one training step and per-rank memory, from the model's shape
network.py  machine presets (machines.toml), measured bandwidth tables, where a group's ranks sit
search.py   every (data, x, y, z) that runs and fits, ranked by predicted communication time
cli.py      the command line
"""

from memtrain.plan.network import Network, load_network
from memtrain.plan.search import Plan, PlanConfig, plan

__all__ = ["Network", "Plan", "PlanConfig", "load_network", "plan"]
