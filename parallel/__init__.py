"""memtrain's 4D parallel engine: data parallelism x a 3D tensor-parallel matmul (X, Y, Z).

    grid = parallel.init(data=-1, x=2, y=2, z=1)        # under torchrun, SLURM, or one process
    fc1 = parallel.Linear(512, 2048, mode="sharded")
    fc2 = parallel.Linear(2048, 512, mode="sharded", transpose=True)

The engine imports nothing else of memtrain. The algorithm is in linear.py's docstring, the rank layout
in grid.py's, overlap in overlap.py's (gradient all-reduce overlapped with backward: bucketed.py's), the
communication ledger in comm.py's, tuned GEMM layouts (`parallel.tune_matmul`) in gemm_tuning.py's.
"""

from .bucketed import GRAD_SYNCS, GradSync, grad_sync
from .comm import LEDGER, Ledger
from .embedding import (
    IGNORE_INDEX,
    ColumnEmbedding,
    Embedding,
    LMHead,
    padded_vocab,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    vocab_parallel_log_probs,
)
from .gemm_tuning import tune_matmul
from .grads import clip_grad_norm_, grad_norm, no_sync, sync_gradients
from .grid import AXES, KNOWN_BACKENDS, Grid, current, init, launch_world_size, resolve_degrees, shutdown
from .linear import MODES, Linear
from .overlap import overlap
from .sharding import BlockLayout, ShardSpec, spec_of, tag, unique_parameters

__all__ = [
    "AXES", "GRAD_SYNCS", "IGNORE_INDEX", "KNOWN_BACKENDS", "LEDGER", "MODES", "BlockLayout", "ColumnEmbedding",
    "Embedding", "GradSync", "Grid", "LMHead", "Ledger", "Linear", "ShardSpec", "clip_grad_norm_", "current",
    "grad_norm", "grad_sync", "init", "launch_world_size", "no_sync", "overlap", "padded_vocab", "resolve_degrees",
    "shutdown", "spec_of", "sync_gradients", "tag", "tune_matmul", "unique_parameters", "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy", "vocab_parallel_log_probs",
]
