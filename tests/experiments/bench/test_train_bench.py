"""experiments.bench.train in-process: ladder-1m over a corpus of short documents, 1 warm-up + 2 timed steps per
side, in fp32 and in bf16 (autocast on both sides), on the CPU (where torch sees no GPU: the trainer would take
it) or on CUDA (only where there is one: not run yet). Checked: the paired ratio is finite and positive, the step-1
and step-2 losses of the two sides agree within the benchmark's own LOSS_TOL (fp32 1e-4, bf16 1e-3), MFU is
positive (on the CPU against its measured matmul), and the peak-memory fields are there: None on the CPU, on CUDA
each side's step part positive and within its peak.
The documents are shorter than a row, so rows pack several and their position_ids restart inside them: the losses
agree only if the plain loop attends within documents as memtrain does.
A run with --profile trains the same steps as one without: step 2's losses are equal (the profiled step, after the
timed ones, is in every run, so the LR schedule spanning the run is the same).
`--device cuda` where torch sees no GPU (hidden by CUDA_VISIBLE_DEVICES on a machine that has one) ends in one
line naming the fix, exit status 1.
"""

import contextlib
import io
import math
import re
import subprocess
import sys

import pytest
import torch

from experiments.bench import train as bench
from memtrain.data import build_stream
from tests.memtrain._helpers import ENV, ROOT, stdlib_corpus


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    corpus = stdlib_corpus(tmp_path_factory.mktemp("corpus"), every=4, count=40, chars=400)
    return ["--models", "ladder-1m", "--steps", "2", "--warmup", "1", "--batch", "2", "--seq", "128",
            "--max-docs", "40", "--corpus", str(corpus), "--cache-dir", str(tmp_path_factory.mktemp("cache"))]


ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="memtrain's trainer takes a visible GPU")
ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@pytest.mark.parametrize("device, precision", [
    pytest.param("cpu", "fp32", marks=ON_CPU), pytest.param("cpu", "bf16", marks=ON_CPU),
    pytest.param("cuda", "fp32", marks=ON_GPU), pytest.param("cuda", "bf16", marks=ON_GPU)])
def test_memtrain_against_the_plain_loop(data, device, precision, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        (r,) = bench.main([*data, "--device", device, "--precision", precision, "--profile", str(tmp_path)])
    assert "ladder-1m" in out.getvalue()
    for side in ("memtrain", "plain"):  # one more step each, profiled after the timed ones
        head = (tmp_path / f"ladder-1m_{side}.txt").read_text().splitlines()
        assert re.fullmatch(r"(device|CPU) self time [\d.]+ ms over \d+ .+", head[0]) and "aten::mm" in "".join(head)
    assert len(r["memtrain_steps_tok_s"]) == len(r["plain_steps_tok_s"]) == 3  # the profiled pair is not timed
    assert (r["device"], r["precision"]) == (device, precision)
    assert math.isfinite(r["paired_ratio"]) and r["paired_ratio"] > 0
    assert r["loss1_rel"] <= bench.LOSS_TOL[precision] and r["loss2_rel"] <= bench.LOSS_TOL[precision]
    assert r["memtrain_mfu"] > 0 and r["plain_mfu"] > 0
    for side in ("memtrain", "plain"):
        if device == "cpu":
            assert r[f"{side}_peak_mb"] is None and r[f"{side}_step_mb"] is None
        else:
            assert 0 < r[f"{side}_step_mb"] <= r[f"{side}_peak_mb"]
    if device == "cpu":
        assert r["peak_source"] == f"measured {precision} 1024^3 matmul on this CPU"

    cfg = bench.make_config("ladder-1m", bench.parse_args(data), 3)
    stream = build_stream(cfg.data, cfg.canaries, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    pos = stream.batch(0, 2)["position_ids"]
    assert (pos[:, 1:] <= pos[:, :-1]).any(dim=1).all()  # every row of step 1 holds a document boundary


@ON_CPU
def test_profiling_leaves_the_timed_steps_as_they_are(data, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        (profiled,) = bench.main([*data, "--profile", str(tmp_path)])
        (plain,) = bench.main(data)
    assert profiled["loss2"] == plain["loss2"]


def test_cuda_without_a_gpu_is_one_line_naming_the_fix():
    r = subprocess.run([sys.executable, "-m", "experiments.bench.train", "--device", "cuda"], capture_output=True,
                       text=True, cwd=ROOT, env=dict(ENV, CUDA_VISIBLE_DEVICES=""), timeout=300)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "no CUDA GPU" in r.stderr and "use --device cpu" in r.stderr, r.stderr
