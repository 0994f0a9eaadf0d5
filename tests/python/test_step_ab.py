"""tools/bench/step-ab with the real CLI on the CPU (MXSCOPE_CLI, one step of the sample
ablation): the run order, the stage table read from run.json, the byte comparison of the outputs
(a wrapper that alters steps.csv must be caught), failed runs and argument errors."""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench" / "step-ab"
CLI = os.environ.get("MXSCOPE_CLI", str(ROOT / "build" / "mxscope"))
DUMP = ROOT / "data" / "sample"
ANALYSIS = ROOT / "analyses" / "wgrad-ablation.toml"


def wrapper(directory, name, after="", order=None):
    """An executable that logs its name, runs the CLI with its arguments, then runs `after` (bash,
    with $out the --out directory) and exits with the CLI's code unless `after` exits first."""
    path = pathlib.Path(directory) / name
    path.write_text(
        "#!/usr/bin/env bash\n"
        f"echo {name} >> {order or directory}/order.txt\n"
        "out=; prev=; for a in \"$@\"; do [[ $prev == --out ]] && out=$a; prev=$a; done\n"
        f"\"{CLI}\" \"$@\"; rc=$?\n{after}\nexit $rc\n")
    path.chmod(0o755)
    return str(path)


def run_tool(*arguments, log_dir):
    return subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--steps", "1", "--log-dir", log_dir,
                           str(DUMP), str(ANALYSIS), *arguments], capture_output=True, text=True)


@unittest.skipUnless(os.access(CLI, os.X_OK), f"no mxscope CLI at {CLI} (set MXSCOPE_CLI)")
class StepAbTest(unittest.TestCase):
    def test_alternating_runs_and_the_stage_table(self):
        with tempfile.TemporaryDirectory() as d:
            bundle = pathlib.Path(d, "bundle")
            bundle.mkdir()
            wrapper(str(bundle), "run", order=d)  # a bundle directory: its `run` is started
            plain = wrapper(d, "plain")
            result = run_tool("--rounds", "2", "--cold", f"main={bundle}", f"new={plain}", log_dir=f"{d}/logs")
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            # The second round's order is rotated: each variant runs first once.
            self.assertEqual(pathlib.Path(d, "order.txt").read_text().split(), ["run", "plain", "plain", "run"])
            self.assertIn("PASS every run wrote the same steps.csv, accumulation.csv, summary.json", result.stdout)
            self.assertIn("(cpu, cold)", result.stdout)
            lines = result.stdout.splitlines()
            runs = [json.loads(pathlib.Path(d, "logs", f"{tag}.run.json").read_text()) for tag in ("new-1", "new-2")]
            totals = sorted(run["seconds"]["total"] for run in runs)
            at = lines.index("total")
            self.assertTrue(lines[at + 1].startswith("  main "))
            self.assertIn(f"({totals[0]:.4f} .. {totals[1]:.4f}, 2 samples)", lines[at + 2])
            for strategy, stages in runs[0]["stage_seconds_per_strategy"].items():
                self.assertIn(strategy, lines)
                self.assertIn(f"{strategy} gemm_product", lines)
            self.assertIn("wall", lines)

    def test_layers_are_passed_to_the_replay(self):
        """--layers REGEX reaches every run: the outputs then hold that layer alone."""
        with tempfile.TemporaryDirectory() as d:
            keep = f'cp "$out/steps.csv" {d}/$(basename "$0").csv'
            a, b = wrapper(d, "a", keep), wrapper(d, "b", keep)
            result = run_tool("--rounds", "1", "--layers", r"layers\.2\..*", f"a={a}", f"b={b}", log_dir=f"{d}/logs")
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            self.assertIn(r"(cpu, layers layers\.2\..*)", result.stdout)
            for name in ("a", "b"):
                rows = pathlib.Path(d, f"{name}.csv").read_text().splitlines()
                header = rows[0].split(",")
                layers = {row.split(",")[header.index("layer")] for row in rows[1:]}
                self.assertEqual(layers, {"layers.2.mlp.down_proj"})
            everything = wrapper(d, "all", keep)
            self.assertEqual(run_tool("--rounds", "1", f"a={everything}", f"b={b}", log_dir=f"{d}/logs2").returncode, 0)
            rows = pathlib.Path(d, "all.csv").read_text().splitlines()
            self.assertGreater(len({row.split(",")[rows[0].split(",").index("layer")] for row in rows[1:]}), 1)

    def test_other_bytes_and_failed_runs_are_reported(self):
        with tempfile.TemporaryDirectory() as d:
            plain = wrapper(d, "plain")
            altered = wrapper(d, "altered", "echo extra >> \"$out/steps.csv\"")
            crash = wrapper(d, "crash", "exit 3")
            result = run_tool("--rounds", "1", f"main={plain}", f"altered={altered}", f"crash={crash}",
                              log_dir=f"{d}/logs")
            self.assertEqual(result.returncode, 1)
            self.assertIn("FAIL altered round 1: steps.csv differs from main round 1", result.stdout)
            self.assertNotIn("accumulation.csv differs", result.stdout)
            self.assertIn("FAIL crash round 1: exit code 3", result.stdout)
            self.assertNotIn("PASS every run", result.stdout)

    def test_another_commit_is_not_another_output(self):
        """Builds of two commits differ in summary.json's provenance.git_hash alone; anything else in
        summary.json that differs is reported."""
        with tempfile.TemporaryDirectory() as d:
            plain = wrapper(d, "plain", f'cp "$out/summary.json" {d}/plain-summary.json')
            other_commit = wrapper(d, "commit", "sed -i 's/\"git_hash\": \"[^\"]*\"/\"git_hash\": \"0123456789ab\"/' "
                                               f'"$out/summary.json"; cp "$out/summary.json" {d}/commit-summary.json')
            other_version = wrapper(d, "version", "sed -i 's/\"version\": \"/\"version\": \"9/' \"$out/summary.json\"")
            result = run_tool("--rounds", "1", f"main={plain}", f"commit={other_commit}", log_dir=f"{d}/logs")
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            changed = pathlib.Path(d, "commit-summary.json").read_text()
            self.assertIn('"git_hash": "0123456789ab"', changed)
            self.assertNotEqual(changed, pathlib.Path(d, "plain-summary.json").read_text())
            result = run_tool("--rounds", "1", f"main={plain}", f"version={other_version}", log_dir=f"{d}/logs2")
            self.assertEqual(result.returncode, 1)
            self.assertIn("FAIL version round 1: summary.json differs from main round 1", result.stdout)

    def test_bad_arguments_exit_2(self):
        with tempfile.TemporaryDirectory() as d:
            plain = wrapper(d, "plain")
            for arguments, message in [([f"a={plain}"], "at least two variants"),
                                       ([f"a={plain}", f"b={d}/none"], "is not an executable file")]:
                result = run_tool(*arguments, log_dir=f"{d}/logs")
                self.assertEqual(result.returncode, 2)
                self.assertIn(message, result.stderr)
            result = subprocess.run([sys.executable, str(TOOL), f"{d}/no-dump", str(ANALYSIS), f"a={plain}", f"b={plain}"],
                                    capture_output=True, text=True)
            self.assertEqual(result.returncode, 2)
            self.assertIn("is not a directory", result.stderr)
            self.assertFalse(os.path.exists(f"{d}/order.txt"))


if __name__ == "__main__":
    unittest.main()
