"""experiments.bench.engine in-process on 4 forked ranks and a small MLP (2 blocks, hidden 32).

One run with timing (2 rounds): every variant next to its peer, parity within the tolerance, the ledger's bytes as
the grids imply, Z all-gathers halved under bf16, memory per rank following the sharding. One run with the torch
peers' weights perturbed: the parity check must fail it, so a green run means the check compared something.
"""

import contextlib
import io
import json

import pytest
import torch

from experiments.bench import engine, mlp_variants

TINY = ["--hidden", "32", "--layers", "2", "--batch", "16", "--steps", "2", "--warmup", "1"]


def _run(argv) -> tuple[str | None, str]:
    """main()'s exit message (None when it passed) and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            engine.main(argv)
            code = None
        except SystemExit as e:
            code = str(e.code)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "out.json"
    code, printed = _run(TINY + ["--json", str(path)])
    return code, printed, json.loads(path.read_text())["variants"]


def test_every_variant_matches_its_peer(run):
    code, printed, figures = run
    assert code is None, printed
    assert set(figures) == set(engine.ALL_VARIANTS)
    for name, row in figures.items():
        assert len(row["times_ms"]) == 2 and row["median_ms"] > 0
        if name != "ddp":
            assert row["peer"] == engine.PEER[name]
            assert max(row["loss_rel_diff"]) <= engine.LOSS_TOL, name
            assert row["paired_ratio"] > 0
    ddp = figures["ddp"]["losses"]
    assert ddp[1] < ddp[0]  # one AdamW step on the batch lowers its loss


def test_ledger_and_memory_follow_the_grids(run):
    _, _, figures = run
    init = mlp_variants.full_params(32, 2)
    matrices = sum(4 * w.numel() for w, _ in init.values())  # fp32 bytes
    biases = sum(4 * b.numel() for _, b in init.values())
    assert figures["ddp"]["param_bytes"] == matrices + biases
    ddp = figures["ddp"]["ledger"]["all_reduce data (model)"]
    assert figures["mt-data"]["ledger"]["all_reduce data"][:2] == ddp[:2]  # one all-reduce of every gradient
    # z=4: every weight gathered in forward and again in backward, its gradient reduce-scattered, the replicated
    # biases' gradients all-reduced; each rank holds a quarter of the matrices and every bias.
    z = figures["mt-z"]["ledger"]
    assert (z["all_gather z"][0], z["reduce_scatter z"][0], z["all_reduce z"][0]) == (2 * matrices, matrices, biases)
    assert figures["mt-z"]["param_bytes"] == matrices // 4 + biases
    for name in ("mt-z", "mt-z+ov", "mt-x2z2-easy"):
        assert figures[name]["z_gather_bytes"]["ratio"] == 0.5, name


def test_parity_check_fails_on_perturbed_weights(monkeypatch):
    build = mlp_variants.torch_mlp

    def perturbed(hidden, layers, init):
        model = build(hidden, layers, init)
        with torch.no_grad():
            model[0].fc1.weight.add_(0.05)
        return model

    monkeypatch.setattr(mlp_variants, "torch_mlp", perturbed)  # the forked ranks inherit it
    code, printed = _run(TINY)
    assert code == "1" and "LOSS MISMATCH" in printed, printed
