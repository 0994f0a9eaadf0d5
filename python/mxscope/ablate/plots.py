"""Loss-curve plots of an ablation: one panel per size, per recipe the seed-mean validation loss and
its min-max band over seeds, the bf16 target as a dashed line, the end of the schedule (where the
overrun starts) as a dotted one. Needs matplotlib; without it the plot
is skipped with a message."""

from __future__ import annotations

import math
from typing import Dict, List, Mapping


def loss_curves(evals: List[Mapping[str, str]], path: str, targets: Mapping[str, float] = None, log=print) -> bool:
    """Write the plot to `path` (PNG); False when matplotlib is missing or there is nothing to plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: loss-curve plot skipped")
        return False
    if not evals:
        log("no evaluations: loss-curve plot skipped")
        return False
    # size -> recipe -> tokens -> [val_loss over seeds]
    data: Dict[str, Dict[str, Dict[float, List[float]]]] = {}
    for row in evals:
        value = float(row["val_loss"])
        data.setdefault(row["size"], {}).setdefault(row["recipe"], {}).setdefault(float(row["tokens"]), []).append(value)
    sizes = sorted(data)
    figure, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.8), squeeze=False)
    for axis, size in zip(axes[0], sizes):
        recipes = sorted(data[size], key=lambda r: (r != "bf16", r))
        for index, recipe in enumerate(recipes):
            points = sorted(data[size][recipe].items())
            tokens = [t for t, v in points if all(math.isfinite(x) for x in v)]
            values = [v for t, v in points if all(math.isfinite(x) for x in v)]
            if not tokens:
                continue
            mean = [sum(v) / len(v) for v in values]
            colour = "black" if recipe == "bf16" else plt.cm.tab20(index % 20)
            axis.plot(tokens, mean, label=recipe, color=colour, linewidth=1.6 if recipe == "bf16" else 1.0)
            axis.fill_between(tokens, [min(v) for v in values], [max(v) for v in values], color=colour, alpha=0.15,
                              linewidth=0)
        ends = {float(r["tokens"]) for r in evals if r["size"] == size and r.get("schedule_steps")
                and r["step"] == r["schedule_steps"]}
        for end in sorted(ends):  # past this line: the overrun at the final learning rate
            axis.axvline(end, color="grey", linestyle=":", linewidth=0.8)
        target = (targets or {}).get(size)
        if target is not None and math.isfinite(target):
            axis.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target:.4f}")
        finals = [m for r in data[size].values() for t, m in [max(r.items())] if all(math.isfinite(x) for x in m)]
        if finals:
            low = min(min(m) for m in finals)
            axis.set_ylim(low - 0.05, low + 1.5)  # the interesting part: near the end of training
        axis.set_title(f"size {size}: validation loss (mean and min-max over seeds)")
        axis.set_xlabel("tokens")
        axis.set_ylabel("validation loss (nats/byte)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    log(f"wrote {path}")
    return True


def overhead_bars(overhead_rows: List[Mapping[str, object]], path: str, log=print) -> bool:
    """Overhead per recipe with its seed-bootstrap interval, one panel per size; a recipe that never
    reaches the target is drawn as a hatched bar at the panel's top, labelled "not reached"."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: overhead plot skipped")
        return False
    sizes = sorted({str(r["size"]) for r in overhead_rows})
    if not sizes:
        return False
    figure, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.8), squeeze=False)
    for axis, size in zip(axes[0], sizes):
        rows = [r for r in overhead_rows if str(r["size"]) == size]
        finite = [float(v) for r in rows for v in (r["overhead"], r["interval_lo"], r["interval_hi"])
                  if math.isfinite(float(v))]
        top = max(finite + [0.1]) * 1.15
        for i, row in enumerate(rows):
            value, lo, hi = float(row["overhead"]), float(row["interval_lo"]), float(row["interval_hi"])
            if math.isnan(value):
                continue
            if math.isinf(value):
                axis.bar(i, top, color="none", edgecolor="tab:red", hatch="//")
                axis.text(i, top * 0.5, "not reached", rotation=90, ha="center", va="center", fontsize=7)
                continue
            axis.bar(i, value, color="tab:blue" if value > 0 else "tab:green")
            if math.isfinite(lo):
                # The interval as drawn from lo to hi (clipped at the plot's top); a percentile
                # bootstrap interval need not contain the point estimate, so the bar is drawn
                # separately rather than as error lengths around the value.
                upper = min(hi, top) if math.isfinite(hi) else top
                axis.vlines(i, lo, upper, color="black", linewidth=0.8)
                axis.hlines([lo, upper], i - 0.15, i + 0.15, color="black", linewidth=0.8)
        axis.axhline(0, color="black", linewidth=0.6)
        axis.set_xticks(range(len(rows)))
        axis.set_xticklabels([str(r["recipe"]) for r in rows], rotation=60, ha="right", fontsize=7)
        axis.set_ylim(min([0.0] + finite) * 1.15 - 0.01, top)
        axis.set_ylabel("tokens to target / bf16's - 1")
        axis.set_title(f"size {size}: overhead (95% seed-bootstrap interval)")
        axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    log(f"wrote {path}")
    return True
