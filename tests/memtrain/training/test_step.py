"""The step's ingredients: the learning-rate rule across widths, and precision 'auto' (a probe, not a guess)."""

import pytest
import torch

from memtrain.config import RunConfig
from memtrain.training import autocast_dtype
from memtrain.training.perf import bf16_faster, matmul_peak_flops
from memtrain.training.step import peak_lr


def _cfg(**train):
    cfg = RunConfig()
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def test_learning_rate_rule_scales_with_width():
    assert peak_lr(_cfg(lr=6e-3), 384) == 6e-3  # no rule: lr as given, whatever the width
    rule = _cfg(lr=6e-3, lr_width=32)
    assert [peak_lr(rule, w) for w in (32, 64, 384)] == pytest.approx([6e-3, 3e-3, 5e-4])
    sqrt = _cfg(lr=8e-3, lr_width=32, lr_width_exponent=0.5)
    assert peak_lr(sqrt, 128) == pytest.approx(4e-3)
    assert peak_lr(_cfg(lr=6e-3, lr_width=32, lr_scale=2.0), 64) == pytest.approx(6e-3)


def test_auto_precision_follows_the_probe_and_leaves_the_rng_alone():
    cpu = torch.device("cpu")
    torch.manual_seed(123)
    before = torch.get_rng_state()
    faster = bf16_faster.__wrapped__(cpu)  # measured now, not the cached answer
    matmul_peak_flops.__wrapped__(cpu, torch.float32, 64, 1)
    assert torch.equal(torch.get_rng_state(), before)  # a resumed run's restored RNG state stays as saved
    assert autocast_dtype(_cfg(precision="auto"), cpu) == (torch.bfloat16 if bf16_faster(cpu) else None)
    assert autocast_dtype(_cfg(precision="fp32"), cpu) is None
    assert autocast_dtype(_cfg(precision="bf16"), cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="train.precision='fp16'"):
        autocast_dtype(_cfg(precision="fp16"), cpu)
    assert isinstance(faster, bool)
