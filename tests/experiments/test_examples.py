"""The README's library example (experiments/examples/library.py) runs end to end: inject, one pass of a plain
PyTorch loop, evaluate every canary and its twin."""

from experiments.examples import library


def test_the_readme_example_runs(capsys):
    result = library.main()
    assert {r["id"] for r in result["rows"]} == {"card", "card-twin", "vault", "vault-twin", "motto", "motto-twin"}
    assert set(result["by_kind"]) == {"pii", "quote"} and result["n_evaluated"] == 3
    rows = {r["id"]: r for r in result["rows"]}
    assert rows["card"]["suffix_len"] == 8 and rows["motto"]["suffix_len"] not in (None, 8)  # its own split
    assert "pii: exact match" in capsys.readouterr().out
