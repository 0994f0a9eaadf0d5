"""tools/bench/gpu-ab against stand-in benchmarks: shell scripts that print the GPU benchmark's
timed lines with known times, so the medians, ranges, ratios, run order and failure reports can be
checked exactly without a GPU."""
import os
import pathlib
import subprocess
import sys
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench" / "gpu-ab"


def fake_bench(directory, name, body):
    """An executable that appends its name and arguments to order.txt, then runs `body` (bash)."""
    path = pathlib.Path(directory) / name
    path.write_text(f"#!/usr/bin/env bash\necho \"{name} $*\" >> {directory}/order.txt\n{body}\n")
    path.chmod(0o755)
    return str(path)


def counter_body(directory, name, times):
    """Prints time number r (r = how many times this bench ran before) on each timed line."""
    values = " ".join(str(t) for t in times)
    return (f"t=({values}); c=$(cat {directory}/{name}.n 2>/dev/null || echo 0); echo $((c + 1)) > {directory}/{name}.n\n"
            "echo \"device: NVIDIA H200 (compute capability 9.0, 132 multiprocessors)\"\n"
            "echo \"gemm mxfp8_e4m3 fp32-block integer sliced n_out 4096 n_in 14336 K 8192: ${t[$c]} ms, 34.6 TFLOP/s, 18.05x the MXFP4 tensor-core product\"\n"
            "echo \"gemm fp32-block, bf16 values, warp kernel (round 1), n_out 4096 n_in 14336 K 8192: 2.000 ms, 1.00 TFLOP/s\"\n"
            "echo \"gemm fp32-block, bf16 values, warp kernel (round 2), n_out 4096 n_in 14336 K 8192: 4.000 ms, 1.00 TFLOP/s\"\n"
            "echo \"gemm mxfp8_e4m3 fp32-block integer: sliced_wgmma 26.5 ms = 1.09x sliced's 24.2 ms\"\n"
            "echo \"PASS gemm mxfp8_e4m3 fp32-block sliced == simt in every entry\"\n"
            "echo \"bench: all checks passed\"")


def run_tool(*arguments, log_dir):
    return subprocess.run([sys.executable, str(TOOL), "--log-dir", log_dir, *arguments], capture_output=True, text=True)


class GpuAbTest(unittest.TestCase):
    def test_medians_ranges_ratios_and_rotated_order(self):
        with tempfile.TemporaryDirectory() as d:
            old = fake_bench(d, "old", counter_body(d, "old", [24.0, 25.0, 23.0]))
            new = fake_bench(d, "new", counter_body(d, "new", [18.0, 12.0, 19.0]))
            mixed = fake_bench(d, "mixed", counter_body(d, "mixed", [24.5, 24.0, 23.5]))
            result = run_tool("--rounds", "3", "--args=--gemm-only", f"main={old}", f"step={new}", f"mixed={mixed}",
                              log_dir=f"{d}/logs")
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            order = pathlib.Path(d, "order.txt").read_text().split("\n")[:-1]
            # Rotated a place each round, so that each variant runs first once.
            self.assertEqual(order, ["old --gemm-only", "new --gemm-only", "mixed --gemm-only",
                                     "new --gemm-only", "mixed --gemm-only", "old --gemm-only",
                                     "mixed --gemm-only", "old --gemm-only", "new --gemm-only"])
            lines = result.stdout.splitlines()
            label = "gemm mxfp8_e4m3 fp32-block integer sliced n_out 4096 n_in 14336 K 8192"
            at = lines.index(label)
            self.assertRegex(lines[at + 1], r"^  main +24\.000 ms  \(23\.000 \.\. 25\.000, 3 samples\)  1\.000x main$")
            self.assertRegex(lines[at + 2],
                             r"^  step +18\.000 ms  \(12\.000 \.\. 19\.000, 3 samples\)  0\.750x main  lower in 3 of 3 paired$")
            # Paired by round: 24.5 > 24, 24 < 25, 23.5 > 23; the medians are equal.
            self.assertRegex(lines[at + 3],
                             r"^  mixed +24\.000 ms  \(23\.500 \.\. 24\.500, 3 samples\)  1\.000x main  lower in 1 of 3 paired$")
            # The benchmark's own rounds merge into one row: 3 runs x (2 and 4 ms), median 3.
            at = lines.index("gemm fp32-block, bf16 values, warp kernel, n_out 4096 n_in 14336 K 8192")
            self.assertIn("3.000 ms  (2.000 .. 4.000, 6 samples)", lines[at + 1])
            # A line whose first figure after the colon is not a time is not a row.
            self.assertNotIn("gemm mxfp8_e4m3 fp32-block integer", lines)
            self.assertTrue(pathlib.Path(d, "logs", "step-3.log").read_text().startswith("device:"))

    def test_fixed_order_and_pairing_by_round(self):
        # Each bench prints the same time in every round but the second; with --fixed-order the runs
        # go a b, a b, a b, and the rotated default pairs samples by round all the same.
        for fixed in (True, False):
            with tempfile.TemporaryDirectory() as d:
                a = fake_bench(d, "a", counter_body(d, "a", [10.0, 30.0, 10.0]))
                b = fake_bench(d, "b", counter_body(d, "b", [11.0, 20.0, 11.0]))
                flags = ["--fixed-order"] if fixed else []
                result = run_tool("--rounds", "3", *flags, f"a={a}", f"b={b}", log_dir=f"{d}/logs")
                self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
                order = pathlib.Path(d, "order.txt").read_text().split()
                self.assertEqual(order, ["a", "b", "a", "b", "a", "b"] if fixed else ["a", "b", "b", "a", "a", "b"])
                self.assertEqual(pathlib.Path(d, "logs", "b-2.log").read_text().count("20.0 ms"), 1)
                lines = result.stdout.splitlines()
                at = lines.index("gemm mxfp8_e4m3 fp32-block integer sliced n_out 4096 n_in 14336 K 8192")
                # b is lower than a only in round 2 (20 < 30), whatever order the round ran in.
                self.assertRegex(lines[at + 2], r"^  b +11\.000 ms  \(11\.000 \.\. 20\.000, 3 samples\)  1\.100x a  "
                                                r"lower in 1 of 3 paired$")

    def test_failures_are_reported_with_the_table(self):
        with tempfile.TemporaryDirectory() as d:
            good = fake_bench(d, "good", "echo 'copy d2d 1 GiB: 0.500 ms, 4200 GB/s'")
            checks = fake_bench(d, "checks", "echo 'copy d2d 1 GiB: 0.600 ms'; echo 'FAIL entry 3 differs'")
            crash = fake_bench(d, "crash", "echo 'copy d2d 1 GiB: 0.700 ms'; exit 3")
            result = run_tool("--rounds", "1", f"a={good}", f"b={checks}", f"c={crash}", log_dir=f"{d}/logs")
            self.assertEqual(result.returncode, 1)
            self.assertIn("  c                     0.700 ms  (0.700 .. 0.700, 1 samples)  1.400x a", result.stdout)
            self.assertIn("FAIL b round 1 (exit code 0)", result.stdout)
            self.assertIn("FAIL c round 1 (exit code 3)", result.stdout)
            self.assertNotIn("FAIL a", result.stdout)

    def test_filter_and_missing_rows(self):
        with tempfile.TemporaryDirectory() as d:
            a = fake_bench(d, "a", "echo 'copy d2d 1 GiB: 0.500 ms'; echo 'reference exact, bf16 values: 30.000 ms'")
            b = fake_bench(d, "b", "echo 'copy d2d 1 GiB: 0.500 ms'")
            result = run_tool("--rounds", "1", "--filter", "reference", f"a={a}", f"b={b}", log_dir=f"{d}/logs")
            self.assertEqual(result.returncode, 0)
            self.assertNotIn("copy d2d", result.stdout)
            self.assertIn("  b                (no figure)", result.stdout)

    def test_bad_arguments_exit_2_before_any_run(self):
        with tempfile.TemporaryDirectory() as d:
            a = fake_bench(d, "a", "echo 'x: 1 ms'")
            cases = [
                ([f"a={a}"], "at least two variants"),
                ([f"a={a}", f"a={a}"], "given twice"),
                ([f"a={a}", "b"], "expected NAME=PATH"),
                ([f"a={a}", f"b={d}/missing"], "not an executable file"),
                (["--rounds", "0", f"a={a}", f"b={a}"], "--rounds must be at least 1"),
            ]
            for arguments, message in cases:
                result = run_tool(*arguments, log_dir=f"{d}/logs")
                self.assertEqual(result.returncode, 2, arguments)
                self.assertIn(message, result.stderr)
            self.assertFalse(os.path.exists(f"{d}/order.txt"))


if __name__ == "__main__":
    unittest.main()
