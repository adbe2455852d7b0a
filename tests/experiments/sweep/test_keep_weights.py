"""[sweep] keep_final_weights: what a spec and --set accept, the size rule of "auto", and what a sweep with
keep_checkpoints = false leaves of its runs (the real trainer's runs: test_sweep_export.py)."""

from __future__ import annotations

import pytest

from experiments.sweep import cli
from experiments.sweep import spec as specs
from memtrain.config import tomllib  # tomllib, or tomli on Python 3.10
from tests.experiments.sweep._helpers import IDS, SPEC


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_the_spec_and_set_take_true_false_or_auto(value):
    raw = tomllib.loads(SPEC)
    assert specs.parse_spec(raw, "mini.toml").keep_final_weights == "auto"  # the default
    raw["sweep"]["keep_final_weights"] = value
    assert specs.parse_spec(raw, "mini.toml").keep_final_weights == value
    text = {True: "true", False: "false", "auto": "auto"}[value]
    spec, _ = specs.points_of(specs.parse_spec(tomllib.loads(SPEC)), [f"sweep.keep_final_weights={text}"])
    assert spec.keep_final_weights == value


@pytest.mark.parametrize("value", ["yes", "false", 1, 0])
def test_anything_else_is_refused_with_the_values_it_takes(value):
    raw = tomllib.loads(SPEC)
    raw["sweep"]["keep_final_weights"] = value
    with pytest.raises(ValueError, match=r"keep_final_weights = .* is invalid: use true, false \(unquoted\) or "):
        specs.parse_spec(raw, "mini.toml")
    with pytest.raises(ValueError, match=r"sweep.keep_final_weights = .* is invalid"):
        specs.points_of(specs.parse_spec(tomllib.loads(SPEC)), [f"sweep.keep_final_weights={value!r}"])


def test_auto_keeps_the_weights_of_models_up_to_100m_parameters():
    spec = specs.parse_spec(tomllib.loads(SPEC), "mini.toml")
    assert specs.FINAL_WEIGHTS_MAX_PARAMS == 100_000_000
    assert [spec.keeps_final_weights(n) for n in (160_000, 100_000_000, 100_000_001, 8_000_000_000, None)] == [
        True, True, False, False, True]
    spec.keep_final_weights = True
    assert spec.keeps_final_weights(405_000_000_000)
    spec.keep_final_weights = False
    assert not spec.keeps_final_weights(160_000)


@pytest.mark.parametrize("keep", ["false", "auto"])
def test_a_sweep_without_checkpoints_deletes_them_or_keeps_the_final_weights(env, keep):
    out = env["tmp"] / "runs"
    assert cli.main([str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--set",
                     "sweep.keep_checkpoints=false", "--set", f"sweep.keep_final_weights={keep}"]) == 0
    for pid in IDS:  # the fake trainer's checkpoint has no state.json: "auto" finds nothing to trim and leaves it
        assert (out / pid / "checkpoints").exists() == (keep == "auto")
