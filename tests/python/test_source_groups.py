"""tools/bench/source-groups on hand-made Nsight Compute source exports: each group's instruction
count, sample share and opcodes against a direct count of the rows written, the order by samples,
and the inputs it must refuse with exit 2."""
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import unittest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench" / "source-groups"
STALLS = ["stall_dispatch", "stall_long_sb", "stall_selected", "stall_wait"]
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed"] + STALLS + [s + " (Not Issued)" for s in STALLS]


def write_export(path, rows):
    """rows: (source, executed, samples, {stall: samples}); ncu's layout: a kernel-name line first,
    every field quoted, counts with thousands separators."""
    lines = ['"Kernel Name","void kernel<1>(float *)",', ",".join(f'"{h}"' for h in HEADER)]
    for i, (source, executed, samples, stalls) in enumerate(rows):
        fields = [f"0x{0x7f00 + 16 * i:x}", source, f"{samples:,}", "0", f"{executed:,}"]
        fields += [f"{stalls.get(s, 0):,}" for s in STALLS] + ["0"] * len(STALLS)
        lines.append(",".join(f'"{f}"' for f in fields))
    path.write_text("\n".join(lines) + "\n")


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)


class SourceGroupsTest(unittest.TestCase):
    def test_groups_against_a_direct_count(self):
        generator = random.Random(7)
        opcodes = ["FFMA", "@!P0  BRA 0x10", "QGMMA.64x64x32.F32.E5M2.E5M2 R24", "LDS.U R2, [R3]", "@P1 UBLKCP"]
        for trial in range(10):
            counts = generator.sample([1792, 14336, 114688, 917504, 229376], 4)
            rows = []
            for _ in range(generator.randint(20, 60)):
                stalls = {s: generator.randint(0, 2000) for s in STALLS}
                rows.append((generator.choice(opcodes), generator.choice(counts), sum(stalls.values()), stalls))
            with tempfile.TemporaryDirectory() as directory:
                path = pathlib.Path(directory) / "kernel.csv"
                write_export(path, rows)
                result = run(path, "--per", 8, "--top", 10)
            self.assertEqual(result.returncode, 0, result.stderr)
            total = sum(r[2] for r in rows)
            self.assertIn(f"{len(rows)} instructions, {total} samples", result.stdout)
            found = re.findall(r"executed (\d+) \(([\d.e+]+) per unit\): (\d+) instructions, ([\d.]+)% of samples\n"
                               r"  ops: (.*)\n", result.stdout)
            expected = {}
            for source, executed, samples, _ in rows:
                group = expected.setdefault(executed, [0, 0, {}])
                group[0] += 1
                group[1] += samples
                words = source.split()
                op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
                group[2][op] = group[2].get(op, 0) + 1
            self.assertEqual(sorted(int(f[0]) for f in found), sorted(expected))
            shares = [float(f[3]) for f in found]
            self.assertEqual(shares, sorted(shares, reverse=True))
            for executed, per, instructions, share, ops in found:
                count, samples, opcodes_seen = expected[int(executed)]
                self.assertAlmostEqual(float(per), int(executed) / 8, delta=int(executed) / 8 * 1e-3)
                self.assertEqual(int(instructions), count)
                self.assertAlmostEqual(float(share), samples / total * 100, delta=0.051)
                listed = dict((op, int(n)) for op, n in (item.rsplit(" ", 1) for item in ops.split(", ")))
                self.assertEqual(listed, opcodes_seen)

    def test_refuses_what_is_not_an_export(self):
        with tempfile.TemporaryDirectory() as directory:
            other = pathlib.Path(directory) / "other.csv"
            other.write_text('"Address","Source"\n"0x10","FFMA R1, R2, R3, R4"\n')
            result = run(other)
            self.assertEqual(result.returncode, 2)
            self.assertIn("other.csv", result.stderr)
            self.assertIn("Instructions Executed", result.stderr)
            empty = pathlib.Path(directory) / "empty.csv"
            write_export(empty, [])
            result = run(empty)
            self.assertEqual(result.returncode, 2)
            self.assertIn("no instruction rows", result.stderr)
            self.assertEqual(run(pathlib.Path(directory) / "missing.csv").returncode, 2)
            good = pathlib.Path(directory) / "good.csv"
            write_export(good, [("FFMA", 4, 3, {"stall_wait": 3})])
            for options in (["--per"], ["--per", "0"], ["--top", "x"], ["--nothing", "1"]):
                result = run(good, *options)
                self.assertEqual(result.returncode, 2, options)
                self.assertEqual(result.stdout, "", options)
            self.assertEqual(run(good).returncode, 0)


if __name__ == "__main__":
    unittest.main()
