"""mxscope.ablate: train a recipe ladder, measure tokens to target, validate replay predictors.

    analysis   tokens to target, divergence, overhead with seed-bootstrap intervals, Spearman,
               replay-derived candidate metrics and the fit/test predictor table (pure Python)
    strategies the analysis TOML that replays a training recipe (pure Python)
    runner     the training runner behind tools/ablate (imports torch when a run starts)
    plots      loss-curve plots (matplotlib when present)

Nothing here imports torch or the mxscope C library at import time, so `import mxscope.ablate`
and `mxscope.ablate.analysis` work on any Python 3.9+ without them.
"""

__all__ = ["analysis", "strategies", "runner", "plots"]
