"""memtrain's 4D parallel engine: data parallelism x a 3D tensor-parallel matmul (X, Y, Z).

    grid = parallel.init(data=-1, x=2, y=2, z=1)        # under torchrun, SLURM, or one process
    fc1 = parallel.Linear(512, 2048, mode="sharded")
    fc2 = parallel.Linear(2048, 512, mode="sharded", transpose=True)

The engine imports nothing else of memtrain; see DESIGN.md section 3 for the algorithm.
"""

from .comm import LEDGER, Ledger
from .embedding import Embedding, LMHead, vocab_parallel_cross_entropy
from .grads import clip_grad_norm_, grad_norm, no_sync, sync_gradients
from .grid import AXES, Grid, current, init, resolve_degrees, shutdown
from .linear import Linear
from .overlap import overlap
from .sharding import BlockLayout, ShardSpec, spec_of, tag

__all__ = [
    "AXES", "LEDGER", "BlockLayout", "Embedding", "Grid", "LMHead", "Ledger", "Linear", "ShardSpec",
    "clip_grad_norm_", "current", "grad_norm", "init", "no_sync", "overlap", "resolve_degrees", "shutdown",
    "spec_of", "sync_gradients", "tag", "vocab_parallel_cross_entropy",
]
