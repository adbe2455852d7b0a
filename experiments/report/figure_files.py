"""How a study's figure leaves the report: PNG (for report.md), PDF and SVG beside it, and its numbers as CSV.

A reader can redraw or check any figure from its CSV without results.jsonl; the vector formats are for print.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from memtrain.files import write_atomic


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    """`rows` under `header`, written whole or not at all (None as an empty cell)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(rows)
    return write_atomic(path, buf.getvalue())


def save_figure(fig, png: Path) -> Path:
    """`fig` as `png` and the same name with .pdf and .svg, then closed (a report draws many); returns `png`."""
    for suffix in (".png", ".pdf", ".svg"):
        fig.savefig(png.with_suffix(suffix), dpi=130, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return png
