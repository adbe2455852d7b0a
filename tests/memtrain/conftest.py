"""The `memtrain` command tests' shared run (test_cli.py, training/test_train.py)."""

from types import SimpleNamespace

import pytest

from tests.memtrain._helpers import memtrain_cold, stdlib_corpus, write_recipe


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One finished `python -m memtrain train` of the tiny recipe (tests/memtrain/_helpers.py TINY: 6 steps, then
    the evaluation) in a new interpreter, as a user starts it (its imports, exit and teardown), over 40 stdlib files
    and two that are not UTF-8, trained first into a fresh cache: `process` is that first run's (its stderr reports
    the data preparation), `out` its run directory. Other runs of `recipe` find the cache ready. Read only: a test
    that changes the run works on a copy (shutil.copytree)."""
    corpus = stdlib_corpus(tmp_path_factory.mktemp("corpus"), every=4, count=40, chars=6000)
    (corpus / "zz_latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    (corpus / "zz_koi8.txt").write_bytes("привет мир".encode("koi8-r"))
    recipe = write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.toml", corpus, tmp_path_factory.mktemp("cache"))
    out = tmp_path_factory.mktemp("tiny_run") / "run"
    r = memtrain_cold("train", "--config", recipe, "--out", out, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return SimpleNamespace(recipe=recipe, corpus=corpus, out=out, process=r)
