"""The `memtrain` command as a user runs it: every command's own --help, and what `memtrain train` says while it
works and when it ends (progress lines on stderr from global rank 0 only, quiet when the data is cached, one
summary line on stdout whose numbers are the run's own files')."""

import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.memtrain._helpers import CPU_RANKS, ENV, ROOT, cli, memtrain, memtrain_cold

COMMANDS = ["train", "eval", "models", "config", "plan", "sweep", "plot", "demo"]


def _assert_own_help(r, command):
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(f"usage: memtrain {command} "), r.stdout[:300]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_the_commands_own(command):
    _assert_own_help(cli(command, "--help"), command)  # in this process: the same exit code and output


@pytest.mark.parametrize("how", ["python -m memtrain", "console script"])
def test_the_command_runs_as_a_new_process(how, tmp_path):
    """The two ways a user starts it: the help of a command of memtrain's own (train) and of one an entry point
    registers (sweep), and bad input after the heavy imports (torch for train, transformers for export): a new
    process prints nothing else on stderr (the other tests run the commands in their own process: `cli`)."""
    script = Path(sys.executable).with_name("memtrain")  # what `pip install` put beside this interpreter

    def run(*args):
        if how == "python -m memtrain":
            return memtrain_cold(*args)
        return subprocess.run([str(script), *map(str, args)], capture_output=True, text=True, env=ENV, cwd=ROOT,
                              timeout=120)

    command = "train" if how == "python -m memtrain" else "sweep"
    r = run(command, "--help")
    _assert_own_help(r, command)
    assert r.stderr == ""
    (tmp_path / "notes.txt").write_text("not a run")
    bad = ["train", "--set", "train.lr=abc"] if how == "python -m memtrain" else ["export", tmp_path, "--out",
                                                                                  tmp_path / "hf"]
    r = run(*bad)
    assert r.returncode == 2 and r.stdout == "", r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memtrain: error:"), r.stderr[-3000:]


@pytest.mark.parametrize("how", ["python -m memtrain", "console script"])
def test_a_process_of_a_launched_world_ends_with_its_code_and_all_its_output(how):
    """In a world of several processes (WORLD_SIZE from torchrun) the command ends with os._exit, past gloo's random
    abort at interpreter teardown: what it printed must still arrive, and its exit code must be main()'s."""
    env = dict(ENV, WORLD_SIZE="2")
    head = [sys.executable, "-m", "memtrain"] if how == "python -m memtrain" else \
        [str(Path(sys.executable).with_name("memtrain"))]
    r = subprocess.run([*head, "models"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "width-384" in r.stdout and r.stdout.endswith("\n"), r.stdout[-500:] + r.stderr
    r = subprocess.run([*head, "train", "--set", "train.lr=abc"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("memtrain: error:"), r.stderr[-2000:]


@pytest.fixture(scope="module")
def recipe(tiny_run):
    """The tiny recipe of tests/memtrain/conftest.py, over a corpus with two files that are not UTF-8."""
    return tiny_run.recipe, tiny_run.corpus


def _lines(stderr: str) -> list[str]:
    """stderr as lines; tqdm redraws its bar with carriage returns, so those end lines too."""
    return [x.strip() for x in re.split(r"[\r\n]+", stderr) if x.strip()]


def _starting(lines: list[str], prefix: str) -> list[str]:
    return [x for x in lines if x.startswith(prefix)]


def _expected_summary(out, with_eval: bool) -> str:
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    line = (f"done: trained 6 steps, final loss {metrics[-1]['loss']:.4f}, "
            f"{statistics.median(m['tokens_per_s'] for m in metrics):,.0f} tokens/s (median)")
    if with_eval:
        e = json.loads((out / "eval.json").read_text())
        line += f"; eval: exact match {e['exact_count']}/{e['n_evaluated']}, val loss {e['val_loss']:.4f}"
        if e["not_reached"]:  # 6 steps stop before the stream's end: the headline names what they never saw
            ids = e["not_reached"]
            line += (f"; {len(ids)} canaries never reached in 6 steps (scored as 0 copies: "
                     f"{', '.join(ids[:4])}{', ...' if len(ids) > 4 else ''})")
    return line


def test_train_reports_progress_and_ends_with_one_summary_line(tiny_run, tmp_path):
    path, corpus = tiny_run.recipe, tiny_run.corpus
    skipped = f"data: skipped 2 files that are not UTF-8, e.g. {corpus / 'zz_koi8.txt'} ("  # first by path

    r = tiny_run.process  # the recipe's first run, into a fresh cache
    assert r.returncode == 0, r.stderr[-3000:]
    lines = _lines(r.stderr)
    assert len(_starting(lines, "data: skipped")) == 1 and _starting(lines, "data: skipped")[0].startswith(skipped)
    stage = r"\.\.\. \d+\.\d s$"  # a stage line ends with its duration
    assert [x for x in lines if re.match(r"data: corpus '.*': 40 documents, [\d,.M]+ chars; training a byte-level "
                                         rf"BPE tokenizer \(vocab 512\){stage}", x)], lines[:10]
    assert [x for x in lines if re.match(rf"data: tokenizing 40 documents and packing .* of 64 tokens{stage}", x)]
    for what in ("extraction of 4 canaries", "membership inference", "exposure of 2 random canaries",
                 "validation loss"):
        found = _starting(lines, f"eval: {what}")
        assert len(found) == 1 and re.search(stage, found[0]), (what, lines[-12:])
    assert len(_starting(lines, "eval: done in")) == 1
    first = tiny_run.out
    assert r.stdout.splitlines() == [_expected_summary(first, True), f"run directory: {first}"]

    # Everything cached: no data line but the skipped files' (every run reads the corpus), no eval without eval.
    r = memtrain("train", "--config", path, "--out", tmp_path / "again", "--set", "eval.enabled=false")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = _lines(r.stderr)
    data = _starting(lines, "data:")
    assert len(data) == 1 and data[0].startswith(skipped), data
    assert not _starting(lines, "eval:")
    assert r.stdout.splitlines()[0] == _expected_summary(tmp_path / "again", False)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "memtrain"]


@pytest.fixture(scope="module")
def on_two_ranks(recipe, tmp_path_factory):
    """`memtrain train` on 2 ranks (x=2) under torchrun, evaluated on its grid, with a time-based checkpoint due
    after every step: (the finished process, its run directory). Read only: a test that changes it copies it."""
    path, _ = recipe
    out = tmp_path_factory.mktemp("two_ranks") / "run"
    r = subprocess.run([*TORCHRUN, "train", "--config", str(path), "--out", str(out), "--set", "parallel.x=2",
                        "--set", "train.checkpoint_every_min=1e-9"], capture_output=True, text=True, env=CPU_RANKS,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r, out


def test_only_global_rank_0_reports(on_two_ranks):
    """Two ranks under torchrun: the corpus is read on both (skipped files found on both), every line once. The
    time-based checkpoint every step (rank 0's clock, broadcast) runs the collective save on both ranks alike, and
    rank 0 keeps the newest three (train.keep_checkpoints)."""
    r, out = on_two_ranks
    lines = _lines(r.stderr)
    assert len(_starting(lines, "data: skipped 2 files")) == 1, r.stderr[-3000:]
    for what in ("extraction of 4 canaries", "membership inference", "exposure of 2 random canaries",
                 "validation loss", "done in"):
        assert len(_starting(lines, f"eval: {what}")) == 1, (what, r.stderr[-3000:])
    assert [x for x in r.stdout.splitlines() if x.startswith("done: ")] == [_expected_summary(out, True)]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_00000{i}" for i in range(4, 7)]


def _rows(out):
    return [json.loads(x) for x in (out / "eval_canaries.jsonl").read_text().splitlines()]


def _assert_same_eval(got, want):
    """Greedy tokens and their metrics equal; losses and MIA scores within 1e-5 relative (sharded matmuls and the
    vocabulary-parallel softmax sum in another order than the plain model's)."""
    a, b = json.loads((want / "eval.json").read_text()), json.loads((got / "eval.json").read_text())
    assert (b["exact_count"], b["n_evaluated"], b["mia_auc_loss"]) == (a["exact_count"], a["n_evaluated"],
                                                                        a["mia_auc_loss"])
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
    for x, y in zip(_rows(want), _rows(got), strict=True):
        assert (y["generated"], y["token_match"], y["rouge_l"]) == (x["generated"], x["token_match"], x["rouge_l"])
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["min_k_pp"] == pytest.approx(x["min_k_pp"],
                                                                                                   rel=1e-5)


def test_a_distributed_run_evaluates_on_its_grid(on_two_ranks, tmp_path):
    """`memtrain train` on 2 ranks (x=2) evaluates on its grid; `memtrain eval` under torchrun evaluates again on a
    grid of the run's x from the sharded checkpoint; both equal `memtrain eval` on one process, each printed once."""
    r, trained = on_two_ranks
    out = tmp_path / "run"
    shutil.copytree(trained, out, ignore=shutil.ignore_patterns(".lock"))
    assert [x for x in r.stdout.splitlines() if x.startswith("done: ")] == [_expected_summary(out, True)]
    on_grid, one_process = tmp_path / "grid", tmp_path / "one"
    on_grid.mkdir()
    one_process.mkdir()
    for name in ("eval.json", "eval_canaries.jsonl"):
        (on_grid / name).write_bytes((out / name).read_bytes())
    r = memtrain("eval", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_eval(on_grid, out)
    for name in ("eval.json", "eval_canaries.jsonl"):  # the single-process files, for the comparison below
        (one_process / name).write_bytes((out / name).read_bytes())
    one = json.loads((out / "eval.json").read_text())
    r = subprocess.run([*TORCHRUN, "eval", str(out)], capture_output=True, text=True, env=CPU_RANKS, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert len([x for x in r.stdout.splitlines() if x.startswith("exact_match_rate=")]) == 1, r.stdout
    assert json.loads((out / "eval.json").read_text())["exact_count"] == one["exact_count"]
    _assert_same_eval(out, one_process)


def test_commands_that_train_nothing_never_import_torch_dynamo():
    """`memtrain plan`, `config` and a bad-input exit of `train` build no optimizer and compile nothing, so
    torch._dynamo (1.3 s of a 4.4 s start) stays out: the engine's eager-under-compile layers import it lazily."""
    probe = ("import contextlib, io, sys\nfrom memtrain.cli import main\n"
             "def code(argv):\n"
             "    try:\n        return main(argv)\n    except SystemExit as e:  # bad input\n        return e.code\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
             "    codes = [code(['plan', '--model', 'ladder-1m', '--gpus', '8']), code(['config']),\n"
             "             code(['train', '--set', 'train.lr=abc'])]\n"
             "print(codes, 'torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["[0,", "0,", "2]", "False"], r.stdout


@pytest.mark.parametrize("argv", [["sweep", "single-pass", "--list"], ["config"],
                                  ["plan", "--model", "ladder-1m", "--gpus", "8"]])
def test_output_into_a_closed_pipe_ends_quietly_with_141(argv):
    """`memtrain sweep single-pass --list | head -1`: the reader gone before the output comes, the command ends as
    a process killed by SIGPIPE would (141, nothing on stderr), not as bad input (2, '[Errno 32] Broken pipe')."""
    p = subprocess.Popen([sys.executable, "-m", "memtrain", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=ENV, cwd=ROOT)
    p.stdout.close()  # before it writes: its imports take a second
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141 and err == b"", err.decode()[-2000:]
