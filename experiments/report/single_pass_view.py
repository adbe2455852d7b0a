"""The single-pass study on the page: its summary, tables and two figures (single_pass.py makes the numbers).

Every figure is written as PNG (for report.md), PDF and SVG, and its numbers as a CSV beside it.
"""

from __future__ import annotations

import math
from pathlib import Path

from .aggregate import human, left_out_line
from .crossing import slope_label
from .figure_files import save_figure as _save
from .figure_files import write_csv as _csv
from .markdown import md_table
from .single_pass import (
    N_BOOT,
    dose_response,
    goldfish_given_back,
    mia_one_exposure,
    one_exposure,
    training_order,
    utility,
)

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _fmt(v, fmt="{:.3f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _interval(t) -> str:
    """'mean [lo, hi]' of a (mean, lo, hi) triple."""
    return "-" if t is None else f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}]"


def _bound(v: float) -> str:
    return "unbounded" if not math.isfinite(v) else f"{v:.3g}"


def _size_interval(s: dict) -> str:
    """A size's copies-to-50% interval; an end beyond the copies tried is that bound ('> c' when every replicate
    stayed below 50% at the most copies, '<= smallest' when one was there at the fewest)."""
    lo, hi = s["interval"]
    above = s["crossing"].above
    low = f"> {above:.3g}" if lo == math.inf and above is not None else "<= smallest" if lo == -math.inf else _bound(lo)
    return f"[{low}, {_bound(hi)}]"


SEED_VARIES = ("A seed draws the canaries (which secrets, which held-out documents, from a pool no other seed "
               "uses), the rows they land in and the order of the pass (under data.max_text_tokens, also which "
               "of the text the pass holds); the base model of each size and its "
               "initialization are shared by all seeds: one pretraining run per size, whose run-to-run variation "
               "(pretrain.seed) is not in these intervals.")


def numbers(rows: list[dict]) -> dict:
    """The section's numbers, computed once (the bootstraps are the report's costliest part): figure 1 ("once"),
    figure 2 ("dose"), held-out loss before and after the pass ("utility"), membership inference at one exposure
    ("mia"), the training-order check ("order") and the canaries Goldfish gave back ("given_back")."""
    return {"once": one_exposure(rows), "dose": dose_response(rows), "utility": utility(rows),
            "mia": mia_one_exposure(rows), "order": training_order(rows), "given_back": goldfish_given_back(rows)}


def draw(nums: dict, fig_dir: Path) -> list[Path]:
    """Figure 1 and figure 2 with their CSVs; none when a figure would have a single x value."""
    once, dose = nums["once"], nums["dose"]
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


def _top_copies(curve: list[tuple]) -> str:
    d, rate, lo, hi, k, n = curve[-1]
    return f"{k}/{n} = {rate:.2f} [{lo:.2f}, {hi:.2f}]"


def _given_back(canaries: list[dict], most: int = 6) -> str:
    """The Goldfish canaries given back, each with the share of its suffix its mask dropped."""
    def one(c):
        cut = f"{c['dropped']} of its {c['suffix']} suffix targets dropped" if c["dropped"] is not None \
            else "its dropped targets not recorded"
        return f"{c['id']} ({c['loss']}, {c['model']}, seed {c['seed']}, {c['copies']} copies: {cut})"
    if not canaries:
        return ""
    more = f", and {len(canaries) - most} more" if len(canaries) > most else ""
    return (f" Given back ({len(canaries)}): " + "; ".join(one(c) for c in canaries[:most]) + more
            + ". The mask hashes each canary's own tokens, so some suffixes lose far fewer than 1/k of their targets.")


def summary(nums: dict) -> list[str]:
    """What the numbers say, in a paragraph: each claim with its n and interval, nulls said as nulls."""
    once, dose, util, mia = nums["once"], nums["dose"], nums["utility"], nums["mia"]
    out = []
    std = [r for r in once if r["loss"] == "standard"]
    if std:
        sig = [r for r in std if r["drop"] and r["drop"][1] > 0]
        out.append("**One exposure.** Seen once, a canary's twin-controlled suffix-loss drop is "
                   + ", ".join(_interval(r["drop"]) for r in std)
                   + f" nats/token from the smallest size to the largest (standard loss, {std[0]['seeds']} seed(s)); "
                   f"its interval excludes 0 at {len(sig)} of {len(std)} sizes. Exact match after one exposure: "
                   + ", ".join(f"{r['k']}/{r['n']}" for r in std)
                   + (" (none at any size: a null at this scale)." if not any(r["k"] for r in std) else "."))
    if "standard" in dose:
        curves = dose["standard"]["curves"]
        models = list(curves)
        first, last = curves[models[0]][-1], curves[models[-1]][-1]
        disjoint = first[3] < last[2] or last[3] < first[2]
        out.append(f"**Copies within one pass.** At {last[0]} copies the standard loss gives back "
                   f"{_top_copies(curves[models[0]])} of the smallest size's canaries and "
                   f"{_top_copies(curves[models[-1]])} of the largest's (95% Wilson, pooled over seeds); the "
                   f"intervals are {'disjoint' if disjoint else 'NOT disjoint'}.")
    gold = [(loss, m, p) for loss, d in dose.items() if loss.startswith("goldfish")
            for m, pts in d["curves"].items() for p in pts if p[0] > 0]
    if gold:
        loss, m, p = max(gold, key=lambda t: t[2][1])
        if p[1] == 0:
            ns = sorted({g[2][5] for g in gold})
            n = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]} to {ns[-1]}"
            out.append(f"**Goldfish.** It gives back none of its canaries in any (size, copies) cell (n = {n} per "
                       "cell).")
        else:
            out.append(f"**Goldfish.** Its highest exact match in any (size, copies) cell is {p[4]}/{p[5]} = "
                       f"{p[1]:.2f} ({loss}, {m}, {p[0]} copies).{_given_back(nums['given_back'])}")
    std_util = [u for u in util if u["loss"] == "standard"]
    if std_util:
        base = [u["base"] for u in std_util]
        falling = all(b2 < b1 for b1, b2 in zip(base, base[1:]))
        out.append("**Utility.** Held-out loss of the base models, smallest to largest: "
                   + ", ".join(f"{b:.3f}" for b in base) + f" ({'falling' if falling else 'NOT falling'} with size); "
                   "after the standard pass it moves by " + ", ".join(_interval(u["delta"]) for u in std_util)
                   + f" nats (worst single run {max(u['worst'] for u in std_util):+.3f}).")
    if mia:
        aucs = [_auc(m["attack_calibrated"]) for m in mia if m["loss"] == "standard"]
        if aucs:
            out.append(f"**Membership at one exposure.** Base-calibrated loss attack, members seen once vs every "
                       f"twin: AUC {', '.join(aucs)} from the smallest size to the largest (standard loss).")
    return [" ".join(out), "", SEED_VARIES, ""] if out else []


def section(nums: dict) -> list[str]:
    """report.md's single-pass section: a summary, then the tables behind figures 1 and 2 and the controls."""
    once, dose = nums["once"], nums["dose"]
    if not once:
        return []
    lines = ["## One pass: what it memorizes", "", *summary(nums), "### Figure 1: one exposure", ""]
    lines += md_table(["loss", "model", "params", "exact match, one exposure [95% Wilson]",
                    "drop: member - twin (nats/token) [95% CI]", "dropped positions", "kept positions"], "llrrrrr",
                   [[r["loss"], r["model"], human(r["params"]), f"{r['k']}/{r['n']} [{r['exact'][0]:.2f}, "
                     f"{r['exact'][1]:.2f}]", _interval(r["drop"]), _interval(r["drop_dropped"]),
                     _interval(r["drop_kept"])] for r in once])
    for loss, d in dose.items():
        trend = d["trend"]
        if trend is None:
            continue
        lines += ["", f"### Copies to 50% exact match within one pass: {loss}", "",
                  "Monotone fit of exact match over copies per size; 95% cluster-bootstrap interval; '> c' a size "
                  "that never reached 50% (a lower bound), '<= c' one already there at its fewest copies.", ""]
        lines += md_table(["model", "params", "copies to 50%", "95% interval"], "lrrr",
                       [[model, human(s["params"]), s["crossing"].label(), _size_interval(s)]
                        for model, s in trend["sizes"].items()])
        lo, hi = trend["slope_interval"]
        slope = slope_label(trend)
        lines += ["", f"Power law copies-to-50% ~ N^slope: slope {slope}, 95% interval "
                  f"[{_bound(lo)}, {_bound(hi)}] ({trend['replicates_censored']} of {N_BOOT} bootstrap replicates "
                  "had a censored size and bound the slope only).", *left_out_line(d["seeds_left_out"])]
        band = d["band"]
        if band and band["band"]:
            lines.append(f"A multi-exposure extrapolation, labelled as such: the size at which 1 copy would reach "
                         f"20-70% exact match lies in [{human(band['band'][0])}, {human(band['band'][1])}] "
                         "parameters (over thresholds and the bootstrap).")
        else:
            lines.append("Extrapolated to a single copy, the size is unbounded by these data (a censored size or a "
                         "slope interval reaching 0): no number is given.")
    return [*lines, "", *_utility_table(nums["utility"]), *_mia_table(nums["mia"]), *_order_table(nums["order"])]


def _utility_table(util: list[dict]) -> list[str]:
    if not util:
        return []
    lines = ["### Utility: held-out loss before and after the pass", "",
             "20k tokens of whole held-out documents, the same for the base (pass 0) and the fine-tuned model; mean "
             "over runs (seeds), 95% bootstrap interval over runs.", ""]
    rows = [[u["loss"], u["model"], human(u["params"]), str(u["runs"]), f"{u['base']:.3f}", f"{u['after']:.3f}",
             _interval(u["delta"]), f"{u['worst']:+.3f}"] for u in util]
    header = ["loss", "model", "params", "runs", "base", "after the pass", "change [95% CI]", "worst run"]
    alone = ["A row of one run has no interval (it resamples that run alone): run-to-run variance is not in it."] \
        if any(u["runs"] == 1 for u in util) else []
    return [*lines, *md_table(header, "llrrrrrr", rows), *alone, ""]


def _mia_table(mia: list[dict]) -> list[str]:
    if not mia:
        return []
    lines = ["### Membership inference at one exposure", "",
             "Members seen exactly once against every never-trained twin, pooled over seeds. Loss attack: lower "
             "suffix loss = member; calibrated: its drop from the base model. AUC [95% cluster-bootstrap interval: "
             "seeds, and in each its members and twins]; TPR at the largest threshold whose false-positive rate is "
             "<= 1% of the twins (0 false positives below 100 twins).", ""]
    rows = [[m["loss"], m["model"], f"{c['n_members']} / {c['n_twins']}", _auc(a), _auc(c),
             f"{a['tpr_at_1pct_fpr']:.2f}", f"{c['tpr_at_1pct_fpr']:.2f}"]
            for m in mia for a, c in [(m["attack_loss"], m["attack_calibrated"])]]
    header = ["loss", "model", "members / twins", "AUC loss", "AUC calibrated", "TPR at 1% FPR, loss",
              "TPR at 1% FPR, calibrated"]
    return [*lines, *md_table(header, "llrrrrr", rows), ""]


def _auc(attack: dict) -> str:
    lo, hi = attack["auc_interval"]
    return f"{attack['auc']:.2f} [{lo:.2f}, {hi:.2f}]"


def _order_table(order: list[dict]) -> list[str]:
    if not order:
        return []
    lines = ["### Training order", "",
             "Within each copies level, the Spearman correlation of a member's last training step with its "
             "log-likelihood after the pass (positive: later-seen canaries are remembered better), pooled over runs "
             "weighted by members; a check on the data order, with few members per level and run. Under a decaying "
             "learning rate a late copy is also trained with a smaller step, which pulls the other way.", ""]
    rows = [[o["loss"], o["model"], str(o["runs"]), str(o["n"]), f"{o['rho']:+.2f}",
             f"[{o['lo']:+.2f}, {o['hi']:+.2f}]"] for o in order]
    return [*lines, *md_table(["loss", "model", "runs", "members", "Spearman (pooled)", "range over runs"], "llrrrr",
                           rows), ""]
