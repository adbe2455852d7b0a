"""A transformers model's blocks, compiled for training (train.compile, ParallelLM.compile_blocks).

Each block's forward is torch.compile'd as torchtitan does: its norms, rotary embedding, activation and residual
adds fuse into a few kernels, and every block shares the compiled graphs (one set with the packed-document mask,
one without). The engine's products are traced where they are torch's own F.linear; on a grid with tensor
parallelism, or with GEMM tuning, parallel.Linear and the sharded norms' all-reduce run eagerly between the
compiled pieces (parallel.comm.eager_under_compile), so what fuses there is the work between two products.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from parallel import Grid, gemm_tuning


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """A transformers model's blocks: its modules of the classes it names in `_no_split_modules`."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in kinds]


def compile_blocks(model: nn.Module) -> int:
    """Compile each block's forward for training (module docstring); the number of blocks."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(f"train.compile=true but {type(model).__name__} names no transformer block class "
                         "(transformers' _no_split_modules): set train.compile=false")
    for block in blocks:
        block.forward = _compiled_in_training(block.forward)
    return len(blocks)


def check_compiled_checkpointing(grid: Grid, device: torch.device) -> None:
    """Refuse compiled blocks that are also checkpointed where the engine's products run eagerly: torch.compile
    traces a checkpointed block as one region that cannot break its graph, and would run it all eagerly, silently
    (measured on a tensor-parallel grid: no graph compiled)."""
    if grid.tensor_parallel_size > 1:
        why = f"a grid with tensor parallelism (x={grid.x} y={grid.y} z={grid.z})"
    elif gemm_tuning.active(device):
        why = "parallel.tune_matmul=true"
    else:
        return
    raise ValueError(f"train.compile=true with train.activation_checkpointing=true on {why}: torch.compile cannot "
                     "break a checkpointed block's graph at the engine's products, so the blocks would run eagerly; "
                     "set train.compile=false or train.activation_checkpointing=false")


def _compiled_in_training(forward):
    """`forward` compiled, run while autograd records; `forward` itself otherwise, so evaluation and decoding
    (inference mode, prompts of every length) never wait on a recompilation."""
    compiled = torch.compile(forward)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return (compiled if torch.is_grad_enabled() else forward)(*args, **kwargs)

    return run
