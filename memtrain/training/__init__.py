"""A training run: the step on the grid, the loop around it, checkpoints, W&B tracking, the MFU probe.

step.py        one optimizer step (train_step), AdamW groups, LR schedule, autocast dtype
trainer.py     `train`: run directory, resume, metrics, progress, checkpoints -> TrainResult
checkpoint.py  sharded checkpoints that load on any grid (each rank its pieces, in safetensors)
tracking.py    Weights & Biases mirror of the run (rank 0, never able to fail it)
perf.py        the measured matmul peak, MFU's denominator
"""

from memtrain.training.step import autocast_dtype, build_optimizer, build_schedule, train_step
from memtrain.training.trainer import TrainResult, setup, train

__all__ = ["TrainResult", "autocast_dtype", "build_optimizer", "build_schedule", "setup", "train", "train_step"]
