"""A sweep's report.md and figures, drawn from its results.jsonl alone.

    memtrain plot runs/quick                       # the sweep directory (or its results.jsonl)
    memtrain plot results.jsonl --out report/      # anywhere: nothing but results.jsonl is read
    memtrain plot audit-a audit-b --out cmp/       # evaluations side by side (evals.py)
    python -m experiments.report runs/quick

Several lines for the same point (a failure, then a retry with --resume) count once: the last one wins. A file
whose points all failed is refused: there is nothing to plot.
Seeds are pooled: exact-match rates are counts over canaries x seeds with 95% Wilson intervals (n given); the
copies or passes a size needs to reach 50% get cluster-bootstrap intervals over seeds and canaries (crossing.py).

The modules, each importing only those below it (and experiments.results, memtrain; never experiments.sweep,
never torch: `memtrain plot` starts fast):

    evals             evaluations (eval.json) side by side: exact match per kind, twins, MIA
    single_pass_view  a one-pass sweep's summary, tables and figures (PNG, PDF, SVG, CSV)
    markdown          report.md: its sections and tables
    figures           the PNG figures (matplotlib, imported when drawing)
    single_pass       one exposure (twin-controlled loss drop) and the dose-response over copies in one pass
    passes            the passes study: passes to 50% per size with intervals, power law, one-pass band, its figure
    figure_files      a study figure as PNG, PDF and SVG, and its numbers as CSV
    aggregate         from records to the numbers shown: pooled rates, per-pass curves, costs
    crossing          threshold crossings with censoring, cluster-bootstrap intervals, power laws, bands
    stats             Wilson intervals
"""

from __future__ import annotations

from pathlib import Path

from experiments.results import RESULTS, read_results
from memtrain.commandline import ArgumentParser, fail
from memtrain.run_files import check_output

from . import evals, passes, single_pass, single_pass_view
from .figures import draw_figures
from .markdown import table_rows, write_markdown


def build_report(results: str | Path, out: str | Path | None = None) -> dict:
    """Figures and report.md from a results.jsonl (or a directory holding one) into `out`."""
    results = Path(results)
    if results.is_dir():
        results = results / RESULTS
    if not results.is_file():
        raise FileNotFoundError(f"{str(results)!r} not found: pass a sweep directory or its results.jsonl")
    out = Path(out) if out else results.parent
    out.mkdir(parents=True, exist_ok=True)
    rows = list(read_results(results).values())
    if not rows:
        raise ValueError(f"{str(results)!r} holds no results yet")
    if not any(r.get("status") == "ok" for r in rows):  # else every figure and table would be drawn empty
        raise ValueError(f"{str(results)!r}: none of its {len(rows)} point(s) succeeded, so there is nothing to plot: "
                         "their errors are in that file, their logs in their run directories; rerun them with "
                         "`memtrain sweep ... --resume` once fixed")
    study = passes.numbers(rows)  # bootstraps: computed once for the figures and the text
    figs = draw_figures(rows, out / "figures", study)
    lead = []
    if single_pass.applies(rows):  # a one-pass sweep: its own figures and summary lead the report
        nums = single_pass_view.numbers(rows)
        figs = single_pass_view.draw(nums, out / "figures") + figs
        lead = single_pass_view.section(nums)
    md = write_markdown(rows, figs, out, lead, study)
    return {"report": md, "figures_dir": out / "figures", "figures": figs, "table": table_rows(rows),
            "runs": len(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="memtrain plot", description="Draw a sweep's figures and report.md from its "
                        "results.jsonl, or compare evaluations (directories with eval.json) side by side.")
    ap.add_argument("path", nargs="+", help="a sweep directory (runs/<sweep>) or a results.jsonl file; or one or "
                    "more evaluation directories (`memtrain eval --out DIR`, run directories)")
    ap.add_argument("--out", default=None, help="where report.md and figures/ go (default: next to results.jsonl; "
                    "for evaluations: the first one's directory, unless it is a run directory); never a run directory "
                    "or inside one")
    args = ap.parse_args(argv)
    try:
        # like every command's output, never a run directory or inside one: only its own training writes there
        if args.out is not None:
            check_output(args.out)
        if evals.applies(args.path):
            out = args.out or check_output(args.path[0], "--out (by default the first directory)")
            made = evals.plot_evals(args.path, out)
            print(f"evaluations: {made['evals']}; figure {made['figure']}, table {made['table']}, numbers "
                  f"{made['csv']}")
            return 0
        if len(args.path) > 1:
            return fail(f"{len(args.path)} paths given: a sweep is plotted alone (several paths must all be "
                        "evaluation directories with eval.json)")
        made = build_report(args.path[0], args.out)
    except BrokenPipeError:  # stdout's reader went away: memtrain.commandline ends it (not bad input)
        raise
    except (OSError, ValueError) as e:
        return fail(str(e))
    print(f"report: {made['report']} ({made['runs']} runs)")
    print(f"figures: {made['figures_dir']}/ ({', '.join(fig.name for fig in made['figures'])})")
    return 0
