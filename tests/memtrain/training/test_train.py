"""`memtrain train` end to end: run directory contents, resume after a kill, resharding, bad input.

Resume and resharding compare float32 tensors: a resumed single-process run repeats the same
operations on the same values (checkpoints hold the fp32 shards), so it must be bitwise equal;
logits after loading a checkpoint into another grid differ only by summation order (1e-5 relative).
"""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import parallel
from memtrain.config import load
from memtrain.data.corpus import load_corpus
from memtrain.models import get_config
from memtrain.plan.compute import model_flops
from memtrain.plan.cost import shape_of
from memtrain.training import (  # here, not in the ranks: forked, they find them imported
    checkpoint,
    run_dir,
    setup,
    trainer,
)
from memtrain.training.perf import datasheet_peak
from parallel.forked import run_ranks
from tests.memtrain._helpers import ENV, ROOT, checkpoint_files, cli, memtrain, memtrain_cold, refused
from tests.memtrain._models import tiny


@pytest.fixture(scope="module")
def recipe(tiny_run):
    return tiny_run.recipe  # tests/memtrain/conftest.py


@pytest.fixture(scope="module")
def finished_run(tiny_run):
    return tiny_run.out  # read only


def test_run_directory_has_everything(finished_run):
    lines = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 7))
    for key in ("loss", "lr", "tokens", "tokens_per_s", "mfu", "memory_mb", "kept_fraction"):
        assert all(x[key] is not None for x in lines), key
    assert lines[-1]["loss"] < lines[0]["loss"]
    run = json.loads((finished_run / "run.json").read_text())
    data = load(finished_run / "config.toml").data
    assert run["corpus"]["source"] == data.corpus and run["corpus"]["documents"] > 0
    assert run["corpus"]["fingerprint"] == load_corpus(data).fingerprint
    peak = run["mfu_peak"]  # MFU's denominator, and its origin
    sheet = datasheet_peak(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    if sheet:  # a GPU the datasheet table knows
        assert peak == {"flop_s": sheet.flops, "source": sheet.source}
    else:
        assert peak["flop_s"] > 0 and peak["source"].startswith("measured ")
    # MFU's numerator is the planner's FLOP count, so a run's MFU and `memtrain plan`'s compare
    config = get_config(load(finished_run / "config.toml").model.name, data.vocab_size)
    assert run["flops_per_token"] == model_flops(shape_of(config), 1, data.seq_len) / data.seq_len
    for x in lines:
        assert x["mfu"] == pytest.approx(run["flops_per_token"] * x["tokens_per_s"] / peak["flop_s"], rel=1e-12)
    result = json.loads((finished_run / "eval.json").read_text())
    for key in ("exact_match_rate", "token_match", "rougeL", "pythia_32_score", "exposure_mean", "mia_auc_loss",
                "val_loss", "by_copies"):
        assert key in result, key
    rows = (finished_run / "eval_canaries.jsonl").read_text().splitlines()
    assert len(rows) == 2 * 2 * 2  # 2 kinds x 2 canaries, each with its twin
    assert (finished_run / "canaries.jsonl").is_file() and (finished_run / "config.toml").is_file()
    assert (finished_run / "checkpoints" / "latest").read_text().strip() == "step_000006"


def test_eval_command_reproduces_eval_json(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(".lock"))
    before = json.loads((run / "eval.json").read_text())
    r = memtrain("eval", "--run", run)
    assert r.returncode == 0, r.stderr[-2000:]
    after = json.loads((run / "eval.json").read_text())
    assert after["exact_match_rate"] == before["exact_match_rate"]
    assert after["val_loss"] == pytest.approx(before["val_loss"], rel=1e-6)


def test_resume_after_kill_equals_uninterrupted(recipe, tmp_path):
    sets = ["--set", "train.max_steps=12", "--set", "train.checkpoint_every=4", "--set", "eval.enabled=false"]
    full = tmp_path / "full"
    r = memtrain("train", "--config", recipe, "--out", full, *sets)
    assert r.returncode == 0, r.stderr[-2000:]
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "memtrain", "train", "--config", str(recipe), "--out", str(cut),
                             *sets], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (cut / "checkpoints" / "latest").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = (cut / "checkpoints" / "latest").read_text().strip()
    assert killed_at != "step_000012", "the run finished before it could be killed"
    r = memtrain("train", "--config", recipe, "--out", cut, "--resume", *sets)
    assert r.returncode == 0, r.stderr[-2000:]
    a = checkpoint_files(full / "checkpoints" / "step_000012")
    b = checkpoint_files(cut / "checkpoints" / "step_000012")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(x)["step"] for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))


def _losses_on_grid(rank, world, degrees, recipe, ckpt):
    cfg = load(recipe)
    if degrees is not None:
        grid = parallel.init(*degrees)
    else:
        grid = parallel.Grid(1, 1, 1, 1)
    stream, plm = setup(cfg, grid)
    with checkpoint.read_weights(ckpt) as weights:
        plm.load_hf_state_dict(weights)
    batch = stream.batch(0, 8)
    rows = plm.local_rows(8)
    with torch.no_grad():
        losses = plm.token_losses(batch["input_ids"][rows], batch["labels"][rows])
    return rows.start, losses


def test_fan_in_init_draws_the_seeded_weights_at_one_over_sqrt_width(recipe):
    # The std of 20k+ normal draws is within 2% of its own with probability ~1 - 1e-9 (its relative SE is
    # 1/sqrt(2n) < 0.5%): 5% tells the two rules apart (0.02 vs 1/sqrt(hidden), 4x apart at width 64).
    grid = parallel.Grid(1, 1, 1, 1)
    for fan_in in (False, True):
        _, plm = setup(load(recipe, [f"model.fan_in_init={str(fan_in).lower()}"]), grid)
        weights = plm.full_state_dict()
        want = plm.config.hidden_size ** -0.5 if fan_in else 0.02
        for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
            std = float(weights[key].float().std())
            assert abs(std / want - 1) < 0.05, (fan_in, key, std, want)


def test_checkpoint_reshards_across_grids(recipe, finished_run):
    ckpt = finished_run / "checkpoints" / "step_000006"
    reference = {}
    for degrees in [(2, 2, 2, 1), (8, 1, 1, 1), (1, 2, 2, 2)]:
        for start, losses in run_ranks(8, _losses_on_grid, degrees, recipe, ckpt):
            reference.setdefault(degrees, {})[start] = losses
    single = run_ranks(1, _losses_on_grid, None, recipe, ckpt)[0][1]
    for degrees, parts in reference.items():
        merged = torch.cat([parts[s] for s in sorted(parts)])
        assert merged.shape == single.shape, degrees
        err = float((merged - single).abs().max() / single.abs().max())
        assert err < 1e-5, (degrees, err)


@pytest.mark.parametrize("args, expect", [
    (["--set", "model.name=ladder-9z"], "ladder-"),
    (["--set", "train.sed=1"], "did you mean 'seed'"),
    (["--set", "parallel.x=3"], "world size"),
    (["--resume"], "config.toml"),
])
def test_bad_input_is_one_clear_line(recipe, tmp_path, args, expect):
    r = cli("train", "--config", recipe, "--out", tmp_path / "bad", *args)  # in this process, as a new one
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("memtrain: error:") and expect in last, r.stderr[-2000:]


def test_resume_with_other_config_and_corrupt_checkpoint(recipe, finished_run, tmp_path):
    r = cli("train", "--config", recipe, "--out", finished_run, "--resume", "--set", "train.seed=5")
    assert r.returncode == 2 and "cannot change train.seed (0 -> 5)" in r.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "state.json").write_text("{}")
    (broken / "model-00000.safetensors").write_bytes(b"not a safetensors file")
    r = cli("eval", "--run", finished_run, "--checkpoint", broken)
    assert r.returncode == 2 and "corrupt" in r.stderr.splitlines()[-1]


def _checkpoint_decisions(rank, world):
    grid = parallel.init(data=world)
    trainer._clock = lambda: 1000.0
    cpu = torch.device("cpu")
    # 5 minutes: rank 0 saved 500 s ago and rank 1 just now, then the other way round; alone, they would disagree.
    return [trainer.agree(grid, cpu, 500.0 if rank == 0 else 1000.0, 5.0, None).due,
            trainer.agree(grid, cpu, 1000.0 if rank == 0 else 500.0, 5.0, None).due,
            trainer.agree(grid, cpu, 0.0, 0.0, None).due]  # 0 minutes: off


def test_time_based_checkpoint_is_rank_0s_decision_on_every_rank():
    assert run_ranks(2, _checkpoint_decisions) == [[True, False, False], [True, False, False]]


def _lrs(rank, world, recipe, out, max_steps: int, resume: bool) -> list[float]:
    sets = ["eval.enabled=false", "train.checkpoint_every=2", f"train.max_steps={max_steps}"]
    trainer.train(load(recipe, sets), out, resume=resume)
    return [json.loads(x)["lr"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_resume_with_more_steps_trains_on_at_the_new_schedules_lr(recipe, tmp_path):
    """train.max_steps may change on resume: the cosine then stretches to the new total from the first resumed step
    on (the old schedule's last lr is not reused), and every step's lr is logged as the step trained with it."""
    (cut,) = run_ranks(1, _lrs, recipe, tmp_path / "run", 4, False)
    (resumed,) = run_ranks(1, _lrs, recipe, tmp_path / "run", 8, True)
    (whole,) = run_ranks(1, _lrs, recipe, tmp_path / "whole", 8, False)
    assert resumed[:4] == cut and cut[2:] != whole[2:4]  # past the warm-up the two totals' schedules differ
    assert resumed[4:] == whole[4:]


def test_time_based_checkpoints_change_nothing_trained(recipe, tmp_path):
    sets = ["--set", "eval.enabled=false"]
    r = memtrain("train", "--config", recipe, "--out", tmp_path / "off", *sets, "--set", "train.checkpoint_every_min=0")
    assert r.returncode == 0, r.stderr[-2000:]
    r = memtrain("train", "--config", recipe, "--out", tmp_path / "often", *sets,
                 "--set", "train.checkpoint_every_min=1e-9", "--set", "train.keep_checkpoints=0")  # each step, all
    assert r.returncode == 0, r.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "often" / "checkpoints").glob("step_*"))
    assert names == [f"step_00000{i}" for i in range(1, 7)]
    assert [p.name for p in (tmp_path / "off" / "checkpoints").glob("step_*")] == ["step_000006"]
    a = checkpoint_files(tmp_path / "off" / "checkpoints" / "step_000006")
    b = checkpoint_files(tmp_path / "often" / "checkpoints" / "step_000006")
    assert a.keys() == b.keys() and any(k.startswith("optimizer") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_compiled_run_trains_as_the_eager_one(recipe, finished_run, tmp_path):
    """train.compile end to end: the same losses to rounding, in the precision 'auto' chose for the eager run
    (tolerances as tests/memtrain/hf/test_blocks.py's; measured over these 6 steps on a CPU with native bf16:
    6.4e-5 relative), and a checkpoint of the same names."""
    out = tmp_path / "compiled"
    precision = json.loads((finished_run / "run.json").read_text())["precision"]  # 'auto' probes: not twice
    r = memtrain("train", "--config", recipe, "--out", out, "--set", "eval.enabled=false",
                 "--set", "train.compile=true", "--set", f"train.precision={precision}")
    assert r.returncode == 0, r.stderr[-2000:]
    got, want = ([json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
                 for run in (out, finished_run))
    assert len(got) == len(want) == 6
    assert max(abs(a / b - 1) for a, b in zip(got, want)) <= (2e-3 if precision == "bf16" else 1e-5)
    a = checkpoint_files(out / "checkpoints" / "step_000006")
    assert a.keys() == checkpoint_files(finished_run / "checkpoints" / "step_000006").keys()
    saved = load(out / "config.toml")
    assert saved.train.compile
    eager = load(out / "config.toml")
    eager.train.compile = False
    assert run_dir.resume_blockers(saved, eager) == []  # how a step computes, not what: a resume may change it
    # so is the permission to run a model directory's code: only --trust-remote-code gives it, on each command
    eager.model.trust_remote_code = True
    assert run_dir.resume_blockers(saved, eager) == []


def test_ctrl_c_names_the_checkpoint_a_resume_starts_from(tmp_path):
    """Ctrl-C stops training at once (SIGTERM saves first): the line names the checkpoint --resume would continue
    from, or says there is none, where it once promised a checkpoint that a run with checkpoint_every=0 never
    wrote (--resume was then refused)."""
    with pytest.raises(KeyboardInterrupt, match="^no checkpoint saved yet, so --resume cannot continue"):
        with trainer._say_what_was_saved(tmp_path):
            raise KeyboardInterrupt
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000004" / "state.json").write_text('{"step": 4}')
    with pytest.raises(KeyboardInterrupt, match="^--resume continues this run from its last checkpoint, step_000004"):
        with trainer._say_what_was_saved(tmp_path):
            raise KeyboardInterrupt


def test_a_model_whose_packed_documents_see_each_other_is_refused_document_attention(recipe, tmp_path):
    """OPT under flex attention (its config.json asks for it) takes no plain 4-D mask, and its own mask ignores
    position ids, so neither keeps packed documents apart; nor does Mamba's recurrence (it carries a row's state
    across documents): with data.document_attention (the default) a canary would be trained in its row's context and
    evaluated alone, so training is refused with the fix. Flex attention has no backward on a CPU: there it is
    refused first, with its own fix. OPT in SDPA and BLOOM (ALiBi from a 2-D mask) train with the engine's mask
    (tests/memtrain/hf/test_documents.py)."""
    def args(family, attention=None, evaluate=False):
        config = tiny(family, "meta").config
        config.max_position_embeddings = 128  # the recipe's rows of 64 (OPT's learned positions)
        name = f"{family}-{attention}" if attention else family
        config.save_pretrained(tmp_path / name)  # a config alone: an architecture, from the seeded init
        if attention:
            path = tmp_path / name / "config.json"
            path.write_text(json.dumps(dict(json.loads(path.read_text()), attn_implementation=attention)))
        return ["train", "--config", recipe, "--set", f"model.name='{tmp_path / name}'", "--set",
                "train.max_steps=1", *([] if evaluate else ["--set", "eval.enabled=false"])]

    flex = args("opt", "flex_attention")
    if torch.cuda.is_available():  # a process of its own: flex attention compiles its block mask for the GPU
        error = refused(memtrain_cold(*flex, "--out", tmp_path / "run", timeout=300),
                        "OPTForCausalLM lets the documents packed")
        assert "set data.document_attention=false" in error
    else:  # refused first for what no setting of memtrain's mends
        error = refused(cli(*flex, "--out", tmp_path / "run"), "OPTForCausalLM asks for flex attention")
        assert "remove attn_implementation from config.json" in error
    error = refused(cli(*args("mamba"), "--out", tmp_path / "mamba"), "MambaForCausalLM lets the documents packed")
    assert "a state-space recurrence" in error
    for family in ("opt", "bloom"):
        r = cli(*args(family), "--out", tmp_path / family)
        assert r.returncode == 0, r.stderr[-2000:]
    # classic packing: Mamba trains (its time-step layer whole: tests/memtrain/hf/test_architectures.py) and its
    # evaluation scores continuations whole (its cache serves one row: tests/memtrain/hf/test_continuation.py)
    classic = ["--set", "data.document_attention=false", "--out", tmp_path / "mamba-classic"]
    r = cli(*args("mamba", evaluate=True), *classic)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "mamba-classic" / "eval.json").read_text())["val_loss"] > 0
