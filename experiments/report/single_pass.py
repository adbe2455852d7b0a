"""The single-pass study: what one pass over the fine-tuning data leaves memorized, by size and by copies.

Figure 1 (one exposure): for the canaries a run saw exactly once, the twin-controlled suffix-loss drop: a member's
suffix loss at pass 0 (the base model, before any step) minus after the pass, less the same drop of its
never-trained twin, in nats per token. The twin removes what the run learned about text like the canary in
general; what is left is memorization of that canary. Under a Goldfish loss the drop is also split into the
positions the loss drops and those it keeps. Exact match of the same canaries sits beside it (k/n, Wilson).

Figure 2 (dose-response within one pass): exact match vs copies seen in the pass, copy 0 being the base model;
per size, the copies needed to reach 50% (monotone fit, crossing.py), with cluster-bootstrap intervals over
seeds and canaries and censored sizes shown as bounds.

Every interval here resamples whole seeds and the canaries inside them (crossing.cluster_resamples), so
run-to-run variance is in it. Nothing here needs torch.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from .aggregate import f, loss_of, loss_order, ok_rows, paired_rows
from .crossing import bootstrap, cells_of, extrapolation_band, size_trend
from .stats import wilson

N_BOOT = 1000


def _first_pass(r: dict) -> tuple[dict, dict] | None:
    """The canary columns of pass 0 and pass 1 of a run, when its probe scored both."""
    by_pass = {p.get("pass"): p.get("canaries") for p in r.get("passes") or []}
    if by_pass.get(0) and by_pass.get(1):
        return by_pass[0], by_pass[1]
    return None


def _drops(before: dict, after: dict, key: str) -> dict[str, float]:
    """Per member id: its suffix-loss drop (column `key`) minus its twin's, where both are measured."""
    drop = {}
    for i, cid in enumerate(before["id"]):
        a, b = before[key][i], after[key][i]
        if a is not None and b is not None:
            drop[cid] = a - b
    return {cid: d - drop[cid + "-twin"] for cid, d in drop.items()
            if not cid.endswith("-twin") and cid + "-twin" in drop}


def units(rows: list[dict], loss: str) -> tuple[list[dict], dict[str, float]]:
    """One unit per (seed, canary) of the runs with this loss whose seed ran at every size (aggregate.paired_rows):
    its copies seen ("dose"), and per model its exact match ("<model>") and twin-controlled drops ("<model>/drop",
    "/drop_dropped", "/drop_kept"). And the models' parameters."""
    table: dict = {}
    sizes: dict[str, float] = {}
    for r in paired_rows(rows, loss)[0]:
        model, seed = str(r.get("model")), r.get("seed")
        sizes[model] = f(r.get("params")) or 0.0
        for c in r.get("canaries") or []:
            if c.get("inserted") and c.get("exact_match") is not None:
                u = table.setdefault((seed, c["id"]), {"seed": seed, "id": c["id"], "dose": c["copies"]})
                u[model] = float(bool(c["exact_match"]))
        pair = _first_pass(r)
        if pair:
            for suffix, key in (("drop", "suffix_loss"), ("drop_dropped", "suffix_loss_dropped"),
                                ("drop_kept", "suffix_loss_kept")):
                for cid, d in _drops(*pair, key).items():
                    if (seed, cid) in table:
                        table[(seed, cid)][f"{model}/{suffix}"] = d
    return list(table.values()), dict(sorted(sizes.items(), key=lambda kv: kv[1]))


def _mean_of(key: str):
    def stat(sample):
        vals = [u[key] for u in sample if u.get(key) is not None]
        return float(np.mean(vals)) if vals else math.nan
    return stat


def one_exposure(rows: list[dict]) -> list[dict]:
    """Figure 1's numbers: per (loss, model), over the canaries seen once, exact match k/n with its Wilson
    interval and the mean twin-controlled drop (all positions; Goldfish also dropped and kept) with its
    cluster-bootstrap interval."""
    out = []
    for loss in sorted({loss_of(r) for r in ok_rows(rows)}, key=loss_order):
        us, sizes = units(rows, loss)
        once = [u for u in us if u["dose"] == 1]
        for model, params in sizes.items():
            exact = [u[model] for u in once if u.get(model) is not None]
            row = {"loss": loss, "model": model, "params": params, "k": int(sum(exact)), "n": len(exact),
                   "exact": wilson(int(sum(exact)), len(exact)), "seeds": len({u["seed"] for u in once})}
            for part in ("drop", "drop_dropped", "drop_kept"):
                key = f"{model}/{part}"
                vals = [u[key] for u in once if u.get(key) is not None]
                row[part] = (float(np.mean(vals)), *bootstrap(once, _mean_of(key), N_BOOT)) if vals else None
            out.append(row)
    return out


def dose_response(rows: list[dict]) -> dict[str, dict]:
    """Figure 2's numbers per loss: exact match per (model, copies) with Wilson intervals (copy 0: the base
    model at pass 0), and the size trend of copies to 50% (crossing.size_trend) with the extrapolation band
    over thresholds 20-70%."""
    out = {}
    for loss in sorted({loss_of(r) for r in ok_rows(rows)}, key=loss_order):
        us, sizes = units(rows, loss)
        if len({u["dose"] for u in us}) < 2 or not sizes:
            continue
        curves = {m: [(d, k / n, *wilson(int(k), n), int(k), n) for d, k, n in cells_of(us, m)] for m in sizes}
        base = _base_exact(rows, loss)
        for m in curves:
            if m in base:
                curves[m].insert(0, (0, base[m][0] / base[m][1], *wilson(*base[m]), *base[m]))
        trend = size_trend(us, sizes, 0.5, n_boot=N_BOOT) if len(sizes) >= 2 else None
        band = extrapolation_band(us, sizes, n_boot=N_BOOT // 4) if len(sizes) >= 2 else None
        out[loss] = {"curves": curves, "sizes": sizes, "trend": trend, "band": band,
                     "seeds_left_out": paired_rows(rows, loss)[1]}
    return out


def goldfish_given_back(rows: list[dict]) -> list[dict]:
    """Every canary a Goldfish run gave back verbatim (the final greedy extraction), with how many of its suffix
    targets the loss dropped (the probe's suffix_dropped of suffix_tokens; None in rows from before it was
    recorded). The mask hashes each canary's own tokens, so it cuts some suffixes far less than 1/k: at k=4, 1
    or none of 16 targets for about 6% of canaries, and those train almost as under the standard loss."""
    out = []
    for r in ok_rows(rows):
        loss, pair = loss_of(r), _first_pass(r)
        if not loss.startswith("goldfish") or not pair:
            continue
        after = pair[1]
        index = {cid: i for i, cid in enumerate(after["id"])}
        for c in r.get("canaries") or []:
            if c.get("inserted") and c.get("exact_match"):
                i = index.get(c["id"])
                out.append({"loss": loss, "model": str(r.get("model")), "seed": r.get("seed"), "id": c["id"],
                            "copies": c.get("copies"), "dropped": _at(after, "suffix_dropped", i),
                            "suffix": _at(after, "suffix_tokens", i)})
    return out


def _at(columns: dict, key: str, i: int | None):
    """columns[key][i]; None where the column (a row from before it was recorded) or the canary is missing."""
    return columns[key][i] if key in columns and i is not None else None


def _base_exact(rows: list[dict], loss: str) -> dict[str, tuple[int, int]]:
    """Per model, exact matches of the members at pass 0 (the base model), pooled over seeds."""
    acc: dict = defaultdict(lambda: [0, 0])
    for r in ok_rows(rows):
        pair = _first_pass(r) if loss_of(r) == loss else None
        if pair:
            before = pair[0]
            for i, member in enumerate(before["inserted"]):
                if member:
                    acc[str(r.get("model"))][0] += int(bool(before["exact"][i]))
                    acc[str(r.get("model"))][1] += 1
    return {m: (k, n) for m, (k, n) in acc.items()}


def _by_loss_and_size(groups: dict, sizes: dict[str, float]) -> list[tuple]:
    """The items of a {(loss, model): value} table in the report's order: losses as loss_order puts them, then
    models by parameters."""
    return sorted(groups.items(), key=lambda kv: (loss_order(kv[0][0]), sizes[kv[0][1]]))


def utility(rows: list[dict]) -> list[dict]:
    """Per (loss, model): held-out loss of the base (pass 0) and after the pass, and the change, each a mean over
    seeds with a 95% bootstrap interval over seeds (every run scores the same held-out documents)."""
    runs: dict = defaultdict(list)
    sizes: dict = {}
    for r in ok_rows(rows):
        by_pass = {p.get("pass"): f(p.get("val_loss")) for p in r.get("passes") or []}
        if by_pass.get(0) is not None and by_pass.get(1) is not None:
            runs[(loss_of(r), str(r.get("model")))].append((by_pass[0], by_pass[1]))
            sizes[str(r.get("model"))] = f(r.get("params")) or 0.0
    rng = np.random.default_rng(0)
    out = []
    for (loss, model), vals in _by_loss_and_size(runs, sizes):
        v = np.asarray(vals)
        delta = v[:, 1] - v[:, 0]
        means = delta[rng.integers(0, len(delta), size=(N_BOOT, len(delta)))].mean(axis=1)
        out.append({"loss": loss, "model": model, "params": sizes[model], "runs": len(v),
                    "base": float(v[:, 0].mean()), "after": float(v[:, 1].mean()),
                    "delta": (float(delta.mean()), *np.percentile(means, [2.5, 97.5]).tolist()),
                    "worst": float(delta.max())})
    return out


def _roc(members: list[float], others: list[float]) -> dict:
    """AUC (ties count half) and TPR at the largest threshold whose false-positive rate is <= 1%, for scores
    where higher means member."""
    pos, neg = np.asarray(members), np.asarray(others)
    auc = float(((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean())
    allowed = int(math.floor(0.01 * len(neg)))  # false positives allowed at 1% FPR (0 below 100 twins)
    cut = np.sort(neg)[::-1][allowed] if allowed < len(neg) else -math.inf
    return {"auc": auc, "tpr_at_1pct_fpr": float((pos > cut).mean()), "n_members": len(pos),
            "n_twins": len(neg), "fpr_max": allowed / len(neg)}


ATTACKS = ("attack_loss", "attack_calibrated")


def _auc_of(attack: str):
    def stat(sample):
        members = [u[attack] for u in sample if u["dose"] == 1]
        twins = [u[attack] for u in sample if u["dose"] == 0]
        return _roc(members, twins)["auc"] if members and twins else math.nan
    return stat


def mia_one_exposure(rows: list[dict]) -> list[dict]:
    """Membership inference after the pass, per (loss, model), pooled over seeds: the members seen exactly once
    against all never-trained twins. Two scores: the loss attack (lower suffix loss = member) and the
    base-calibrated one (the drop in suffix loss from the base model, a reference-model attack). Each AUC has a
    95% cluster-bootstrap interval ("auc_interval": seeds, and in each its members and its twins)."""
    units: dict = defaultdict(list)  # one per scored canary or twin: "dose" 1 a member seen once, 0 a twin
    sizes: dict = {}
    for r in ok_rows(rows):
        pair = _first_pass(r)
        if not pair:
            continue
        before, after = pair
        key = (loss_of(r), str(r.get("model")))
        sizes[key[1]] = f(r.get("params")) or 0.0
        for i, member in enumerate(after["inserted"]):
            a, b = after["suffix_loss"][i], before["suffix_loss"][i]
            if a is None or b is None or (member and after["copies"][i] != 1):
                continue
            units[key].append({"seed": r.get("seed"), "dose": int(member), "attack_loss": -a,
                               "attack_calibrated": b - a})
    out = []
    for (loss, model), us in _by_loss_and_size(units, sizes):
        members = [u for u in us if u["dose"] == 1]
        twins = [u for u in us if u["dose"] == 0]
        if members and twins:
            row = {"loss": loss, "model": model, "params": sizes[model]}
            for attack in ATTACKS:
                row[attack] = dict(_roc([u[attack] for u in members], [u[attack] for u in twins]),
                                   auc_interval=bootstrap(us, _auc_of(attack), N_BOOT))
            out.append(row)
    return out


def training_order(rows: list[dict]) -> list[dict]:
    """Per (loss, model): the runs' order effect (eval.order_effect: per copies level, the Spearman correlation of
    a member's last training step with its log-likelihood; later-seen text should be remembered better), pooled
    over runs weighted by members, with the range of the runs' own values."""
    acc: dict = defaultdict(list)
    sizes: dict = {}
    for r in ok_rows(rows):
        oe = (r.get("eval") or {}).get("order_effect") or {}
        if f(oe.get("mean")) is not None and oe.get("n"):
            acc[(loss_of(r), str(r.get("model")))].append((float(oe["mean"]), int(oe["n"])))
            sizes[str(r.get("model"))] = f(r.get("params")) or 0.0
    out = []
    for (loss, model), vals in _by_loss_and_size(acc, sizes):
        n = sum(k for _, k in vals)
        out.append({"loss": loss, "model": model, "params": sizes[model], "runs": len(vals), "n": n,
                    "rho": sum(v * k for v, k in vals) / n, "lo": min(v for v, _ in vals),
                    "hi": max(v for v, _ in vals)})
    return out


def applies(rows: list[dict]) -> bool:
    """A single-pass sweep: its runs trained one pass and their probe scored pass 0 and pass 1."""
    ok = ok_rows(rows)
    return bool(ok) and all(_first_pass(r) and len(r.get("passes") or []) == 2 for r in ok)
