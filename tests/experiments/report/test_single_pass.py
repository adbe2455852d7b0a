"""The single-pass study's numbers from hand-made result records whose answers are known."""

import math

import pytest

from experiments.report import build_report, single_pass
from experiments.report.single_pass import dose_response, one_exposure, units

COPIES = (1, 2, 4, 8, 16, 32)


def _record(model: str, params: float, loss: str, seed: int, rate_at, drop: float) -> dict:
    """A finished one-pass run: 4 canaries per copies level, round(4 rate_at(copies)) of them exact; a member's
    suffix loss falls by `drop` + 0.1 over the pass, its twin's by 0.1 (so the twin-controlled drop is `drop`);
    held-out loss 5.0 before the pass and 5.0 + 0.1 * seed after it."""
    ids, canaries = [], []
    for c in COPIES:
        for i in range(4):
            cid = f"c{c}-{i}"
            ids.append((cid, c))
            canaries.append({"id": cid, "kind": "random", "copies": c, "inserted": True,
                             "exact_match": i < round(4 * rate_at(c))})
    cols = lambda after: {  # noqa: E731
        "id": [i for i, _ in ids] + [i + "-twin" for i, _ in ids],
        "inserted": [True] * len(ids) + [False] * len(ids), "exact": [False] * 2 * len(ids),
        "copies": [c for _, c in ids] * 2,
        "suffix_loss": [5.0 - (drop + 0.1 if after else 0)] * len(ids) + [5.0 - (0.1 if after else 0)] * len(ids),
        "suffix_loss_dropped": [None] * 2 * len(ids), "suffix_loss_kept": [None] * 2 * len(ids)}
    return {"sweep": "t", "point": f"{model}_{loss}_{seed}", "status": "ok", "model": model, "params": params,
            "loss": loss, "seed": seed, "eval": {"exact_match_rate": 0.0}, "canaries": canaries,
            "passes": [{"pass": 0, "canaries": cols(False), "val_loss": 5.0},
                       {"pass": 1, "canaries": cols(True), "val_loss": 5.0 + 0.1 * seed}]}


@pytest.fixture(scope="module")
def rows():
    out = []
    for seed in (1, 2, 3):
        out.append(_record("small", 1e5, "standard", seed, lambda c: min(1.0, c / 128), 0.2))
        out.append(_record("large", 4e6, "standard", seed, lambda c: min(1.0, c / 8), 0.6))
        out.append(_record("small", 1e5, "goldfish k=4", seed, lambda c: 0.0, 0.05))
        out.append(_record("large", 4e6, "goldfish k=4", seed, lambda c: 0.0, 0.05))
    return out


def test_units_pair_each_canary_across_sizes_with_its_twin_controlled_drop(rows):
    us, sizes = units(rows, "standard")
    assert sizes == {"small": 1e5, "large": 4e6} and len(us) == 3 * 24
    assert all(u["small/drop"] == pytest.approx(0.2) and u["large/drop"] == pytest.approx(0.6) for u in us)
    assert single_pass.applies(rows)


def test_one_exposure_reports_the_drop_and_exact_match_of_the_canaries_seen_once(rows):
    got = {(r["loss"], r["model"]): r for r in one_exposure(rows)}
    large = got[("standard", "large")]
    assert large["n"] == 12 and large["seeds"] == 3
    mean, lo, hi = large["drop"]
    assert mean == pytest.approx(0.6) and lo == pytest.approx(0.6) and hi == pytest.approx(0.6)  # no variance
    assert got[("goldfish k=4", "small")]["k"] == 0


def test_dose_response_finds_fewer_copies_for_the_larger_model_and_censors_goldfish(rows):
    d = dose_response(rows)
    trend = d["standard"]["trend"]
    small, large = trend["sizes"]["small"]["crossing"], trend["sizes"]["large"]["crossing"]
    assert large.value is not None and large.value < 8 and small.value is None and small.above == 32
    assert trend["sizes"]["small"]["interval"][1] == math.inf  # censored: no upper bound
    assert d["standard"]["band"]["band"] is None  # a censored size: no extrapolated number
    gold = d["goldfish k=4"]["trend"]["sizes"]
    assert all(s["crossing"].above == 32 for s in gold.values())


def test_utility_is_the_held_out_loss_change_over_the_pass_with_an_interval_over_seeds(rows):
    got = {(u["loss"], u["model"]): u for u in single_pass.utility(rows)}
    u = got[("standard", "large")]
    assert u["runs"] == 3 and u["base"] == pytest.approx(5.0) and u["after"] == pytest.approx(5.2)
    mean, lo, hi = u["delta"]
    assert mean == pytest.approx(0.2) and 0.1 - 1e-9 <= lo < 0.2 < hi <= 0.3 + 1e-9 and u["worst"] == pytest.approx(0.3)


def test_roc_auc_and_tpr_at_one_percent_fpr_known_answers():
    got = single_pass._roc([3.0, 2.0, 1.0, 0.5], [0.0, 1.0, 1.5, 0.2])
    assert got["auc"] == pytest.approx((4 + 4 + 2.5 + 2) / 16)  # 1.0 ties with one twin: half a pair
    assert got["tpr_at_1pct_fpr"] == 0.5 and got["fpr_max"] == 0  # above every twin: 3.0 and 2.0
    many = single_pass._roc([5.0, 0.988], [i / 200 for i in range(200)])  # 2 false positives allowed of 200
    assert many["fpr_max"] == 0.01 and many["tpr_at_1pct_fpr"] == 1.0  # 0.988 beats all but 0.99 and 0.995


def test_membership_at_one_exposure_pairs_members_seen_once_with_every_twin(rows):
    got = {(m["loss"], m["model"]): m for m in single_pass.mia_one_exposure(rows)}
    m = got[("standard", "large")]["attack_calibrated"]
    assert m["n_members"] == 3 * 4 and m["n_twins"] == 3 * 24  # 4 canaries seen once per seed; every twin
    assert m["auc"] == 1.0 and m["tpr_at_1pct_fpr"] == 1.0  # a member's drop 0.7 vs a twin's 0.1
    assert m["auc_interval"] == (1.0, 1.0)  # every seed separates them fully


def test_membership_auc_has_an_interval_over_seeds():
    """Seed 3's members are indistinguishable from its twins (no drop beyond theirs): the pooled AUC falls below 1,
    and the seed-level bootstrap spreads around it, reaching 1 where seed 3 is not drawn."""
    rows = [_record(m, p, "standard", seed, lambda c: 0.0, 0.0 if seed == 3 else 0.6)
            for seed in (1, 2, 3) for m, p in (("small", 1e5), ("large", 4e6))]
    m = {r["model"]: r for r in single_pass.mia_one_exposure(rows)}["large"]["attack_calibrated"]
    lo, hi = m["auc_interval"]
    assert lo < m["auc"] < 1.0 and hi == 1.0


def test_training_order_pools_the_runs_spearman_weighted_by_members():
    rows = [{"status": "ok", "model": "m", "params": 1e5, "loss": "standard", "seed": seed,
             "eval": {"order_effect": {"mean": rho, "n": n}}} for seed, rho, n in ((1, 0.6, 10), (2, 0.0, 30))]
    rows.append(dict(rows[0], seed=3, eval={"order_effect": {"mean": None, "n": 0}}))  # no level had 4 members
    (got,) = single_pass.training_order(rows)
    assert got["runs"] == 2 and got["n"] == 40 and got["rho"] == pytest.approx(0.15)
    assert (got["lo"], got["hi"]) == (0.0, 0.6)


def test_the_report_leads_with_the_single_pass_section_and_writes_csv_pdf_svg(rows, tmp_path):
    import json

    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = build_report(tmp_path)
    text = made["report"].read_text()
    assert text.index("## One pass") < text.index("## Runs")
    assert "> 32" in text and "unbounded by these data" in text
    assert "| > 32 | [> 32, unbounded] |" in text  # Goldfish: every replicate stays below 50% at 32 copies
    assert "**One exposure.**" in text and "Held-out loss of the base models" in text
    assert "### Membership inference at one exposure" in text
    for name in ("one_exposure", "dose_response"):
        for suffix in (".png", ".pdf", ".svg", ".csv"):
            assert (tmp_path / "figures" / f"{name}{suffix}").is_file()
    assert not (tmp_path / "figures" / "exact_match_vs_passes.png").exists()  # one pass: no curve over passes


def test_a_failed_run_leaves_its_seed_out_of_the_studies_and_the_report_is_made(rows, tmp_path):
    """Seed 2's large run failed: its seed has no data at that size, and a bootstrap sample drawing only it would
    have none there. The studies keep the seeds run at every size, say which they left out, and the report is
    written."""
    import json

    broken = [dict(r, status="failed", eval=None) if (r["model"], r["loss"], r["seed"]) == ("large", "standard", 2)
              else r for r in rows]
    us, _ = units(broken, "standard")
    assert {u["seed"] for u in us} == {1, 3}
    assert {(r["loss"], r["model"]): r["seeds"] for r in one_exposure(broken)}[("standard", "large")] == 2
    d = dose_response(broken)
    assert d["standard"]["seeds_left_out"] == [2] and d["goldfish k=4"]["seeds_left_out"] == []
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in broken))
    text = build_report(tmp_path)["report"].read_text()
    assert "Seeds left out: 2 (a run at some size failed" in text


def test_goldfish_canaries_given_back_are_listed_with_the_suffix_targets_their_mask_dropped():
    from experiments.report.single_pass_view import numbers, summary

    rows = [_record("small", 1e5, "standard", 1, lambda c: min(1.0, c / 8), 0.2),
            _record("small", 1e5, "goldfish k=4", 1, lambda c: 0.25 if c == 32 else 0.0, 0.05),  # c32-0 given back
            _record("small", 1e5, "goldfish k=4", 2, lambda c: 0.25 if c == 32 else 0.0, 0.05)]  # (no columns)
    last = rows[1]["passes"][-1]["canaries"]
    last["suffix_tokens"] = [16] * len(last["id"])
    last["suffix_dropped"] = [1 if cid == "c32-0" else 4 for cid in last["id"]]
    got = single_pass.goldfish_given_back(rows)
    assert [(g["seed"], g["id"], g["copies"], g["dropped"], g["suffix"]) for g in got] == \
        [(1, "c32-0", 32, 1, 16), (2, "c32-0", 32, None, None)]
    text = " ".join(summary(numbers(rows)))
    assert "c32-0 (goldfish k=4, small, seed 1, 32 copies: 1 of its 16 suffix targets dropped)" in text
    assert "seed 2, 32 copies: its dropped targets not recorded" in text
