"""The keys of a configuration of dataclass sections, as text: each key's type read from its annotation, its
docstring read from its source, its default written in TOML, and a value typed as text (`--set section.key=value`,
TOML value syntax) parsed and checked against the type.

memtrain/config.py holds the sections, their ranges and the checks across keys, and passes its sections in: this
module knows no section, so the run configuration imports it and never the other way round. Annotations are read
as strings (`from __future__ import annotations` in every config module): "int | None", "list[str]".
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import sys
import textwrap

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "None": "none"}
_PLURALS = {"int": "integers", "float": "numbers", "bool": "true or false values", "str": "strings"}
_PLACEHOLDERS = {"int": "<integer>", "float": "<number>", "str": "<string>", "bool": "<true|false>"}


def closest(word: str, options) -> str:
    """' (did you mean ...?)' naming the option nearest `word`, or '' when none is near."""
    near = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def parse_value(text: str):
    """A `--set` value in TOML syntax; anything that does not parse is a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def type_ok(value, annotation: str) -> bool:
    """Whether `value` (as TOML gives it) is of the annotated type; an int is a valid float (TOML's `lr = 1`)."""
    for alt in (a.strip() for a in annotation.split("|")):
        if (alt == "None" and value is None or alt == "bool" and isinstance(value, bool)
                or alt == "str" and isinstance(value, str)
                or alt in ("int", "float") and isinstance(value, int) and not isinstance(value, bool)
                or alt == "float" and isinstance(value, float)):
            return True
        if alt.startswith("list[") and isinstance(value, list) and all(type_ok(v, alt[5:-1]) for v in value):
            return True
    return False


def expected(annotation: str) -> str:
    """The annotated type in words: 'int | None' -> 'an integer or none', 'list[str]' -> 'a list of strings'."""
    words = []
    for alt in (a.strip() for a in annotation.split("|")):
        inner = alt[5:-1] if alt.startswith("list[") else None
        words.append(f"a list of {_PLURALS.get(inner, inner)}" if inner else _WORDS.get(alt, alt))
    return " or ".join(words)


def placeholder(annotation: str) -> str:
    """What a value of the type looks like, None left out: 'int | None' -> '<integer>'."""
    kinds = [a.strip() for a in annotation.split("|") if a.strip() != "None"]
    return " or ".join(_PLACEHOLDERS.get(k, f"<{k}>") for k in kinds)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    # JSON's escapes are TOML's, but for characters past U+FFFF, which JSON writes as a surrogate pair TOML refuses:
    # those stay as they are (and DEL, which JSON leaves raw, is escaped)
    return json.dumps(str(v), ensure_ascii=False).replace("\x7f", "\\u007f")


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def typed(key: str, value, f: dataclasses.Field):
    """`value` as field `f` ('section.key' `key`) takes it, 'none' or 'null' being None where the type allows it
    (TOML has no null); ValueError naming the key, the value, the type and an example when the type does not fit."""
    annotation = str(f.type)
    if isinstance(value, str) and value.lower() in ("none", "null") and "None" in annotation:
        return None
    if not type_ok(value, annotation):
        default = default_of(f)
        example = "" if default is None else f", e.g. {key}={toml_value(default)}"
        raise ValueError(f"{key}={value!r} is invalid: expected {expected(annotation)}{example}")
    kinds = {a.strip() for a in annotation.split("|")}
    if isinstance(value, int) and not isinstance(value, bool) and "float" in kinds and "int" not in kinds:
        return float(value)  # lr = 1 is lr = 1.0: one config, one digest and one config.toml, however written
    return value


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def listing(sections: dict[str, type], width: int = 100) -> str:
    """Every key of `sections` ({name: dataclass}) for a --help: `  section.key: type = default` (the default in
    TOML, 'none' for None), its docstring wrapped below it; a blank line between sections."""
    out = []
    for section, cls in sections.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = default_of(f)
            out.append(f"  {section}.{f.name}: {f.type} = {'none' if default is None else toml_value(default)}")
            out += textwrap.wrap(docs.get(f.name, ""), width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                 break_on_hyphens=False)  # "--trust-remote-code" and "document-relative" stay whole
        out.append("")
    return "\n".join(out).rstrip("\n")
