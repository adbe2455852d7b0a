"""MFU's numerator (the planner's FLOP count) and denominator: NVIDIA's dense bf16 datasheet peak by GPU name (no
GPU needed to check the table's matching), and the measured matmul everywhere else."""

import pytest
import torch

from memtrain.plan.compute import model_flops
from memtrain.plan.cost import shape_of
from memtrain.training import perf
from memtrain.training.perf import datasheet_peak, matmul_peak_flops, mfu_peak
from tests.memtrain._models import tiny


@pytest.mark.parametrize("name, tflops, label", [
    ("NVIDIA H100 80GB HBM3", 989, "H100 SXM"),
    ("NVIDIA H100 PCIe", 756, "H100 PCIe"),
    ("NVIDIA H200", 989, "H200 SXM"),
    ("NVIDIA A100-SXM4-80GB", 312, "A100"),
    ("NVIDIA A100-PCIE-40GB", 312, "A100"),
    ("NVIDIA A100 80GB PCIe", 312, "A100"),
    ("NVIDIA L4", 121, "L4"),
])
def test_known_gpus_get_their_datasheet_peak(name, tflops, label):
    peak = datasheet_peak(name)
    assert peak.flops == tflops * 1e12 and peak.source == f"{label} dense bf16 datasheet peak ({name})"


@pytest.mark.parametrize("name", ["NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA L40S",
                                  "NVIDIA L40", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090",
                                  "AMD Instinct MI250X"])
def test_other_gpus_are_measured_rather_than_guessed(name):
    assert datasheet_peak(name) is None


def test_a_cpu_peak_is_its_measured_matmul():
    cpu = torch.device("cpu")
    peak = mfu_peak(cpu)
    assert peak.flops == matmul_peak_flops(cpu, torch.float32, 1024) > 0
    assert peak.source == "measured fp32 1024^3 matmul on this CPU"


@pytest.mark.parametrize("seconds, bf16", [({torch.bfloat16: 1.0, torch.float32: 3.0}, True),  # AVX512-BF16, AMX
                                            ({torch.bfloat16: 30.0, torch.float32: 1.0}, False)])  # AVX2 only
def test_the_precision_probe_is_not_swayed_by_a_burst_of_load(monkeypatch, seconds, bf16):
    """A fake clock: every matmul takes its dtype's time, and 12 consecutive calls wherever they fall (another
    process's burst, longer than one dtype's 10 timed calls) take 100 more. The probe still finds the faster dtype.
    Timing all of one dtype's calls before the other's, as it did, a burst over that block decided for the slower
    dtype."""
    for start in range(2 * (10 + 1)):  # every position of the burst among the probe's calls
        clock = _BurstClock(seconds, start, length=12)
        monkeypatch.setattr(perf, "_matmul", clock.matmul)
        monkeypatch.setattr(perf.time, "perf_counter", clock.now)
        assert perf.bf16_faster.__wrapped__(torch.device("cpu"), n=8) is bf16, start


def test_the_precision_probe_times_one_thread_and_gives_the_count_back(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    monkeypatch.setattr(perf, "_matmul", lambda a, b: seen.append(torch.get_num_threads()))
    try:
        perf.bf16_faster.__wrapped__(torch.device("cpu"), n=8)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


class _BurstClock:
    """Time that passes only in matmuls: each takes its dtype's seconds, and 100 more from call `start` on for
    `length` calls."""

    def __init__(self, seconds: dict, start: int, length: int):
        self.seconds, self.burst, self.time, self.calls = seconds, range(start, start + length), 0.0, 0

    def now(self) -> float:
        return self.time

    def matmul(self, a, b):
        self.time += self.seconds[a.dtype] + 100.0 * (self.calls in self.burst)
        self.calls += 1


@pytest.mark.parametrize("family", ["llama", "neox", "gpt2", "opt"])
def test_mfu_numerator_is_the_planners_and_leaves_out_the_lookup_table(family):
    """The trainer's FLOPs per token equal `memtrain plan`'s (so a run's MFU and the plan's compare); a family the
    planner does not model (OPT) counts every parameter as multiplying except an untied input embedding table,
    which only looks rows up (tied, the same table is the LM head and multiplies)."""
    config = tiny(family, "meta").config
    n, seq = 10_000, 16
    got = perf.flops_per_token(config, n, seq)
    if family != "opt":
        assert got == model_flops(shape_of(config), 1, seq) / seq
        return
    attention = 12.0 * config.num_hidden_layers * config.hidden_size * seq
    assert config.tie_word_embeddings and got == 6.0 * n + attention
    config.tie_word_embeddings = False
    assert perf.flops_per_token(config, n, seq) == 6.0 * (n - config.vocab_size * config.hidden_size) + attention
