"""The `memtrain` command: train, eval, export, plan, models, config, and the commands other packages register.

The experiments layer adds sweep, plot and demo through the entry-point group "memtrain.commands"
(pyproject.toml): memtrain itself never imports the layer above it. A registered command is a function
`command(argv) -> exit code` whose docstring is its help line.

Bad input ends with one line `memtrain: error: ...` naming the value and the fix, and exit code 2
(memtrain/commandline.py: the rules every memtrain command line shares).
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points, version
from pathlib import Path

from memtrain.commandline import EXIT_CODES, ArgumentParser, positive_float, run_command

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub on most research clusters' compute nodes
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

COMMAND_GROUP = "memtrain.commands"
TRUST = ("run the Python code a model directory asks for (auto_map); only this flag allows it, never a config "
         "file or a run directory")


def summary_line(result, scores: dict | None = None) -> str:
    """The line `memtrain train` ends with (rank 0): steps, final loss, median throughput, the eval headline."""
    parts = [f"trained {result.steps:,} steps"]
    if result.last:
        parts.append(f"final loss {result.last['loss']:.4f}")
    if result.tokens_per_s is not None:
        parts.append(f"{result.tokens_per_s:,.0f} tokens/s (median)")
    line = "done: " + ", ".join(parts)
    if scores:
        line += f"; eval: exact match {scores['exact_count']}/{scores['n_evaluated']}"
        if scores.get("val_loss") is not None:
            line += f", val loss {scores['val_loss']:.4f}"
    return line


def _train(args) -> None:
    import parallel
    from memtrain import config as config_mod
    from memtrain.evaluate import evaluate_after
    from memtrain.models import allow_remote_code
    from memtrain.run_files import check_output
    from memtrain.training import train

    cfg = config_mod.load(args.config, args.set)
    allow_remote_code(cfg, args.trust_remote_code, args.config or "--set")
    out = check_output(Path("runs") / Path(cfg.model.name).name if args.out is None else args.out, own_run=True)
    result = train(cfg, out, resume=args.resume, force=args.force)
    scores = evaluate_after(cfg, result) if cfg.eval.enabled else None
    result.tracker.finish()
    if result.grid.rank == 0:
        print(summary_line(result, scores))
        print(f"run directory: {out}")
    parallel.shutdown()


def _eval(args) -> None:
    from memtrain.evaluate import evaluate_run

    if (args.run is None) == (args.run_flag is None):
        raise ValueError("memtrain eval takes the run directory exactly once: memtrain eval RUN_DIR")
    result = evaluate_run(Path(args.run or args.run_flag), args.checkpoint, trust_remote_code=args.trust_remote_code)
    if result is None:  # a rank other than 0 of a distributed evaluation
        return
    keys = ("exact_match_rate", "token_match", "rougeL", "pythia_32_score", "exposure_mean", "mia_auc_loss",
            "val_loss")
    print(" ".join(f"{k}={result[k]:.4g}" if isinstance(result[k], float) else f"{k}={result[k]}" for k in keys))


def _export(args) -> None:
    from memtrain.export import export

    ckpt, out = export(args.source, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30),
                       trust_remote_code=args.trust_remote_code)
    print(f"exported {ckpt} to {out}")


def _models(args) -> None:
    from memtrain.models import list_models

    for name in list_models():
        print(name)


def _config(args) -> None:
    from memtrain.config import describe

    print(describe())


def _plan(argv) -> int | None:
    from memtrain.plan.cli import main

    return main(argv)  # `plan --validate` exits 1 when the planner disagrees with the dry run


def registered() -> dict:
    """Commands other packages registered: name -> entry point (loaded only when run or asked for help)."""
    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = registered()
    if argv and argv[0] == "plan":
        return run_command(lambda: _plan(argv[1:]))
    if argv and argv[0] in plugins:
        return run_command(lambda: plugins[argv[0]].load()(argv[1:]))
    parser = ArgumentParser(prog="memtrain", description=__doc__.splitlines()[0], epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"memtrain {version('memtrain')}")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one run (single process, torchrun or srun)", epilog=EXIT_CODES)
    t.add_argument("--config", help="TOML recipe (sections: see `memtrain config`)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    t.add_argument("--out", help="run directory (default runs/<model>)")
    t.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    t.add_argument("--force", action="store_true", help="replace another run's files in --out (fresh runs refuse)")
    t.add_argument("--trust-remote-code", action="store_true", help=TRUST)
    t.set_defaults(fn=_train)
    e = sub.add_parser("eval", help="re-run memorization evaluation of a finished run (one process, torchrun or srun)")
    e.add_argument("run", nargs="?", help="run directory written by `memtrain train`")
    # The flag spelling stays for scripts; after torchrun's `-m memtrain` only the positional parses (torchrun
    # reads `--run` as an abbreviation of its own --run-path).
    e.add_argument("--run", dest="run_flag", metavar="RUN", help="the same, as a flag")
    e.add_argument("--checkpoint", help="checkpoint directory (default: the run's latest)")
    e.add_argument("--trust-remote-code", action="store_true", help=TRUST)
    e.set_defaults(fn=_eval)
    x = sub.add_parser("export", help="write a run's model and tokenizer as a transformers directory")
    x.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="run directory (its latest checkpoint) or a checkpoint")
    x.add_argument("--out", required=True, help="directory for from_pretrained (new, empty, or an earlier export)")
    x.add_argument("--max-shard-gb", type=positive_float, default=5.0,
                   help="largest weights file; a larger model is split as save_pretrained does (default 5)")
    x.add_argument("--trust-remote-code", action="store_true", help=TRUST)
    x.set_defaults(fn=_export)
    sub.add_parser("models", help="list model names").set_defaults(fn=_models)
    sub.add_parser("config", help="every config key with its default and meaning").set_defaults(fn=_config)
    sub.add_parser("plan", help="rank (data, x, y, z) grids for a model on N GPUs: memtrain plan --model M --gpus N")
    for name, ep in plugins.items():
        sub.add_parser(name, help=(ep.load().__doc__ or "").strip().splitlines()[0])
    args = parser.parse_args(argv)
    return run_command(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())

