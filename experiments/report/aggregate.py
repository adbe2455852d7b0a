"""From a sweep's result records to the numbers its report shows: per-size series, pooled exact-match counts with
Wilson intervals, per-pass memorization curves, the Goldfish loss's validation cost at equal supervised tokens,
and the base models. (Passes to 50% and the power law through them, with intervals: passes.py.)

Seeds are pooled: the canaries of every seed of a (loss, model) point are one sample, so a rate's n is
canaries x seeds. Nothing here needs torch.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from .stats import wilson

THRESHOLD = 0.5
"""The exact-match rate whose crossing the passes study reports (passes to 50%, passes.py)."""


def f(v):
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


def ok_rows(rows):
    return [r for r in rows if r.get("status") == "ok" and isinstance(r.get("eval"), dict)]


def paired_rows(rows: list[dict], loss: str) -> tuple[list[dict], list]:
    """The ok runs with this loss of the seeds that have exactly one at every size, and the seeds left out. A seed's
    canaries are the same at every size and the studies' bootstrap draws whole seeds across sizes: a seed whose
    run at some size failed (or is missing) would leave that size without data in the samples that draw it, and
    one with several runs at a size (another axis, e.g. train.lr_scale) would have them stand for one another."""
    ok = [r for r in ok_rows(rows) if loss_of(r) == loss]
    models = {str(r.get("model")) for r in ok}
    by_seed: dict = defaultdict(list)
    for r in ok:
        by_seed[r.get("seed")].append(str(r.get("model")))
    kept = {seed for seed, ms in by_seed.items() if sorted(ms) == sorted(models)}
    tried = {r.get("seed") for r in rows if loss_of(r) == loss}
    return [r for r in ok if r.get("seed") in kept], sorted(tried - kept, key=str)


def left_out_line(seeds: list) -> list[str]:
    """The report's sentence naming the seeds paired_rows left out, if any."""
    if not seeds:
        return []
    return [f"Seeds left out: {', '.join(map(str, seeds))} (a run at some size failed or is missing, or several "
            "runs share a size; the intervals draw whole seeds across sizes, so only seeds run once at every size "
            "count)."]


def _size_key(r):
    return (f(r.get("params")) or float("inf"), str(r.get("model")))


def models_by_size(rows) -> list[str]:
    seen = {}
    for r in sorted(rows, key=_size_key):
        seen.setdefault(str(r.get("model")), f(r.get("params")))
    return list(seen)


def human(n: float) -> str:
    if n >= 1e15:
        return f"{n:.2g}"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def losses(rows) -> list[str]:
    return sorted({loss_of(r) for r in rows}, key=loss_order)


def agg(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    lo, hi = min(vals), max(vals)
    # Clamped: rounding can put a mean of equal values one ulp outside them (3 x 0.1 sums to 0.30000000000000004),
    # and the figures draw hi - mean and mean - lo as error bars, which must not be negative.
    return min(max(sum(vals) / len(vals), lo), hi), lo, hi, len(vals)


def series(rows, metric) -> dict[str, list[tuple]]:
    """{loss: [(params, mean, lo, hi, model), ...] sorted by params} for a metric(row) -> float|None; the
    bars span the seeds' min and max."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in ok_rows(rows):
        p = f(r.get("params"))
        if p is None:
            continue
        groups[(loss_of(r), p, str(r.get("model")))].append(metric(r))
    out: dict[str, list] = defaultdict(list)
    for (loss, p, model), vals in groups.items():
        a = agg(vals)
        if a:
            out[loss].append((p, a[0], a[1], a[2], model))
    return {k: sorted(v) for k, v in sorted(out.items(), key=lambda kv: loss_order(kv[0]))}


def ev(r, *keys):
    d = r.get("eval") or {}
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return f(d)


def copies_of(rows) -> list[str]:
    cs = set()
    for r in ok_rows(rows):
        cs.update(((r.get("eval") or {}).get("by_copies") or {}).keys())
    return sorted(cs, key=lambda c: (float(c) if re.fullmatch(r"[\d.]+", c) else math.inf, c))


# ---------------------------------------------------------------------------------------------------
# Exact match as counts: pooled over seeds, with Wilson intervals.


def _counts(block: dict | None) -> tuple[int, int] | None:
    """(k exact, n scored) of an eval.json summary block, from its counts or (older files) its rate."""
    if not isinstance(block, dict):
        return None
    n = block.get("n_evaluated", block.get("n"))
    if not n:
        return None
    k = block.get("exact_count")
    if k is None and f(block.get("exact_match_rate")) is not None:
        k = round(block["exact_match_rate"] * n)
    return (int(k), int(n)) if k is not None else None


def pooled(rows, pick) -> dict[str, list[tuple]]:
    """{loss: [(params, rate, lo, hi, model, k, n), ...] by params}: the counts `pick(row)` gives, summed over
    the seeds of each (loss, model), with the 95% Wilson interval."""
    sums: dict[tuple, list] = defaultdict(lambda: [0, 0])
    for r in ok_rows(rows):
        kn, p = pick(r), f(r.get("params"))
        if kn is None or p is None:
            continue
        s = sums[(loss_of(r), p, str(r.get("model")))]
        s[0] += kn[0]
        s[1] += kn[1]
    out: dict[str, list] = defaultdict(list)
    for (loss, p, model), (k, n) in sums.items():
        lo, hi = wilson(k, n)
        out[loss].append((p, k / n, lo, hi, model, k, n))
    return {k: sorted(v) for k, v in sorted(out.items(), key=lambda kv: loss_order(kv[0]))}


def final_exact(rows, block: str | None = None, kind: str | None = None):
    """Pooled final exact match of all inserted canaries, of one by-copies block, or of one kind."""
    def pick(r):
        e = r.get("eval") or {}
        if kind is not None:
            cells = [c for key, c in (e.get("cells") or {}).items() if key.split("/")[0] == kind]
            counts = [_counts(c) for c in cells]
            counts = [c for c in counts if c]
            return (sum(c[0] for c in counts), sum(c[1] for c in counts)) if counts else None
        return _counts((e.get("by_copies") or {}).get(block) if block is not None else e)
    return pooled(rows, pick)


def twin_exact(rows):
    """The control beside every exact-match figure: pooled final exact match of the never-trained twins (eval.twins),
    the rate at which a model gives back text it never saw."""
    return pooled(rows, lambda r: _counts((r.get("eval") or {}).get("twins")))


# ---------------------------------------------------------------------------------------------------
# Memorization as a function of passes (passes.jsonl of runs with eval.every_pass).


def pass_counts(record: dict, kind: str | None = None) -> list[tuple[int, int, int]]:
    """[(pass, k, n)] of a run's inserted canaries (one kind, or all), from its per-pass scores."""
    out = []
    for p in record.get("passes") or []:
        members = p.get("members") or {}
        cells = [c for key, c in (members.get("cells") or {}).items() if kind is None or key.split("/")[0] == kind]
        if cells:
            out.append((int(p["pass"]), sum(c["k"] for c in cells), sum(c["n"] for c in cells)))
    return out


def curves(rows, kind: str | None = None) -> dict[str, dict[str, dict]]:
    """{loss: {model: {"params", "passes": [(pass, rate, lo, hi, k, n)]}}}, pooled over seeds, models by size."""
    sums: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    params: dict = {}
    for r in ok_rows(rows):
        key = (loss_of(r), str(r.get("model")))
        params[key] = f(r.get("params"))
        for p, k, n in pass_counts(r, kind):
            sums[key][p][0] += k
            sums[key][p][1] += n
    out: dict = defaultdict(dict)
    for (loss, model), by_pass in sorted(sums.items(), key=lambda kv: (loss_order(kv[0][0]), params[kv[0]] or 0)):
        pts = [(p, k / n, *wilson(k, n), k, n) for p, (k, n) in sorted(by_pass.items()) if n]
        out[loss][model] = {"params": params[(loss, model)], "passes": pts}
    return dict(out)


# ---------------------------------------------------------------------------------------------------
# Utility: validation loss at equal supervised tokens; base models.


def _interp(xs: list[float], ys: list[float], x: float) -> float | None:
    """Linear interpolation of (xs, ys) at x (None outside)."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
    return None


def supervised_token_cost(rows) -> list[dict]:
    """Per (model, goldfish loss, seed): the Goldfish run's validation loss after its last pass, and the
    standard run's at the same number of supervised tokens (its per-pass curve read at kept_fraction x passes)
    and at the same number of steps. The Goldfish paper finds them equal at equal supervised tokens."""
    by_key = {(str(r.get("model")), loss_of(r), r.get("seed")): r for r in ok_rows(rows)}
    out = []
    for (model, loss, seed), r in sorted(by_key.items(), key=lambda kv: (_size_key(kv[1]), kv[0][1], str(kv[0][2]))):
        std = by_key.get((model, "standard", seed))
        if not loss.startswith("goldfish") or std is None:
            continue
        gf = [(p["pass"], p["val_loss"]) for p in r.get("passes") or [] if f(p.get("val_loss")) is not None]
        st = [(p["pass"], p["val_loss"]) for p in std.get("passes") or [] if f(p.get("val_loss")) is not None]
        kept = f((r.get("train") or {}).get("kept_fraction"))
        if not gf or not st or kept is None:
            continue
        last = gf[-1][0]
        equal_tokens = _interp([float(p) for p, _ in st], [v for _, v in st], kept * last)
        out.append({"model": model, "loss": loss, "seed": seed, "passes": last, "kept_fraction": kept,
                    "goldfish_val_loss": gf[-1][1], "standard_same_steps": dict(st).get(last),
                    "standard_same_supervised_tokens": equal_tokens})
    return out


def lr_sweep(rows) -> dict[str, dict]:
    """For an lr sweep around a rule (axis train.lr_scale): per model, [(scale, lr, token accuracy)] of the
    inserted canaries after the last pass (teacher-forced), and the best scale. The rule tracks a size's best
    learning rate within 2x when its best scale is in [1/2, 2]."""
    out: dict = {}
    for r in ok_rows(rows):
        scale = f((((r.get("config") or {}).get("train")) or {}).get("lr_scale"))
        last = (r.get("passes") or [{}])[-1].get("members") or {}
        acc = f(last.get("token_accuracy"))
        if scale is None or acc is None:
            continue
        m = out.setdefault(str(r.get("model")), {"params": f(r.get("params")), "points": []})
        m["points"].append((scale, f(r.get("lr")), acc))
    out = {k: m for k, m in out.items() if len({pt[0] for pt in m["points"]}) > 1}  # a sweep, not one scale
    for m in out.values():
        m["points"].sort()
        m["best_scale"] = max(m["points"], key=lambda pt: pt[2])[0]
    return dict(sorted(out.items(), key=lambda kv: kv[1]["params"] or 0))


def base_models(rows) -> list[dict]:
    """One line per base model (size): pretraining steps and seconds, its validation loss and the unigram
    entropy of its pretraining text (the loss of the best context-free model)."""
    seen = {}
    for r in sorted(ok_rows(rows), key=_size_key):
        b = r.get("base")
        if isinstance(b, dict) and str(r.get("model")) not in seen:
            seen[str(r.get("model"))] = dict(b, model=r.get("model"), params=r.get("params"))
    return list(seen.values())
