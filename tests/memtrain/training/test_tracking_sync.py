"""W&B for many runs, with real offline runs: the pass axis a training run defines, a config given in place of the
run's (a sweep's report logs its spec), and one `wandb sync` command for the runs under several directories."""

from __future__ import annotations

import glob
import json
import shlex

import pytest

from memtrain.config import RunConfig
from memtrain.training.tracking import OFFLINE_RUNS, PASS_AXIS, Tracker, sync_all
from tests.memtrain.training._wandb_files import of_type, records


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """No real credentials or settings: HOME and every W&B directory are temporary."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var, name in (("WANDB_DIR", "wandb-dir"), ("WANDB_CONFIG_DIR", "wandb-config"),
                      ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
        monkeypatch.setenv(var, str(tmp_path / name))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)


def _cfg():
    cfg = RunConfig()
    cfg.wandb.mode, cfg.wandb.group = "offline", "sweep-x"
    return cfg


def test_a_training_run_plots_the_probe_against_the_pass(tmp_path, capsys):
    tr = Tracker.start(_cfg(), tmp_path / "sweep" / "point", rank=0)
    for p in (0, 1, 2):  # what the trainer logs after every pass (and before the first), at its step
        tr.log({"pass": {"pass": p, "step": 5 * p, "val_loss": 4.0 - p, "members": {"k": p, "n": 4}}}, step=5 * p)
    tr.log({"step": 10, "loss": 1.5}, step=10)
    tr.finish(say_sync=False)
    assert "sync" not in capsys.readouterr().err  # left to the caller that names many runs at once
    recs = records(tmp_path / "sweep" / "point")
    metrics = [(m.name, m.glob_name, m.step_metric) for m in of_type(recs, "metric")]
    assert metrics[:2] == [(PASS_AXIS, "", ""), ("", "train/pass/*", PASS_AXIS)]
    logged = [{"/".join(i.nested_key or [i.key]): json.loads(i.value_json) for i in h.item}
              for h in of_type(recs, "history")]
    assert [h[PASS_AXIS] for h in logged if PASS_AXIS in h] == [0, 1, 2]
    assert [h["train/pass/members/k"] for h in logged if PASS_AXIS in h] == [0, 1, 2]


def test_a_report_run_logs_the_config_it_is_given_and_no_pass_axis(tmp_path):
    spec = {"name": "sweep-x", "axes": {"model.name": ["a", "b"]}, "base": {"train": {"lr": 0.01}},
            "wandb": {"api_key": "not-a-key"}}
    tr = Tracker.start(_cfg(), tmp_path / "sweep" / "report", rank=0, job_type="report", config=spec)
    tr.finish()
    recs = records(tmp_path / "sweep" / "report")
    (run,) = of_type(recs, "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    assert config == dict(spec, wandb={"api_key": "<redacted>"})  # redacted as a run's own config is
    assert not of_type(recs, "metric")


def test_one_sync_command_for_the_offline_runs_of_several_directories(tmp_path):
    for where in ("sweep/a", "sweep/b", "sweep/report", "base/k1", "base/k2"):
        Tracker.start(_cfg(), tmp_path / where, rank=0).finish(say_sync=False)
    found, command = sync_all([(tmp_path / "sweep", "*/" + OFFLINE_RUNS), (tmp_path / "base" / "k1", OFFLINE_RUNS),
                               (tmp_path / "nothing", "*/" + OFFLINE_RUNS)])
    exe, sync, *globs = shlex.split(command)
    assert sync == "sync" and len(globs) == 2  # a glob that matches nothing is left out
    named = sorted(p for g in globs for p in glob.glob(g))
    made = sorted(str(p) for where in ("sweep/a", "sweep/b", "sweep/report", "base/k1")
                  for p in (tmp_path / where).glob(OFFLINE_RUNS))
    assert found == 4 and named == made
    assert sync_all([(tmp_path / "nothing", "*/" + OFFLINE_RUNS)]) is None
