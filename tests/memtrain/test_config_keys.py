"""The config keys on the command line: `memtrain train --help` lists every key with its type, default and doc, and
a `--set` value is parsed to its key's type as the command line is parsed (memtrain.config.override_type), so a
bad one ends with argparse's one line before any file is read; `override_type(sections)` limits the keys."""

import argparse
import dataclasses

import pytest

from memtrain import cli as cli_mod
from memtrain.commandline import ArgumentParser
from memtrain.config import _section_classes, load, override_type
from memtrain.config_keys import default_of, expected, field_docs, toml_value
from tests.memtrain._helpers import cli, refused


def _help_entries(text: str) -> dict[str, tuple[str, str]]:
    """'section.key' -> (its `section.key: type = default` line, its doc joined from the lines below it)."""
    entries, key = {}, None
    for line in text.split("config keys", 1)[1].splitlines():
        if line.startswith("  ") and not line.startswith("      ") and ": " in line:
            key = line.split(":", 1)[0].strip()
            entries[key] = (line, "")
        elif line.startswith("      ") and key:
            head, doc = entries[key]
            entries[key] = (head, f"{doc} {line.strip()}".strip())
        elif not line.strip():
            key = None
    return entries


def test_train_help_lists_every_key_with_its_type_default_and_doc():
    r = cli("train", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: memtrain train "), r.stderr[-2000:]
    entries = _help_entries(r.stdout)
    assert entries["train.lr"] == ("  train.lr: float = 0.001", "Peak learning rate of AdamW (of a model of hidden "
                                   "size lr_width, when that is set).")
    assert entries["train.max_steps"][0] == "  train.max_steps: int | None = none"
    assert entries["canaries.kinds"][0] == '  canaries.kinds: list[str] = ["random", "document"]'
    expected_keys = {f"{s}.{f.name}" for s, cls in _section_classes().items() for f in dataclasses.fields(cls)}
    assert set(entries) == expected_keys
    for section, cls in _section_classes().items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = default_of(f)
            shown = "none" if default is None else toml_value(default)
            assert entries[f"{section}.{f.name}"] == (f"  {section}.{f.name}: {f.type} = {shown}", docs[f.name])
    assert max(len(line) for line in r.stdout.split("config keys", 1)[1].splitlines()) <= 100
    assert "exit codes: 0 done" in r.stdout  # the epilog kept the exit codes every command shows


@pytest.mark.parametrize("item, expect", [
    ("train.lr=abc", "train.lr='abc' is invalid: expected a number, e.g. train.lr=0.001"),
    ("train.batch_size=1.5", "train.batch_size=1.5 is invalid: expected an integer, e.g. train.batch_size=16"),
    ("eval.pythia=maybe", "eval.pythia='maybe' is invalid: expected true or false, e.g. eval.pythia=true"),
    ("train.max_steps=soon", "train.max_steps='soon' is invalid: expected an integer or none"),
    ("canaries.copies=[1, 0.5]", "canaries.copies=[1, 0.5] is invalid: expected a list of integers"),
    ("train.lrr=0.1", "unknown config key train.lrr (did you mean 'lr'?)"),
    ("trian.lr=0.1", "unknown config section 'trian' in --set 'trian.lr=0.1' (did you mean 'train'?)"),
    ("train.batch_size=0", "train.batch_size=0 is invalid: use a value >= 1"),
    ("train.lr=inf", "train.lr=inf is not a finite number"),
    ("train.precision=fp8", "train.precision='fp8' is invalid: use one of 'auto', 'fp32', 'bf16'"),
    ("train.lr", "'train.lr' is malformed: use section.key=value"),
])
def test_a_bad_set_ends_at_parse_time_in_one_line(tmp_path, item, expect):
    # The recipe named does not exist: the --set line comes first, so the value was refused as it was parsed.
    r = cli("train", "--config", tmp_path / "missing.toml", "--set", "train.seed=1", "--set", item)
    line = refused(r, expect)
    assert r.returncode == 2 and r.stdout == ""
    assert line == f"memtrain: error: memtrain train: argument --set: {expect}" + line.split(expect, 1)[1]
    assert line.endswith("(see memtrain train --help)")


def test_values_arrive_typed_in_the_config(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli_mod, "_train", lambda args: seen.update(cfg=load(args.config, args.set)))
    items = ["train.lr=3e-4", "train.batch_size=8", "train.max_steps=none", "eval.pythia=false",
             "canaries.kinds=['random']", "canaries.copies=[1, 3]", "canaries.placement=5", "loss.kind=goldfish",
             "data.corpus=/data/my corpus", "model.init='runs/base'", "parallel.timeout_s=30"]
    r = cli("train", *[a for item in items for a in ("--set", item)])
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = seen["cfg"]
    assert (cfg.train.lr, cfg.train.batch_size, cfg.train.max_steps, cfg.eval.pythia) == (3e-4, 8, None, False)
    assert (cfg.canaries.kinds, cfg.canaries.copies, cfg.canaries.placement) == (["random"], [1, 3], 5)
    assert (cfg.loss.kind, cfg.data.corpus, cfg.model.init, cfg.parallel.timeout_s) == (
        "goldfish", "/data/my corpus", "runs/base", 30)
    assert type(cfg.train.lr) is float and type(cfg.train.batch_size) is int


def test_a_good_item_comes_back_unchanged_for_load():
    parse = override_type()
    for item in ["train.lr=1", "canaries.placement=random", "data.corpus=", "train.seed = 3", "wandb.group=null"]:
        assert parse(item) == item
    # The checks across keys wait for the whole config: each item is fine on its own.
    assert parse("train.min_lr=0.5") == "train.min_lr=0.5"
    assert parse("data.vocab_size=100") == "data.vocab_size=100"  # too small only with the default 'bpe' tokenizer


def test_overrides_limited_to_some_sections():
    parse = override_type(sections=("eval",))
    assert parse("eval.batch_size=8") == "eval.batch_size=8"
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'train.lr=0.1' cannot be set here: this command takes "
                                                          r"only eval\.\* keys$"):
        parse("train.lr=0.1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"eval.batch_size='abc' is invalid: expected an integer"):
        parse("eval.batch_size=abc")
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown config section 'evl' .*did you mean 'eval'"):
        parse("evl.batch_size=8")
    with pytest.raises(argparse.ArgumentTypeError, match=r"only eval\.\*, wandb\.\* keys"):
        override_type(sections=("eval", "wandb"))("model.name=x")


def test_a_limited_set_option_is_one_line_in_a_parser(capsys):
    ap = ArgumentParser(prog="memtrain eval")
    ap.add_argument("--set", action="append", default=[], type=override_type(("eval",)))
    assert ap.parse_args(["--set", "eval.pythia=false"]).set == ["eval.pythia=false"]
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--set", "train.lr=0.1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "memtrain: error: memtrain eval: argument --set: 'train.lr=0.1' cannot be set here: this command takes only "
        "eval.* keys (see memtrain eval --help)"]


def test_types_in_words():
    assert expected("int | None") == "an integer or none"
    assert expected("str | int") == "a string or an integer"
    assert expected("list[int]") == "a list of integers"
    assert expected("bool") == "true or false"


def test_an_integer_for_a_float_key_is_that_float():
    """lr = 1 and lr = 1.0 are one config: the same value type and TOML however the number is written (an integer
    key stays an integer; a sweep's digest, built from it, agrees too: tests/experiments/sweep/test_digests.py)."""
    from memtrain.config import from_dict, to_toml

    as_int, as_float = from_dict({"train": {"lr": 1, "seed": 3}}), from_dict({"train": {"lr": 1.0, "seed": 3}})
    assert type(as_int.train.lr) is float and type(as_int.train.seed) is int
    assert to_toml(as_int) == to_toml(as_float)


def test_any_text_in_a_string_key_writes_toml_that_reads_back():
    """A run's config.toml is how export, eval and --resume read it back: an emoji (past U+FFFF: JSON would write a
    surrogate pair, which TOML refuses), accents, DEL, quotes, a backslash and a newline survive the round trip."""
    from memtrain.config import from_dict, to_toml, tomllib

    cfg = from_dict({"wandb": {"name": 'run-\U0001f680 é \x7f "q" \\ \n'}})
    assert from_dict(tomllib.loads(to_toml(cfg))) == cfg
