"""The `memtrain` command: train, eval, plan, models, config, and the commands other packages register.

The experiments layer adds sweep, plot and demo through the entry-point group "memtrain.commands"
(pyproject.toml): memtrain itself never imports the layer above it. A registered command is a function
`command(argv) -> exit code` whose docstring is its help line.

Bad input ends with one line `memtrain: error: ...` naming the value and the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub on most research clusters' compute nodes
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

COMMAND_GROUP = "memtrain.commands"


def _train(args) -> None:
    import parallel
    from memtrain import config as config_mod
    from memtrain.evaluate import evaluate_after
    from memtrain.training import train

    cfg = config_mod.load(args.config, args.set)
    out = Path(args.out or Path("runs") / Path(cfg.model.name).name)
    result = train(cfg, out, resume=args.resume, force=args.force)
    if cfg.eval.enabled:
        evaluate_after(cfg, result)
    result.tracker.finish()
    if result.grid.rank == 0:
        print(f"run directory: {out}")
    parallel.shutdown()


def _eval(args) -> None:
    from memtrain.evaluate import evaluate_run

    result = evaluate_run(Path(args.run), args.checkpoint)
    keys = ("exact_match_rate", "token_match", "rougeL", "pythia_32_score", "exposure_mean", "mia_auc_loss",
            "val_loss")
    print(" ".join(f"{k}={result[k]:.4g}" if isinstance(result[k], float) else f"{k}={result[k]}" for k in keys))


def _models(args) -> None:
    from memtrain.models import list_models

    for name in list_models():
        print(name)


def _config(args) -> None:
    from memtrain.config import describe

    print(describe())


def _plan(argv) -> None:
    from memtrain.plan.cli import main

    main(argv)


def registered() -> dict:
    """Commands other packages registered: name -> entry point (loaded only when run or asked for help)."""
    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def main(argv: list[str] | None = None) -> int | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = registered()
    if argv and argv[0] == "plan":
        return _run(lambda: _plan(argv[1:]))
    if argv and argv[0] in plugins:
        return _run(lambda: plugins[argv[0]].load()(argv[1:]))
    parser = argparse.ArgumentParser(prog="memtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one run (single process, torchrun or srun)")
    t.add_argument("--config", help="TOML recipe (sections: see `memtrain config`)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    t.add_argument("--out", help="run directory (default runs/<model>)")
    t.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    t.add_argument("--force", action="store_true", help="replace another run's files in --out (fresh runs refuse)")
    t.set_defaults(fn=_train)
    e = sub.add_parser("eval", help="re-run memorization evaluation of a finished run")
    e.add_argument("--run", required=True, help="run directory written by `memtrain train`")
    e.add_argument("--checkpoint", help="checkpoint directory (default: the run's latest)")
    e.set_defaults(fn=_eval)
    sub.add_parser("models", help="list model names").set_defaults(fn=_models)
    sub.add_parser("config", help="every config key with its default and meaning").set_defaults(fn=_config)
    sub.add_parser("plan", help="rank (data, x, y, z) grids for a model on N GPUs: memtrain plan --model M --gpus N")
    for name, ep in plugins.items():
        sub.add_parser(name, help=(ep.load().__doc__ or "").strip().splitlines()[0])
    args = parser.parse_args(argv)
    return _run(lambda: args.fn(args))


def _run(fn) -> int | None:
    try:
        return fn()
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        msg = str(e).strip("'\"") or type(e).__name__
        print(f"memtrain: error: {msg}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
