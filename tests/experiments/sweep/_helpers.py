"""What the sweep tests share: the small spec (3 ladder sizes x {standard, goldfish k=4}), a stand-in for
`python -m memtrain` (FAKE), readers of what it and the sweep wrote, and a small corpus."""

import json
import textwrap
from pathlib import Path

SPEC = textwrap.dedent('''
    [sweep]
    name = "mini"
    description = "fake runs"

    [base.train]
    batch_size = 4

    [base.wandb]
    mode = "disabled"

    [axes]
    "model.name" = ["ladder-1m", "ladder-3m", "ladder-10m"]
    loss = [{ kind = "standard" }, { kind = "goldfish", k = 4 }]
''')

IDS = [f"{m}_{loss}" for m in ("ladder-1m", "ladder-3m", "ladder-10m") for loss in ("standard", "goldfish-k4")]

# Stands in for `python -m memtrain`: `train --config C --out D [--resume]` writes the files of a run.
FAKE = textwrap.dedent('''
    import json, os, signal, sys, time
    from pathlib import Path
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    args = sys.argv[1:]
    assert args[0] == "train", args
    cfg = tomllib.loads(Path(args[args.index("--config") + 1]).read_text())
    out = Path(args[args.index("--out") + 1])
    name = cfg["wandb"].get("name") or out.name
    pretrain = cfg["canaries"].get("number", 8) == 0  # base models train on text alone
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"name": name, "pretrain": pretrain, "resume": "--resume" in args,
                            "rank": os.environ.get("SLURM_PROCID", os.environ.get("RANK")),
                            "init": cfg["model"].get("init"), "config": cfg}) + "\\n")
    if os.environ.get("FAKE_SLEEP") and "--resume" not in args:  # a long run: a checkpoint first, then time
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints" / "latest").write_text("step_000001")
        time.sleep(float(os.environ["FAKE_SLEEP"]))
    if os.environ.get("FAKE_SLOW") and name.startswith(os.environ["FAKE_SLOW"]):  # e.g. a big base's pretraining
        time.sleep(6)
    hold = os.environ.get("FAKE_HOLD")
    if hold and "--resume" not in args:  # a run that ends only when the test says so (the file exists)
        for _ in range(6000):
            if Path(hold).exists():
                break
            time.sleep(0.1)
    if name in os.environ.get("FAKE_FAIL", "").split(","):
        print("  5%|##  | 1/20 [00:01<00:19, loss=7.1]\\rTraceback (most recent call last):", file=sys.stderr)
        print(f"ValueError: planned failure of {name}", file=sys.stderr)
        sys.exit(1)
    kill = Path(os.environ.get("FAKE_KILL_MARK", "/nonexistent"))
    if name == os.environ.get("FAKE_KILL") and not kill.exists():
        kill.write_text("killed")
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)  # a half-done run: no checkpoint pointer
        os.kill(os.getppid(), signal.SIGKILL)  # the sweep dies mid-run, as with `kill -9` or a lost node
        sys.exit(1)
    sizes = {"ladder-1m": 1_000_000, "ladder-3m": 3_000_000, "ladder-10m": 10_000_000}
    params = sizes.get(cfg["model"]["name"], 123)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "loss": 5.0 - step, "lr": 1e-3, "tokens": 2048 * step,
                                "tokens_per_s": 1000.0 + step, "mfu": 0.01, "memory_mb": 100.0,
                                "kept_fraction": 1.0}) + "\\n")
    (out / "run.json").write_text(json.dumps({"stream_key": "k", "trained": {"steps": 3, "epochs": 1},
                                              "grid": {"data": 1}, "mode": "sharded", "params": params}))
    ck = out / "checkpoints" / "step_000003"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "model.safetensors").write_bytes(b"weights")
    (out / "checkpoints" / "latest").write_text("step_000003")
    if pretrain:
        (out / "eval.json").write_text(json.dumps({"val_loss": 4.5, "unigram_entropy": 6.0}))
    else:
        goldfish = cfg["loss"].get("kind") == "goldfish"
        em = 0.0 if goldfish else params / 1e7
        by = {str(c): {"n": 2, "exact_match_rate": min(1.0, em * c), "rougeL": 0.5, "exposure_mean": 2.0 * c,
                       "mia_auc_loss": 0.6} for c in (1, 2, 4, 8)}
        (out / "eval.json").write_text(json.dumps({"exact_match_rate": em, "token_match": 0.5, "rougeL": 0.5,
                                                   "pythia_32_score": 0.1, "exposure_mean": 4.0,
                                                   "mia_auc_loss": 0.6, "val_loss": 3.0, "by_copies": by}))
        rows = [{"id": f"c{i}", "kind": "random", "copies": 1, "inserted": i % 2 == 0, "exact_match": False,
                 "rouge_l": 0.1 * i, "generated_text": "x", "exposure": 1.0} for i in range(4)]
        (out / "eval_canaries.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
''')


def write_corpus(root: Path, count: int = 40) -> Path:
    """`count` distinct short documents (doc00.txt, ...) in the new directory `root`."""
    words = ("the model reads every token of the stream once and the loss drops a hashed subset of "
             "targets so that no passage can be repeated verbatim from memory alone").split()
    root.mkdir()
    for i in range(count):
        text = " ".join(words[(i * 5 + j * (i % 7 + 1)) % len(words)] for j in range(90 + 3 * i))
        (root / f"doc{i:02d}.txt").write_text(f"# note {i}\n{text}\n")
    return root


def launched(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
