"""Bad numbers and damaged files, driven through the `memtrain` command as a user types it (issue 24).

Every number a command reads (a config key, a flag, a figure in a bandwidth table or a sweep spec) is finite and
within a bound (memtrain/bounds.py) before any work, and every file it reads (weights, corpora, tokenizers, run.json,
config.toml, checkpoints/latest, results.jsonl, bandwidth tables) is checked where it is read. As in
test_cli_bad_input.py, each case runs in this process (tests/memtrain/_helpers.py `cli`) and must end with a non-zero
exit, exactly one error line (the last on stderr) that starts `memtrain: error:` and names the key, flag or path, no
traceback, every file that existed before byte-identical, and, since a huge value used to make a search or the data
preparation run for minutes, within a time bound.
"""

import json
import os
import shutil
import time

import pytest

from tests.memtrain._helpers import (
    cli,
    finished_tiny_run,
    refused,
    snapshot,
    unchanged,
)

SECONDS = 60
"""Each case's bound: a refusal comes before any real work (the slowest here prepare a 12-document stream first)."""


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace: a finished run, its recipe and corpus, copies of the run with one file damaged each, and
    files made to be wrong (weights, corpora, a tokenizer, bandwidth tables, results files, sweep specs)."""
    root = tmp_path_factory.mktemp("bounds")
    finished_tiny_run(root)
    bad = root / "bad"
    bad.mkdir()
    _damaged_runs(root / "run", bad)
    _damaged_models(root / "run", bad)
    _bad_corpora(bad)
    _bad_tables(bad)
    _bad_sweeps(bad)
    (bad / "inf_lr.toml").write_text("[train]\nlr = inf\n")
    (bad / "binary.toml").write_bytes(bytes(range(128, 256)))
    return root


def _damaged_runs(run, bad):
    for name, file, data in (("latest_binary", "checkpoints/latest", bytes(range(128, 256))),
                             ("latest_elsewhere", "checkpoints/latest", b"../../elsewhere\n"),
                             ("run_json_empty", "run.json", b""),
                             ("run_json_torn", "run.json", (run / "run.json").read_bytes()[:40]),
                             ("run_json_list", "run.json", b"[1, 2]\n"),
                             ("run_json_no_steps", "run.json", b"{}\n"),
                             ("config_binary", "config.toml", bytes(range(128, 256)))):
        shutil.copytree(run, bad / name)
        (bad / name / file).write_bytes(data)


def _damaged_models(run, bad):
    """A model directory and an init directory whose weights are noise, a model whose config.json has a field of
    the wrong type, a tokenizer directory that is not one."""
    for name in ("garbage_model", "garbage_weights"):
        (bad / name).mkdir()
        (bad / name / "model.safetensors").write_bytes(os.urandom(4096))
    (bad / "garbage_model" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2}))
    (bad / "typed_model").mkdir()
    (bad / "typed_model" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "big"}))
    shutil.copytree(run / "tokenizer", bad / "tokenizer_damaged")
    (bad / "tokenizer_damaged" / "tokenizer.json").write_text('{"not": "a tokenizer"}')


def _bad_corpora(bad):
    (bad / "numbers.jsonl").write_text("".join(json.dumps({"text": i}) + "\n" for i in range(20)))
    (bad / "numbers.csv").write_text("text,other\n" + "".join(f"{i},{i}\n" for i in range(20)))
    (bad / "zero.jsonl").write_text("")
    (bad / "noise.parquet").write_bytes(os.urandom(3000))


def _bad_tables(bad):
    (bad / "bw_null.json").write_text("null\n")
    (bad / "bw_zero.json").write_text(json.dumps({"intra_node_gbps": 0, "inter_node_gbps": 0}))
    (bad / "bw_binary.json").write_bytes(bytes(range(256)))
    (bad / "bw_collective_zero.json").write_text(json.dumps({"collectives": {"all_reduce": {"intra": {"2": [0, 5]}}}}))


def _bad_sweeps(bad):
    sweep = ('[sweep]\nname = "s"\n{}[base.wandb]\nmode = "disabled"\n'
             '[axes]\n"model.name" = ["ladder-1m", "ladder-3m"]\n')
    (bad / "spec.toml").write_text(sweep.format(""))
    (bad / "spec_keep_yes.toml").write_text(sweep.format('keep_checkpoints = "yes"\n'))
    (bad / "spec_pretrain_typo.toml").write_text(sweep.format("") + '[pretrain]\nsteps = 2\ncorpus = "same"\n'
                                                 'set = ["train.lrr=1"]\n')
    (bad / "spec_pretrain_inf.toml").write_text(sweep.format("") + "[pretrain]\nsteps = 2\nlr = inf\n")
    records = {"results_point_list": {"point": [1, 2], "status": "ok"},
               "results_wrong_types": {"point": "a", "status": "ok", "eval": [1], "canaries": 5},
               "results_pass_cells": {"point": "a", "status": "ok", "passes": [{"pass": 1, "members": {"cells": [1]}}]}}
    for name, record in records.items():
        (bad / name).mkdir()
        (bad / name / "results.jsonl").write_text(json.dumps(record) + "\n")
    (bad / "results_binary").mkdir()
    (bad / "results_binary" / "results.jsonl").write_bytes(bytes(range(256)) * 4)


TRAIN = ["train", "--config", "{recipe}", "--out", "{fresh}"]
PLAN = ["plan", "--model", "ladder-1m", "--gpus", "4"]
RESUME = ["sweep", "{bad}/spec.toml", "--resume", "--runner", "false", "--out"]
CASES = [
    # numbers in the config: finite, and bounded before any work
    ("lr-inf", [*TRAIN, "--set", "train.lr=inf"], "train.lr=inf"),
    ("lr-nan", [*TRAIN, "--set", "train.lr=nan"], "train.lr=nan"),
    ("lr-inf-in-recipe", ["train", "--config", "{bad}/inf_lr.toml", "--out", "{fresh}"], "train.lr=inf"),
    ("seed-negative", [*TRAIN, "--set", "train.seed=-1"], "train.seed=-1"),
    ("seed-huge", [*TRAIN, "--set", "train.seed=1099511627776"], "train.seed"),
    ("canary-seed-negative", [*TRAIN, "--set", "canaries.seed=-3"], "canaries.seed=-3"),
    ("timeout-inf", [*TRAIN, "--set", "parallel.timeout_s=inf"], "parallel.timeout_s"),
    ("timeout-1e20", [*TRAIN, "--set", "parallel.timeout_s=1e20"], "parallel.timeout_s"),
    ("seq-len-huge", [*TRAIN, "--set", "data.seq_len=1000000000"], "data.seq_len"),
    ("canaries-number-huge", [*TRAIN, "--set", "canaries.number=1000000000"], "canaries.number"),
    ("canary-copies-huge", [*TRAIN, "--set", "canaries.copies=[100000000]"], "canaries.copies"),
    ("canary-rows-too-many", [*TRAIN, "--set", "canaries.number=10000", "--set", "canaries.copies=[100]"],
     "canaries.number"),
    ("document-canaries-beyond-the-corpus", [*TRAIN, "--set", "canaries.number=5000", "--set",
                                             "canaries.kinds=['document']"], "canaries.number"),
    ("max-steps-huge", [*TRAIN, "--set", "train.max_steps=" + "9" * 40], "train.max_steps"),
    ("degree-huge", [*TRAIN, "--set", "parallel.x=1000000000"], "parallel.x"),
    ("set-key-twice", [*TRAIN, "--set", "train.seed=1", "--set", "train.seed=2"], "train.seed"),
    ("recipe-binary", ["train", "--config", "{bad}/binary.toml", "--out", "{fresh}"], "binary.toml"),
    # weights, corpora and tokenizers: checked where they are read
    ("model-weights-garbage", [*TRAIN, "--set", "model.name='{bad}/garbage_model'"], "garbage_model"),
    ("init-weights-garbage", [*TRAIN, "--set", "model.init='{bad}/garbage_weights'"], "garbage_weights"),
    ("model-config-typed-wrong", [*TRAIN, "--set", "model.name='{bad}/typed_model'"], "typed_model"),
    ("corpus-jsonl-numbers", [*TRAIN, "--set", "data.corpus='{bad}/numbers.jsonl'"], "numbers.jsonl"),
    ("corpus-csv-numeric", [*TRAIN, "--set", "data.corpus='{bad}/numbers.csv'"], "numbers.csv"),
    ("corpus-jsonl-0-bytes", [*TRAIN, "--set", "data.corpus='{bad}/zero.jsonl'"], "zero.jsonl"),
    ("corpus-parquet-noise", [*TRAIN, "--set", "data.corpus='{bad}/noise.parquet'"], "noise.parquet"),
    ("tokenizer-damaged", [*TRAIN, "--set", "data.tokenizer='{bad}/tokenizer_damaged'"], "tokenizer_damaged"),
    # a run's own files
    ("eval-latest-binary", ["eval", "{bad}/latest_binary"], "latest"),
    ("export-latest-binary", ["export", "{bad}/latest_binary", "--out", "{fresh}"], "latest"),
    ("eval-latest-outside-the-run", ["eval", "{bad}/latest_elsewhere"], "latest"),
    ("resume-latest-binary", ["train", "--config", "{recipe}", "--out", "{bad}/latest_binary", "--resume"], "latest"),
    ("eval-run-json-empty", ["eval", "{bad}/run_json_empty"], "run.json"),
    ("eval-run-json-torn", ["eval", "{bad}/run_json_torn"], "run.json"),
    ("eval-run-json-not-an-object", ["eval", "{bad}/run_json_list"], "run.json"),
    ("eval-run-json-without-steps", ["eval", "{bad}/run_json_no_steps"], "trained.steps"),
    ("eval-config-binary", ["eval", "{bad}/config_binary"], "config.toml"),
    ("export-shard-size-huge", ["export", "{run}", "--out", "{fresh}", "--max-shard-gb", "1e308"], "--max-shard-gb"),
    # the planner: its flags, searches and bandwidth tables
    ("plan-gpus-huge", ["plan", "--model", "ladder-1m", "--gpus", "100000000000"], "--gpus"),
    ("plan-batch-huge", [*PLAN, "--batch", "100000000000"], "--batch"),
    ("plan-memory-nan", [*PLAN, "--gpu-memory-gb", "nan"], "--gpu-memory-gb"),
    ("plan-sizes-not-numbers", ["plan", "--measure", "--sizes", "abc"], "--sizes-mb"),
    ("plan-bandwidth-null", [*PLAN, "--bandwidth", "{bad}/bw_null.json"], "bw_null.json"),
    ("plan-bandwidth-zero", [*PLAN, "--bandwidth", "{bad}/bw_zero.json"], "intra_node_gbps"),
    ("plan-bandwidth-binary", [*PLAN, "--bandwidth", "{bad}/bw_binary.json"], "bw_binary.json"),
    ("plan-bandwidth-collective-zero", [*PLAN, "--bandwidth", "{bad}/bw_collective_zero.json"], "collectives"),
    # sweeps: specs, --set, and results files read by --resume and by plot
    ("sweep-keep-checkpoints-string", ["sweep", "{bad}/spec_keep_yes.toml", "--list"], "keep_checkpoints"),
    ("sweep-keep-checkpoints-set-string", ["sweep", "{bad}/spec.toml", "--list", "--set",
                                           "sweep.keep_checkpoints=no"], "keep_checkpoints"),
    ("sweep-pretrain-key-mistyped", ["sweep", "{bad}/spec_pretrain_typo.toml", "--list"], "train.lrr"),
    ("sweep-pretrain-lr-inf", ["sweep", "{bad}/spec_pretrain_inf.toml", "--list"], "pretrain.lr"),
    ("sweep-set-key-twice", ["sweep", "{bad}/spec.toml", "--list", "--set", "pretrain.steps=1", "--set",
                             "pretrain.steps=2"], "pretrain.steps"),
    ("sweep-nproc-huge", ["sweep", "{bad}/spec.toml", "--list", "--nproc", "100000"], "--nproc"),
    ("resume-results-point-list", [*RESUME, "{bad}/results_point_list"], "results.jsonl"),
    ("resume-results-wrong-types", [*RESUME, "{bad}/results_wrong_types"], "results.jsonl"),
    ("resume-results-binary", [*RESUME, "{bad}/results_binary"], "results.jsonl"),
    ("plot-results-point-list", ["plot", "{bad}/results_point_list", "--out", "{fresh}"], "results.jsonl"),
    ("plot-results-wrong-types", ["plot", "{bad}/results_wrong_types", "--out", "{fresh}"], "results.jsonl"),
    ("plot-results-pass-cells", ["plot", "{bad}/results_pass_cells", "--out", "{fresh}"], "results.jsonl"),
]


@pytest.mark.parametrize("argv, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_number_or_file_is_one_line_fast_and_changes_nothing(ws, tmp_path, argv, expect):
    values = {"recipe": ws / "tiny.toml", "run": ws / "run", "bad": ws / "bad", "fresh": tmp_path / "fresh"}
    before = snapshot(ws)
    start = time.perf_counter()
    r = cli(*[a.format(**values) for a in argv])
    seconds = time.perf_counter() - start
    refused(r, expect)
    assert seconds < SECONDS, f"{seconds:.0f} s before the error"
    assert unchanged(before, ws)


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
