"""report.md: the sections of a sweep's report, as markdown tables drawn from its result records.

Sections: memorization vs passes (when the runs scored every pass): exact match after the passes beside passes to
50% with cluster-bootstrap intervals, censored sizes as bounds, the power law across sizes and the extrapolation to
one pass only as a band over thresholds, labelled as such, with no number where it is unbounded; the runs; exact
match by copies; the base models (validation loss beside the unigram entropy of their pretraining text); the
Goldfish loss's validation cost at equal supervised tokens; the learning-rate rule; canaries buried mid-row; the
published anchors; failures; the figures (figures.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from memtrain.files import write_atomic

from . import passes
from .aggregate import (
    THRESHOLD,
    base_models,
    copies_of,
    curves,
    ev,
    f,
    final_exact,
    human,
    left_out_line,
    loss_of,
    lr_sweep,
    ok_rows,
    supervised_token_cost,
    twin_exact,
)
from .crossing import slope_label
from .passes import N_BOOT, bound

ANCHORS = [
    "Goldfish paper (Hans et al., NeurIPS'24), extreme setting: Llama-2-7B trained 100 epochs on 100 Wikipedia "
    "documents memorizes 84/100 exactly with the standard loss, 0/100 with Goldfish k=4 (50-token suffix).",
    "SC'24 AxoNN paper (Singh et al.), as its abstract states it: models sufficiently large memorize their training "
    "data in a single pass (\"catastrophic memorization\"). Its per-size figures are not quoted here.",
]


def _cell(v, fmt="{:.3f}") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return fmt.format(v)
    return str(v).replace("|", "\\|")


def md_table(header: list[str], align: str, rows) -> list[str]:
    """Markdown table lines; align has one letter per column: 'l' (labels) or 'r' (numbers)."""
    return ["| " + " | ".join(header) + " |", "|" + "".join("---|" if a == "l" else "---:|" for a in align),
            *("| " + " | ".join(row) + " |" for row in rows)]


def _rate(pt) -> str:
    """'rate [lo, hi] (k/n)' of a pooled point (..., rate, lo, hi, ..., k, n)."""
    rate, lo, hi, k, n = pt
    return f"{rate:.2f} [{lo:.2f}, {hi:.2f}] ({k}/{n})"


def table_rows(rows: list[dict]) -> list[dict]:
    """One flat dict per run (the report table, also logged to W&B)."""
    out = []
    for r in rows:
        out.append({
            "point": r.get("point"), "model": r.get("model"), "params": r.get("params"), "loss": loss_of(r),
            "seed": r.get("seed"), "lr": f(r.get("lr")), "precision": r.get("precision"),
            "exact_match": ev(r, "exact_match_rate"), "n": (r.get("eval") or {}).get("n_evaluated"),
            "rougeL": ev(r, "rougeL"), "rougeL_text": ev(r, "rougeL_text"), "exposure": ev(r, "exposure_mean"),
            "mia_auc": ev(r, "mia_auc_loss"), "val_loss": ev(r, "val_loss"),
            "train_loss": f((r.get("train") or {}).get("loss")),
            "tokens_per_s": f((r.get("train") or {}).get("tokens_per_s")),
            "status": r.get("status"), "error": r.get("error"), "run_dir": r.get("run_dir"),
        })
    return out


def _passes_section(rows: list[dict], kind: str | None, study: dict) -> list[str]:
    """Exact match after every few passes (Wilson, pooled counts) beside passes to 50% with their cluster-bootstrap
    intervals, then the power law and the one-pass extrapolation band. `study`: passes.numbers(rows)[kind], by
    loss (empty when the runs kept no per-canary scores: then no crossing is shown, rather than one without an
    interval)."""
    data = curves(rows, kind)
    n_pass = max((pt[0] for by_model in data.values() for c in by_model.values() for pt in c["passes"]), default=0)
    if n_pass < 2:  # pass 0 (the start) and one pass: the single-pass section tells it
        return []
    what = f"{kind} canaries" if kind else "all inserted canaries"
    lines = [f"## Memorization vs passes: {what}", "",
             f"Exact match after p passes [95% Wilson interval] (k/n, pooled over seeds). Passes to {THRESHOLD:.0%}: "
             "where the monotone fit of exact match over passes crosses it, interpolated between the passes around "
             "it, with a 95% cluster-bootstrap interval (seeds, and in each its canaries with their whole curves); "
             "'> P': not reached in P passes (a lower bound), '<= 1': reached by the first pass (an upper bound).", ""]
    if not study:
        lines += ["These runs kept no per-canary scores after each pass (only pooled counts), so passes to 50% are "
                  "not estimated: without them there is no interval over canaries to give.", ""]
    for loss, by_model in data.items():
        s = study.get(loss)
        show = sorted({0, 1, max(1, n_pass // 4), max(1, n_pass // 2), max(1, 3 * n_pass // 4), n_pass})
        table = []
        for model, c in by_model.items():
            at = {pt[0]: pt for pt in c["passes"]}
            cross = s["trend"]["sizes"].get(model) if s else None
            table.append([model, human(c["params"] or 0), cross["crossing"].label() if cross else "-",
                          _interval(*cross["interval"], s["passes"]) if cross else "-",
                          *(_rate((at[p][1], at[p][2], at[p][3], at[p][4], at[p][5])) if p in at else "-"
                            for p in show)])
        header = ["model", "params", f"passes to {THRESHOLD:.0%}", "95% interval",
                  *(f"pass {p}" if p else "pass 0 (base)" for p in show)]
        lines += [f"**{loss}**", "", *md_table(header, "lrrr" + "r" * len(show), table)]
        if s:
            lines += ["", *_trend_lines(s)]
        lines.append("")
    return lines


def _interval(lo: float, hi: float, last: int) -> str:
    """'[lo, hi]' of passes to 50%: an infinite side is 'unbounded', except the side of an interval that lies wholly
    outside the measured passes, which is that bound ('> P' above the last pass, '<= 1' at the first)."""
    return (f"[{f'> {last}' if lo == math.inf else bound(lo)}, "
            f"{'<= 1' if hi == -math.inf else bound(hi)}]")


def _trend_lines(s: dict) -> list[str]:
    """The power law across sizes and the one-pass band, or why there is no number."""
    trend, band = s["trend"], s["band"]
    lo, hi = trend["slope_interval"]
    slope = slope_label(trend)
    lo, hi = bound(lo, "{:.2f}"), bound(hi, "{:.2f}")
    lines = [f"Power law passes-to-{THRESHOLD:.0%} ~ N^slope over {len(s['sizes'])} sizes ({s['seeds']} seed(s) x "
             f"{s['canaries']} canaries, {s['passes']} passes): slope {slope}, 95% interval [{lo}, {hi}]; "
             f"{trend['replicates_censored']} of {N_BOOT} bootstrap replicates had a censored size and bound the "
             "slope only."]
    if s["seeds"] == 1:
        lines.append("One seed: these intervals resample its canaries only; run-to-run variance is not in them.")
    lines += left_out_line(s["seeds_left_out"])
    if band is None:
        return lines
    if band["band"]:
        lines.append(f"A multi-exposure EXTRAPOLATION, outside the measured range (a projection, not a measurement): "
                     f"the size at which ONE pass would reach 20-70% exact match lies in [{human(band['band'][0])}, "
                     f"{human(band['band'][1])}] parameters (over the thresholds and the bootstrap).")
    else:
        lines.append("Extrapolated to one pass (a multi-exposure extrapolation), the size is unbounded by these data "
                     "at some threshold in 20-70% (a censored size, or a slope interval reaching 0): no number is "
                     "given.")
    return lines


def _base_section(rows: list[dict]) -> list[str]:
    bases = base_models(rows)
    if not bases:
        return []
    lines = ["## Base models", "", "Pretrained once per size on text the fine-tuning never sees, cached per machine. "
             "Unigram entropy: the loss of the best model that ignores context.", ""]
    table = []
    for b in bases:
        gap = b["unigram_entropy"] - b["val_loss"] if f(b.get("val_loss")) and f(b.get("unigram_entropy")) else None
        table.append([b["model"], human(b["params"] or 0), _cell(b.get("steps")), _cell(f(b.get("seconds")), "{:.0f}"),
                      _cell(f(b.get("val_loss"))), _cell(f(b.get("unigram_entropy"))), _cell(gap)])
    header = ["model", "params", "steps", "seconds", "val loss", "unigram entropy", "below unigram"]
    return lines + md_table(header, "lrrrrrr", table) + [""]


def _cost_section(rows: list[dict]) -> list[str]:
    cost = supervised_token_cost(rows)
    if not cost:
        return []
    lines = ["## The Goldfish loss's validation cost", "",
             "Validation loss after the last pass; the standard run read at the same number of supervised tokens "
             "(its per-pass curve at kept fraction x passes) and at the same number of steps.", ""]
    table = [[c["model"], c["loss"], _cell(c["seed"]), str(c["passes"]), f"{c['kept_fraction']:.3f}",
              _cell(c["goldfish_val_loss"]), _cell(c["standard_same_supervised_tokens"]),
              _cell(c["standard_same_steps"])] for c in cost]
    header = ["model", "loss", "seed", "passes", "kept", "goldfish val", "standard, equal supervised tokens",
              "standard, equal steps"]
    return lines + md_table(header, "llrrrrrr", table) + [""]


def _lr_section(rows: list[dict]) -> list[str]:
    data = lr_sweep(rows)
    if not data:
        return []
    lines = ["## Learning-rate rule", "", "Suffix token accuracy after the last pass per learning-rate scale around "
             "the rule; the rule tracks a size's best learning rate within 2x when the best scale is in [0.5, 2].", ""]
    table = []
    for model, d in data.items():
        best = max(d["points"], key=lambda p: p[2])
        table.append([model, human(d["params"] or 0), f"{best[0]:g}", _cell(best[1], "{:.2e}"),
                      "yes" if 0.5 <= best[0] <= 2 else "NO"])
    return lines + md_table(["model", "params", "best scale", "best lr", "within 2x"], "lrrrl", table) + [""]


def _exposure_note(ok: list[dict]) -> str:
    """How exposure was obtained: estimated from sampled alternatives (Carlini et al.'s distribution fit), so its
    resolution and ceiling are the reader's to know."""
    samples = sorted({int(n) for r in ok if isinstance(n := (r.get("eval") or {}).get("exposure_samples"), int)})
    if not samples:
        return "exact or estimated per canary"
    return (f"ESTIMATED from {'/'.join(map(str, samples))} sampled alternative secrets per canary by a fitted "
            "distribution (capped at log2 of the candidate space; the empirical rank alone resolves only "
            f"log2({samples[-1] + 1}) = {math.log2(samples[-1] + 1):.1f} bits)")


def _corpus_note(ok: list[dict]) -> list[str]:
    """Which text the runs trained and were tested on: results compare across machines only on the same one."""
    corpora = {(c.get("source"), c.get("fingerprint"), c.get("documents"))
               for r in ok if (c := (r.get("run") or {}).get("corpus"))}
    if not corpora:
        return []
    if len(corpora) > 1:
        names = "; ".join(f"{s} ({str(f)[:12]})" for s, f, _ in sorted(corpora, key=str))
        return [f"**Corpus: {len(corpora)} different ones across these runs** ({names}): their results do not pool.",
                ""]
    (source, fp, docs), = corpora
    why = (" The built-in corpus is the running Python's own sources: another Python version trains and tests on "
           "other text, with other canaries, twins and tokenizer." if str(source).startswith("stdlib") else "")
    return [f"Corpus: {source}, {docs} documents, sha256 {str(fp)[:12]}; results compare with another machine's "
            f"only where this fingerprint is the same.{why}", ""]


def _precision_note(ok: list[dict]) -> list[str]:
    """Runs that trained in different dtypes (train.precision "auto" decided on two machines, say, a sweep resumed
    elsewhere): which points took which, since pooling their seeds and sizes assumes the dtype does not matter."""
    points: dict[str, set[str]] = {}
    for r in ok:
        if r.get("precision"):
            points.setdefault(str(r["precision"]), set()).add(str(r.get("point")))
    if len(points) < 2:
        return []
    fewest = min(points, key=lambda p: (len(points[p]), p))
    most = max(points, key=lambda p: (len(points[p]), p))
    named = sorted(points[fewest])
    listed = ", ".join(named[:6]) + (f" and {len(named) - 6} more" if len(named) > 6 else "")
    counts = ", ".join(f"{p}: {len(v)} point(s)" for p, v in sorted(points.items()))
    return [f"**Precision: {len(points)} different ones across these runs** ({counts}; {fewest}: {listed}): their "
            "results pool only if the dtype changes nothing, which this report does not test. For one dtype "
            f"throughout, set it in the sweep's [base] (or --set train.precision={most}) and rerun those points.", ""]


def write_markdown(rows: list[dict], figs: list[Path], out: Path, lead: list[str] = (), study: dict | None = None
                   ) -> Path:
    """report.md: the header, `lead` (a study's own summary and tables), then the sections every sweep has.
    `study`: the passes study's numbers (passes.numbers(rows)), computed here when not given."""
    name = next((r.get("sweep") for r in rows if r.get("sweep")), out.name)
    ok = ok_rows(rows)
    failed = [r for r in rows if r.get("status") != "ok"]
    precisions = sorted({str(r.get("precision")) for r in ok if r.get("precision")})
    lines = [f"# Memorization sweep `{name}`", "",
             f"{len(rows)} run(s): {len(ok)} ok, {len(failed)} failed; precision {', '.join(precisions) or '-'}. "
             "Metrics are over the inserted canaries (exact match, ROUGE-L: greedy suffix extraction; exposure: "
             f"random canaries, in bits, {_exposure_note(ok)}; MIA AUC: loss attack, inserted canaries vs their "
             "never-trained twins; val loss: held-out documents).", "", *_corpus_note(ok), *_precision_note(ok), *lead]
    study = passes.numbers(rows) if study is None else study
    kinds = sorted({key.split("/")[0] for r in ok for key in ((r.get("eval") or {}).get("cells") or {})})
    for kind in [None, *kinds] if len(kinds) > 1 else [None]:
        lines += _passes_section(rows, kind, study.get(kind, {}))
    runs = [[_cell(t["point"]), _cell(t["model"]), human(t["params"]) if isinstance(t["params"], (int, float)) else "-",
             _cell(t["loss"]), _cell(t["seed"]), _cell(t["lr"], "{:.2e}"),
             f"{_cell(t['exact_match'])} ({_cell(t['n'])})", f"{_cell(t['rougeL'])} / {_cell(t['rougeL_text'])}",
             _cell(t["exposure"], "{:.2f}"), _cell(t["mia_auc"]), _cell(t["val_loss"]), _cell(t["train_loss"]),
             _cell(t["status"])] for t in table_rows(rows)]
    lines += ["## Runs", "", *md_table(["point", "model", "params", "loss", "seed", "lr", "exact match (n)",
                                      "ROUGE-L (ids / text)", "exposure", "MIA AUC", "val loss", "train loss",
                                      "status"], "llrlrrrrrrrrl", runs)]
    copies = copies_of(rows)
    if copies:
        by_block = {c: final_exact(rows, block=c) for c in copies}
        twins = twin_exact(rows)
        table = []
        for loss, pts in final_exact(rows).items():
            for p in pts:
                cells = []
                for block in (*(by_block[c].get(loss, []) for c in copies), twins.get(loss, [])):
                    hit = [q for q in block if q[4] == p[4]]
                    cells.append(_rate((hit[0][1], hit[0][2], hit[0][3], hit[0][5], hit[0][6])) if hit else "-")
                table.append([loss, p[4], *cells])
        lines += ["", "## Exact match by copies seen", "",
                  "Copies seen in training: copies per pass x passes. Pooled over seeds: rate [95% Wilson interval] "
                  "(k/n). The control: the canaries' never-trained twins, asked the same way.", "",
                  *md_table(["loss", "model", *(f"{c}x" for c in copies), "twins (never trained)"],
                            "ll" + "r" * (len(copies) + 1), table)]
    lines += ["", *_base_section(rows), *_cost_section(rows), *_lr_section(rows)]
    in_row = [r for r in ok if (r.get("eval") or {}).get("in_row")]
    if in_row:
        lines += ["## Canaries buried mid-row (no document attention)", "",
                  "Exact match from the canary's own prefix vs from its recorded row context.", "",
                  *md_table(["point", "own prefix", "row context"], "lrr",
                          [[r["point"], _cell(ev(r, "exact_match_rate")), _cell(ev(r, "in_row", "exact_match_rate"))]
                           for r in in_row]), ""]
    lines += ["## Anchors", "", *[f"- {a}" for a in ANCHORS], ""]
    if failed:
        lines += ["## Failures", ""]
        lines += [f"- `{r.get('point')}`: {_cell(r.get('error'))} (run dir `{r.get('run_dir')}`)" for r in failed]
        lines.append("")
    lines += ["## Figures", ""]
    for fig in figs:
        rel = fig.relative_to(out) if fig.is_relative_to(out) else fig
        lines += [f"### {fig.stem.replace('_', ' ')}", "", f"![{fig.stem}]({rel.as_posix()})", ""]
    return write_atomic(out / "report.md", "\n".join(lines) + "\n")
