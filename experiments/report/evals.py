"""`memtrain plot EVAL_DIR [EVAL_DIR ...]`: one or many evaluations side by side (`memtrain eval --model ...
--out DIR` audits, or run directories): exact match per canary kind with 95% Wilson intervals, twins beside
members as the control, and membership inference (AUC) per kind. Writes evals.png/.pdf/.svg, evals.csv and
evals.md into --out; reads nothing but each directory's eval.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from memtrain.files import write_atomic
from memtrain.run_files import EVAL

from .figure_files import save_figure, write_csv
from .stats import wilson


def applies(paths: list[Path]) -> bool:
    """Whether every path is an evaluation (a directory with eval.json) rather than a sweep."""
    return all((Path(p) / EVAL).is_file() for p in paths)


def _kinds(result: dict) -> dict:
    """{kind: (exact, scored, twins exact, twins scored, AUC)} of one eval.json; a run's from before `by_kind`
    existed is summed from its (kind, copies) cells (no twins or AUC per kind there)."""
    if "by_kind" in result:
        return {k: (v["exact_count"], v["n_evaluated"], v.get("twins_exact_count"), v.get("twins_evaluated"),
                    v.get("mia_auc_loss")) for k, v in result["by_kind"].items()}
    out: dict = {}
    for key, cell in result.get("cells", {}).items():
        kind = key.rsplit("/", 1)[0]
        k, n = out.get(kind, (0, 0, None, None, None))[:2]
        out[kind] = (k + cell["exact_count"], n + cell["n_evaluated"], None, None, None)
    return out


def plot_evals(paths: list[str | Path], out: str | Path) -> dict:
    """The figure, CSV and table of the evaluations in `paths` (labelled by directory name) into `out`."""
    paths = [Path(p) for p in paths]
    labels = [p.resolve().name for p in paths]
    if len(set(labels)) < len(labels):
        labels = [str(p) for p in paths]
    evals = {}
    for label, p in zip(labels, paths):
        try:
            evals[label] = _kinds(json.loads((p / EVAL).read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{str(p / EVAL)!r} is not an evaluation memtrain wrote ({e}): pass directories "
                             "written by `memtrain eval` or `memtrain train`") from None
    kinds = sorted({k for v in evals.values() for k in v}, key=str)
    rows = []
    for label, by in evals.items():
        for kind in kinds:
            if kind in by:
                k, n, tk, tn, auc = by[kind]
                lo, hi = wilson(k, n)
                rows.append([label, kind, k, n, k / n if n else None, lo, hi, tk, tn, auc])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    csv = write_csv(out / "evals.csv", ["eval", "kind", "exact", "n", "rate", "lo95", "hi95", "twins_exact",
                                        "twins_n", "mia_auc_loss"], rows)
    png = _draw(rows, labels, kinds, out / "evals.png")
    md = ["| eval | kind | exact match | 95% Wilson | twins exact | MIA AUC (loss) |", "|---|---|---:|---|---:|---:|"]
    for label, kind, k, n, _, lo, hi, tk, tn, auc in rows:
        twins = "-" if tn is None else f"{tk}/{tn}"
        md.append(f"| {label} | {kind} | {k}/{n} | [{lo:.2f}, {hi:.2f}] | {twins} | "
                  f"{'-' if auc is None else f'{auc:.3f}'} |")
    table = write_atomic(out / "evals.md", "\n".join(md) + "\n")
    return {"figure": png, "csv": csv, "table": table, "evals": len(evals)}


def _draw(rows: list[list], labels: list[str], kinds: list, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(kinds) * max(1, len(labels)) ** 0.5 + 2), 3.6))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        mine = [r for r in rows if r[0] == label]
        xs = [kinds.index(r[1]) + (i - (len(labels) - 1) / 2) * width for r in mine]
        ys = [r[4] or 0.0 for r in mine]
        err = [[y - r[5] for y, r in zip(ys, mine)], [r[6] - y for y, r in zip(ys, mine)]]
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=label)
    ax.set_xticks(range(len(kinds)))
    ax.set_xticklabels([str(k) for k in kinds])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("exact match (95% Wilson)")
    ax.set_title("extraction per canary kind")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, png)
