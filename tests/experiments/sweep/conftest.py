"""The sweep tests' workspace: a fake memtrain runner, the mini spec, and a clean environment."""

import sys

import pytest

from tests.experiments.sweep._helpers import FAKE, SPEC


@pytest.fixture
def env(tmp_path, monkeypatch):
    fake = tmp_path / "fake_memtrain.py"
    fake.write_text(FAKE)
    spec = tmp_path / "mini.toml"
    spec.write_text(SPEC)
    log = tmp_path / "fake_log.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for var in ("FAKE_FAIL", "FAKE_KILL", "FAKE_KILL_MARK", "FAKE_SLEEP", "FAKE_SQUEUE_SLOW", "FAKE_HOLD", "FAKE_SLOW"):
        monkeypatch.delenv(var, raising=False)
    return {"tmp": tmp_path, "runner": f"{sys.executable} {fake}", "spec": spec, "log": log}
