"""Every number of the run configuration is finite and within a bound (memtrain/bounds.py) before any work: a key
added later gets the same check, since it runs over every field whose annotation says int or float."""

import dataclasses

import pytest

from memtrain import bounds
from memtrain.config import RunConfig, _section_classes, apply_overrides, check_overrides, from_dict, load


def _numeric_keys() -> list[tuple[str, str, str]]:
    """(section, key, annotation) of every int, float or list[int] field of the config."""
    return [(section, f.name, str(f.type)) for section, cls in _section_classes().items()
            for f in dataclasses.fields(cls) if any(t in str(f.type) for t in ("int", "float"))]


def test_the_config_has_numbers_to_bound():
    keys = {f"{s}.{k}" for s, k, _ in _numeric_keys()}
    assert {"train.lr", "data.seq_len", "canaries.copies", "parallel.timeout_s", "train.seed"} <= keys
    assert set(bounds.LIMITS) <= keys, set(bounds.LIMITS) - keys  # no bound left of a key since renamed


@pytest.mark.parametrize("section, key, annotation", _numeric_keys(), ids=[f"{s}.{k}" for s, k, _ in _numeric_keys()])
def test_every_number_is_bounded_and_finite(section, key, annotation):
    huge = 10**40
    value = [huge] if annotation.startswith("list") else huge
    with pytest.raises(ValueError, match=rf"^{section}\.{key}=.* is too large: use at most "):
        from_dict({section: {key: value}})
    if "float" in annotation:
        for text in ("inf", "-inf", "nan"):
            with pytest.raises(ValueError, match=rf"^{section}\.{key}=.*(not a finite number|is invalid)"):
                load(overrides=[f"{section}.{key}={text}"])


def test_each_bound_itself_is_accepted():
    assert from_dict({"parallel": {"timeout_s": bounds.limit("parallel.timeout_s")}}).parallel.timeout_s == 604800
    assert from_dict({"train": {"seed": bounds.SEED}}).train.seed == 2**32 - 1
    assert from_dict({"data": {"seq_len": bounds.POSITIONS}, "canaries": {"number": 0}}).data.seq_len == 2**20


def test_seeds_are_not_negative():
    for key in ("train.seed", "canaries.seed"):
        with pytest.raises(ValueError, match=rf"^{key}=-1 is invalid: use a value >= 0"):
            load(overrides=[f"{key}=-1"])


@pytest.mark.parametrize("canaries, seq_len, expect", [
    ({"number": 10_000, "copies": [100]}, 64, "is 2,000,000 copies: use at most 1,000,000"),  # 2 kinds
    ({"number": 1_000, "copies": [300]}, 4096, "rows of 2,457,600,000 tokens at data.seq_len=4096"),
])
def test_canary_copies_and_their_rows_are_bounded(canaries, seq_len, expect):
    with pytest.raises(ValueError, match=expect):
        from_dict({"canaries": canaries, "data": {"seq_len": seq_len}})
    within = {"number": 10_000, "copies": [1, 99], "kinds": ["random"]}  # 5,000 x (1 + 99) = 500,000 copies
    assert from_dict({"canaries": within}).canaries.number == 10_000


def test_a_key_set_twice_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^--set train.seed is given twice"):
        apply_overrides({}, ["train.seed=1", "train.lr=0.1", "train.seed=2"])
    assert apply_overrides({}, ["train.seed=1", "canaries.seed=1"]) == {"train": {"seed": 1}, "canaries": {"seed": 1}}


@pytest.mark.parametrize("items, expect", [
    (["train.lrr=1"], "unknown config key train.lrr"),
    (["train.lr=fast"], "train.lr='fast' is invalid"),
    (["train.lr=inf"], "train.lr=inf is not a finite number"),
    (["train.batch_size=0"], "train.batch_size=0 is invalid"),
    (["data.seq_len=1"], "data.seq_len=1 is invalid"),
])
def test_overrides_are_checked_on_their_own(items, expect):
    with pytest.raises(ValueError, match=expect):
        check_overrides(items)
    check_overrides(["train.min_lr=0.5", "data.seq_len=4096"])  # across keys (min_lr > lr) waits for the config


def test_defaults_pass_their_own_bounds():
    assert from_dict({}) == RunConfig()


def test_a_goldfish_context_as_long_as_the_sequence_is_refused():
    """The hashed mask drops a target only after h tokens of its document: at h >= seq_len it would drop nothing and
    the run, recorded as Goldfish, would train the standard loss."""
    with pytest.raises(ValueError, match=r"^loss.h=64 leaves no target of a data.seq_len=64 sequence"):
        from_dict({"loss": {"kind": "goldfish", "h": 64}, "data": {"seq_len": 64}})
    assert from_dict({"loss": {"kind": "goldfish", "h": 63}, "data": {"seq_len": 64}}).loss.h == 63
    assert from_dict({"loss": {"kind": "goldfish", "h": 64, "mask": "static"}, "data": {"seq_len": 64}})  # no context
