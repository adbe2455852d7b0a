"""The passes study's numbers, text and figure from hand-made result records whose answers are known."""

import json
import math

import pytest

from experiments.report import build_report, passes

PASSES = 8


def _record(model: str, params: float, loss: str, seed: int, first_exact, n: int = 10) -> dict:
    """A finished run of PASSES passes: n canaries seen once per pass (with a twin each, never exact), canary i
    exact from pass `first_exact(i)` on (None: never); pass 0, the base model, has none exact."""
    ids = [f"random-{i:02d}" for i in range(n)]

    def cols(p):
        exact = [first_exact(i) is not None and 1 <= first_exact(i) <= p for i in range(n)]
        return {"id": ids + [i + "-twin" for i in ids], "inserted": [True] * n + [False] * n,
                "exact": exact + [False] * n, "copies": [1] * 2 * n, "kind": ["random"] * 2 * n}

    rows = [{"pass": p, "canaries": cols(p), "val_loss": 5.0,
             "members": {"cells": {"random/1": {"k": sum(cols(p)["exact"][:n]), "n": n}}}} for p in range(PASSES + 1)]
    return {"sweep": "t", "point": f"{model}_{loss}_{seed}", "status": "ok", "model": model, "params": params,
            "loss": loss, "seed": seed, "eval": {"exact_match_rate": 0.0}, "passes": rows}


def _rows(sizes: dict[str, tuple[float, object]], seeds=(1, 2, 3)) -> list[dict]:
    return [_record(m, p, "standard", s, first) for s in seeds for m, (p, first) in sizes.items()]


def test_units_are_one_per_seed_canary_and_pass_with_the_canary_as_cluster():
    rows = _rows({"small": (1e5, lambda i: 8), "large": (4e6, lambda i: 2)}, seeds=(1, 2))
    rows[0]["passes"][3]["canaries"]["copies"][0] = 2  # a canary seen twice in a pass: passes are not exposures
    us, sizes = passes.units(rows, "standard")
    assert sizes == {"small": 1e5, "large": 4e6}
    assert len(us) == 2 * 10 * PASSES  # twins and pass 0 (the base) left out
    assert {u["dose"] for u in us} == set(range(1, PASSES + 1))
    u = next(u for u in us if u["seed"] == 1 and u["canary"] == "random-00" and u["dose"] == 3)
    assert "small" not in u and u["large"] == 1.0  # the twice-seen score is dropped, the other size kept
    assert passes.units(rows, "standard", kind="document") == ([], {})


def test_seeds_not_run_once_at_every_size_are_left_out_and_named():
    """Seed 2 failed at the large size; seed 3 ran the small size twice (another axis, e.g. train.lr_scale): their
    runs cannot be paired across sizes, so the study keeps seed 1 and names 2 and 3."""
    rows = _rows({"small": (1e5, lambda i: 8), "large": (4e6, lambda i: 2)})
    rows = [dict(r, status="failed") if (r["model"], r["seed"]) == ("large", 2) else r for r in rows]
    rows.append(_record("small", 1e5, "standard", 3, lambda i: 4))
    study = passes.numbers(rows)[None]["standard"]
    assert study["seeds"] == 1 and study["seeds_left_out"] == [2, 3]
    assert {u["seed"] for u in passes.units(rows, "standard")[0]} == {1}


def test_identical_canaries_give_the_crossing_exactly_and_a_bounded_band():
    # every canary turns exact at pass 8 (small) or 2 (large): 0 -> 100% between passes 7 and 8, so the crossing
    # of q is at 7 + q (1 + q for large); no canary differs from another, so every interval has zero width
    rows = _rows({"small": (1e5, lambda i: 8), "large": (4e6, lambda i: 2)})
    s = passes.numbers(rows)[None]["standard"]
    assert s["seeds"] == 3 and s["canaries"] == 10 and s["passes"] == PASSES
    trend = s["trend"]
    assert trend["sizes"]["small"]["crossing"].value == pytest.approx(7.5)
    assert trend["sizes"]["large"]["crossing"].value == pytest.approx(1.5)
    assert trend["sizes"]["small"]["interval"] == pytest.approx((7.5, 7.5))
    slope = math.log10(1.5 / 7.5) / math.log10(40)
    assert trend["slope"] == pytest.approx(slope) and trend["slope_interval"] == pytest.approx((slope, slope))

    def one_pass(q):  # where the line through (1e5, 7 + q) and (4e6, 1 + q) reaches 1 pass
        b = math.log10((1 + q) / (7 + q)) / math.log10(40)
        return 1e5 * 10 ** (-math.log10(7 + q) / b)

    lo, hi = s["band"]["band"]
    assert lo == pytest.approx(min(one_pass(q) for q in (0.2, 0.5, 0.7)), rel=1e-6)
    assert hi == pytest.approx(max(one_pass(q) for q in (0.2, 0.5, 0.7)), rel=1e-6)


def test_canaries_that_differ_give_an_interval_around_the_crossing():
    # canary i exact from pass i // 2 + 1 (pass 1: 2 of 10 ... pass 4: 8 of 10): the rate is 0.4 after pass 2
    # and 0.6 after pass 3, so 50% at 2.5; drawing canaries moves it
    rows = _rows({"small": (1e5, lambda i: i // 2 + 1), "large": (4e6, lambda i: 1)})
    trend = passes.numbers(rows)[None]["standard"]["trend"]
    small = trend["sizes"]["small"]
    assert small["crossing"].value == pytest.approx(2.5)
    lo, hi = small["interval"]
    assert 1 <= lo < 2.5 < hi <= 4
    assert trend["sizes"]["large"]["crossing"].label() == "<= 1"  # all exact after pass 1: left-censored


def test_a_size_that_never_reaches_half_is_a_lower_bound_with_no_number_beyond_it(tmp_path):
    # "flat": 2 of 10 canaries exact from pass 1 on, the rest never: 20% at every pass, never 50%
    rows = _rows({"flat": (1e5, lambda i: 1 if i < 2 else None), "large": (4e6, lambda i: 2)})
    s = passes.numbers(rows)[None]["standard"]
    flat = s["trend"]["sizes"]["flat"]
    assert flat["crossing"].label() == f"> {PASSES}" and flat["interval"] == (math.inf, math.inf)
    # no slope, but a bound: the small size's crossing lies above PASSES, so the slope is at most that of
    # (PASSES, 1.5) over 40x the parameters (steeper were the crossing later); only the upper end is bounded
    at_most = math.log10(1.5 / PASSES) / math.log10(40)
    assert s["trend"]["slope"] is None and s["trend"]["slope_bound"] == ("upper", pytest.approx(at_most))
    lo, hi = s["trend"]["slope_interval"]
    assert lo == -math.inf and at_most <= hi < 0
    assert s["band"]["band"] is None

    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = build_report(tmp_path)
    text = made["report"].read_text()
    section = text[text.index("## Memorization vs passes"):text.index("## Runs")]
    assert f"| flat | 100k | > {PASSES} | [> {PASSES}, unbounded] |" in section
    assert "| large | 4M | 1.5 | [1.5, 1.5] |" in section
    assert (f"slope at most {at_most:.2f} (censored sizes set at their bounds), 95% interval [unbounded, {hi:.2f}]"
            in section)
    assert "no number is given" in section and "parameters (over the thresholds" not in section
    assert "pass 8" in section and "(6/30)" in section  # the Wilson per-pass table is kept beside it
    for suffix in (".png", ".pdf", ".svg", ".csv"):
        assert (tmp_path / "figures" / f"passes_to_threshold{suffix}").is_file()
    assert tmp_path / "figures" / "passes_to_threshold.png" in made["figures"]
    csv = (tmp_path / "figures" / "passes_to_threshold.csv").read_text().splitlines()
    assert csv[0].startswith("loss,model,params,passes_to_50,censored,bound,lo,hi")
    assert csv[1].startswith(f"standard,flat,100000.0,,above,{PASSES},inf,inf")
    assert csv[0].endswith(",slope_bound_side,slope_bound")
    side, value = csv[1].split(",")[-2:]
    assert side == "upper" and float(value) == pytest.approx(at_most)


def test_a_bounded_band_is_printed_as_a_labelled_extrapolation(tmp_path):
    rows = _rows({"small": (1e5, lambda i: 8), "large": (4e6, lambda i: 2)})
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = build_report(tmp_path)["report"].read_text()
    assert "A multi-exposure EXTRAPOLATION" in text and "ONE pass would reach 20-70% exact match lies in [" in text
    assert "| small | 100k | 7.5 | [7.5, 7.5] |" in text


def test_no_figure_or_study_without_a_second_pass():
    rows = _rows({"small": (1e5, lambda i: 1)})
    for r in rows:
        r["passes"] = r["passes"][:2]
    assert not passes.applies(rows) and passes.numbers(rows) == {}
    assert passes.fig_threshold({}, None) is None
