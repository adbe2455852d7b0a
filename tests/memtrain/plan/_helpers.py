"""What the planner tests share: the byte model's step (test_cost.py), which the compute model's test
(test_compute.py) measures too: B sequences of S tokens in two micro-batches, on tests/memtrain/_models.py's."""

from tests.memtrain._models import tiny

B, S = 16, 8


def step_model(family, extra, device):
    """The tiny model of `family` with `extra` ((key, value) config pairs; ("recompute", True) is no config key)."""
    kw = {k: v for k, v in extra if k != "recompute"}
    if family == "llama":
        kw.setdefault("num_hidden_layers", 2)
    return tiny(family, device, **kw)


def micro_batch(degrees, mode):
    """Two micro-batches per step: the per-micro-batch collectives must count twice."""
    split = 8 if mode == "easy" else degrees[0] * degrees[3]
    return B // split // 2
