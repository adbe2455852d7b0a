"""transformers models on the 4D engine: per-architecture plans, parallelization, sharded greedy decoding.

    from memtrain.hf import parallelize
    plm = parallelize(build_model("ladder-10m", vocab_size=4096, device="meta"), grid, mode="auto", seed=0)

architectures.py  one object per architecture: block layers, ends, init rule, checkpoint names
slots.py          how each HF tensor maps onto this rank's shard (seeded init, loading, gathering)
materialize.py    storage and initial values: the engine's from the seed, the rest by transformers' initializer
blocks.py         a model's transformer blocks, torch.compile'd for training (train.compile)
documents.py      the block-causal mask for families whose own mask ignores position ids, and the probe
parallelize.py    `parallelize` and the resulting `ParallelLM`; `export_hf`
decode.py         evaluation on the grid: greedy decoding with a KV cache, teacher-forced scoring, GridModel
"""

from memtrain.hf.architectures import ARCHITECTURES, Architecture, Shape, architecture_of
from memtrain.hf.decode import (
    GridModel,
    ParallelStepper,
    parallel_greedy_decode,
    parallel_sequence_logprobs,
    teacher_forced,
)
from memtrain.hf.parallelize import ParallelLM, export_hf, parallelize

__all__ = ["ARCHITECTURES", "Architecture", "GridModel", "ParallelLM", "ParallelStepper", "Shape", "architecture_of",
           "export_hf", "parallel_greedy_decode", "parallel_sequence_logprobs", "parallelize", "teacher_forced"]
