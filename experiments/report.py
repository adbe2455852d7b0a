"""Catastrophic-memorization figures and a Markdown report, drawn from a sweep's results.jsonl alone.

    memtrain plot runs/quick                       # the sweep directory (or its results.jsonl)
    memtrain plot results.jsonl --out report/      # anywhere: nothing but results.jsonl is read
    python -m experiments.report runs/quick

Figures (PNG, matplotlib Agg, colour-blind palette), under <out>/figures/:
- exact_match_vs_size.png     exact-match rate of inserted canaries vs parameters (log x), a line per loss
- exact_match_by_copies.png   the same, one panel per number of copies in the training stream
- rougeL_distribution.png     ROUGE-L of the generated suffixes per model and loss (per canary when the
                              results carry them, else per copy count), twins (never trained on) as baseline
- exposure_vs_copies.png      mean exposure of random canaries vs copies, a panel per loss, a line per model
- mia_auc_vs_size.png         membership-inference AUC (loss attack, members vs twins) vs parameters
- val_loss_vs_size.png        validation loss (utility) vs parameters
- metrics_by_loss.png         exact match, ROUGE-L and MIA AUC per loss variant, bars per model
and <out>/report.md with a table of every run (failed ones too) linking the figures.

Several lines for the same point (a failure, then a retry with --resume) count once: the last one wins.
Several seeds of the same model and loss are averaged; error bars span their min and max.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

from experiments.results import latest_by_point, read_results
from memtrain.files import write_atomic

# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
PALETTE = ["#D55E00", "#0072B2", "#009E73", "#E69F00", "#56B4E9", "#CC79A7", "#F0E442", "#000000"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
DPI = 150


# ---------------------------------------------------------------------------------------------------
# reading


def _f(v):
    """A finite float or None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def loss_of(r: dict) -> str:
    if r.get("loss"):
        return str(r["loss"])
    loss = (r.get("config") or {}).get("loss") or {}
    return f"goldfish k={loss.get('k')}" if loss.get("kind") == "goldfish" else str(loss.get("kind", "?"))


def loss_order(label: str):
    """standard first, then goldfish by growing k (k large ~ standard), then anything else."""
    m = re.search(r"k=(\d+)", label)
    if label.startswith("standard"):
        return (0, 0, label)
    if label.startswith("goldfish"):
        return (1, int(m.group(1)) if m else 0, label)
    return (2, 0, label)


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok" and isinstance(r.get("eval"), dict)]


def _size_key(r):
    return (_f(r.get("params")) or float("inf"), str(r.get("model")))


def models_by_size(rows) -> list[str]:
    seen = {}
    for r in sorted(rows, key=_size_key):
        seen.setdefault(str(r.get("model")), _f(r.get("params")))
    return list(seen)


def _agg(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return sum(vals) / len(vals), min(vals), max(vals), len(vals)


def series(rows, metric) -> dict[str, list[tuple]]:
    """{loss: [(params, mean, lo, hi, model), ...] sorted by params} for a metric(row) -> float|None."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in _ok(rows):
        p = _f(r.get("params"))
        if p is None:
            continue
        groups[(loss_of(r), p, str(r.get("model")))].append(metric(r))
    out: dict[str, list] = defaultdict(list)
    for (loss, p, model), vals in groups.items():
        a = _agg(vals)
        if a:
            out[loss].append((p, a[0], a[1], a[2], model))
    return {k: sorted(v) for k, v in sorted(out.items(), key=lambda kv: loss_order(kv[0]))}


def ev(r, *keys):
    d = r.get("eval") or {}
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return _f(d)


def copies_of(rows) -> list[str]:
    cs = set()
    for r in _ok(rows):
        cs.update(((r.get("eval") or {}).get("by_copies") or {}).keys())
    return sorted(cs, key=lambda c: (float(c) if re.fullmatch(r"[\d.]+", c) else math.inf, c))


# ---------------------------------------------------------------------------------------------------
# figures


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
        for p, *_rest, model in pts:
            names.setdefault(p, model)
    if 0 < len(names) <= 8:
        ax.set_xticks(sorted(names))
        ax.set_xticklabels([f"{_human(p)}\n{names[p]}" for p in sorted(names)], fontsize=7)
        ax.minorticks_off()
    ax.grid(True, which="both", alpha=0.3)


def _human(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def _plot_series(ax, data: dict, labels: list[str]):
    for loss, pts in data.items():
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        lo = [p[1] - p[2] for p in pts]
        hi = [p[3] - p[1] for p in pts]
        st = _style(loss, labels)
        ax.errorbar(xs, ys, yerr=[lo, hi] if any(lo) or any(hi) else None, label=loss, capsize=3, lw=1.8,
                    ms=6, **st)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)
    return path


def _empty(fig, ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def fig_vs_size(rows, labels, path: Path, metric, ylabel: str, title: str, ylim=None, hline=None) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    data = series(rows, metric)
    if not any(data.values()):
        _empty(fig, ax, "no finished run with this metric")
    else:
        _plot_series(ax, data, labels)
        _size_axis(ax, data)
        if hline is not None:
            ax.axhline(hline[0], color="0.5", ls=":", lw=1, label=hline[1])
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def fig_exact_by_copies(rows, labels, path: Path) -> Path:
    plt = _plt()
    copies = copies_of(rows)
    n = max(1, len(copies))
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n + 0.6, 3.8), sharey=True, squeeze=False)
    if not copies:
        _empty(fig, axes[0][0], "no per-copy results")
    for ax, c in zip(axes[0], copies):
        data = series(rows, lambda r, c=c: ev(r, "by_copies", c, "exact_match_rate"))
        if any(data.values()):
            _plot_series(ax, data, labels)
            _size_axis(ax, data)
        ax.set_title(f"{c} cop{'y' if c == '1' else 'ies'}", fontsize=10)
        ax.set_ylim(-0.03, 1.03)
    axes[0][0].set_ylabel("exact-match rate")
    handles, names = axes[0][0].get_legend_handles_labels()
    if handles:
        axes[0][-1].legend(handles, names, fontsize=7)
    fig.suptitle("Exact match vs model size, by copies of the canary in the training pass", fontsize=10)
    return _save(fig, path)


def _rouge_values(r: dict, inserted: bool) -> list[float]:
    """Per-canary ROUGE-L when the results carry canaries, else the per-copy (or run) means."""
    vals = [_f(c.get("rouge_l")) for c in r.get("canaries") or [] if bool(c.get("inserted")) == inserted]
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
    ok = _ok(rows)
    models = models_by_size(ok)
    losses = [lbl for lbl in labels if any(loss_of(r) == lbl for r in ok)]
    fig, ax = plt.subplots(figsize=(max(6.4, 1.3 * len(models) * max(1, len(losses)) + 1.5), 4.4))
    width = 0.8 / max(1, len(losses) + 1)
    drawn = False
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
    return _save(fig, path)


def fig_exposure(rows, labels, path: Path) -> Path:
    plt = _plt()
    ok = _ok(rows)
    losses = [lbl for lbl in labels if any(loss_of(r) == lbl for r in ok)] or ["-"]
    models = models_by_size(ok)
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(losses), figsize=(4.2 * len(losses) + 0.6, 4.0), sharey=True, squeeze=False)
    drawn = False
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
            ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o", lw=1.6,
                    color=cmap(i / max(1, len(models) - 1) * 0.9), label=model)
            drawn = True
        ax.set_xscale("log", base=2)
        ticks = sorted({float(c) for c in copies_of(ok) if re.fullmatch(r"[\d.]+", c) and float(c) > 0})
        if ticks:
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel("copies in the training pass")
        ax.set_title(loss, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("mean exposure (bits)")
    if drawn:
        axes[0][-1].legend(fontsize=7, title="model", title_fontsize=7)
    else:
        _empty(fig, axes[0][0], "no exposure values (random canaries)")
    fig.suptitle("Exposure of random canaries vs copies", fontsize=10)
    return _save(fig, path)


def fig_by_loss(rows, labels, path: Path) -> Path:
    plt = _plt()
    ok = _ok(rows)
    losses = [lbl for lbl in labels if any(loss_of(r) == lbl for r in ok)]
    models = models_by_size(ok)
    metrics = [("exact_match_rate", "exact-match rate"), ("rougeL", "ROUGE-L"), ("mia_auc_loss", "MIA AUC (loss)")]
    fig, axes = plt.subplots(1, 3, figsize=(max(10.0, 1.1 * len(losses) * 3 + 2), 3.9), squeeze=False)
    cmap = plt.get_cmap("viridis")
    width = 0.8 / max(1, len(models))
    for ax, (key, name) in zip(axes[0], metrics):
        for i, model in enumerate(models):
            xs, ys = [], []
            for j, loss in enumerate(losses):
                vals = [ev(r, key) for r in ok if loss_of(r) == loss and str(r.get("model")) == model]
                a = _agg(vals)
                if a:
                    xs.append(j + (i - (len(models) - 1) / 2) * width)
                    ys.append(a[0])
            ax.bar(xs, ys, width=width * 0.95, color=cmap(i / max(1, len(models) - 1) * 0.9), label=model)
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
    return _save(fig, path)


def draw_figures(rows: list[dict], fig_dir: Path) -> list[Path]:
    fig_dir.mkdir(parents=True, exist_ok=True)
    labels = sorted({loss_of(r) for r in rows}, key=loss_order)
    figs = [
        fig_vs_size(rows, labels, fig_dir / "exact_match_vs_size.png", lambda r: ev(r, "exact_match_rate"),
                    "exact-match rate", "Exact match of inserted canaries after fine-tuning vs model size",
                    ylim=(-0.03, 1.03)),
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
    return figs


# ---------------------------------------------------------------------------------------------------
# report.md


def _cell(v, fmt="{:.3f}") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return fmt.format(v)
    return str(v).replace("|", "\\|")


def table_rows(rows: list[dict]) -> list[dict]:
    """One flat dict per run (the report table, also logged to W&B)."""
    out = []
    for r in rows:
        out.append({
            "point": r.get("point"), "model": r.get("model"), "params": r.get("params"), "loss": loss_of(r),
            "seed": r.get("seed"), "exact_match": ev(r, "exact_match_rate"), "rougeL": ev(r, "rougeL"),
            "exposure": ev(r, "exposure_mean"), "mia_auc": ev(r, "mia_auc_loss"), "val_loss": ev(r, "val_loss"),
            "train_loss": _f((r.get("train") or {}).get("loss")),
            "tokens_per_s": _f((r.get("train") or {}).get("tokens_per_s")),
            "status": r.get("status"), "error": r.get("error"), "run_dir": r.get("run_dir"),
        })
    return out


def write_markdown(rows: list[dict], figs: list[Path], out: Path) -> Path:
    name = next((r.get("sweep") for r in rows if r.get("sweep")), out.name)
    ok = _ok(rows)
    failed = [r for r in rows if r.get("status") != "ok"]
    lines = [f"# Memorization sweep `{name}`", "",
             f"{len(rows)} run(s): {len(ok)} ok, {len(failed)} failed. Metrics are over the inserted canaries "
             "(exact match, ROUGE-L: greedy suffix extraction; exposure: random canaries; MIA AUC: loss attack, "
             "inserted canaries vs their never-trained twins; val loss: held-out documents).", ""]
    lines += ["## Runs", "",
              "| point | model | params | loss | seed | exact match | ROUGE-L | exposure | MIA AUC | val loss | "
              "train loss | status |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in table_rows(rows):
        params = _human(t["params"]) if isinstance(t["params"], (int, float)) else "-"
        lines.append(f"| {_cell(t['point'])} | {_cell(t['model'])} | {params} | {_cell(t['loss'])} | "
                     f"{_cell(t['seed'])} | {_cell(t['exact_match'])} | {_cell(t['rougeL'])} | "
                     f"{_cell(t['exposure'], '{:.2f}')} | {_cell(t['mia_auc'])} | {_cell(t['val_loss'])} | "
                     f"{_cell(t['train_loss'])} | {_cell(t['status'])} |")
    copies = copies_of(rows)
    if copies:
        lines += ["", "## Exact match by copies", "",
                  "| point | " + " | ".join(f"{c}x" for c in copies) + " |",
                  "|---|" + "---:|" * len(copies)]
        for r in ok:
            lines.append(f"| {_cell(r.get('point'))} | "
                         + " | ".join(_cell(ev(r, "by_copies", c, "exact_match_rate")) for c in copies) + " |")
    if failed:
        lines += ["", "## Failures", ""]
        lines += [f"- `{r.get('point')}`: {_cell(r.get('error'))} (run dir `{r.get('run_dir')}`)" for r in failed]
    lines += ["", "## Figures", ""]
    for f in figs:
        rel = f.relative_to(out) if f.is_relative_to(out) else f
        lines += [f"### {f.stem.replace('_', ' ')}", "", f"![{f.stem}]({rel.as_posix()})", ""]
    return write_atomic(out / "report.md", "\n".join(lines) + "\n")


def build_report(results: str | Path, out: str | Path | None = None) -> dict:
    """Figures and report.md from a results.jsonl (or a directory holding one) into `out`."""
    results = Path(results)
    if results.is_dir():
        results = results / "results.jsonl"
    if not results.is_file():
        raise FileNotFoundError(f"{str(results)!r} not found: pass a sweep directory or its results.jsonl")
    out = Path(out) if out else results.parent
    out.mkdir(parents=True, exist_ok=True)
    rows = list(latest_by_point(read_results(results)).values())
    if not rows:
        raise ValueError(f"{str(results)!r} holds no results yet")
    figs = draw_figures(rows, out / "figures")
    md = write_markdown(rows, figs, out)
    return {"report": md, "figures_dir": out / "figures", "figures": figs, "table": table_rows(rows),
            "runs": len(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memtrain plot", description="Draw a sweep's figures and report.md from "
                                 "its results.jsonl (nothing else is read).")
    ap.add_argument("path", help="a sweep directory (runs/<sweep>) or a results.jsonl file")
    ap.add_argument("--out", default=None, help="where report.md and figures/ go (default: next to results.jsonl)")
    args = ap.parse_args(argv)
    try:
        made = build_report(args.path, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {made['report']} ({made['runs']} runs)")
    print(f"figures: {made['figures_dir']}/ ({', '.join(f.name for f in made['figures'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
