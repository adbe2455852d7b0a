"""The passes study (`quick`): every canary is seen once per pass and scored after every pass, over many passes.

The dose is the number of passes. Per loss and size, the passes needed to reach 50% exact match are read with the
single-pass study's statistics (crossing.py): the rate over passes made monotone, the crossing interpolated
linearly between the two passes around it (passes go up one by one, not by doubling), right-censored ('> P') for
a size that never reaches 50% within its P passes and left-censored ('<= 1') for one already there after the
first. Intervals come from a cluster bootstrap that draws seeds and, inside each, canaries with their whole curve
over passes: a canary's score after pass p and after pass p + 1 are not independent draws. Across sizes: the
power law of passes-to-50% vs parameters with its interval, and the extrapolation to ONE pass only as the band
over thresholds 20-70% (crossing.extrapolation_band), labelled a multi-exposure statement; where any bound is
missing there is no band, and no number is printed or drawn.

Only canaries inserted once per pass count, so that passes are exposures. Nothing here needs torch.
"""

from __future__ import annotations

import math
from pathlib import Path

from .aggregate import THRESHOLD, f, human, loss_of, loss_order, ok_rows, paired_rows
from .crossing import extrapolation_band, loglog_slope, size_trend
from .figure_files import save_figure, write_csv

N_BOOT = 1000
"""Bootstrap replicates of a size trend; the extrapolation band (three thresholds) uses a quarter per threshold."""

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def applies(rows: list[dict]) -> bool:
    """A passes study: some run scored its canaries after a second pass (pass 0 is the base model)."""
    return any(int(p.get("pass") or 0) >= 2 and p.get("canaries") for r in ok_rows(rows) for p in r.get("passes") or [])


def kinds(rows: list[dict]) -> list[str]:
    """The canary kinds scored after the passes (random secrets, documents), sorted."""
    return sorted({k for r in ok_rows(rows) for p in r.get("passes") or []
                   for k in (p.get("canaries") or {}).get("kind") or []})


def units(rows: list[dict], loss: str, kind: str | None = None) -> tuple[list[dict], dict[str, float]]:
    """One unit per (seed, canary, pass >= 1) of the runs with this loss (one kind, or all) whose seed ran at every
    size (aggregate.paired_rows): dose = pass, per model
    the canary's exact match after that pass (0/1), and "canary" = its id, so that a bootstrap draws the canary's
    whole curve. A seed's canaries are the same at every size (paired). And the models' parameters, by size."""
    table: dict = {}
    sizes: dict[str, float] = {}
    for r in paired_rows(rows, loss)[0]:
        model, seed = str(r.get("model")), r.get("seed")
        for p in r.get("passes") or []:
            cols, n = p.get("canaries"), p.get("pass")
            if not cols or not isinstance(n, int) or n < 1:  # pass 0 is the base model: no exposure yet
                continue
            copies = cols.get("copies") or [1] * len(cols["id"])
            kind_of = cols.get("kind") or [None] * len(cols["id"])
            for cid, member, exact, c, k in zip(cols["id"], cols["inserted"], cols["exact"], copies, kind_of):
                if member and exact is not None and c == 1 and kind in (None, k):
                    u = table.setdefault((seed, cid, n), {"seed": seed, "canary": cid, "id": cid, "dose": n})
                    u[model] = float(bool(exact))
                    sizes[model] = f(r.get("params")) or 0.0
    return list(table.values()), dict(sorted(sizes.items(), key=lambda kv: kv[1]))


def numbers(rows: list[dict]) -> dict:
    """{kind: {loss: study}}, kind None for all canaries and each kind when there are several. A study: the
    sizes {model: params}, the size trend of passes to 50% ("trend", crossing.size_trend), the band over
    thresholds 20-70% ("band", None with a single size), its seeds, canaries per seed and passes."""
    if not applies(rows):
        return {}
    ks = kinds(rows)
    out: dict = {}
    for kind in [None, *ks] if len(ks) > 1 else [None]:
        for loss in sorted({loss_of(r) for r in ok_rows(rows)}, key=loss_order):
            us, sizes = units(rows, loss, kind)
            if not us:
                continue
            seeds = {u["seed"] for u in us}
            out.setdefault(kind, {})[loss] = {
                "sizes": sizes, "seeds": len(seeds), "seeds_left_out": paired_rows(rows, loss)[1],
                "canaries": len({(u["seed"], u["canary"]) for u in us}) // len(seeds),
                "passes": max(u["dose"] for u in us),
                "trend": size_trend(us, sizes, THRESHOLD, log=False, n_boot=N_BOOT),
                "band": extrapolation_band(us, sizes, log=False, n_boot=N_BOOT // 4) if len(sizes) >= 2 else None}
    return out


def _fit_line(trend: dict) -> tuple[float, float] | None:
    """(slope, intercept) of the point estimate's power law, None when a size is censored (no fit then)."""
    sizes = trend["sizes"].values()
    return loglog_slope([s["params"] for s in sizes], [s["crossing"].as_number() for s in sizes])


def fig_threshold(study: dict, path: Path, kind: str | None = None) -> Path | None:
    """Passes to 50% exact match vs parameters (log-log), a colour per loss: a measured crossing with its 95%
    cluster-bootstrap interval (dotted where a side is unbounded, drawn to the edge of the measured passes and
    ended by a filled triangle); a censored size only as its bound (an open triangle at the last pass pointing
    up: more passes than that; at the first pointing down); the power law only over the measured sizes and only
    when none is censored; the one-pass extrapolation only as a shaded band labelled as such, and only when
    bounded. With its CSV, PDF and SVG beside it; None (no figure) when no loss has two sizes."""
    if not any(len(s["sizes"]) >= 2 for s in study.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.6))
    table = []
    for i, (loss, s) in enumerate(study.items()):
        color, trend, top = PALETTE[i % len(PALETTE)], s["trend"], s["passes"]
        dodge = 10 ** (0.015 * (i - (len(study) - 1) / 2))  # losses side by side at a size, not on top of each other
        band = (s["band"] or {}).get("band")
        marks: dict[tuple, list] = {}  # (marker, hollow, legend) -> [(x, y)]: each kind of mark listed once
        for model, row in trend["sizes"].items():
            c, (lo, hi), x = row["crossing"], row["interval"], row["params"] * dodge
            if lo < math.inf and hi > -math.inf:  # some of the interval lies within the measured passes
                bounded = math.isfinite(lo) and math.isfinite(hi)
                ax.plot([x, x], [max(lo, 1.0), min(hi, top)], "-" if bounded else ":", color=color, lw=1.2)
            censored, limit = "", None
            if c.value is not None:
                marks.setdefault(("o", False, "passes to 50% [95% bootstrap]"), []).append((x, c.value))
                if not math.isfinite(hi):
                    marks.setdefault(("^", False, "interval unbounded above"), []).append((x, top))
            elif c.above is not None:
                censored, limit = "above", c.above
                marks.setdefault(("^", True, f"not reached in {top} passes (a lower bound)"), []).append((x, limit))
            else:
                censored, limit = "below", c.below
                marks.setdefault(("v", True, "reached by pass 1 (an upper bound)"), []).append((x, limit))
            table.append([loss, model, row["params"], c.value, censored, limit, lo, hi, trend["slope"],
                          *trend["slope_interval"], *(band or (None, None)), *(trend["slope_bound"] or (None, None))])
        for (marker, hollow, what), pts in marks.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, ls="none", color=color, ms=7,
                    mfc="white" if hollow else color, label=f"{loss}: {what}")
        fit = _fit_line(trend)
        if fit is not None:
            xs = [dodge * min(r["params"] for r in trend["sizes"].values()),
                  dodge * max(r["params"] for r in trend["sizes"].values())]
            lo, hi = (bound(v, "{:.2f}") for v in trend["slope_interval"])
            ax.plot(xs, [10 ** (fit[1] + fit[0] * math.log10(x)) for x in xs], "-", color=color, alpha=0.6,
                    label=f"{loss}: passes ~ N^{fit[0]:.2f}, measured range only (slope 95%: [{lo}, {hi}])")
        if band:
            ax.axvspan(*band, color=color, alpha=0.12, hatch="//", lw=0,
                       label=f"{loss}: EXTRAPOLATION (multi-exposure): size at which 1 pass reaches 20-70%")
    ax.axhline(1, color="0.6", ls=":", lw=1)  # one pass: where the extrapolation asks the line to land
    ax.set(xscale="log", yscale="log", ylim=(0.8, max(s["passes"] for s in study.values()) * 1.6),
           xlabel="parameters", ylabel=f"passes to {THRESHOLD:.0%} exact match",
           title=f"Passes to {THRESHOLD:.0%} exact match vs size{f' ({kind} canaries)' if kind else ''}")
    bands = [v for s in study.values() for v in (s["band"] or {}).get("band") or ()]  # a band's ends get ticks too
    params = sorted({r["params"] for s in study.values() for r in s["trend"]["sizes"].values()} | set(bands))
    ax.set_xticks(params, [human(p) for p in params], fontsize=7)
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= ax.get_ylim()[1]]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()  # the sizes and round pass counts are the ticks; log minor labels would pile up
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=6)
    write_csv(path.with_suffix(".csv"), ["loss", "model", "params", "passes_to_50", "censored", "bound", "lo", "hi",
                                         "slope", "slope_lo", "slope_hi", "one_pass_band_lo", "one_pass_band_hi",
                                         "slope_bound_side", "slope_bound"],
              table)
    return save_figure(fig, path)


def bound(v: float, fmt: str = "{:.3g}") -> str:
    """One end of an interval: the number, or 'unbounded' where the data give none (never a number for it)."""
    return fmt.format(v) if math.isfinite(v) else "unbounded"
