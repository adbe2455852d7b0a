"""MFU's denominator: NVIDIA's dense bf16 datasheet peak by GPU name (no GPU needed to check the table's matching),
and the measured matmul everywhere else."""

import pytest
import torch

from memtrain.training.perf import datasheet_peak, matmul_peak_flops, mfu_peak


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
