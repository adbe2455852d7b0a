"""Bad input, driven through the `memtrain` command as a user types it.

Every case runs in this process (tests/memtrain/_helpers.py `cli`: the same exit code, stdout and stderr as a new
`memtrain` process, and nothing left behind in this one); test_cli.py runs the command as a new process. Every case
must end with a non-zero exit, exactly one error line (the last on stderr; progress lines may come
before it) that starts `memtrain: error:` and names the offending key, value or path, no traceback, and every
file that existed before byte-identical (a finished run, its recipe, its corpus, files made to be wrong).
"""


import pytest

from tests.memtrain._helpers import (
    cli,
    finished_tiny_run,
    refused,
    snapshot,
    unchanged,
)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace with a finished run, its recipe and corpus, and files made to be wrong."""
    root = tmp_path_factory.mktemp("ws")
    finished_tiny_run(root)
    bad = root / "bad"
    bad.mkdir()
    (bad / "binary").mkdir()
    (bad / "binary" / "blob.txt").write_bytes(bytes(range(256)) * 64)
    (bad / "empty").mkdir()
    (bad / "empty" / "nothing.txt").write_text("")
    (bad / "malformed.json").write_text('{"text": "unterminated')
    (bad / "a_file").write_text("not a directory\n")
    (bad / "broken.toml").write_text("[train\nlr = 1\n")
    (bad / "string_lr.toml").write_text('[train]\nlr = "fast"\n')
    (bad / "list_section.toml").write_text("train = [1, 2]\n")
    (bad / "spec_bad_key.toml").write_text('[sweep]\nname = "s"\n[axes]\n"model.name" = ["ladder-1m"]\n'
                                           '[base.train]\nlrr = 1\n')
    (bad / "results_list").mkdir()
    (bad / "results_list" / "results.jsonl").write_text("[1, 2, 3]\n")
    (bad / "results_junk").mkdir()
    (bad / "results_junk" / "results.jsonl").write_text("{not json\n")
    (bad / "results_empty").mkdir()
    (bad / "results_empty" / "results.jsonl").write_text("")
    return root


TRAIN = ["train", "--config", "{recipe}", "--out", "{fresh}"]
RESUME = ["train", "--config", "{recipe}", "--out", "{run}", "--resume"]
CASES = [
    # values of the wrong type or out of range
    ("lr-not-a-number", [*TRAIN, "--set", "train.lr=abc"], "train.lr"),
    ("lr-string-in-toml", ["train", "--config", "{bad}/string_lr.toml", "--out", "{fresh}"], "train.lr"),
    ("epochs-negative", [*TRAIN, "--set", "train.epochs=-1"], "train.epochs"),
    ("max-steps-zero", [*TRAIN, "--set", "train.max_steps=0"], "train.max_steps"),
    ("suffix-zero", [*TRAIN, "--set", "eval.suffix_len=0"], "eval.suffix_len"),
    ("suffix-covers-canary", [*TRAIN, "--set", "eval.suffix_len=16", "--set", "canaries.kinds=['document']"],
     "eval.suffix_len"),
    ("corpus-empty-string", [*TRAIN, "--set", "data.corpus="], "data.corpus"),
    ("warmup-negative", [*TRAIN, "--set", "train.warmup_steps=-3"], "train.warmup_steps"),
    ("grad-clip-negative", [*TRAIN, "--set", "train.grad_clip=-1.0"], "train.grad_clip"),
    ("checkpoint-every-negative", [*TRAIN, "--set", "train.checkpoint_every=-5"], "train.checkpoint_every"),
    ("micro-batch-zero", [*TRAIN, "--set", "train.micro_batch_size=0"], "train.micro_batch_size"),
    ("micro-batch-not-dividing", [*TRAIN, "--set", "train.micro_batch_size=3"],
     "train.micro_batch_size=3 does not divide this rank's 4 sequences per step: use one of [1, 2, 4]"),
    ("val-docs-zero", [*TRAIN, "--set", "eval.val_docs=0"], "eval.val_docs"),
    ("batch-zero", [*TRAIN, "--set", "train.batch_size=0"], "train.batch_size"),
    ("log-every-zero", [*TRAIN, "--set", "train.log_every=0"], "train.log_every"),
    ("min-lr-above-lr", [*TRAIN, "--set", "train.min_lr=1.0"], "train.min_lr"),
    ("beta-above-one", [*TRAIN, "--set", "train.beta2=1.5"], "train.beta2"),
    ("precision-unknown", [*TRAIN, "--set", "train.precision=fp8"], "train.precision"),
    ("seq-len-one", [*TRAIN, "--set", "data.seq_len=1"], "data.seq_len"),
    ("vocab-tiny", [*TRAIN, "--set", "data.vocab_size=10"], "data.vocab_size"),
    ("canaries-negative", [*TRAIN, "--set", "canaries.number=-1"], "canaries.number"),
    ("goldfish-k-one", [*TRAIN, "--set", "loss.kind='goldfish'", "--set", "loss.k=1"], "loss.k"),
    ("loss-kind-unknown", [*TRAIN, "--set", "loss.kind=fish"], "loss.kind"),
    ("wandb-mode-unknown", [*TRAIN, "--set", "wandb.mode=cloud"], "wandb.mode"),
    ("timeout-zero", [*TRAIN, "--set", "parallel.timeout_s=0"], "parallel.timeout_s"),
    # keys and recipes
    ("key-misspelled", [*TRAIN, "--set", "train.sed=1"], "train.sed"),
    ("section-unknown", [*TRAIN, "--set", "trian.seed=1"], "trian"),
    ("set-without-equals", [*TRAIN, "--set", "train.lr"], "train.lr"),
    ("recipe-missing", ["train", "--config", "{bad}/nope.toml", "--out", "{fresh}"], "nope.toml"),
    ("recipe-malformed", ["train", "--config", "{bad}/broken.toml", "--out", "{fresh}"], "broken.toml"),
    ("recipe-section-not-table", ["train", "--config", "{bad}/list_section.toml", "--out", "{fresh}"], "train"),
    ("recipe-section-not-table-and-set", ["train", "--config", "{bad}/list_section.toml", "--out", "{fresh}",
                                          "--set", "train.lr=0.1"], "config section [train] must be a table"),
    ("model-unknown", [*TRAIN, "--set", "model.name=ladder-9z"], "ladder-9z"),
    # the machine and the grid
    ("nccl-without-cuda", [*TRAIN, "--set", "parallel.backend=nccl"], "nccl"),
    ("grid-larger-than-world", [*TRAIN, "--set", "parallel.x=3"], "parallel"),
    # corpora
    ("corpus-missing", [*TRAIN, "--set", "data.corpus='{bad}/no_such_dir'"], "no_such_dir"),
    ("corpus-binary", [*TRAIN, "--set", "data.corpus='{bad}/binary'"], "binary"),
    ("corpus-empty-file", [*TRAIN, "--set", "data.corpus='{bad}/empty'"], "empty"),
    ("corpus-malformed-json", [*TRAIN, "--set", "data.corpus='{bad}/malformed.json'"], "malformed.json"),
    # run directories
    ("out-is-a-file", [*TRAIN[:-1], "{bad}/a_file"], "a_file"),
    ("out-not-writable", [*TRAIN[:-1], "/sys/memtrain-run"], "/sys/memtrain-run"),  # EPERM, even for root
    ("fresh-into-finished-run", [*TRAIN[:-1], "{run}"], "--force"),
    ("resume-nothing", [*TRAIN, "--resume"], "config.toml"),
    ("resume-changes-seed", [*RESUME, "--set", "train.seed=7"], "train.seed"),
    ("resume-changes-model", [*RESUME, "--set", "data.seq_len=48"], "data.seq_len"),
    # evaluation
    ("eval-run-missing", ["eval", "--run", "{bad}/no_run"], "no_run"),
    ("eval-run-is-file", ["eval", "--run", "{bad}/a_file"], "a_file"),
    ("eval-run-twice", ["eval", "{run}", "--run", "{run}"], "RUN_DIR"),
    ("eval-checkpoint-missing", ["eval", "--run", "{run}", "--checkpoint", "{bad}/no_ckpt"], "no_ckpt"),
    ("eval-checkpoint-corrupt", ["eval", "--run", "{run}", "--checkpoint", "{bad}/empty"], "empty"),
    # the planner
    ("plan-batch-zero", ["plan", "--model", "ladder-1m", "--gpus", "4", "--batch", "0"], "--batch"),
    ("plan-top-negative", ["plan", "--model", "ladder-1m", "--gpus", "4", "--top", "-1"], "--top"),
    ("plan-gpus-zero", ["plan", "--model", "ladder-1m", "--gpus", "0"], "--gpus"),
    ("plan-json-is-dir", ["plan", "--model", "ladder-1m", "--gpus", "4", "--json", "{bad}"], "bad"),
    ("plan-model-unknown", ["plan", "--model", "ladder-9z", "--gpus", "4"], "ladder-9z"),
    ("plan-machine-unknown", ["plan", "--model", "ladder-1m", "--gpus", "4", "--machine", "cray-9"], "cray-9"),
    ("plan-missing-gpus", ["plan", "--model", "ladder-1m"], "--gpus"),
    # sweeps and reports
    ("sweep-spec-missing", ["sweep", "no-such-preset", "--out", "{fresh}"], "no-such-preset"),
    ("sweep-spec-bad-key", ["sweep", "{bad}/spec_bad_key.toml", "--out", "{fresh}"], "lrr"),
    ("sweep-jobs-zero", ["sweep", "quick", "--jobs", "0", "--out", "{fresh}"], "--jobs"),
    ("sweep-nproc-zero", ["sweep", "quick", "--nproc", "0", "--out", "{fresh}"], "--nproc"),
    ("sweep-set-bad-value", ["sweep", "quick", "--set", "train.lr=abc", "--out", "{fresh}"], "train.lr"),
    ("plot-missing", ["plot", "{bad}/no_sweep"], "no_sweep"),
    ("plot-results-list", ["plot", "{bad}/results_list"], "results.jsonl"),
    ("plot-results-junk", ["plot", "{bad}/results_junk"], "results.jsonl"),
    ("plot-results-empty", ["plot", "{bad}/results_empty"], "results.jsonl"),
    ("demo-bad-jobs", ["demo", "--jobs", "-2", "--out", "{fresh}"], "--jobs"),
    # the command line itself
    ("command-unknown", ["trian"], "trian"),
    ("option-unknown", ["train", "--lr", "1"], "--lr"),
]


@pytest.mark.parametrize("argv, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(ws, tmp_path, argv, expect):
    values = {"recipe": ws / "tiny.toml", "run": ws / "run", "bad": ws / "bad", "fresh": tmp_path / "fresh"}
    before = snapshot(ws)
    refused(cli(*[a.format(**values) for a in argv]), expect)
    assert unchanged(before, ws)


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
