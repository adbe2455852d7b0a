"""The `memtrain` command: train, eval, export, plan, models, config, and the commands other packages register.

The experiments layer adds sweep, plot and demo through the entry-point group "memtrain.commands"
(pyproject.toml): memtrain itself never imports the layer above it. A registered command is a function
`command(argv) -> exit code` whose docstring is its help line.

Bad input ends with one line `memtrain: error: ...` naming the value and the fix, and exit code 2
(memtrain/commandline.py: the rules every memtrain command line shares).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from importlib.metadata import entry_points, version
from pathlib import Path

from memtrain.commandline import EXIT_CODES, ArgumentParser, closed_pipe, positive_float, positive_int, run_command

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
        if scores.get("not_scored"):
            line += (f"; {len(scores['not_scored'])} canaries too short for eval.suffix_len={scores['suffix_len']} "
                     "not scored")
        if scores.get("not_reached"):
            shown = ", ".join(map(str, scores["not_reached"][:4])) + (", ..." if len(scores["not_reached"]) > 4 else "")
            line += (f"; {len(scores['not_reached'])} canaries never reached in {result.steps:,} steps (scored as "
                     f"0 copies: {shown})")
    return line


def _train(args) -> None:
    import parallel
    from memtrain import config as config_mod
    from memtrain.models import allow_remote_code
    from memtrain.run_files import check_output
    from memtrain.training import train

    cfg = config_mod.load(args.config, args.set)
    allow_remote_code(cfg, args.trust_remote_code, args.config or "--set")
    out = check_output(Path("runs") / Path(cfg.model.name).name if args.out is None else args.out, own_run=True)
    result = train(cfg, out, resume=args.resume, force=args.force)
    scores = None
    if cfg.eval.enabled:
        # Imported only here: what evaluation loads (scipy.stats, datasets) adds ~1 s to the start of every run.
        from memtrain.evaluate import evaluate_after

        scores = evaluate_after(cfg, result)
    result.tracker.finish()
    if result.grid.rank == 0:
        print(summary_line(result, scores))
        print(f"run directory: {out}")
    parallel.shutdown()


def _eval(args) -> None:
    if args.model is not None:
        _audit(args)
        return
    from memtrain.evaluate import evaluate_run

    if (args.run is None) == (args.run_flag is None):
        raise ValueError("memtrain eval takes the run directory exactly once (memtrain eval RUN_DIR), or a model and "
                         "canaries: memtrain eval --model DIR --canaries FILE --out DIR")
    if args.canaries is not None:
        raise ValueError("--canaries scores a file against --model: memtrain eval --model RUN_OR_DIR --canaries FILE "
                         "--out DIR (a run's own canaries: memtrain eval RUN_DIR)")
    result = evaluate_run(Path(args.run or args.run_flag), args.checkpoint, trust_remote_code=args.trust_remote_code,
                          overrides=_eval_overrides(args), out=args.out)
    if result is None:  # a rank other than 0 of a distributed evaluation
        return
    keys = ("exact_match_rate", "token_match", "rougeL", "pythia_32_score", "exposure_mean", "mia_auc_loss",
            "val_loss")
    print(" ".join(f"{k}={result[k]:.4g}" if isinstance(result[k], float) else f"{k}={result[k]}" for k in keys))


def _eval_overrides(args) -> list[str]:
    return args.set + ([f"eval.suffix_len={args.suffix_len}"] if args.suffix_len is not None else [])


def _audit(args) -> None:
    from memtrain.audit import audit, table

    if args.run is not None or args.run_flag is not None or args.checkpoint is not None:
        raise ValueError("--model names what to evaluate: drop the run directory and --checkpoint (a checkpoint "
                         "directory can be the --model)")
    if args.canaries is None or args.out is None:
        raise ValueError("memtrain eval --model needs --canaries FILE and --out DIR (a run's own canaries: memtrain "
                         "eval RUN_DIR)")
    result = audit(args.model, args.canaries, args.out, _eval_overrides(args), args.trust_remote_code)
    if result is not None:
        print(table(result))
        print(f"results: {Path(args.out) / 'eval.json'}")


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
    # Here, not at the top: memtrain.config imports transformers, which reads HF_HUB_OFFLINE (set above) once.
    from memtrain.config import keys_help, override_type

    parser = ArgumentParser(prog="memtrain", description=__doc__.splitlines()[0], epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"memtrain {version('memtrain')}")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one run (single process, torchrun or srun)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"config keys (--set SECTION.KEY=VALUE, or a --config recipe):\n{keys_help()}\n\n"
                       + textwrap.fill(EXIT_CODES, 100))
    t.add_argument("--config", help="TOML recipe (`memtrain config` writes one with every key at its default)")
    t.add_argument("--set", action="append", default=[], type=override_type(), metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable): VALUE in TOML syntax (3e-4, true, [1, 2], \"text\"; "
                        "bare text is a string; none where the default is none), refused at once unless of the "
                        "key's type and range. Every key with its type, default and meaning is listed below")
    t.add_argument("--out", help="run directory (default runs/<model>)")
    t.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    t.add_argument("--force", action="store_true", help="replace another run's files in --out (fresh runs refuse)")
    t.add_argument("--trust-remote-code", action="store_true", help=TRUST)
    t.set_defaults(fn=_train)
    e = sub.add_parser("eval", help="memorization evaluation: of a finished run again, or of any model on a canary "
                       "file (one process, torchrun or srun)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="  memtrain eval RUN_DIR     a run's canaries again (from its checkpoint)\n"
                       "  memtrain eval --model DIR --canaries F.jsonl --out OUT     your canaries, any model\n\n"
                       "canary file: one JSON object a line, {\"text\": ...} or {\"prefix\": ..., \"suffix\": ...}, "
                       "optional id, kind, twin, copies (memtrain/data/canary_file.py)\n\n"
                       f"keys for --set (and parallel.* for a grid under torchrun):\n{keys_help(('eval',))}\n\n"
                       + textwrap.fill(EXIT_CODES, 100))
    e.add_argument("run", nargs="?", help="run directory written by `memtrain train`")
    # The flag spelling stays for scripts; after torchrun's `-m memtrain` only the positional parses (torchrun
    # reads `--run` as an abbreviation of its own --run-path).
    e.add_argument("--run", dest="run_flag", metavar="RUN", help="the same, as a flag")
    e.add_argument("--checkpoint", help="one of the run's checkpoints/step_* directories (default: its latest); an "
                   "earlier one needs --out, and its canaries count the copies trained up to its step")
    e.add_argument("--model", help="a transformers model directory (safetensors) or a memtrain run or checkpoint, "
                   "scored on --canaries")
    e.add_argument("--canaries", help="JSONL canary file to score against --model")
    e.add_argument("--out", help="directory for eval.json and eval_canaries.jsonl (with --model, or with --set on a "
                   "run: the run's own results are not replaced by other settings)")
    e.add_argument("--suffix-len", type=positive_int, default=None,
                   help="tokens to extract from a `text` canary (the same as --set eval.suffix_len=N)")
    e.add_argument("--set", action="append", default=[], type=override_type(("eval", "parallel")),
                   metavar="SECTION.KEY=VALUE", help="override an eval.* key (or parallel.* for the grid)")
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


def run() -> None:
    """The `memtrain` command and `python -m memtrain`: main(), then the process ends with its exit code.

    A process of a launched world (torchrun, srun) ends with os._exit once main() has returned: its files are
    written and closed and its process groups destroyed by then, and a gloo group something still references
    is otherwise freed at interpreter teardown, where gloo aborts at random ("terminate called without an active
    exception": SIGABRT after a finished run, which a launcher or a sweep reads as a failed one)."""
    try:
        code = main()
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit (a traceback, exit 120)
    except BrokenPipeError:
        code = closed_pipe()
    if int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()

