"""Tests of mxscope.ablate: tokens to target, divergence, overhead intervals, Spearman, replay
metrics, the predictor fit/test split, the replay strategy of a recipe, and the runner on CPU.

Run: PYTHONPATH=python /usr/bin/python3 -m unittest -v test_ablate   (from tests/python)
"""

import csv
import importlib.util
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import types
import unittest
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

from mxscope.ablate import analysis, strategies  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None  # the runner tests train on CPU


class TokensToTarget(unittest.TestCase):
    CURVE = [(0, 5.0), (100, 4.0), (200, 3.0), (300, 2.5)]

    def test_crossing_between_evaluations_is_interpolated(self):
        # 3.5 lies between 4.0 at 100 tokens and 3.0 at 200: 100 + (4.0 - 3.5) / (4.0 - 3.0) * 100 = 150.
        self.assertAlmostEqual(analysis.tokens_to_target(self.CURVE, 3.5), 150.0, places=12)
        # 2.6 between 3.0 at 200 and 2.5 at 300: 200 + 0.4 / 0.5 * 100 = 280.
        self.assertAlmostEqual(analysis.tokens_to_target(self.CURVE, 2.6), 280.0, places=9)

    def test_target_met_exactly_at_an_evaluation(self):
        self.assertEqual(analysis.tokens_to_target(self.CURVE, 4.0), 100.0)
        self.assertEqual(analysis.tokens_to_target(self.CURVE, 6.0), 0.0)  # the first evaluation already reaches

    def test_never_reached(self):
        self.assertIsNone(analysis.tokens_to_target(self.CURVE, 2.0))
        self.assertIsNone(analysis.tokens_to_target([], 2.0))

    def test_first_crossing_counts_on_a_non_monotone_curve(self):
        curve = [(0, 5.0), (10, 3.0), (20, 4.0), (30, 2.0)]
        # First crossing of 3.5: between 0 (5.0) and 10 (3.0): 0 + 1.5 / 2.0 * 10 = 7.5.
        self.assertAlmostEqual(analysis.tokens_to_target(curve, 3.5), 7.5, places=12)

    def test_non_finite_losses_never_reach(self):
        curve = [(0, 5.0), (10, float("nan")), (20, 2.0)]
        self.assertEqual(analysis.tokens_to_target(curve, 3.0), 20.0)  # no finite left end to interpolate from
        self.assertIsNone(analysis.tokens_to_target([(0, 5.0), (10, float("nan")), (20, float("inf"))], 3.0))

    def test_unsorted_curve_is_refused(self):
        with self.assertRaises(ValueError):
            analysis.tokens_to_target([(0, 5.0), (20, 4.0), (10, 3.0)], 3.5)


class Divergence(unittest.TestCase):
    def test_healthy_curves(self):
        self.assertFalse(analysis.diverged([(0, 5.5), (1, 4.0), (2, 3.0), (3, 2.9)]))
        # Noise below the absolute tolerance on a flat stretch is not a divergence.
        self.assertFalse(analysis.diverged([(0, 5.5), (1, 3.0), (2, 3.05), (3, 2.95)]))

    def test_non_finite(self):
        self.assertIn("non-finite", analysis.divergence([(0, 5.5), (1, 4.0), (2, float("nan"))]))
        self.assertTrue(analysis.diverged([(0, 5.5), (1, float("inf"))]))
        self.assertTrue(analysis.diverged([(0, 5.5), (1, 4.0)], train_losses=[5.0, float("nan")]))

    def test_rising_above_the_initial_loss(self):
        self.assertTrue(analysis.diverged([(0, 5.5), (1, 5.7)]))

    def test_giving_back_more_than_half_the_progress(self):
        # Best 3.0 after starting at 5.0: progress 2.0; a rise to 4.1 gives back 1.1 > 1.0.
        self.assertTrue(analysis.diverged([(0, 5.0), (1, 3.0), (2, 4.1)]))
        # A rise to 3.9 gives back 0.9 < 1.0: not diverged under the default rule, diverged at 0.4.
        self.assertFalse(analysis.diverged([(0, 5.0), (1, 3.0), (2, 3.9)]))
        self.assertTrue(analysis.diverged([(0, 5.0), (1, 3.0), (2, 3.9)], rise_fraction=0.4))


class Spearman(unittest.TestCase):
    def test_ranks_with_ties_and_infinity(self):
        self.assertEqual(analysis.rankdata([10, 30, 20, 30]), [1.0, 3.5, 2.0, 3.5])
        self.assertEqual(analysis.rankdata([1.0, float("inf"), 2.0, float("inf")]), [1.0, 3.5, 2.0, 3.5])
        with self.assertRaises(ValueError):
            analysis.rankdata([1.0, float("nan")])

    def test_without_ties_matches_the_d_squared_formula(self):
        # Ranks of y: 3, 1, 4, 5, 2; d = -2, 1, -1, -1, 3; sum d^2 = 16; rho = 1 - 6*16/(5*24) = 0.2.
        rho = analysis.spearman_rho([10, 20, 30, 40, 50], [3, 1, 4, 5, 2])
        self.assertAlmostEqual(rho, 0.2, places=12)

    def test_with_ties_matches_a_hand_computation(self):
        # x ranks 1, 2.5, 2.5, 4, 5 (deviations -2, -.5, -.5, 1, 2); y ranks 2, 1, 4, 3, 5 (-1, -2, 1, 0, 2).
        # sum of products 2 + 1 - 0.5 + 0 + 4 = 6.5; sums of squares 9.5 and 10: rho = 6.5 / sqrt(95).
        rho = analysis.spearman_rho([1, 2, 2, 3, 5], [2, 1, 4, 3, 5])
        self.assertAlmostEqual(rho, 6.5 / math.sqrt(95), places=12)

    def test_degenerate(self):
        self.assertTrue(math.isnan(analysis.spearman_rho([1, 1, 1], [1, 2, 3])))
        self.assertTrue(math.isnan(analysis.spearman_rho([1], [2])))
        self.assertAlmostEqual(analysis.spearman_rho([1, 2, 3], [float("inf"), 5, 1]), -1.0, places=12)

    def test_bootstrap_interval_is_deterministic_and_contains_the_estimate(self):
        rng = random.Random(3)
        x = [rng.random() for _ in range(15)]
        y = [v + 0.3 * rng.random() for v in x]
        a = analysis.spearman(x, y, n_boot=500, seed=11)
        b = analysis.spearman(x, y, n_boot=500, seed=11)
        self.assertEqual(a, b)
        self.assertLessEqual(a.lo, a.rho)
        self.assertLessEqual(a.rho, a.hi)
        self.assertLessEqual(a.hi, 1.0)
        self.assertEqual(a.n, 15)

    def test_fisher_interval_is_symmetric_in_z(self):
        c = analysis.spearman([1, 2, 3, 4, 5, 6, 7, 8], [2, 1, 4, 3, 6, 5, 8, 7], interval="fisher")
        self.assertAlmostEqual(math.atanh(c.lo) + math.atanh(c.hi), 2 * math.atanh(c.rho), places=9)
        self.assertLess(c.lo, c.rho)
        self.assertLess(c.rho, c.hi)


class Overhead(unittest.TestCase):
    # bf16 finals 3.0, 3.1, 3.2: target (mean) 3.1; the bf16 mean curve (0, 6), (1000, 4), (2000, 3.1)
    # reaches it at 2000 tokens. The recipe's mean curve (1000, 4.3), (2000, 3.4), (3000, 3.0) crosses
    # 3.1 at 2000 + 0.3/0.4 * 1000 = 2750 tokens: overhead 2750/2000 - 1 = 0.375.
    BF16 = {s: [(0, 6.0), (1000, 4.0), (2000, 3.0 + 0.1 * s)] for s in range(3)}
    RECIPE = {s: [(0, 6.0), (1000, 4.2 + 0.1 * s), (2000, 3.3 + 0.1 * s), (3000, 2.9 + 0.1 * s)] for s in range(3)}

    def test_point_estimate_and_per_seed_values(self):
        summary = analysis.overhead_summary(self.RECIPE, self.BF16, n_boot=200, seed=5)
        self.assertAlmostEqual(summary.target, 3.1, places=12)
        self.assertAlmostEqual(summary.baseline_tokens, 2000.0, places=6)
        self.assertAlmostEqual(summary.tokens, 2750.0, places=6)
        self.assertAlmostEqual(summary.overhead, 0.375, places=9)
        self.assertTrue(summary.reached)
        # Seed 0: the recipe crosses 3.1 between (2000, 3.3) and (3000, 2.9) at 2500 tokens; bf16 seed 0
        # crosses it between (1000, 4.0) and (2000, 3.0) at 1900.
        seed0 = summary.per_seed[0]
        self.assertAlmostEqual(seed0["tokens"], 2500.0, places=6)
        self.assertAlmostEqual(seed0["overhead_vs_baseline"], 0.25, places=9)
        self.assertAlmostEqual(seed0["paired_overhead"], 2500.0 / 1900.0 - 1, places=9)
        # bf16 seed 2 ends at 3.2, above the mean target: its pairing is undefined (nan), not dropped.
        self.assertTrue(math.isnan(summary.per_seed[2]["paired_overhead"]))

    def test_target_at_the_end_of_the_schedule_with_an_overrun(self):
        # bf16 runs on past its schedule (ending at 2000 tokens) to 3000: the target stays the mean of
        # the losses at 2000 (3.1), not at 3000 (2.9), and the recipe reaches it in the overrun.
        bf16 = {s: c + [(3000, 2.8 + 0.1 * s)] for s, c in self.BF16.items()}
        summary = analysis.overhead_summary(self.RECIPE, bf16, n_boot=100, schedule_tokens=2000)
        self.assertAlmostEqual(summary.target, 3.1, places=12)
        self.assertAlmostEqual(summary.baseline_tokens, 2000.0, places=6)
        self.assertAlmostEqual(summary.overhead, 0.375, places=9)
        self.assertLessEqual(summary.lo, summary.overhead)
        self.assertLessEqual(summary.overhead, summary.hi)
        # Without the schedule's end, the last evaluation would define the target: (2.8+2.9+3.0)/3.
        self.assertAlmostEqual(analysis.overhead_summary(self.RECIPE, bf16, n_boot=10).target, 2.9, places=12)
        self.assertEqual(analysis.loss_at(bf16[0], 2500), 3.0)
        self.assertTrue(math.isnan(analysis.loss_at(bf16[0], -1)))

    def test_bootstrap_is_deterministic_and_contains_the_estimate(self):
        a = analysis.overhead_summary(self.RECIPE, self.BF16, n_boot=300, seed=9)
        b = analysis.overhead_summary(self.RECIPE, self.BF16, n_boot=300, seed=9)
        self.assertEqual((a.overhead, a.lo, a.hi), (b.overhead, b.lo, b.hi))
        self.assertLessEqual(a.lo, a.overhead)
        self.assertLessEqual(a.overhead, a.hi)
        self.assertLess(a.lo, a.hi)  # the seeds differ, so the resamples do

    def test_a_recipe_that_never_reaches(self):
        slow = {s: [(0, 6.0), (1000, 5.0), (2000, 4.0)] for s in range(3)}
        summary = analysis.overhead_summary(slow, self.BF16, n_boot=100)
        self.assertEqual(summary.overhead, math.inf)
        self.assertFalse(summary.reached)
        self.assertEqual(summary.hi, math.inf)
        self.assertIsNone(summary.per_seed[1]["tokens"])
        self.assertEqual(summary.per_seed[1]["overhead_vs_baseline"], math.inf)

    def test_diverged_bf16_seeds_leave_the_baseline(self):
        bf16 = dict(self.BF16)
        bf16[3] = [(0, 6.0), (1000, float("nan"))]
        summary = analysis.overhead_summary(self.RECIPE, bf16, n_boot=50)
        self.assertEqual(summary.excluded_baseline_seeds, [3])
        self.assertAlmostEqual(summary.overhead, 0.375, places=9)

    def test_bf16_against_itself_is_zero(self):
        summary = analysis.overhead_summary(self.BF16, self.BF16, n_boot=100)
        self.assertEqual(summary.overhead, 0.0)
        self.assertEqual((summary.lo, summary.hi), (0.0, 0.0))

    def test_percentile(self):
        self.assertEqual(analysis.percentile([4, 1, 3, 2], 0.5), 2.5)
        self.assertEqual(analysis.percentile([1, 2, 3, 4], 0.25), 1.75)
        self.assertEqual(analysis.percentile([1, 2, math.inf, math.inf], 0.5), math.inf)
        self.assertEqual(analysis.percentile([1, 2, 3, math.inf], 0.0), 1)


class Predictors(unittest.TestCase):
    def synthetic(self):
        """Two sizes x 12 recipes. The overhead is a monotone function of a hidden quality q plus
        small noise; 'planted' = q + tiny noise, 'planted_neg' = -q, 'flipped' = q at size A and -q at
        size B (a metric whose direction does not transfer), 'noise' independent of everything."""
        rng = random.Random(2024)
        overheads, metrics = {}, {}
        for size in ("A", "B"):
            overheads[size], metrics[size] = {}, {}
            for i in range(12):
                q = i / 11 + rng.gauss(0, 0.02)
                recipe = f"r{i}"
                overheads[size][recipe] = math.inf if i >= 10 else 0.5 * q * q + rng.gauss(0, 0.005)
                metrics[size][recipe] = {
                    "planted": q + rng.gauss(0, 0.01),
                    "planted_neg": -q + rng.gauss(0, 0.01),
                    "flipped": q if size == "A" else -q,
                    "noise": rng.random(),
                }
        return overheads, metrics

    def test_planted_predictor_is_found_and_noise_is_not(self):
        overheads, metrics = self.synthetic()
        rows = analysis.predictor_table(overheads, metrics, n_boot=400)
        by = {(r["metric"], r["fit_size"], r["test_size"]): r for r in rows}
        self.assertEqual(len(rows), 4 * 2)
        for fit, test in (("A", "B"), ("B", "A")):
            planted = by[("planted", fit, test)]
            self.assertEqual(planted["direction"], 1)
            self.assertGreater(planted["spearman"], 0.9)
            self.assertTrue(planted["predicts"])
            self.assertLessEqual(planted["interval_lo"], planted["spearman"])
            self.assertLess(planted["test_p_holm"], 0.05)
            # The Holm family is what the fit size selected: the metrics whose fit interval excludes 0.
            selected = [r for r in rows if (r["fit_size"], r["test_size"]) == (fit, test)
                        and (r["fit_interval_lo"] > 0 or r["fit_interval_hi"] < 0)]
            self.assertEqual(planted["n_metrics"], len(selected))
            self.assertGreaterEqual(len(selected), 3)  # planted, planted_neg and flipped fit well
            for r in rows:
                if (r["fit_size"], r["test_size"]) == (fit, test) and r not in selected:
                    self.assertTrue(math.isnan(r["test_p_holm"]))
                    self.assertFalse(r["predicts"])
            negative = by[("planted_neg", fit, test)]
            self.assertEqual(negative["direction"], -1)
            self.assertGreater(negative["spearman"], 0.9)
            self.assertTrue(negative["predicts"])
            # Fitted on one size, the flipped metric's direction is wrong on the other.
            flipped = by[("flipped", fit, test)]
            self.assertLess(flipped["spearman"], -0.9)
            self.assertFalse(flipped["predicts"])
            noise = by[("noise", fit, test)]
            self.assertFalse(noise["predicts"])
            self.assertLessEqual(noise["interval_lo"], 0.0)
        # Best first: the planted metrics lead the table.
        self.assertIn(rows[0]["metric"], ("planted", "planted_neg"))

    def test_baselines_are_left_out(self):
        # Any error metric separates bf16 (no error, overhead 0) from the quantized recipes; among the
        # quantized recipes this one is unrelated to the overhead. With the baseline in, it would look
        # predictive; left out (the default), it must not.
        rng = random.Random(5)
        overheads, metrics = {}, {}
        for size in ("A", "B"):
            overheads[size] = {"bf16": 0.0}
            metrics[size] = {"bf16": {"err": 0.0}}
            for i in range(8):
                overheads[size][f"r{i}"] = 0.05 + rng.random()
                metrics[size][f"r{i}"] = {"err": 1.0 + rng.random()}
        with_baseline = analysis.predictor_table(overheads, metrics, n_boot=200, exclude=())
        self.assertTrue(all(r["n_test"] == 9 for r in with_baseline))
        rows = analysis.predictor_table(overheads, metrics, n_boot=200)
        self.assertTrue(all(r["n_test"] == 8 and not r["predicts"] for r in rows))

    def test_permutation_p_and_holm_by_hand(self):
        # rho = 1 on 3 points: only the identity of the 3! orderings is as large: p = 1/6.
        self.assertAlmostEqual(analysis.permutation_p([1, 2, 3], [1, 2, 3]), 1 / 6, places=12)
        # y = 1, 1, 2 (ranks 1.5, 1.5, 3): the orderings that keep the 3 last, 2 of 6, are as large.
        self.assertAlmostEqual(analysis.permutation_p([1, 2, 3], [1, 1, 2]), 1 / 3, places=12)
        # rho = -1: every ordering is at least as large.
        self.assertEqual(analysis.permutation_p([1, 2, 3], [3, 2, 1]), 1.0)
        # Monte Carlo (10! > n_perm): deterministic, never 0, small for a perfect correlation.
        p = analysis.permutation_p(list(range(10)), list(range(10)), n_perm=2000, seed=1)
        self.assertEqual(p, analysis.permutation_p(list(range(10)), list(range(10)), n_perm=2000, seed=1))
        self.assertAlmostEqual(p, 1 / 2001, places=12)
        # Holm: sorted 0.01, 0.03, 0.04 -> 3 x 0.01, max(2 x 0.03, 0.03), max(0.06, 1 x 0.04).
        adjusted = analysis.holm([0.01, 0.04, 0.03, float("nan")])
        self.assertEqual([round(v, 12) for v in adjusted[:3]], [0.03, 0.06, 0.06])
        self.assertTrue(math.isnan(adjusted[3]))

    def test_too_few_recipes_give_nan(self):
        overheads = {"A": {"r0": 0.0, "r1": 0.1}, "B": {"r0": 0.0, "r1": 0.2}}
        metrics = {s: {"r0": {"m": 1.0}, "r1": {"m": 2.0}} for s in "AB"}
        rows = analysis.predictor_table(overheads, metrics, n_boot=10)
        self.assertTrue(all(math.isnan(r["spearman"]) and not r["predicts"] for r in rows))


def _write(path, header, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, quoting=csv.QUOTE_NONNUMERIC)  # quoted strings: RFC 4180 quoting
        writer.writerow(header)
        writer.writerows(rows)


class ReplayMetrics(unittest.TestCase):
    def test_metrics_from_a_hand_made_run_directory(self):
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        header = ["layer", "gemm", "strategy", "step", "t", "rel_err", "bias", "orth_err", "quant_err", "accum_err",
                  "a_underflow_frac", "b_underflow_frac", "a_saturate_frac", "b_saturate_frac",
                  "attr_a_flush", "attr_a_clip", "attr_a_round", "attr_b_flush", "attr_b_clip", "attr_b_round"]
        rows = [
            ["L0", "wgrad", "s", 10, 1, 0.1, -0.06, 0.08, 0.1, 0.0, 0.2, 0.0, 0.0, 0.0, 0.01, 0.0, 0.03, 0.0, 0.0, 0.04],
            ["L0", "wgrad", "s", 11, 2, 0.3, -0.02, 0.2, 0.3, 0.0, 0.0, 0.0, 0.1, 0.1, 0.0, 0.0, 0.1, 0.0, 0.1, 0.0],
            ["L1", "wgrad", "s", 10, 1, 0.2, 0.04, 0.1, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, "nan", "nan", "nan", "nan",
             "nan", "nan"],
        ]
        _write(os.path.join(tmp, "steps.csv"), header, rows)
        acc_header = ["layer", "gemm", "strategy", "T", "step", "acc_err", "coherence", "alpha", "lag1_corr",
                      "structural_share", "sgd_upd_err", "sgd_disp_err", "adamw_upd_err", "adamw_disp_err"]
        _write(os.path.join(tmp, "accumulation.csv"), acc_header, [
            ["L0", "wgrad", "s", 1, 10, 0.1, 1.0, "nan", "nan", 1.0, 0.1, 0.1, 0.2, 0.2],
            ["L0", "wgrad", "s", 2, 11, 0.15, 1.2, 0.7, 0.5, 0.72, 0.1, 0.12, 0.2, 0.25],
            ["L1", "wgrad", "s", 1, 10, 0.2, 1.0, "nan", "nan", 1.0, 0.2, 0.2, 0.3, 0.3],
        ])
        with open(os.path.join(tmp, "summary.json"), "w") as handle:
            json.dump({"units": [{"layer": "L0", "gemm": "wgrad", "strategy": "s", "consecutive": False},
                                 {"layer": "L1", "gemm": "wgrad", "strategy": "s", "consecutive": True}]}, handle)
        m = analysis.replay_metrics(tmp)["s"]
        # L0: rel_err mean 0.2, |bias| mean 0.04; L1: 0.2 and 0.04. Averages over the two layers:
        self.assertAlmostEqual(m["wgrad.rel_err"], 0.2, places=12)
        self.assertAlmostEqual(m["wgrad.abs_bias"], 0.04, places=12)
        # Signed bias: L0 mean -0.04, L1 0.04 -> 0.
        self.assertAlmostEqual(m["wgrad.bias"], 0.0, places=12)
        # bias_coherence: L0 |−0.04| / sqrt((0.01+0.09)/2) = 0.04/sqrt(0.05); L1 0.04/0.2 = 0.2.
        self.assertAlmostEqual(m["wgrad.bias_coherence"], (0.04 / math.sqrt(0.05) + 0.2) / 2, places=12)
        # bias_share: L0 mean of 0.0036/0.01 and 0.0004/0.09; L1 0.0016/0.04.
        self.assertAlmostEqual(m["wgrad.bias_share"], ((0.36 + 0.0004 / 0.09) / 2 + 0.04) / 2, places=12)
        # Last accumulation rows: L0 T=2, L1 T=1.
        self.assertAlmostEqual(m["wgrad.acc_err"], (0.15 + 0.2) / 2, places=12)
        # alpha: L0's window is not consecutive (left out), L1's is nan (T = 1): nan.
        self.assertTrue(math.isnan(m["wgrad.alpha"]))
        self.assertAlmostEqual(m["wgrad.lag1_corr"], 0.5, places=12)  # only L0 defines it
        # norm_acc_err: L0 sqrt(0.72) * sqrt(0.05); L1 sqrt(1.0) * 0.2.
        self.assertAlmostEqual(m["wgrad.norm_acc_err"], (math.sqrt(0.72 * 0.05) + 0.2) / 2, places=12)
        # Attribution shares (L0 only; L1 has none): step 1 flush (0.01 + 0) / 0.08, step 2 flush 0.
        self.assertAlmostEqual(m["wgrad.flush_share"], (0.01 / 0.08 + 0.0) / 2, places=12)
        self.assertAlmostEqual(m["wgrad.clip_share"], (0.0 + 0.1 / 0.2) / 2, places=12)
        self.assertAlmostEqual(m["all.rel_err"], m["wgrad.rel_err"], places=12)
        self.assertNotIn("fprop.rel_err", m)


class OverheadsFrom(unittest.TestCase):
    """analyze(out, overheads_from=DIR): overheads from DIR's evals.csv, metrics from out's replays."""

    def test_agreement_by_hand(self):
        from mxscope.ablate import runner
        mine = {"d": {"a": {"m": 1.0}, "b": {"m": 2.0}, "c": {"m": 3.0}, "e": {"m": float("nan")}}}
        other = [{"size": "d", "recipe": r, "metric": "m", "value": v}
                 for r, v in (("a", "1.0"), ("b", "1.5"), ("c", "1.2"), ("e", "7"), ("f", "9"))]
        rows = runner.metrics_agreement(mine, other)
        self.assertEqual(len(rows), 1)
        row = rows[0]
        self.assertEqual((row["size"], row["metric"], row["n_recipes"]), ("d", "m", 3))
        # ranks (1, 2, 3) against (1, 3, 2): d = (0, -1, 1), rho = 1 - 6 * 2 / (3 * 8) = 0.5
        self.assertAlmostEqual(row["spearman"], 0.5, places=12)
        # relative differences 0, 0.5 / 2, 1.8 / 3
        self.assertAlmostEqual(row["median_rel_diff"], 0.25, places=12)
        self.assertAlmostEqual(row["max_rel_diff"], 0.6, places=12)
        self.assertEqual(runner.metrics_agreement(mine, []), [])

    def test_tables_go_to_out_and_the_other_directory_is_untouched(self):
        from mxscope.ablate import runner
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root)
        main, extra = os.path.join(root, "main"), os.path.join(root, "extra")
        os.makedirs(main)
        evals = []
        for recipe, slope in (("bf16", 1.0), ("r1", 0.9), ("r2", 0.8)):
            for seed in (0, 1):
                for step in (0, 2, 4, 6):
                    loss = 5.0 - slope * step * (1 + 0.01 * seed)
                    evals.append({"size": "d", "recipe": recipe, "seed": seed, "step": step, "tokens": 100 * step,
                                  "train_loss": "nan", "val_loss": loss, "wall_s": 1.0, "schedule_steps": 4})
        runner._write_csv(os.path.join(main, "evals.csv"), runner.EVAL_COLUMNS, evals)
        runner._write_csv(os.path.join(main, "metrics.csv"), ("size", "recipe", "metric", "value"),
                          [{"size": "d", "recipe": "r1", "metric": "own.late.wgrad.rel_err", "value": 0.1},
                           {"size": "d", "recipe": "r2", "metric": "own.late.wgrad.rel_err", "value": 0.3}])
        def contents(directory):
            out = {}
            for name in os.listdir(directory):
                with open(os.path.join(directory, name)) as handle:
                    out[name] = handle.read()
            return out

        before = contents(main)
        header = ["layer", "gemm", "strategy", "step", "t", "rel_err", "bias"]
        for recipe, rel in (("r1", 0.2), ("r2", 0.4)):
            window = os.path.join(extra, "runs", "d", recipe, "seed0", "replay", "late")
            os.makedirs(window)
            _write(os.path.join(window, "steps.csv"), header, [["L0", "wgrad", recipe, 400, 1, rel, 0.0]])
            _write(os.path.join(window, "accumulation.csv"), ["layer", "gemm", "strategy", "T", "step"],
                   [["L0", "wgrad", recipe, 1, 400]])
            with open(os.path.join(window, "summary.json"), "w") as handle:
                json.dump({"units": []}, handle)
        runner.analyze(extra, n_boot=20, predictor_boot=20, plot=False, log=lambda text: None, overheads_from=main)
        self.assertEqual(contents(main), before)
        for name in ("runs.csv", "overhead.csv", "overhead.md"):
            self.assertFalse(os.path.exists(os.path.join(extra, name)), name)
        metrics = analysis.read_csv(os.path.join(extra, "metrics.csv"))
        rel = {r["recipe"]: float(r["value"]) for r in metrics if r["metric"] == "own.late.wgrad.rel_err"}
        self.assertEqual(rel, {"r1": 0.2, "r2": 0.4})
        self.assertTrue(os.path.exists(os.path.join(extra, "predictors.csv")))
        agreement = analysis.read_csv(os.path.join(extra, "metrics_agreement.csv"))
        self.assertEqual([(r["metric"], r["n_recipes"]) for r in agreement], [("own.late.wgrad.rel_err", "2")])
        self.assertAlmostEqual(float(agreement[0]["max_rel_diff"]), 0.5, places=12)  # 0.1 against 0.2


class Strategies(unittest.TestCase):
    def test_keys_of_recipe_gemms(self):
        g = lambda **kw: types.SimpleNamespace(**{**dict(format="mxfp4", grad_format=None, rounding="rne",  # noqa
                                                        scale_rule="floor", rotation=0, signs="none",
                                                        seed_policy="per-step", block=0), **kw})
        self.assertEqual(strategies.gemm_keys("wgrad", None), {"format": "bf16"})
        self.assertEqual(strategies.gemm_keys("fprop", g()), {"format": "mxfp4"})
        self.assertEqual(strategies.gemm_keys("wgrad", g(rotation=16, signs="per-step")),
                         {"format": "mxfp4", "rotation": "hadamard:16", "signs": "per-step"})
        self.assertEqual(strategies.gemm_keys("wgrad", g(rotation=16)), {"format": "mxfp4", "rotation": "hadamard:16"})
        self.assertEqual(strategies.gemm_keys("dgrad", g(rounding="sr", seed_policy="fixed")),
                         {"format": "mxfp4", "rounding": "sr", "seed_policy": "fixed"})
        fp8 = g(format="fp8_e4m3", grad_format="fp8_e5m2")
        self.assertEqual(strategies.gemm_keys("fprop", fp8), {"format": "fp8_e4m3"})
        self.assertEqual(strategies.gemm_keys("wgrad", fp8), {"format": "fp8_e4m3", "a": {"format": "fp8_e5m2"}})
        self.assertEqual(strategies.gemm_keys("wgrad", g(format="nvfp4", block=16)), {"format": "nvfp4", "block": 16})
        recipe = types.SimpleNamespace(fprop=g(), dgrad=g(), wgrad=fp8)
        text = strategies.analysis_toml([("r", recipe, 7, "bf16"), ("bf16", None, 7, "bf16"), ("r", recipe, 7, "bf16")],
                                        "t")
        try:
            import tomllib
        except ImportError:
            self.skipTest("tomllib needs Python 3.11")
        parsed = tomllib.loads(text)
        self.assertEqual([s["name"] for s in parsed["strategy"]], ["r", "bf16"])  # duplicates dropped
        self.assertEqual(parsed["strategy"][0]["wgrad"], {"format": "fp8_e4m3", "a": {"format": "fp8_e5m2"}})
        self.assertEqual(parsed["strategy"][0]["seed"], 7)
        self.assertEqual(parsed["strategy"][1]["dgrad"], {"format": "bf16"})
        self.assertEqual(parsed["gemms"], ["fprop", "dgrad", "wgrad"])

    def test_fields_without_a_replay_key_are_reported(self):
        plain = types.SimpleNamespace(format="nvfp4", rounding="rne", rotation=0, signs="none", block=0)
        self.assertEqual(strategies.unmapped_fields(plain), {})
        odd = types.SimpleNamespace(format="nvfp4", rotation=16, weight_scaling="2d", flag=False)
        self.assertEqual(strategies.unmapped_fields(odd), {"weight_scaling": "2d"})
        text = strategies.strategy_toml("x", types.SimpleNamespace(fprop=None, dgrad=None, wgrad=odd))
        self.assertIn("# wgrad: GemmRecipe fields without a replay key, not reproduced: weight_scaling='2d'", text)

    def test_neighbours(self):
        ladder = ["a", "b", "c", "d"]
        self.assertEqual(strategies.neighbours(ladder, "b"), ["b", "a", "c"])
        self.assertEqual(strategies.neighbours(ladder, "a"), ["a", "b"])
        self.assertEqual(strategies.neighbours(ladder, "d", 2), ["d", "c", "b"])


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class RunnerOnCpu(unittest.TestCase):
    ARGS = ["--sizes", "tiny", "--recipes", "bf16,fp32", "--steps", "4", "--overrun", "1.5", "--eval-every", "2",
            "--eval-batches", "1",
            "--max-corpus-bytes", "100000", "--threads", "1", "--device", "cpu", "--no-plot", "--bootstrap", "50"]

    def run_main(self, out, *extra):
        from mxscope.ablate import runner
        buffer = io.StringIO()
        with redirect_stdout(buffer):
            self.assertEqual(runner.main(["--out", out] + self.ARGS + list(extra)), 0)
        return buffer.getvalue()

    def test_runs_resume_and_tables(self):
        from mxscope.ablate import runner
        out = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, out)
        self.run_main(out, "--seeds", "0,1")
        evals_path = os.path.join(out, "evals.csv")
        with open(evals_path, newline="") as handle:
            first_text = handle.read()
        evals = list(csv.DictReader(io.StringIO(first_text)))
        self.assertEqual(tuple(evals[0].keys()), runner.EVAL_COLUMNS)
        keys = sorted((r["recipe"], int(r["seed"]), int(r["step"])) for r in evals)
        # The schedule ends at step 4; the overrun (1.5 x 4 steps) adds the evaluation at step 6.
        self.assertEqual(keys, sorted((r, s, t) for r in ("bf16", "fp32") for s in (0, 1) for t in (0, 2, 4, 6)))
        self.assertEqual({r["schedule_steps"] for r in evals}, {"4"})
        tokens_per_step = runner.SIZES["tiny"]["batch"] * runner.SIZES["tiny"]["seq"]
        for row in evals:
            self.assertEqual(int(row["tokens"]), int(row["step"]) * tokens_per_step)
            self.assertTrue(math.isfinite(float(row["val_loss"])))
            self.assertEqual(row["size"], "tiny")
            # Step 0 is the initial evaluation: about ln 256 for a byte model at initialization.
            if row["step"] == "0":
                self.assertLess(abs(float(row["val_loss"]) - math.log(256)), 0.3)
                self.assertEqual(row["train_loss"], "nan")

        with open(os.path.join(out, "runs.csv"), newline="") as handle:
            runs = list(csv.DictReader(handle))
        self.assertEqual(tuple(runs[0].keys()), runner.RUN_COLUMNS)
        self.assertEqual(sorted((r["recipe"], int(r["seed"])) for r in runs),
                         [("bf16", 0), ("bf16", 1), ("fp32", 0), ("fp32", 1)])
        finals = {(r["recipe"], int(r["seed"])): float(r["val_loss"]) for r in evals if r["step"] == "4"}
        lasts = {(r["recipe"], int(r["seed"])): float(r["val_loss"]) for r in evals if r["step"] == "6"}
        bf16_finals = [finals[("bf16", 0)], finals[("bf16", 1)]]
        for run in runs:
            self.assertEqual(float(run["final_val_loss"]), finals[(run["recipe"], int(run["seed"]))])
            self.assertEqual(float(run["last_val_loss"]), lasts[(run["recipe"], int(run["seed"]))])
            self.assertEqual(run["diverged"], "False")
            self.assertAlmostEqual(float(run["target"]), sum(bf16_finals) / 2, places=12)
            # A run reaches the target iff its curve goes at or below it.
            curve = [(float(r["tokens"]), float(r["val_loss"])) for r in evals
                     if (r["recipe"], r["seed"]) == (run["recipe"], run["seed"])]
            reached = any(loss <= float(run["target"]) for _, loss in curve)
            self.assertEqual(run["reached"], str(reached))
            self.assertEqual(math.isinf(float(run["tokens_to_target"])), not reached)
        with open(os.path.join(out, "overhead.csv"), newline="") as handle:
            overhead = {r["recipe"]: r for r in csv.DictReader(handle)}
        self.assertEqual(float(overhead["bf16"]["overhead"]), 0.0)
        with open(os.path.join(out, "run.json")) as handle:
            provenance = json.load(handle)
        self.assertIn("torch", provenance["software"])
        self.assertEqual(len(provenance["invocations"]), 1)
        self.assertEqual(len(provenance["runs"]), 4)

        # A rerun trains nothing and leaves evals.csv byte for byte as it was.
        log = self.run_main(out, "--seeds", "0,1")
        self.assertEqual(log.count("skip tiny/"), 4)
        with open(evals_path, newline="") as handle:
            self.assertEqual(handle.read(), first_text)
        # Appending a run that is already there is refused.
        self.assertFalse(runner.append_run(evals_path, [dict(evals[0])]))

        # A third seed trained by two concurrent workers: only the new runs are added, once each.
        self.run_main(out, "--seeds", "0,1,2", "--parallel", "2")
        with open(evals_path, newline="") as handle:
            text = handle.read()
        self.assertTrue(text.startswith(first_text))
        rows = list(csv.DictReader(io.StringIO(text)))
        self.assertEqual(len(rows), 2 * 3 * 4)
        self.assertEqual(len({(r["recipe"], r["seed"], r["step"]) for r in rows}), len(rows))


class Scheduling(unittest.TestCase):
    def jobs(self):
        from mxscope.ablate import runner
        return [runner.RunOptions(out="/nonexistent", size="tiny", size_config=runner.SIZES["tiny"], recipe=r, seed=s,
                                  steps=4, eval_every=2)
                for r in ("bf16", "mxfp4-fdw", "mxfp4-fdw-sr", "nvfp4-te") for s in (2, 0, 1)]

    def test_seed_major_and_slow_recipes_first(self):
        from mxscope.ablate import runner
        jobs = self.jobs()
        ordered = [(j.seed, j.recipe) for j in runner.order_jobs(jobs)]
        self.assertEqual([s for s, _ in ordered], [0] * 4 + [1] * 4 + [2] * 4)
        # within a seed: the two-part costs (sr, nvfp4 + ... ) before the plain recipes, stable otherwise
        self.assertEqual([r for s, r in ordered if s == 0], ["mxfp4-fdw-sr", "nvfp4-te", "bf16", "mxfp4-fdw"])
        # capturing runs go first, whatever their seed
        for job in jobs:
            job.capture = job.seed == 2
        ordered = [(j.seed, j.recipe) for j in runner.order_jobs(jobs)]
        self.assertEqual([s for s, _ in ordered], [2] * 4 + [0] * 4 + [1] * 4)

    def test_a_passed_deadline_starts_nothing_and_returns_every_job(self):
        from mxscope.ablate import runner
        jobs = self.jobs()
        for parallel in (1, 2):
            trained = []
            left = runner._train_all(jobs, parallel, "/nonexistent/evals.csv", lambda text: None,
                                     deadline=time.time() - 1, on_finished=trained.append)
            self.assertEqual(left, jobs)
            self.assertEqual(trained, [])


class ReplayedSeeds(unittest.TestCase):
    def test_only_seeds_with_a_finished_window_count(self):
        from mxscope.ablate import runner
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root)
        os.makedirs(os.path.join(root, "seed0", "replay", "early"))  # stopped before its summary.json
        os.makedirs(os.path.join(root, "seed1"))  # trained without a capture
        for seed in (2, 3):
            os.makedirs(os.path.join(root, f"seed{seed}", "replay", "late"))
            open(os.path.join(root, f"seed{seed}", "replay", "late", "summary.json"), "w").close()
        self.assertEqual(runner._replayed_seeds(root), [2, 3])
        self.assertEqual(runner._replayed_seeds(os.path.join(root, "absent")), [])


class Projections(unittest.TestCase):
    def test_regex_matches_the_seven_projections_of_the_chosen_blocks(self):
        import re
        from mxscope.ablate import runner
        hf = runner.projections_regex(*runner.BACKEND_NAMES["hf-llama"], layers=(1, 3))
        names = [f"model.layers.{i}.{m}" for i in range(4) for m in
                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj", "input_layernorm", "self_attn", "mlp")]
        names += ["lm_head", "model.embed_tokens", "model.layers.13.mlp.up_proj", "model.layers.1.mlp.up_proj.x"]
        matched = [n for n in names if re.fullmatch(hf, n)]
        self.assertEqual(len(matched), 14)
        self.assertEqual({n.split(".")[2] for n in matched}, {"1", "3"})
        every = runner.projections_regex(*runner.BACKEND_NAMES["tiny-llama"])
        self.assertTrue(re.fullmatch(every, "layers.12.attn.o_proj"))
        self.assertFalse(re.fullmatch(every, "layers.0.mlp.o_proj"))
        self.assertFalse(re.fullmatch(every, "lm_head"))

    def test_recipes_are_checked_before_training(self):
        from mxscope.ablate import runner
        runner.check_recipes(["bf16", "fp32"])  # built in: nothing to import
        if importlib.util.find_spec("mxscope.torch") is None:
            with self.assertRaises(SystemExit) as raised:
                runner.check_recipes(["bf16", "mxfp4-fdw"])
            self.assertIn("mxscope.torch", str(raised.exception))

    def test_capture_windows(self):
        from mxscope.ablate import runner
        self.assertEqual(runner.capture_windows(1000, 8, None), {"early": (100, 107), "late": (993, 1000)})
        self.assertEqual(runner.capture_windows(6, 2, None), {"early": (1, 2), "late": (5, 6)})
        self.assertEqual(runner.capture_windows(4, 4, None), {"early": (1, 4)})  # no room for a second window
        self.assertEqual(runner.default_capture_layers(4), (1, 3))
        self.assertEqual(runner.default_capture_layers(2), (0, 1))


FAKE_MXSCOPE = r'''
import json, os, sys, tomllib
args = sys.argv[1:]
assert args[0] == "replay", args
dump = args[1]
opts = dict(zip(args[2::2], args[3::2]))
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.log"), "a") as log:
    log.write(json.dumps(args) + "\n")
first, last = (int(v) for v in opts["--steps"].split("-"))
with open(opts["--analysis"], "rb") as f:
    analysis = tomllib.load(f)
with open(os.path.join(dump, "manifest.json")) as f:
    entries = [e for e in json.load(f)["entries"] if first <= e["step"] <= last]
out = opts["--out"]
os.makedirs(out)
steps = ["layer,gemm,strategy,step,t,rel_err,bias,orth_err"]
acc = ["layer,gemm,strategy,T,step,acc_err,coherence,alpha,structural_share"]
units = []
for s in analysis["strategy"]:
    # A made-up error per strategy: larger for more quantized GEMMs (bf16 0.01, fp32 0).
    for gemm in analysis["gemms"]:
        err = {"bf16": 0.01, "fp32": 0.0}.get(s[gemm]["format"], 0.1)
        for layer in sorted({e["layer"] for e in entries}):
            mine = sorted(e["step"] for e in entries if e["layer"] == layer)
            for t, step in enumerate(mine, 1):
                steps.append(f"{layer},{gemm},{s['name']},{step},{t},{err},{-err / 2},{err / 2}")
                acc.append(f"{layer},{gemm},{s['name']},{t},{step},{err},1,0.5,{err}")
            units.append({"layer": layer, "gemm": gemm, "strategy": s["name"], "consecutive": True})
open(os.path.join(out, "steps.csv"), "w").write("\n".join(steps) + "\n")
open(os.path.join(out, "accumulation.csv"), "w").write("\n".join(acc) + "\n")
json.dump({"units": units}, open(os.path.join(out, "summary.json"), "w"))
'''


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class RunnerCaptureAndReplay(unittest.TestCase):
    def test_divergence_is_detected_and_named(self):
        from mxscope.ablate import runner
        out = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, out)
        with redirect_stdout(io.StringIO()):
            # A learning rate of 30 blows the model up within a few steps.
            runner.main(["--out", out, "--sizes", "tiny", "--recipes", "bf16", "--seeds", "0", "--steps", "6",
                         "--eval-every", "2", "--eval-batches", "1", "--max-corpus-bytes", "100000", "--threads", "1",
                         "--device", "cpu", "--no-plot", "--lr", "30"])
        with open(os.path.join(out, "runs.csv"), newline="") as handle:
            (run,) = list(csv.DictReader(handle))
        self.assertEqual(run["diverged"], "True")
        self.assertTrue(run["divergence_reason"])

    @unittest.skipUnless(sys.version_info >= (3, 11), "the stand-in CLI reads TOML with tomllib")
    def test_capture_replay_and_metrics_through_a_stand_in_cli(self):
        from mxscope.ablate import runner
        out = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, out)
        cli = os.path.join(out, "fake-mxscope")
        with open(cli, "w") as handle:
            handle.write(f"#!{sys.executable}\n" + FAKE_MXSCOPE)
        os.chmod(cli, 0o755)
        with redirect_stdout(io.StringIO()):
            runner.main(["--out", os.path.join(out, "a"), "--sizes", "tiny,mini", "--size", "mini=16:2:2:48:16:2",
                         "--recipes", "bf16,fp32", "--seeds", "0,1", "--steps", "6", "--eval-every", "3",
                         "--eval-batches", "1", "--max-corpus-bytes", "100000", "--threads", "1", "--device", "cpu",
                         "--no-plot", "--bootstrap", "20", "--capture", "--capture-window", "2", "--replay",
                         "--mxscope", cli])
        root = os.path.join(out, "a")
        # Only the first seed captures: the 7 projections of blocks 0 and 1, steps 1-2 and 5-6.
        self.assertFalse(os.path.exists(os.path.join(root, "runs", "tiny", "bf16", "seed1", "capture")))
        with open(os.path.join(root, "runs", "tiny", "fp32", "seed0", "capture", "manifest.json")) as handle:
            entries = json.load(handle)["entries"]
        self.assertEqual(sorted({e["step"] for e in entries}), [1, 2, 5, 6])
        self.assertEqual(len({e["layer"] for e in entries}), 14)
        self.assertEqual(len(entries), 14 * 4)
        with open(os.path.join(out, "calls.log")) as handle:
            calls = [json.loads(line) for line in handle]
        self.assertEqual(len(calls), 2 * 2 * 2)  # sizes x recipes x windows
        self.assertEqual(sorted({c[c.index("--steps") + 1] for c in calls}), ["1-2", "5-6"])
        import tomllib
        with open(os.path.join(root, "runs", "tiny", "fp32", "seed0", "replay", "analysis.toml"), "rb") as handle:
            toml = tomllib.load(handle)
        self.assertEqual([s["name"] for s in toml["strategy"]], ["fp32", "bf16"])  # own first, then neighbours
        self.assertEqual(toml["strategy"][0]["wgrad"], {"format": "fp32"})
        with open(os.path.join(root, "metrics.csv"), newline="") as handle:
            metrics = {(r["size"], r["recipe"], r["metric"]): float(r["value"]) for r in csv.DictReader(handle)}
        self.assertEqual(metrics[("tiny", "bf16", "own.early.wgrad.rel_err")], 0.01)
        self.assertEqual(metrics[("mini", "fp32", "own.late.all.rel_err")], 0.0)
        self.assertEqual(metrics[("tiny", "fp32", "bf16cap.late.wgrad.abs_bias")], 0.0)
        self.assertAlmostEqual(metrics[("tiny", "bf16", "bf16cap.early.all.abs_bias")], 0.005, places=15)
        with open(os.path.join(root, "predictors.csv"), newline="") as handle:
            predictors = list(csv.DictReader(handle))
        self.assertEqual(tuple(predictors[0].keys()), analysis.PREDICTOR_COLUMNS)
        self.assertEqual({(r["fit_size"], r["test_size"]) for r in predictors}, {("mini", "tiny"), ("tiny", "mini")})
        # Two recipes are too few for a correlation: every row says so instead of inventing one.
        self.assertTrue(all(r["spearman"] == "nan" and r["predicts"] == "False" for r in predictors))
        # The MXFP4-family table: no recipe of this run is in the family, so no row has a value.
        with open(os.path.join(root, "predictors_mxfp4.csv"), newline="") as handle:
            family = list(csv.DictReader(handle))
        self.assertEqual(len(family), len(predictors))
        self.assertTrue(all(r["spearman"] == "nan" for r in family))

if __name__ == "__main__":
    unittest.main()
