"""The figures of a sweep report (matplotlib Agg, colour-blind palette), drawn from result records alone: each as
PNG, PDF and SVG, with the numbers it draws as a CSV of the same name.

Exact-match rates are pooled over seeds with 95% Wilson intervals (n = canaries x seeds, in the legend), the
never-trained twins' rate beside them as the control (grey); other metrics average the seeds, bars spanning their
min and max.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from . import passes
from .aggregate import (
    THRESHOLD,
    agg,
    copies_of,
    curves,
    ev,
    f,
    final_exact,
    human,
    loss_of,
    losses,
    lr_sweep,
    models_by_size,
    ok_rows,
    series,
    twin_exact,
)
from .figure_files import save_figure, write_csv
from .passes import fig_threshold

# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
PALETTE = ["#D55E00", "#0072B2", "#009E73", "#E69F00", "#56B4E9", "#CC79A7", "#F0E442", "#000000"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
SERIES_CSV = ["loss", "model", "params", "value", "lo", "hi", "k", "n"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _style(label: str, labels: list[str]) -> dict:
    i = labels.index(label) if label in labels else 0
    return {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)]}


def _size_axis(ax, pts_by_loss):
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    names = {}
    for pts in pts_by_loss.values():
        for p, _, _, _, model, *_ in pts:
            names.setdefault(p, model)
    if 0 < len(names) <= 8:
        ax.set_xticks(sorted(names))
        ax.set_xticklabels([f"{human(p)}\n{names[p]}" for p in sorted(names)], fontsize=7)
        ax.minorticks_off()
    ax.grid(True, which="both", alpha=0.3)


def _plot_series(ax, data: dict, labels: list[str]):
    """Series of (x, y, lo, hi, model[, k, n]) per loss; pooled counts put their n in the legend."""
    for loss, pts in data.items():
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        lo = [p[1] - p[2] for p in pts]
        hi = [p[3] - p[1] for p in pts]
        ns = sorted({p[6] for p in pts if len(p) > 6})
        label = loss + (f" (n={'/'.join(map(str, ns))}, 95% Wilson)" if ns else "")
        ax.errorbar(xs, ys, yerr=[lo, hi] if any(lo) or any(hi) else None, label=label, capsize=3, lw=1.8,
                    ms=6, **_style(loss, labels))


def _save(fig, path: Path, header: list[str], table: list[list]) -> Path:
    """The figure in its three formats and `table` (what it draws) as the CSV beside it."""
    fig.tight_layout()
    write_csv(path.with_suffix(".csv"), header, table)
    return save_figure(fig, path)


def _series_table(data: dict, *lead) -> list[list]:
    """CSV rows of a {loss: [(params, value, lo, hi, model[, k, n])]} series, each after `lead`."""
    return [[*lead, loss, p[4], p[0], p[1], p[2], p[3], *(p[5:7] if len(p) > 6 else (None, None))]
            for loss, pts in data.items() for p in pts]


def _empty(fig, ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_controls(ax, control: dict):
    """The never-trained twins' series beside the members', grey and dashed, a line per loss."""
    for i, (loss, pts) in enumerate(control.items()):
        ns = sorted({p[6] for p in pts})
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts],
                                                                    [p[3] - p[1] for p in pts]],
                    color="0.55", ls="--", marker=MARKERS[i % len(MARKERS)], ms=4, capsize=2, lw=1,
                    label=f"{loss}: never-trained twins (control, n={'/'.join(map(str, ns))})")


def fig_vs_size(rows, labels, path: Path, metric, ylabel: str, title: str, ylim=None, hline=None,
                control: dict | None = None) -> Path:
    """A metric vs parameters, a line per loss: `metric` is a row -> value function (seeds averaged) or the
    precomputed series (e.g. pooled exact-match counts); `control` the twins' series of the same metric."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    data = metric if isinstance(metric, dict) else series(rows, metric)
    control = {loss: pts for loss, pts in (control or {}).items() if pts}
    if not any(data.values()):
        _empty(fig, ax, "no finished run with this metric")
    else:
        _plot_series(ax, data, labels)
        _plot_controls(ax, control)
        _size_axis(ax, data)
        if hline is not None:
            ax.axhline(hline[0], color="0.5", ls=":", lw=1, label=hline[1])
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, path, SERIES_CSV, _series_table(data) + _series_table(_as_twins(control)))


def _as_twins(control: dict) -> dict:
    """A control series keyed as its CSV rows name it."""
    return {f"{loss} (never-trained twins)": pts for loss, pts in control.items()}


def fig_exact_by_copies(rows, labels, path: Path) -> Path:
    plt = _plt()
    copies = copies_of(rows)
    n = max(1, len(copies))
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n + 0.6, 3.8), sharey=True, squeeze=False)
    if not copies:
        _empty(fig, axes[0][0], "no per-copy results")
    table = []
    control = {loss: pts for loss, pts in twin_exact(rows).items() if pts}  # a twin is never trained: any panel
    for ax, c in zip(axes[0], copies):
        data = final_exact(rows, block=c)
        table += _series_table(data, c)
        if any(data.values()):
            _plot_series(ax, data, labels)
            _plot_controls(ax, control)
            _size_axis(ax, data)
        ax.set_title(f"{c} cop{'y' if c == '1' else 'ies'} seen", fontsize=10)
        ax.set_ylim(-0.03, 1.03)
    axes[0][0].set_ylabel("exact-match rate")
    handles, names = axes[0][0].get_legend_handles_labels()
    if handles:
        axes[0][0].legend(handles, names, fontsize=7, loc="upper left")  # low copies: an empty upper panel
    fig.suptitle("Exact match vs model size, by copies of the canary seen in training (copies per pass x passes)",
                 fontsize=10)
    return _save(fig, path, ["copies", *SERIES_CSV], table + _series_table(_as_twins(control), "any"))


def _rouge_values(r: dict, inserted: bool) -> list[float]:
    """Per-canary ROUGE-L when the results carry canaries, else the per-copy (or run) means."""
    vals = [f(c.get("rouge_l")) for c in r.get("canaries") or [] if bool(c.get("inserted")) == inserted]
    vals = [v for v in vals if v is not None]
    if vals or r.get("canaries"):
        return vals
    if not inserted:
        v = ev(r, "twins", "rougeL")
        return [v] if v is not None else []
    per = [ev(r, "by_copies", c, "rougeL") for c in ((r.get("eval") or {}).get("by_copies") or {})]
    per = [v for v in per if v is not None]
    return per or [v for v in [ev(r, "rougeL")] if v is not None]


def fig_rouge(rows, labels, path: Path) -> Path:
    plt = _plt()
    ok = ok_rows(rows)
    models = models_by_size(ok)
    losses = [lbl for lbl in labels if any(loss_of(r) == lbl for r in ok)]
    fig, ax = plt.subplots(figsize=(max(6.4, 1.3 * len(models) * max(1, len(losses)) + 1.5), 4.4))
    width = 0.8 / max(1, len(losses) + 1)
    drawn, table = False, []
    for i, model in enumerate(models):
        for j, loss in enumerate(losses + ["twins"]):
            if loss == "twins":
                sel = [r for r in ok if str(r.get("model")) == model]
                vals = [v for r in sel for v in _rouge_values(r, inserted=False)]
                color, hatch = "0.8", "//"
            else:
                sel = [r for r in ok if str(r.get("model")) == model and loss_of(r) == loss]
                vals = [v for r in sel for v in _rouge_values(r, inserted=True)]
                color, hatch = _style(loss, labels)["color"], None
            if not vals:
                continue
            table += [[model, loss, v] for v in vals]
            pos = i + (j - len(losses) / 2) * width
            b = ax.boxplot([vals], positions=[pos], widths=width * 0.9, patch_artist=True, showfliers=True,
                           medianprops={"color": "black"}, flierprops={"markersize": 3})
            for patch in b["boxes"]:
                patch.set_facecolor(color)
                patch.set_alpha(0.85)
                if hatch:
                    patch.set_hatch(hatch)
            drawn = True
    if not drawn:
        _empty(fig, ax, "no ROUGE-L values")
    else:
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, fontsize=8)
        ax.set_xlim(-0.6, len(models) - 0.4)
        ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel("ROUGE-L of the generated suffix")
        from matplotlib.patches import Patch

        handles = [Patch(facecolor=_style(lbl, labels)["color"], label=lbl) for lbl in losses]
        handles.append(Patch(facecolor="0.8", hatch="//", label="twins (never trained on)"))
        ax.legend(handles=handles, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    ax.set_title("ROUGE-L distribution of inserted canaries, per model and loss", fontsize=10)
    return _save(fig, path, ["model", "loss", "rouge_l"], table)


def fig_exposure(rows, labels, path: Path) -> Path:
    plt = _plt()
    ok = ok_rows(rows)
    losses = [lbl for lbl in labels if any(loss_of(r) == lbl for r in ok)] or ["-"]
    models = models_by_size(ok)
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(losses), figsize=(4.2 * len(losses) + 0.6, 4.0), sharey=True, squeeze=False)
    drawn, table = False, []
    for ax, loss in zip(axes[0], losses):
        for i, model in enumerate(models):
            pts = defaultdict(list)
            for r in ok:
                if loss_of(r) != loss or str(r.get("model")) != model:
                    continue
                for c in (r.get("eval") or {}).get("by_copies") or {}:
                    v = ev(r, "by_copies", c, "exposure_mean")
                    if v is not None and re.fullmatch(r"[\d.]+", c):
                        pts[float(c)].append(v)
            if not pts:
                continue
            xs = sorted(pts)
            means = [sum(pts[x]) / len(pts[x]) for x in xs]
            table += [[loss, model, f"{x:g}", m, len(pts[x])] for x, m in zip(xs, means)]
            ax.plot(xs, means, marker="o", lw=1.6,
                    color=cmap(i / max(1, len(models) - 1) * 0.9), label=model)
            drawn = True
        ax.set_xscale("log", base=2)
        ticks = sorted({float(c) for c in copies_of(ok) if re.fullmatch(r"[\d.]+", c) and float(c) > 0})
        if ticks:
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel("copies seen in training (copies per pass x passes)")
        ax.set_title(loss, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("mean exposure, estimated (bits)")
    if drawn:
        axes[0][-1].legend(fontsize=7, title="model", title_fontsize=7)
    else:
        _empty(fig, axes[0][0], "no exposure values (random canaries)")
    fig.suptitle("Exposure of random canaries vs copies", fontsize=10)
    return _save(fig, path, ["loss", "model", "copies", "mean_exposure_bits", "runs"], table)


def fig_by_loss(rows, labels, path: Path) -> Path:
    plt = _plt()
    ok = ok_rows(rows)
    losses = [lbl for lbl in labels if any(loss_of(r) == lbl for r in ok)]
    models = models_by_size(ok)
    metrics = [("exact_match_rate", "exact-match rate"), ("rougeL", "ROUGE-L"), ("mia_auc_loss", "MIA AUC (loss)")]
    fig, axes = plt.subplots(1, 3, figsize=(max(10.0, 1.1 * len(losses) * 3 + 2), 3.9), squeeze=False)
    cmap = plt.get_cmap("viridis")
    width = 0.8 / max(1, len(models))
    table = []
    for ax, (key, name) in zip(axes[0], metrics):
        for i, model in enumerate(models):
            xs, ys, spread, twins = [], [], [[], []], []
            for j, loss in enumerate(losses):
                runs = [r for r in ok if loss_of(r) == loss and str(r.get("model")) == model]
                a = agg([ev(r, key) for r in runs])
                if a:
                    xs.append(j + (i - (len(models) - 1) / 2) * width)
                    ys.append(a[0])
                    spread[0].append(a[0] - a[1])
                    spread[1].append(a[2] - a[0])
                    table.append([key, loss, model, *a])
                    control = agg([ev(r, "twins", key) for r in runs]) if key == "exact_match_rate" else None
                    twins.append(control[0] if control else None)
                    if control:
                        table.append([key, f"{loss} (never-trained twins)", model, *control])
            ax.bar(xs, ys, yerr=spread, width=width * 0.95, color=cmap(i / max(1, len(models) - 1) * 0.9),
                   label=model, error_kw={"lw": 0.8, "capsize": 2})
            marked = [(x, t) for x, t in zip(xs, twins) if t is not None]
            if marked:
                ax.plot(*zip(*marked), ls="none", marker="_", ms=9, mew=2, color="0.35",
                        label="never-trained twins (control)" if i == 0 else None)
        ax.set_xticks(range(len(losses)))
        ax.set_xticklabels(losses, rotation=30, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        if key == "mia_auc_loss":
            ax.axhline(0.5, color="0.5", ls=":", lw=1)
            ax.set_ylim(0, 1)
        elif key in ("exact_match_rate", "rougeL"):
            ax.set_ylim(0, 1)
    if models:
        axes[0][0].legend(fontsize=7, title="model", title_fontsize=7)
    else:
        _empty(fig, axes[0][0], "no finished run")
    fig.suptitle("Memorization per loss variant", fontsize=10)
    return _save(fig, path, ["metric", "loss", "model", "mean", "min", "max", "runs"], table)


def fig_passes(rows, labels, path: Path, kind: str | None = None) -> Path:
    """Exact match vs passes, a panel per loss, a line per size (pooled seeds, 95% Wilson bands)."""
    plt = _plt()
    data = curves(rows, kind)
    panels = [lbl for lbl in labels if lbl in data] or ["-"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 0.6, 4.0), sharey=True, squeeze=False)
    cmap = plt.get_cmap("viridis")
    table = []
    for ax, loss in zip(axes[0], panels):
        by_model = data.get(loss, {})
        for i, (model, c) in enumerate(by_model.items()):
            pts = c["passes"]
            table += [[loss, model, c["params"], *pt] for pt in pts]
            color = cmap(i / max(1, len(by_model) - 1) * 0.9)
            xs = [pt[0] for pt in pts]
            ax.plot(xs, [pt[1] for pt in pts], marker="o", ms=3, lw=1.6, color=color,
                    label=f"{model} ({human(c['params'] or 0)}, n={pts[-1][5]})")
            ax.fill_between(xs, [pt[2] for pt in pts], [pt[3] for pt in pts], color=color, alpha=0.15, lw=0)
        ax.axhline(THRESHOLD, color="0.5", ls=":", lw=1)
        ax.set_xlabel("passes over the fine-tuning data")
        ax.set_title(loss, fontsize=10)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
        if by_model:
            ax.legend(fontsize=7, title="model", title_fontsize=7)
    axes[0][0].set_ylabel("exact-match rate")
    if not any(data.values()):
        _empty(fig, axes[0][0], "no per-pass results (eval.every_pass)")
    fig.suptitle(f"Exact match vs passes{f' ({kind} canaries)' if kind else ''}, by model size", fontsize=10)
    return _save(fig, path, ["loss", "model", "params", "pass", "rate", "lo", "hi", "k", "n"], table)


def fig_lr_sweep(rows, path: Path) -> Path:
    """Teacher-forced canary token accuracy vs learning-rate scale around the rule, a line per size; the rule
    tracks a size's best learning rate within 2x when its best point lies in the shaded band."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    data = lr_sweep(rows)
    cmap = plt.get_cmap("viridis")
    table = []
    for i, (model, d) in enumerate(data.items()):
        color = cmap(i / max(1, len(data) - 1) * 0.9)
        pts = d["points"]
        table += [[model, d["params"], *p] for p in pts]
        ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", color=color,
                label=f"{model} ({human(d['params'] or 0)}): best x{d['best_scale']:g}")
        best = max(pts, key=lambda p: p[2])
        ax.plot([best[0]], [best[2]], "*", color=color, ms=14)
    ax.axvspan(0.5, 2, color="0.85", alpha=0.5, lw=0, label="within 2x of the rule")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("learning rate / the rule's (train.lr_scale)")
    ax.set_ylabel("suffix token accuracy after the last pass")
    ax.grid(True, which="both", alpha=0.3)
    if data:
        ax.legend(fontsize=7)
    else:
        _empty(fig, ax, "no learning-rate sweep (axis train.lr_scale)")
    ax.set_title("Learning-rate sweep per size around the width rule", fontsize=10)
    return _save(fig, path, ["model", "params", "lr_scale", "lr", "token_accuracy"], table)


def draw_figures(rows: list[dict], fig_dir: Path, study: dict | None = None) -> list[Path]:
    """Every sweep's figures; over passes, the curves and (from `study`, passes.numbers(rows), computed here when
    not given) passes to 50% vs size."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    labels = losses(rows)
    figs = [
        fig_vs_size(rows, labels, fig_dir / "exact_match_vs_size.png", final_exact(rows), "exact-match rate",
                    "Exact match of inserted canaries after fine-tuning vs model size", ylim=(-0.03, 1.03),
                    control=twin_exact(rows)),
        fig_exact_by_copies(rows, labels, fig_dir / "exact_match_by_copies.png"),
        fig_rouge(rows, labels, fig_dir / "rougeL_distribution.png"),
        fig_exposure(rows, labels, fig_dir / "exposure_vs_copies.png"),
        fig_vs_size(rows, labels, fig_dir / "mia_auc_vs_size.png", lambda r: ev(r, "mia_auc_loss"),
                    "AUC", "Membership inference (loss) on canaries vs twins", ylim=(0, 1.03),
                    hline=(0.5, "chance")),
        fig_vs_size(rows, labels, fig_dir / "val_loss_vs_size.png", lambda r: ev(r, "val_loss"),
                    "validation loss (nats/token)", "Utility: validation loss vs model size"),
        fig_by_loss(rows, labels, fig_dir / "metrics_by_loss.png"),
    ]
    if any(len(r.get("passes") or []) > 2 for r in rows):  # pass 0 and one pass: nothing to draw over passes
        kinds = sorted({key.split("/")[0] for r in rows for p in r.get("passes") or []
                        for key in ((p.get("members") or {}).get("cells") or {})})
        for kind in [None, *kinds] if len(kinds) > 1 else [None]:
            suffix = f"_{kind}" if kind else ""
            figs.append(fig_passes(rows, labels, fig_dir / f"exact_match_vs_passes{suffix}.png", kind))
            study = passes.numbers(rows) if study is None else study
            drawn = fig_threshold(study.get(kind, {}), fig_dir / f"passes_to_threshold{suffix}.png", kind)
            figs += [drawn] if drawn else []
    if lr_sweep(rows):
        figs.append(fig_lr_sweep(rows, fig_dir / "lr_sweep.png"))
    return figs
