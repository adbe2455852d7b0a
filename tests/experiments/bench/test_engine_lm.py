"""experiments.bench.engine_lm in-process on 4 forked ranks and a 1-layer ladder model at a 512-token vocabulary.

One run with timing (1 round): every 4-rank grid in both modes next to DDP and FSDP2, parity within the tolerance,
ratios positive and finite, the same rows in the JSON. One run with the plain model's weights perturbed: the parity
check must stop it before timing and fail it, so a green run means the check really compared something.
"""

import contextlib
import io
import json
import math

import pytest
import torch

from experiments.bench import engine_lm
from memtrain.plan.search import factorizations
from tests._helpers import once_per_session

TINY = ["--worlds", "4", "--set", "num_hidden_layers=1", "--set", "vocab_size=512"]


def _run(argv) -> tuple[list[dict] | str, str]:
    """main()'s rows (or its exit message) and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rows = engine_lm.main(argv)
        except SystemExit as e:
            rows = str(e.code)
    return rows, out.getvalue()


@pytest.fixture(scope="module")
def run(request, tmp_path_factory):
    def compute():
        path = tmp_path_factory.mktemp("engine_lm") / "out.json"
        rows, printed = _run(TINY + ["--rounds", "1", "--warmup", "0", "--json", str(path)])
        return rows, printed, json.loads(path.read_text())

    return once_per_session(request, compute)


def test_every_grid_in_both_modes_next_to_the_peers(run):
    rows, printed, _ = run
    assert isinstance(rows, list), rows
    expected = {(engine_lm.grid_name(d), m) for d in factorizations(4) for m in engine_lm.MODES}
    assert len(expected) == 20
    assert {(r["grid"], r["mode"]) for r in rows} == expected | {("ddp", "torch"), ("fsdp2", "torch")}
    assert all(r["world"] == 4 for r in rows)
    assert "world 4: fastest grid d" in printed


def test_parity_within_tolerance(run):
    rows, _, _ = run
    ddp = next(r for r in rows if r["grid"] == "ddp")
    assert ddp["losses"][0] == pytest.approx(math.log(512), rel=0.05)  # a fresh model: near-uniform predictions
    assert ddp["losses"][1] < ddp["losses"][0]  # one AdamW step on the batch lowers its loss
    for r in rows:
        assert len(r["rel_diffs"]) == 4 and max(r["rel_diffs"]) <= engine_lm.LOSS_TOL, r["variant"]
        assert r["losses"] == pytest.approx(ddp["losses"], rel=engine_lm.LOSS_TOL)
        assert r["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=engine_lm.LOSS_TOL)


def test_times_and_ratios(run):
    rows, _, _ = run
    for r in rows:
        assert len(r["times_s"]) == 1 and r["median_s"] > 0
        for key in ("ratio_ddp", "paired_ddp", "ratio_fsdp2", "paired_fsdp2"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["variant"], key)
    assert next(r for r in rows if r["grid"] == "ddp")["paired_ddp"] == 1.0


def test_memory_per_rank_follows_the_sharding(run):
    rows, _, _ = run
    total = {r["variant"]: r["param_bytes"] + r["opt_bytes"] for r in rows}
    # DDP and a pure data-parallel grid replicate everything; FSDP2 and z=4 hold about a quarter each.
    assert total["d4x1y1z1 easy"] == pytest.approx(total["ddp"], rel=0.01)
    assert total["d1x1y1z4 easy"] == pytest.approx(total["fsdp2"], rel=0.05)
    assert total["fsdp2"] < total["ddp"] / 3


def test_json_holds_the_rows(run):
    rows, _, doc = run
    assert doc["loss_tol"] == engine_lm.LOSS_TOL and doc["args"]["worlds"] == [4]
    assert [r["variant"] for r in doc["rows"]] == [r["variant"] for r in rows]
    assert [r["paired_fsdp2"] for r in doc["rows"]] == [r["paired_fsdp2"] for r in rows]
    assert "machine" in doc


def test_parity_check_fails_on_perturbed_weights(monkeypatch, tmp_path):
    plain = engine_lm.plain_model

    def perturbed(args, init):  # the DDP and FSDP2 side starts from other weights than every grid
        model = plain(args, init)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(1.01)
        return model

    monkeypatch.setattr(engine_lm, "plain_model", perturbed)  # the forked ranks inherit it
    path = tmp_path / "out.json"
    message, printed = _run(TINY + ["--json", str(path)])
    assert isinstance(message, str) and message.startswith("PARITY FAILED"), message
    doc = json.loads(path.read_text())
    failed = {r["variant"] for r in doc["rows"] if max(r["rel_diffs"]) > engine_lm.LOSS_TOL}
    assert failed == {r["variant"] for r in doc["rows"]} - {"ddp", "fsdp2"}  # FSDP2 shares DDP's perturbation
    assert all("times_s" not in r for r in doc["rows"])  # stopped before timing
    assert "fastest grid" not in printed
