"""The `memtrain` commands of the experiments layer, registered in pyproject.toml under the entry-point
group "memtrain.commands" (memtrain/cli.py finds them there; memtrain never imports this layer)."""

from __future__ import annotations


def sweep(argv: list[str]) -> int:
    """run a memorization sweep: memtrain sweep SPEC [--set ...] [--resume]"""
    from experiments.sweep.cli import main

    return main(argv)


def plot(argv: list[str]) -> int:
    """figures and report.md from runs/<sweep>/results.jsonl, or evaluations (eval.json) side by side"""
    from experiments.report import main

    return main(argv)


def demo(argv: list[str]) -> int:
    """the single-pass memorization sweep (same as `memtrain sweep single-pass`)"""
    from experiments.sweep.cli import build_parser, main

    parser = build_parser(preset="single-pass", prog="memtrain demo", description=(
        "The single-pass memorization sweep, what `make demo` runs: the same as `memtrain sweep single-pass` (see "
        "experiments/presets/single-pass.toml), with the same options. Report: <out>/report.md (default "
        "runs/single-pass)."))
    return main(argv, parser)
