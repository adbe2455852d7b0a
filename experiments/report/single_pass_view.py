"""The single-pass study on the page: its summary, tables and two figures (single_pass.py makes the numbers).

Every figure is written as PNG (for report.md), PDF and SVG, and its numbers as a CSV beside it.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from memtrain.files import write_atomic

from .aggregate import human
from .single_pass import N_BOOT, dose_response, one_exposure

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _fmt(v, fmt="{:.3f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _interval(t) -> str:
    """'mean [lo, hi]' of a (mean, lo, hi) triple."""
    return "-" if t is None else f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}]"


def _bound(v: float) -> str:
    return "unbounded" if not math.isfinite(v) else f"{v:.3g}"


def _csv(path: Path, header: list[str], rows: list[list]) -> Path:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(rows)
    return write_atomic(path, buf.getvalue())


def _save(fig, png: Path) -> Path:
    for suffix in (".png", ".pdf", ".svg"):
        fig.savefig(png.with_suffix(suffix), dpi=130, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return png


def numbers(rows: list[dict]) -> tuple[list[dict], dict]:
    """Figure 1's and figure 2's numbers, computed once (the bootstraps are the report's costliest part)."""
    return one_exposure(rows), dose_response(rows)


def draw(once: list[dict], dose: dict, fig_dir: Path) -> list[Path]:
    """Figure 1 and figure 2 with their CSVs; none when a figure would have a single x value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    if len({r["model"] for r in once}) >= 2:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, loss in enumerate(dict.fromkeys(r["loss"] for r in once)):
            pts = [r for r in once if r["loss"] == loss]
            parts = [("drop", "")] + ([("drop_dropped", " (dropped positions)"), ("drop_kept", " (kept positions)")]
                                      if loss.startswith("goldfish") else [])
            for j, (part, label) in enumerate(parts):
                ok = [r for r in pts if r[part] is not None]
                if ok:
                    xs = [r["params"] for r in ok]
                    ys = [r[part][0] for r in ok]
                    err = [[y - r[part][1] for y, r in zip(ys, ok)], [r[part][2] - y for y, r in zip(ys, ok)]]
                    ax1.errorbar(xs, ys, yerr=err, marker="os^"[j], ls="-:-"[j], capsize=3,
                                 color=PALETTE[i % len(PALETTE)], label=loss + label)
            xs = [r["params"] for r in pts]
            ys = [r["k"] / r["n"] if r["n"] else math.nan for r in pts]
            err = [[max(0.0, y - r["exact"][0]) for y, r in zip(ys, pts)],
                   [max(0.0, r["exact"][1] - y) for y, r in zip(ys, pts)]]
            ax2.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=PALETTE[i % len(PALETTE)], label=loss)
        ax1.axhline(0, color="0.5", lw=1, ls=":")
        ax1.set(xscale="log", xlabel="parameters", ylabel="member drop - twin drop (nats/token)",
                title="Suffix-loss drop after one exposure, twin-controlled")
        ax2.set(xscale="log", xlabel="parameters", ylabel="exact match", ylim=(-0.03, 1.03),
                title="Exact match after one exposure")
        for ax in (ax1, ax2):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        figs.append(_save(fig, fig_dir / "one_exposure.png"))
        _csv(fig_dir / "one_exposure.csv",
             ["loss", "model", "params", "seeds", "k", "n", "exact_lo", "exact_hi", "drop", "drop_lo", "drop_hi",
              "drop_dropped", "drop_kept"],
             [[r["loss"], r["model"], r["params"], r["seeds"], r["k"], r["n"], *r["exact"], *(r["drop"] or [None] * 3),
               (r["drop_dropped"] or [None])[0], (r["drop_kept"] or [None])[0]] for r in once])
    if dose:
        fig, ax = plt.subplots(figsize=(7, 4.4))
        table = []
        for i, (loss, d) in enumerate(dose.items()):
            for j, (model, pts) in enumerate(d["curves"].items()):
                xs = [max(p[0], 0.5) for p in pts]  # copy 0 (the base) drawn at 0.5 on the log axis
                ys = [p[1] for p in pts]
                err = [[max(0.0, y - p[2]) for y, p in zip(ys, pts)], [max(0.0, p[3] - y) for y, p in zip(ys, pts)]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=2, ls="-" if i == 0 else "--",
                            color=PALETTE[j % len(PALETTE)], alpha=1 if i == 0 else 0.6,
                            label=f"{loss}, {model} ({human(d['sizes'][model])})")
                table += [[loss, model, d["sizes"][model], p[0], p[4], p[5], p[2], p[3]] for p in pts]
        ax.axhline(0.5, color="0.5", lw=1, ls=":")
        ax.set(xscale="log", xlabel="copies in the pass (0.5: the base model)", ylabel="exact match",
               ylim=(-0.03, 1.03), title="Exact match vs copies inside one pass, by size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
        figs.append(_save(fig, fig_dir / "dose_response.png"))
        _csv(fig_dir / "dose_response.csv", ["loss", "model", "params", "copies", "k", "n", "lo", "hi"], table)
    return figs


def section(once: list[dict], dose: dict) -> list[str]:
    """report.md's single-pass section: a summary, then the tables behind figures 1 and 2."""
    if not once:
        return []
    lines = ["## One pass: what it memorizes", ""]
    seeds = max((r["seeds"] for r in once), default=0)
    std = [r for r in once if r["loss"] == "standard"]
    if std:
        sig = [r for r in std if r["drop"] and r["drop"][1] > 0]
        lines += [f"After one exposure ({seeds} seed(s), intervals: cluster bootstrap over seeds and canaries), the "
                  f"standard loss leaves a twin-controlled suffix-loss drop whose interval excludes 0 at "
                  f"{len(sig)} of {len(std)} sizes; exact match after one exposure is "
                  + ", ".join(f"{r['k']}/{r['n']}" for r in std) + " from the smallest size to the largest.", ""]
    lines += ["| loss | model | params | exact match, one exposure [95% Wilson] | drop: member - twin (nats/token) "
              "[95% CI] | dropped positions | kept positions |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in once:
        lines.append(f"| {r['loss']} | {r['model']} | {human(r['params'])} | {r['k']}/{r['n']} "
                     f"[{r['exact'][0]:.2f}, {r['exact'][1]:.2f}] | {_interval(r['drop'])} | "
                     f"{_interval(r['drop_dropped'])} | {_interval(r['drop_kept'])} |")
    for loss, d in dose.items():
        trend = d["trend"]
        if trend is None:
            continue
        lines += ["", f"### Copies to 50% exact match within one pass: {loss}", "",
                  "Monotone fit of exact match over copies per size; 95% cluster-bootstrap interval; '> c' a size "
                  "that never reached 50% (a lower bound), '<= c' one already there at its fewest copies.", "",
                  "| model | params | copies to 50% | 95% interval |", "|---|---:|---:|---:|"]
        for model, s in trend["sizes"].items():
            lo, hi = s["interval"]
            lines.append(f"| {model} | {human(s['params'])} | {s['crossing'].label()} | "
                         f"[{_bound(lo) if lo > -math.inf else '<= smallest'}, {_bound(hi)}] |")
        lo, hi = trend["slope_interval"]
        slope = "-" if trend["slope"] is None else f"{trend['slope']:.2f}"
        lines += ["", f"Power law copies-to-50% ~ N^slope: slope {slope}, 95% interval "
                  f"[{_bound(lo)}, {_bound(hi)}] ({trend['replicates_censored']} of {N_BOOT} bootstrap replicates "
                  "had a censored size and bound the slope only)."]
        band = d["band"]
        if band and band["band"]:
            lines.append(f"A multi-exposure extrapolation, labelled as such: the size at which 1 copy would reach "
                         f"20-70% exact match lies in [{human(band['band'][0])}, {human(band['band'][1])}] "
                         "parameters (over thresholds and the bootstrap).")
        else:
            lines.append("Extrapolated to a single copy, the size is unbounded by these data (a censored size or a "
                         "slope interval reaching 0): no number is given.")
    return [*lines, ""]

