"""Sweep specs: parsing, expansion into points (ids, axes, overrides), bad specs, and the shipped presets."""

from __future__ import annotations

import re

import pytest

from experiments.sweep import cli
from experiments.sweep import spec as specs
from memtrain.config import tomllib  # tomllib, or tomli on Python 3.10
from tests.experiments.sweep._helpers import IDS, SPEC


def test_expand_ids_axes_and_overrides():
    spec = specs.parse_spec(tomllib.loads(SPEC), "mini.toml")
    points = specs.expand(spec, ["train.lr=0.01", "data.seq_len=64"], wandb_mode="offline")
    assert [p.id for p in points] == IDS
    p = points[3]
    assert p.axes == {"model.name": "ladder-3m", "loss": {"kind": "goldfish", "k": 4}}
    assert p.cfg.model.name == "ladder-3m" and p.cfg.loss.kind == "goldfish" and p.cfg.loss.k == 4
    assert p.cfg.train.lr == 0.01 and p.cfg.data.seq_len == 64 and p.cfg.train.batch_size == 4
    assert p.cfg.wandb.group == "mini" and p.cfg.wandb.name == p.id and p.cfg.wandb.mode == "offline"
    assert len({q.digest for q in points}) == len(points)


def test_seeds_named_axes_and_bad_specs():
    spec = specs.parse_spec({"sweep": {"name": "s"}, "axes": {
        "seeds": [0, 1], "size": [{"label": "small", "model.name": "ladder-1m", "parallel.z": 1},
                                  {"model.name": "ladder-3m", "train.micro_batch_size": 2}]}})
    points = specs.expand(spec)
    assert [p.id for p in points] == ["seed0_small", "seed0_ladder-3m-micro_batch_size2", "seed1_small",
                                      "seed1_ladder-3m-micro_batch_size2"]
    assert points[1].cfg.train.micro_batch_size == 2 and points[2].cfg.train.seed == 1
    with pytest.raises(ValueError, match="unknown config key"):
        specs.expand(specs.parse_spec({"axes": {"train.lrr": [1.0]}}))
    with pytest.raises(ValueError, match="unknown config section"):
        specs.parse_spec({"axes": {"trian.lr": [1.0]}})
    with pytest.raises(ValueError, match="non-empty list"):
        specs.parse_spec({"axes": {"train.lr": 1.0}})
    with pytest.raises(ValueError, match="whole section"):
        specs.expand(specs.parse_spec({"axes": {"loss": ["goldfish"]}}))
    with pytest.raises(ValueError, match="pretrain"):
        specs.parse_spec({"pretrain": {"stpes": 3}})
    with pytest.raises(FileNotFoundError, match="neither a file nor a preset"):
        specs.load_spec("no-such-preset")


def test_a_point_id_is_never_a_directory_above_its_own():
    """A point's run directory is the sweep's directory / its id: an axis value whose label is "." or ".." (a path
    ending in a dot) would make it the sweep's own directory, or its parent, which a fresh point clears."""
    spec = specs.parse_spec({"sweep": {"name": "s"}, "axes": {"data.corpus": ["stdlib", "./", "corpora/x/.."]}})
    assert [p.id for p in specs.expand(spec)] == ["stdlib", "x", "x_1"]


def test_the_same_run_twice_is_refused():
    """Two points of one config (a repeated axis value, or the seeds axis beside train.seed) would each be counted
    by the report: refused, naming both."""
    for axes in ({"seeds": [1, 2, 1]}, {"seeds": [1, 2], "train.seed": [3]}):
        with pytest.raises(ValueError, match=r"sweep points '\w+' and '\w+' are the same run .*remove the repeat"):
            specs.expand(specs.parse_spec({"sweep": {"name": "s"}, "axes": axes}))


def test_a_pretraining_schedule_that_rises_is_refused_before_any_point_runs():
    with pytest.raises(ValueError, match=r"pretrain.min_lr=0.01 exceeds pretrain.lr=0.001"):
        specs.parse_spec({"sweep": {"name": "s"}, "pretrain": {"lr": 0.001, "min_lr": 0.01}, "axes": {"seeds": [1]}})


@pytest.mark.parametrize("name", specs.presets())
def test_presets_parse(name):
    assert set(specs.presets()) >= {"quick", "extreme", "goldfish-k", "paper"}
    spec = specs.load_spec(name)
    points = specs.expand(spec)
    assert points and len({p.id for p in points}) == len(points)
    assert all(p.cfg.train.precision == "auto" for p in points), "let the machine choose bf16 or fp32"
    if name == "quick":  # a size study: >= 5 sizes of one shape over >= 30x parameters, scored every pass
        from memtrain.models import get_config, param_count

        models = sorted({p.cfg.model.name for p in points}, key=lambda m: param_count(m, 2048))
        assert len(models) >= 5 and {p.cfg.loss.kind for p in points} == {"standard", "goldfish"}
        assert param_count(models[-1], 2048) >= 30 * param_count(models[0], 2048)
        assert len({get_config(m).num_hidden_layers for m in models}) == 1  # width only
        assert all(p.cfg.train.lr_width and p.cfg.eval.every_pass and p.cfg.train.epochs > 1 for p in points)
        assert all(p.cfg.canaries.number >= 32 and p.cfg.train.seed != 0 for p in points)  # 0 chose the settings
        assert spec.pretrain.steps > 0
    if name == "goldfish-k":
        assert sorted(p.cfg.loss.k for p in points if p.cfg.loss.kind == "goldfish") == [3, 4, 8, 32, 128]
        assert len({p.cfg.model.name for p in points}) == 1
    if name == "paper":
        assert {p.cfg.model.name for p in points} == {"llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b"}
        assert spec.pretrain.steps == 0


def test_the_utility_preset_runs_the_single_pass_preset_s_settings():
    """single-pass-utility is the single-pass study with one more arm: every setting but its arms must stay the
    single-pass preset's (it once kept whole-file text after single-pass moved to pieces)."""
    study, utility = specs.load_spec("single-pass"), specs.load_spec("single-pass-utility")
    assert utility.base == study.base and utility.pretrain == study.pretrain


def test_points_of_is_what_a_sweep_list_and_dry_run_take(tmp_path, capsys):
    spec = specs.parse_spec(tomllib.loads(SPEC), "mini.toml")
    resolved, points = specs.points_of(spec, ["pretrain.steps=7", "train.lr=0.01"], "offline", "goldfish")
    assert spec.pretrain.steps == 0 and resolved.pretrain.steps == 7  # the spec given is left as it was
    assert [p.id for p in points] == [i for i in IDS if "goldfish" in i]
    assert all(p.cfg.train.lr == 0.01 and p.cfg.wandb.mode == "offline" for p in points)
    unpretrained = specs.points_of(spec, ["train.lr=0.01"], "offline", "goldfish")[1]
    assert [p.digest for p in points] != [p.digest for p in unpretrained]  # a base model changes the result
    path = tmp_path / "mini.toml"
    path.write_text(SPEC)
    argv = [str(path), "--only", "goldfish", "--set", "pretrain.steps=7", "--set", "train.lr=0.01"]
    assert cli.main(argv + ["--list"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == "pretrain: 7 steps (disjoint corpus)"
    assert [line.split()[0] for line in printed[2:]] == [p.id for p in points]
    argv += ["--launcher", "slurm", "--dry-run", "--time", "5", "--gpus-per-node", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    scripts = re.findall(r"^#### (\S+): .*after its base model is pretrained", capsys.readouterr().out, re.M)
    assert scripts == [p.id for p in points]


def test_set_on_an_axis_key_warns():
    spec = specs.parse_spec(tomllib.loads(SPEC), "mini.toml")
    with pytest.warns(UserWarning, match="overridden by the sweep axis"):
        points = specs.expand(spec, ['model.name="ladder-30m"'])
    assert {p.cfg.model.name for p in points} == {"ladder-1m", "ladder-3m", "ladder-10m"}
    with pytest.warns(UserWarning, match="overridden"):
        specs.expand(spec, ["loss.k=8"])


def test_paper_preset_grids_run_and_fit_by_the_planner():
    """The `paper` preset cannot run here, but each size's grid must be one the planner accepts: valid for
    the model's divisibility, the batch splits, and it fits a 64 GB GPU (Frontier's MI250X GCD)."""
    from memtrain.plan import PlanConfig, load_network, plan

    net = load_network("frontier")
    for p in specs.expand(specs.load_spec("paper")):
        par, train = p.cfg.parallel, p.cfg.train
        grid = (1, par.x, par.y, par.z)  # data=-1 takes whatever the world size leaves; 1 at the minimum size
        cfg = PlanConfig(model=p.cfg.model.name, gpus=par.x * par.y * par.z, batch=train.batch_size,
                         seq=p.cfg.data.seq_len, micro_batch=train.micro_batch_size,
                         activation_checkpointing=train.activation_checkpointing)
        plans, summary = plan(cfg, net)
        assert grid in [q.grid for q in plans], (p.id, summary)
