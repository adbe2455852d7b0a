"""`memtrain config`: a TOML recipe with every key at its default, each key's docstring as comments above it."""

import dataclasses
import re
import sys

from memtrain.config import RunConfig, _section_classes, describe, field_docs, load
from tests.memtrain._helpers import cli

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_config_command_prints_toml_that_loads_as_the_defaults(tmp_path):
    r = cli("config")  # in this process: the same exit code and output as a new one
    assert r.returncode == 0, r.stderr[-2000:]
    defaults = RunConfig().to_dict()
    # Every value equals its default; None (no TOML value) is left out, which is how TOML recipes say "default".
    assert tomllib.loads(r.stdout) == {s: {k: v for k, v in values.items() if v is not None}
                                       for s, values in defaults.items()}
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(r.stdout)
    assert load(recipe) == RunConfig()


def _keys(text: str) -> dict[tuple[str, str], tuple[str, list[str]]]:
    """(section, key) -> (its line, the comment lines right above it)."""
    found, section, comments = {}, None, []
    for line in text.splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section, comments = m.group(1), []
        elif m := re.fullmatch(r"(?:# )?(\w+) = .*", line) if section else None:
            found[section, m.group(1)] = (line, comments)
            comments = []
        elif line.startswith("# "):
            comments.append(line[2:])
    return found


def test_every_key_has_its_docstring_above_it_and_none_defaults_are_commented_out():
    keys = _keys(describe())
    defaults = RunConfig()
    expected = {(s, f.name) for s, cls in _section_classes().items() for f in dataclasses.fields(cls)}
    assert set(keys) == expected
    for section, cls in _section_classes().items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            line, comments = keys[section, f.name]
            assert " ".join(comments) == docs[f.name], (section, f.name)
            assert all(len(c) <= 110 for c in comments), (section, f.name)
            if getattr(getattr(defaults, section), f.name) is None:
                assert re.fullmatch(rf"# {f.name} = <[a-z|]+>( or <[a-z|]+>)*\s+\(default: none\)", line), line
            else:
                assert not line.startswith("#"), line
