"""W&B tracking: offline run files with the config, no secrets written, disabled writes nothing, and a
failure inside wandb never reaches the training run."""

from __future__ import annotations

import struct
import warnings
import zlib

import pytest

from memtrain.config import RunConfig
from memtrain.training import tracking
from memtrain.training.tracking import Tracker

FAKE_KEY = "f" * 8 + "0123456789abcdef0123456789abcdef"  # 40 chars, shaped like a W&B key; not a real one


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """No real credentials or settings can be read or written: HOME, netrc and W&B dirs are temporary."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    return home


def _cfg(mode="offline", name=None):
    cfg = RunConfig()
    cfg.model.name = "ladder-unique-model-name"
    cfg.wandb.mode = mode
    cfg.wandb.group = "test-sweep"
    cfg.wandb.name = name
    return cfg


def _png(path):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + b"\x80\x40\x20" * 8 for _ in range(8))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path


def _all_bytes(root):
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_offline_run_lands_in_run_dir_with_config_and_no_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)  # present in the environment: must never be written
    run_dir = tmp_path / "runs" / "sweep" / "point-a"
    tr = Tracker.start(_cfg("offline"), run_dir, rank=0)
    assert tr.active and tr.mode == "offline"
    for step in (1, 2, 3):
        tr.log({"step": step, "loss": 3.0 / step, "lr": 1e-3, "loss_dropped": None, "mfu": 0.1}, step=step)
    tr.log_eval({"exact_match_rate": 0.25, "rougeL": 0.5, "by_copies": {"1": {"exact_match_rate": 0.0}}},
                [{"id": "c0", "copies": 1, "inserted": True, "exact_match": False, "generated": [1, 2]}])
    tr.log_images([_png(tmp_path / "fig.png"), tmp_path / "missing.png"])
    tr.finish()
    tr.finish()  # idempotent

    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    blob = _all_bytes(run_dir)
    assert b"ladder-unique-model-name" in blob  # the config went into the run files
    assert b"test-sweep" in blob  # group
    assert FAKE_KEY.encode() not in blob
    assert FAKE_KEY.encode() not in _all_bytes(tmp_path)
    assert (run_dir / "wandb-run.json").is_file()


def test_resume_reuses_the_run_id(tmp_path):
    run_dir = tmp_path / "run"
    t1 = Tracker.start(_cfg("offline"), run_dir)
    first = t1._run.id
    t1.finish()
    t2 = Tracker.start(_cfg("offline"), run_dir)
    assert t2._run.id == first
    t2.finish()


def test_disabled_and_other_ranks_write_nothing(tmp_path):
    for tr, d in ((Tracker.start(_cfg("disabled"), tmp_path / "a", rank=0), tmp_path / "a"),
                  (Tracker.start(_cfg("offline"), tmp_path / "b", rank=1), tmp_path / "b")):
        assert not tr.active and tr.mode == "disabled"
        tr.log({"loss": 1.0}, step=1)
        tr.log_eval({"exact_match_rate": 0.0}, [{"id": "x"}])
        tr.log_images([tmp_path / "nothing.png"])
        tr.finish()
        assert not d.exists()


def test_env_disables_auto(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    tr = Tracker.start(_cfg("auto"), tmp_path / "run")
    assert not tr.active and not (tmp_path / "run").exists()


def test_auto_mode_resolution(monkeypatch, isolated_env):
    monkeypatch.setattr(tracking, "network_reachable", lambda timeout=1.5: True)
    assert tracking.resolve_mode("auto") == "offline"  # no credentials
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert tracking.resolve_mode("auto") == "online"
    monkeypatch.setattr(tracking, "network_reachable", lambda timeout=1.5: False)
    assert tracking.resolve_mode("auto") == "offline"  # credentials but no network
    monkeypatch.delenv("WANDB_API_KEY")
    (isolated_env / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + FAKE_KEY + "\n")
    (isolated_env / ".netrc").chmod(0o600)
    assert tracking.has_credentials()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert tracking.resolve_mode("auto") == "offline"
    assert tracking.resolve_mode("disabled") == "disabled"
    with pytest.raises(ValueError, match="wandb.mode"):
        tracking.resolve_mode("sometimes")


def test_network_check_is_fast_when_unreachable(monkeypatch):
    import time

    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # discard port: refused at once
    t = time.time()
    assert tracking.network_reachable(timeout=1.0) is False
    assert time.time() - t < 2.0


class _Boom:
    id = "boom"
    dir = "/nonexistent/files"

    def __init__(self):
        self.summary = {}
        self.calls = 0

    def log(self, *a, **k):
        self.calls += 1
        raise RuntimeError("wandb exploded")

    def finish(self, *a, **k):
        raise RuntimeError("finish exploded too")


def test_failures_inside_wandb_never_raise(tmp_path, monkeypatch):
    import wandb

    def bad_init(**kwargs):
        raise RuntimeError("cannot start the service")

    monkeypatch.setattr(wandb, "init", bad_init)
    with pytest.warns(UserWarning, match="W&B tracking disabled"):
        tr = Tracker.start(_cfg("offline"), tmp_path / "run")
    assert not tr.active
    tr.log({"loss": 1.0}, step=1)
    tr.finish()

    boom = _Boom()
    tr = Tracker(boom, "offline", wandb)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.log({"loss": 1.0}, step=1)
        tr.log({"loss": 1.0}, step=2)
        tr.log_eval({"exact_match_rate": 0.0}, [{"id": "x"}])
        tr.log_images([_png(tmp_path / "f.png")])
        tr.finish()
    assert boom.calls == 1  # the first failure turned the tracker off
    assert len([w for w in caught if "W&B" in str(w.message)]) == 1  # warned once
    assert not tr.active


def test_invalid_mode_warns_and_continues(tmp_path):
    with pytest.warns(UserWarning, match="wandb.mode"):
        tr = Tracker.start(_cfg("sometimes"), tmp_path / "run")
    assert not tr.active


def test_redact_and_flatten():
    d = tracking.redact({"wandb": {"api_key": "x", "project": "p"}, "canaries": {"random_format": "secret"},
                         "nested": [{"password": "y"}]})
    assert d == {"wandb": {"api_key": "<redacted>", "project": "p"}, "canaries": {"random_format": "secret"},
                 "nested": [{"password": "<redacted>"}]}
    flat = tracking.flatten({"a": 1, "b": {"c": 2.5, "d": "text", "e": None, "f": True}, "g": float("inf")})
    assert flat == {"a": 1, "b/c": 2.5, "b/f": 1}


def test_offline_run_names_its_directory_and_sync_command_once(tmp_path, monkeypatch, capsys):
    import shlex
    from pathlib import Path

    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)  # in the environment: must never be printed
    run_dir = tmp_path / "run"
    tr = Tracker.start(_cfg("offline"), run_dir, rank=0)
    tr.log({"loss": 1.0}, step=1)
    tr.finish()
    tr.finish()
    out, err = capsys.readouterr()
    named = [line for line in err.splitlines() if "sync" in line]
    assert len(named) == 1, err
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and any(offline[0].glob("*.wandb"))  # the directory named holds the run
    where, command = named[0].split("; upload it with: ")
    assert where == f"W&B: offline run saved in {shlex.quote(str(offline[0]))}"
    exe, *args = shlex.split(command)
    assert args == ["sync", str(offline[0])]
    assert exe == "wandb" or Path(exe).name == "wandb" and Path(exe).is_file()
    assert FAKE_KEY not in out + err

    for tr in (Tracker.start(_cfg("offline"), tmp_path / "other-rank", rank=1),
               Tracker.start(_cfg("disabled"), tmp_path / "disabled", rank=0)):
        tr.finish()
    assert "sync" not in capsys.readouterr().err
