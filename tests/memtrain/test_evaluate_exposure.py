"""eval.json reports the exposure sample with what it can resolve: its counts show at most log2(n + 1) bits (the
fitted estimate extrapolates past them), and no exposure exceeds log2 |R|."""

import json
import math

import pytest

from memtrain.run_files import EVAL


def test_eval_json_gives_the_exposure_sample_its_resolution(tiny_run):
    got = json.loads((tiny_run.out / EVAL).read_text())
    n = got["exposure_samples"]
    assert n == 64  # tests/memtrain/_helpers.py TINY
    assert got["exposure_resolution_bits"] == pytest.approx(math.log2(n + 1))
    assert got["exposure_ceiling_bits"] == pytest.approx(8 * math.log2(10))  # 2 groups of 4 digits
