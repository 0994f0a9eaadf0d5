"""Tokens to target, divergence, overhead intervals, Spearman and replay predictors (pure Python).

Curves. A curve is a list of (tokens, val_loss) pairs sorted by tokens: one pair per evaluation of
one run (tools/ablate evaluates at step 0 and every --eval-every steps, and at the last step).

Target and overhead (docs/validation.md, "Method"):
  target      the bf16 validation loss at the end of its schedule: the mean over the bf16 seeds of
              each seed's validation loss there (target_rule="mean"; "max" takes the worst bf16
              seed instead). bf16 seeds that diverged are left out of the target and the baseline.
              With an overrun (curves that go on past the schedule's end at the final learning
              rate, tools/ablate --overrun), "there" is schedule_tokens, and a recipe may reach
              the target in the overrun.
  baseline    tokens to target of the bf16 *seed-mean curve* (the mean over seeds of val_loss at
              each evaluation). Under "mean" its point at the end of the schedule equals the target, so
              the baseline is always reached, at the latest at the end of the schedule; a single bf16 seed that ends
              above the mean target is not (it is reported, in runs.csv, as not reached).
  overhead    tokens_to_target(recipe seed-mean curve) / baseline - 1, over the seeds both recipes
              have (paired: the same seed means the same initialization and data order). A recipe
              whose mean curve never reaches the target has overhead = inf and reached = False.
  per seed    overhead_vs_baseline = tokens(run) / baseline - 1, and paired_overhead =
              tokens(run) / tokens(bf16 run of the same seed) - 1 (nan when that bf16 run itself
              does not reach the target); inf for a run that never reaches.
  interval    seed bootstrap, percentile: resample the paired seeds with replacement (the same
              resampled seeds for the recipe and for bf16), recompute the target from the resampled
              bf16 seeds, both mean curves, both tokens to target and the overhead; the interval is
              the (1-level)/2 and (1+level)/2 percentiles of those overheads (inf where a resample
              never reaches). The RNG is random.Random(seed): deterministic.

Spearman: Pearson correlation of the ranks, ties getting their average rank, +inf ranked above
every finite value (a run that never reaches the target is the worst). Interval: bootstrap over the
recipes (resample the (x, y) pairs with replacement, percentile interval, resamples with a constant
rank vector skipped), or Fisher z with the Bonett-Wright standard error sqrt((1 + rho^2/2)/(n-3)).
predictor_table uses the bootstrap.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import statistics
from collections import namedtuple
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

Curve = List[Tuple[float, float]]

INF = float("inf")
NAN = float("nan")


def _finite(value) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


# ------------------------------------------------------------------------------------------------
# Tokens to target and divergence.


def tokens_to_target(curve: Sequence[Tuple[float, float]], target: float) -> Optional[float]:
    """The first token count where val_loss <= target, linearly interpolated between the two
    evaluations that bracket the crossing; None when no evaluation reaches the target.

    A non-finite loss never reaches. When the crossing evaluation follows a non-finite one, there is
    nothing to interpolate from and its own token count is returned. The first evaluation reaching
    the target returns its token count exactly."""
    previous = None
    for tokens, loss in curve:
        if previous is not None and tokens < previous[0]:
            raise ValueError("curve must be sorted by tokens")
        if _finite(loss) and loss <= target:
            if previous is None or not _finite(previous[1]):
                return float(tokens)
            t0, l0 = previous
            # l0 > target >= loss: the segment from (t0, l0) to (tokens, loss) crosses the target.
            return t0 + (l0 - target) / (l0 - loss) * (tokens - t0)
        previous = (tokens, loss)
    return None


def divergence(curve: Sequence[Tuple[float, float]], train_losses: Iterable[float] = (),
               rise_fraction: float = 0.5, abs_tolerance: float = 0.1) -> Optional[str]:
    """Why the run diverged, or None. The rule:

    1. any non-finite validation loss, or any non-finite training loss in `train_losses`; or
    2. some evaluation i > 0 with loss_i > best_i + max(rise_fraction * (loss_0 - best_i),
       abs_tolerance), where best_i = min over the evaluations before i and loss_0 the first
       (initial) one: the run gave back more than `rise_fraction` (default half) of the progress it
       had made, or rose above its initial loss (best_i = loss_0 makes the allowance abs_tolerance).
       abs_tolerance (nats) keeps evaluation noise on a flat curve from counting.
    """
    for value in train_losses:
        if not _finite(value):
            return f"non-finite training loss {value}"
    if not curve:
        return None
    for tokens, loss in curve:
        if not _finite(loss):
            return f"non-finite validation loss {loss} at {tokens:g} tokens"
    initial = curve[0][1]
    best = initial
    for tokens, loss in curve[1:]:
        allowance = max(rise_fraction * (initial - best), abs_tolerance)
        if loss > best + allowance:
            return (f"validation loss rose to {loss:.4g} at {tokens:g} tokens from a best of {best:.4g} "
                    f"(initial {initial:.4g})")
        best = min(best, loss)
    return None


def diverged(curve: Sequence[Tuple[float, float]], train_losses: Iterable[float] = (), **rule) -> bool:
    """True when divergence(curve, train_losses, **rule) names a reason."""
    return divergence(curve, train_losses, **rule) is not None


# ------------------------------------------------------------------------------------------------
# Target, mean curves, overhead.


def _mean(values: Sequence[float]) -> float:
    # One summation order everywhere, so the bf16 mean curve's last point equals the mean target.
    return math.fsum(values) / len(values)


def loss_at(curve: Curve, tokens: Optional[float]) -> float:
    """The validation loss of the last evaluation at or before `tokens` (None: the last one); nan
    when there is none."""
    kept = [loss for t, loss in curve if tokens is None or t <= tokens]
    return kept[-1] if kept else NAN


def target_loss(bf16_curves: Sequence[Curve], rule: str = "mean",
                schedule_tokens: Optional[float] = None) -> Optional[float]:
    """The target from each bf16 curve's validation loss at the end of its schedule (the last
    evaluation at or before `schedule_tokens`; None: the curve's last evaluation): their mean (rule
    "mean") or their maximum ("max"). None when there is no curve."""
    finals = [loss_at(curve, schedule_tokens) for curve in bf16_curves if curve]
    if not finals:
        return None
    if rule == "mean":
        return _mean(finals)
    if rule == "max":
        return max(finals)
    raise ValueError(f"unknown target rule {rule!r} (mean or max)")


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """The mean over curves of val_loss at every token count that appears in any curve; nan where a
    curve lacks that evaluation (a run stopped early) or has a non-finite loss there."""
    by_run = [dict(curve) for curve in curves]
    grid = sorted({tokens for curve in curves for tokens, _ in curve})
    out = []
    for tokens in grid:
        values = [run.get(tokens, NAN) for run in by_run]
        out.append((tokens, _mean(values) if all(_finite(v) for v in values) else NAN))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) by linear interpolation between order statistics (numpy's
    default); where a neighbour is infinite, the larger neighbour (so +inf stays +inf)."""
    ordered = sorted(values)
    if not ordered:
        return NAN
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    a, b = ordered[low], ordered[high]
    if low == high or a == b:
        return a
    if not (math.isfinite(a) and math.isfinite(b)):
        return max(a, b)
    return a + (position - low) * (b - a)


def _overhead(recipe_curves: Sequence[Curve], bf16_curves: Sequence[Curve], rule: str,
              schedule_tokens: Optional[float]) -> Tuple[float, float, float]:
    """(overhead, recipe tokens or inf, baseline tokens or nan) for one set of paired curves."""
    target = target_loss(bf16_curves, rule, schedule_tokens)
    baseline = tokens_to_target(mean_curve(bf16_curves), target)
    reached = tokens_to_target(mean_curve(recipe_curves), target)
    if baseline is None or baseline <= 0:
        return NAN, (INF if reached is None else reached), NAN
    if reached is None:
        return INF, INF, baseline
    return reached / baseline - 1.0, reached, baseline


OverheadSummary = namedtuple("OverheadSummary", "overhead lo hi reached target baseline_tokens tokens seeds "
                                                "per_seed excluded_baseline_seeds")


def overhead_summary(recipe_curves: Mapping[int, Curve], bf16_curves: Mapping[int, Curve],
                     target_rule: str = "mean", n_boot: int = 2000, level: float = 0.95,
                     seed: int = 0, target: Optional[float] = None,
                     schedule_tokens: Optional[float] = None) -> OverheadSummary:
    """Overhead of one recipe against bf16 at one size (module docstring), with its seed-bootstrap
    interval. recipe_curves / bf16_curves: seed -> curve. `target` overrides the target of the
    point estimate (e.g. one computed from more bf16 seeds than are paired here). schedule_tokens:
    where the bf16 schedule ends when the curves run on past it (tools/ablate --overrun); the
    target is the loss there, and every curve may reach it later, in the overrun.

    per_seed: seed -> dict(tokens (None if not reached), overhead_vs_baseline, paired_overhead,
    diverged)."""
    usable_bf16 = {s: c for s, c in bf16_curves.items() if not diverged(c)}
    excluded = sorted(set(bf16_curves) - set(usable_bf16))
    seeds = sorted(set(recipe_curves) & set(usable_bf16))
    if target is None:
        target = target_loss([usable_bf16[s] for s in sorted(usable_bf16)], target_rule, schedule_tokens)
    baseline = None
    if target is not None and usable_bf16:
        baseline = tokens_to_target(mean_curve([usable_bf16[s] for s in sorted(usable_bf16)]), target)

    per_seed = {}
    for s, curve in sorted(recipe_curves.items()):
        tokens = tokens_to_target(curve, target) if target is not None else None
        own = tokens_to_target(usable_bf16[s], target) if (s in usable_bf16 and target is not None) else None
        per_seed[s] = {
            "tokens": tokens,
            "overhead_vs_baseline": (NAN if not baseline else (INF if tokens is None else tokens / baseline - 1.0)),
            "paired_overhead": (NAN if not own else (INF if tokens is None else tokens / own - 1.0)),
            "diverged": diverged(curve),
        }

    if not seeds or target is None:
        return OverheadSummary(NAN, NAN, NAN, False, target, baseline, None, seeds, per_seed, excluded)
    recipe_list = [recipe_curves[s] for s in seeds]
    bf16_list = [usable_bf16[s] for s in seeds]
    reached_tokens = tokens_to_target(mean_curve(recipe_list), target)
    if baseline is None or baseline <= 0:
        point = NAN
    else:
        point = INF if reached_tokens is None else reached_tokens / baseline - 1.0

    rng = random.Random(seed)
    samples = []
    for _ in range(n_boot):
        picks = [rng.randrange(len(seeds)) for _ in seeds]
        value, _, _ = _overhead([recipe_list[i] for i in picks], [bf16_list[i] for i in picks], target_rule,
                                schedule_tokens)
        if not math.isnan(value):
            samples.append(value)
    lo = percentile(samples, (1 - level) / 2) if samples else NAN
    hi = percentile(samples, (1 + level) / 2) if samples else NAN
    return OverheadSummary(point, lo, hi, reached_tokens is not None, target, baseline, reached_tokens, seeds,
                           per_seed, excluded)


# ------------------------------------------------------------------------------------------------
# Rank correlation.


Correlation = namedtuple("Correlation", "rho lo hi n")


def rankdata(values: Sequence[float]) -> List[float]:
    """Ranks 1..n, ties sharing their average rank; +inf ranks above every finite value (and ties
    with other +inf). NaN is refused."""
    if any(isinstance(v, float) and math.isnan(v) for v in values):
        raise ValueError("rankdata: NaN has no rank")
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        average = (i + j) / 2.0 + 1.0
        for k in range(i, j + 1):
            ranks[order[k]] = average
        i = j + 1
    return ranks


def _pearson(a: Sequence[float], b: Sequence[float]) -> float:
    n = len(a)
    ma, mb = math.fsum(a) / n, math.fsum(b) / n
    sab = math.fsum((x - ma) * (y - mb) for x, y in zip(a, b))
    saa = math.fsum((x - ma) ** 2 for x in a)
    sbb = math.fsum((y - mb) ** 2 for y in b)
    if saa == 0 or sbb == 0:
        return NAN
    return sab / math.sqrt(saa * sbb)


def spearman_rho(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho (Pearson of average ranks); nan when fewer than 2 pairs or a constant side."""
    if len(x) != len(y):
        raise ValueError("spearman: x and y differ in length")
    if len(x) < 2:
        return NAN
    return _pearson(rankdata(x), rankdata(y))


def spearman(x: Sequence[float], y: Sequence[float], interval: str = "bootstrap", n_boot: int = 2000,
             level: float = 0.95, seed: int = 0) -> Correlation:
    """Spearman's rho of x and y with a `level` interval: "bootstrap" (over the pairs, percentile,
    random.Random(seed)) or "fisher" (Fisher z, Bonett-Wright standard error; needs n > 3)."""
    rho = spearman_rho(x, y)
    n = len(x)
    if math.isnan(rho):
        return Correlation(rho, NAN, NAN, n)
    if interval == "fisher":
        if n <= 3:
            return Correlation(rho, NAN, NAN, n)
        z = math.atanh(max(-0.999999999, min(0.999999999, rho)))
        se = math.sqrt((1 + rho * rho / 2) / (n - 3))
        critical = statistics.NormalDist().inv_cdf((1 + level) / 2)
        return Correlation(rho, math.tanh(z - critical * se), math.tanh(z + critical * se), n)
    if interval != "bootstrap":
        raise ValueError(f"unknown interval {interval!r} (bootstrap or fisher)")
    rng = random.Random(seed)
    rx, ry = rankdata(x), rankdata(y)
    samples = []
    for _ in range(n_boot):
        picks = [rng.randrange(n) for _ in range(n)]
        # Re-rank inside the resample: a duplicated pair becomes a tie, as Spearman on it would.
        value = _pearson(rankdata([rx[i] for i in picks]), rankdata([ry[i] for i in picks]))
        if not math.isnan(value):
            samples.append(value)
    if not samples:
        return Correlation(rho, NAN, NAN, n)
    return Correlation(rho, percentile(samples, (1 - level) / 2), percentile(samples, (1 + level) / 2), n)


# ------------------------------------------------------------------------------------------------
# Candidate metrics from a replay run directory.


GEMMS = ("fprop", "dgrad", "wgrad")

#: name -> how it is computed for one (layer, gemm, strategy) unit and how it is normalized.
METRIC_DOCS = {
    "rel_err": "mean over steps of ||E_t||/||G_t|| (each step normalized by its own gradient norm)",
    "bias": "mean over steps of <E_t,G_t>/||G_t||^2 (per-step normalized; negative: shrinks G)",
    "abs_bias": "mean over steps of |bias_t| (per-step normalized)",
    "orth_err": "mean over steps of ||E_t - bias_t G_t||/||G_t|| (per-step normalized)",
    "quant_err": "mean over steps of the quantization-only error (per-step normalized)",
    "accum_err": "mean over steps of the accumulation-only error (per-step normalized)",
    "bias_share": "mean over steps of bias_t^2/rel_err_t^2: share of the step's error energy along G_t "
                  "(scale-free per step; 0 for a step without error)",
    "bias_coherence": "|mean_t bias_t| / sqrt(mean_t rel_err_t^2): the part of the per-step-normalized error that "
                      "is the same shrink (or growth) along the gradient every step; a bias-aware coherence "
                      "(scale-free per step)",
    "flush_frac": "mean over steps of the two operands' mean underflow fraction",
    "clip_frac": "mean over steps of the two operands' mean saturation fraction",
    "flush_share": "mean over steps of (attr_a_flush+attr_b_flush)/(sum of the six attr_*) (needs --attribute)",
    "clip_share": "as flush_share, for the clip terms",
    "round_share": "as flush_share, for the round terms",
    "acc_err": "acc_err at the end of the replayed window (weighted by ||G_t||: use consecutive windows)",
    "coherence": "coherence at the end of the window (weighted by ||E_t||)",
    "structural_share": "structural_share at the end of the window (weighted by ||E_t||^2)",
    "lag1_corr": "lag1_corr at the end of the window (mean of per-pair cosines: scale-free)",
    "alpha": "alpha at the end of the window, only where summary.json says the window is consecutive (else nan)",
    "sgd_disp_err": "SGD-momentum displacement error at the end of the window",
    "adamw_disp_err": "AdamW displacement error at the end of the window (Adam's per-coordinate normalization)",
    "sgd_upd_err": "SGD-momentum update error at the end of the window",
    "adamw_upd_err": "AdamW update error at the end of the window",
    "norm_acc_err": "sqrt(structural_share) * sqrt(mean_t rel_err_t^2) = ||mean_t E_t/||G_t|| || exactly when "
                    "||G_t|| is constant over the window (a consecutive window), else its E-weighted estimate: the "
                    "per-step-normalized error that survives averaging over steps",
}


def _number(text) -> float:
    if text is None or text == "":
        return NAN
    try:
        return float(text)  # accepts nan, inf, -inf as the replay writes them
    except ValueError:
        return NAN


def read_csv(path: str) -> List[Dict[str, str]]:
    """Rows of a CSV file as dicts (csv module: RFC 4180 quoting)."""
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _nanmean(values: Iterable[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return math.fsum(kept) / len(kept) if kept else NAN


def _share(numerator: float, denominator: float) -> float:
    if math.isnan(numerator) or math.isnan(denominator):
        return NAN
    if denominator == 0:
        return 0.0
    return numerator / denominator


def unit_metrics(step_rows: Sequence[Mapping[str, str]], last_accumulation: Optional[Mapping[str, str]],
                 consecutive: Optional[bool]) -> Dict[str, float]:
    """The METRIC_DOCS metrics of one (layer, gemm, strategy) unit from its steps.csv rows and the
    last accumulation.csv row (T = window length)."""
    rows = sorted(step_rows, key=lambda r: int(r["t"]))
    rel = [_number(r.get("rel_err")) for r in rows]
    bias = [_number(r.get("bias")) for r in rows]
    out = {
        "rel_err": _nanmean(rel),
        "bias": _nanmean(bias),
        "abs_bias": _nanmean(abs(b) for b in bias),
        "orth_err": _nanmean(_number(r.get("orth_err")) for r in rows),
        "quant_err": _nanmean(_number(r.get("quant_err")) for r in rows),
        "accum_err": _nanmean(_number(r.get("accum_err")) for r in rows),
        "bias_share": _nanmean(_share(b * b, e * e) for b, e in zip(bias, rel)),
        "flush_frac": _nanmean((_number(r.get("a_underflow_frac")) + _number(r.get("b_underflow_frac"))) / 2
                               for r in rows),
        "clip_frac": _nanmean((_number(r.get("a_saturate_frac")) + _number(r.get("b_saturate_frac"))) / 2
                              for r in rows),
    }
    mean_sq = _nanmean(e * e for e in rel)
    out["bias_coherence"] = _share(abs(out["bias"]), math.sqrt(mean_sq)) if not math.isnan(mean_sq) else NAN
    for kind in ("flush", "clip", "round"):
        values = []
        for r in rows:
            terms = [_number(r.get(f"attr_{side}_{k}")) for side in "ab" for k in ("flush", "clip", "round")]
            mine = _number(r.get(f"attr_a_{kind}")) + _number(r.get(f"attr_b_{kind}"))
            values.append(_share(mine, sum(terms)))
        out[f"{kind}_share"] = _nanmean(values)
    acc = last_accumulation or {}
    for name in ("acc_err", "coherence", "structural_share", "lag1_corr", "alpha", "sgd_disp_err",
                 "adamw_disp_err", "sgd_upd_err", "adamw_upd_err"):
        out[name] = _number(acc.get(name))
    if consecutive is False:
        out["alpha"] = NAN  # alpha over a window with gaps mostly measures the gradient-scale change
    ss = out["structural_share"]
    out["norm_acc_err"] = (math.sqrt(ss) * math.sqrt(mean_sq)
                           if not (math.isnan(ss) or math.isnan(mean_sq) or ss < 0) else NAN)
    return out


def replay_metrics(run_dir: str) -> Dict[str, Dict[str, float]]:
    """strategy -> {f"{gemm}.{metric}": value} from a replay run directory (steps.csv,
    accumulation.csv, summary.json). Each metric is computed per (layer, gemm) unit (unit_metrics)
    and averaged over the captured layers, nan units skipped; gemm "all" averages over every layer
    and GEMM replayed."""
    steps = read_csv(os.path.join(run_dir, "steps.csv"))
    accumulation = read_csv(os.path.join(run_dir, "accumulation.csv"))
    consecutive = {}
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as handle:
            for unit in json.load(handle).get("units", []):
                consecutive[(unit["layer"], unit["gemm"], unit["strategy"])] = bool(unit.get("consecutive"))
    grouped: Dict[Tuple[str, str, str], List[Dict[str, str]]] = {}
    for row in steps:
        grouped.setdefault((row["layer"], row["gemm"], row["strategy"]), []).append(row)
    last: Dict[Tuple[str, str, str], Dict[str, str]] = {}
    for row in accumulation:
        key = (row["layer"], row["gemm"], row["strategy"])
        if key not in last or int(row["T"]) > int(last[key]["T"]):
            last[key] = row
    per_unit = {key: unit_metrics(rows, last.get(key), consecutive.get(key)) for key, rows in grouped.items()}
    out: Dict[str, Dict[str, float]] = {}
    strategies = sorted({key[2] for key in per_unit})
    for strategy in strategies:
        metrics = {}
        for gemm in GEMMS + ("all",):
            units = [m for (layer, g, s), m in per_unit.items() if s == strategy and (gemm == "all" or g == gemm)]
            if not units:
                continue
            for name in METRIC_DOCS:
                metrics[f"{gemm}.{name}"] = _nanmean(u[name] for u in units)
        out[strategy] = metrics
    return out


# ------------------------------------------------------------------------------------------------
# Predictor validation.


def permutation_p(x: Sequence[float], y: Sequence[float], n_perm: int = 10000, seed: int = 0) -> float:
    """One-sided permutation p-value of Spearman's rho being at least as large as observed:
    exact (all n! orderings of y) when n! <= n_perm, else Monte Carlo with n_perm random
    permutations (random.Random(seed)) and the (count + 1) / (n_perm + 1) estimate, so it is never 0.
    Ties keep their average ranks; nan when rho is undefined."""
    import itertools
    n = len(x)
    rx, ry = rankdata(x), rankdata(y)
    mx, my = math.fsum(rx) / n, math.fsum(ry) / n
    dx = [v - mx for v in rx]
    dy = [v - my for v in ry]
    sxx, syy = math.fsum(v * v for v in dx), math.fsum(v * v for v in dy)
    if n < 2 or sxx == 0 or syy == 0:
        return NAN
    # Under a permutation only sum(dx * dy[perm]) changes; compare it with a relative tolerance so
    # that orderings tying the observed value count as "at least as large".
    observed = math.fsum(a * b for a, b in zip(dx, dy))
    tolerance = 1e-12 * math.sqrt(sxx * syy)
    if math.factorial(n) <= n_perm:
        total = count = 0
        for perm in itertools.permutations(dy):
            total += 1
            count += sum(a * b for a, b in zip(dx, perm)) >= observed - tolerance
        return count / total
    rng = random.Random(seed)
    shuffled = list(dy)
    count = 0
    for _ in range(n_perm):
        rng.shuffle(shuffled)
        count += sum(a * b for a, b in zip(dx, shuffled)) >= observed - tolerance
    return (count + 1) / (n_perm + 1)


def holm(p_values: Sequence[float]) -> List[float]:
    """Holm-Bonferroni adjusted p-values (nan entries stay nan and do not count in the family)."""
    indexed = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    m = len(indexed)
    adjusted = [NAN] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(indexed):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


#: n_metrics: how many metrics the fit size selected for the pair (the Holm family).
PREDICTOR_COLUMNS = ("metric", "fit_size", "test_size", "spearman", "interval", "interval_lo", "interval_hi",
                     "n_test", "test_p", "test_p_holm", "n_metrics", "direction", "fit_spearman", "fit_interval_lo",
                     "fit_interval_hi", "n_fit", "predicts")

#: Recipes left out of the correlations by default: the baselines have zero (fp32: near-zero)
#: replay error and zero overhead by construction, so with them in, any error metric would look
#: predictive merely by telling quantized from unquantized.
BASELINE_RECIPES = ("bf16", "fp32")


def predictor_table(overheads: Mapping[str, Mapping[str, float]],
                    metrics: Mapping[str, Mapping[str, Mapping[str, float]]],
                    n_boot: int = 1000, level: float = 0.95, seed: int = 0,
                    min_recipes: int = 4, exclude: Sequence[str] = BASELINE_RECIPES,
                    n_perm: int = 10000, alpha: float = 0.05) -> List[Dict[str, object]]:
    """For each candidate metric and each ordered pair (fit size, test size) of distinct sizes,
    across the recipes of each size other than `exclude` (the baselines):

    - fit: Spearman of the metric against measured overhead on the fit size, with its bootstrap
      interval; its sign is the direction (+1: a larger metric means more overhead; 0 counts as +1);
    - test: Spearman on the held-out size times that direction (positive: the direction chosen on
      the fit size holds), its bootstrap interval (flipped with the sign), and test_p, the one-sided
      permutation p-value of that directed correlation (permutation_p);
    - selection and confirmation: a metric whose fit interval excludes 0 is *selected* on the fit
      size; test_p_holm adjusts test_p (Holm) over the n_metrics metrics selected for the same (fit,
      test) pair (nan for the others: only what the fit size selected is tested, which is what the
      held-out size is for).

    predicts is True when the metric is selected, the test interval's lower end is above 0, and
    test_p_holm < alpha.

    overheads: size -> recipe -> overhead (inf for never reached; nan rows are dropped).
    metrics: size -> recipe -> metric name -> value (nan dropped).
    A pair with fewer than `min_recipes` recipes on either side gives nan. Rows are sorted by test
    spearman, best first (nan last)."""
    names = sorted({name for per_size in metrics.values() for per_recipe in per_size.values() for name in per_recipe})
    sizes = sorted(set(overheads) & set(metrics))
    excluded = set(exclude)

    def pairs(size, name):
        xs, ys = [], []
        for recipe in sorted(overheads[size]):
            if recipe in excluded:
                continue
            y = overheads[size][recipe]
            x = metrics[size].get(recipe, {}).get(name, NAN)
            if y is None or x is None or math.isnan(y) or math.isnan(x):
                continue
            xs.append(x)
            ys.append(y)
        return xs, ys

    rows = []
    for fit in sizes:
        for test in sizes:
            if fit == test:
                continue
            block = []
            for name in names:
                fx, fy = pairs(fit, name)
                tx, ty = pairs(test, name)
                if len(fx) < min_recipes or len(tx) < min_recipes:
                    fit_c = Correlation(NAN, NAN, NAN, len(fx))
                    test_c = Correlation(NAN, NAN, NAN, len(tx))
                else:
                    fit_c = spearman(fx, fy, n_boot=n_boot, level=level, seed=seed)
                    test_c = spearman(tx, ty, n_boot=n_boot, level=level, seed=seed)
                direction = NAN if math.isnan(fit_c.rho) else (1 if fit_c.rho >= 0 else -1)
                if math.isnan(direction):
                    rho, lo, hi, p = NAN, NAN, NAN, NAN
                else:
                    rho = direction * test_c.rho
                    lo, hi = sorted((direction * test_c.lo, direction * test_c.hi))
                    # Only a correlation in the fitted direction can be evidence; others get p = 1
                    # without the cost of the permutations.
                    if math.isnan(rho):
                        p = NAN
                    elif rho > 0:  # negating y reverses its ranks (inf becomes -inf, still the extreme)
                        p = permutation_p(tx, [direction * v for v in ty], n_perm=n_perm, seed=seed)
                    else:
                        p = 1.0
                established = (not math.isnan(fit_c.lo)) and (fit_c.lo > 0 or fit_c.hi < 0)
                block.append({
                    "metric": name, "fit_size": fit, "test_size": test, "spearman": rho,
                    "interval": f"[{lo:.3f}, {hi:.3f}]", "interval_lo": lo, "interval_hi": hi,
                    "n_test": test_c.n, "test_p": p, "direction": direction, "fit_spearman": fit_c.rho,
                    "fit_interval_lo": fit_c.lo, "fit_interval_hi": fit_c.hi, "n_fit": fit_c.n,
                    "_established": established,
                })
            # The family: the metrics selected on the fit size (a nan p-value, e.g. a constant
            # metric on the test size, counts as 1 so that it still takes its place in the family).
            selected = [r["_established"] for r in block]
            adjusted = holm([(1.0 if math.isnan(r["test_p"]) else r["test_p"]) if chosen else NAN
                             for r, chosen in zip(block, selected)])
            family = sum(selected)
            for r, q in zip(block, adjusted):
                chosen = r.pop("_established")
                r["test_p_holm"] = q
                r["n_metrics"] = family
                r["predicts"] = bool(chosen and not math.isnan(r["interval_lo"]) and r["interval_lo"] > 0
                                     and not math.isnan(q) and q < alpha)
            rows.extend(block)
    rows.sort(key=lambda r: (math.isnan(r["spearman"]), -(r["spearman"] if not math.isnan(r["spearman"]) else 0),
                             r["metric"], r["fit_size"]))
    return rows
