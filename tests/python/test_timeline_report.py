"""tools/bench/timeline-report on hand-made run directories: its totals and idle gaps against a
brute-force count of covered milliseconds, and the disagreements between kernel_times.csv and
run.json it must catch (exit 1) or the missing files it must name (exit 2)."""
import json
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import unittest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench" / "timeline-report"


def write_run(directory, rows, timeline=None):
    """rows: (stream, label, name, start_ms, stop_ms) with integer times. The run.json totals are
    counted cell by cell unless `timeline` is given."""
    lines = ["index,stream,label,name,bytes,start_ms,stop_ms"]
    for i, (stream, label, name, start, stop) in enumerate(rows):
        lines.append(f'{i},{stream},{label},"{name}",0,{start:.3f},{stop:.3f}')
    (directory / "kernel_times.csv").write_text("\n".join(lines) + "\n")
    if timeline is None:
        cells = {t for _, _, _, a, b in rows for t in range(a, b)}
        span = (max(r[4] for r in rows) - min(r[3] for r in rows)) / 1e3
        timeline = {"operations": len(rows), "span_seconds": span, "busy_seconds": len(cells) / 1e3,
                    "idle_seconds": span - len(cells) / 1e3,
                    "operation_seconds": sum(b - a for *_, a, b in rows) / 1e3, "labels": [], "names": []}
    (directory / "run.json").write_text(json.dumps({"device_timeline": timeline}))
    return timeline


def run(directory):
    return subprocess.run([sys.executable, str(TOOL), str(directory)], capture_output=True, text=True)


class TimelineReportTest(unittest.TestCase):
    def test_consistent_runs_pass_and_gaps_add_up_to_the_idle_time(self):
        generator = random.Random(3)
        for trial in range(20):
            rows = []
            for _ in range(generator.randint(1, 40)):
                start = generator.randint(0, 300)
                rows.append((generator.randint(0, 1), f"label {generator.randint(0, 2)}", "kernel<1, 2>", start,
                             start + generator.randint(0, 25)))
            with tempfile.TemporaryDirectory() as d:
                timeline = write_run(pathlib.Path(d), rows)
                result = run(d)
                self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
                gaps = re.search(r"of (\d+) gaps totalling ([0-9.]+) ms", result.stdout)
                self.assertIsNotNone(gaps, result.stdout)
                self.assertAlmostEqual(float(gaps.group(2)) / 1e3, timeline["idle_seconds"], places=9)

    def test_disagreements_are_failures(self):
        rows = [(0, "reference", "a", 0, 10), (0, "bf16: gemm", "b", 12, 20), (1, "upload beside", "copy", 5, 15)]
        with tempfile.TemporaryDirectory() as d:
            good = write_run(pathlib.Path(d), rows)
            for field, value in (("operations", 4), ("busy_seconds", good["busy_seconds"] + 0.001),
                                 ("span_seconds", good["span_seconds"] - 0.002),
                                 ("operation_seconds", good["operation_seconds"] * 2)):
                write_run(pathlib.Path(d), rows, dict(good, **{field: value}))
                result = run(d)
                self.assertEqual(result.returncode, 1, field)
                self.assertIn("FAIL", result.stdout)
            write_run(pathlib.Path(d), [(0, "x", "k", 5, 4)], dict(good, operations=1))
            self.assertEqual(run(d).returncode, 1)  # stop before start

    def test_missing_files_and_bad_headers(self):
        with tempfile.TemporaryDirectory() as d:
            result = run(d)
            self.assertEqual(result.returncode, 2)
            self.assertIn("kernel_times.csv", result.stderr)
            (pathlib.Path(d) / "kernel_times.csv").write_text("a,b\n")
            (pathlib.Path(d) / "run.json").write_text("{}")
            self.assertEqual(run(d).returncode, 2)


if __name__ == "__main__":
    unittest.main()
