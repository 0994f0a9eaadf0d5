"""tools/gpu-test without a GPU: --prebuilt against stand-in binaries (shell scripts in place of a
tests/gpu build), so that the verdicts, the exit codes and the usage errors can be checked; and its
nvcc fallback's list of test sources against tests/gpu/CMakeLists.txt's."""
import os
import pathlib
import re
import subprocess
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu-test"


def executable(path, body):
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def prebuilt(directory, test_body, bench_body="echo 'bench: all checks passed'"):
    build = pathlib.Path(directory) / "build"
    build.mkdir()
    (build / "CMakeCache.txt").write_text("CMAKE_CUDA_ARCHITECTURES:STRING=90a\n")
    executable(build / "mxscope_gpu_test", test_body)
    executable(build / "mxscope_gpu_bench", bench_body)
    return build


def run_tool(*arguments, out):
    environment = dict(os.environ, OUT=str(out))
    return subprocess.run([str(TOOL), *arguments], capture_output=True, text=True, env=environment, cwd=ROOT)


class GpuTestScriptTest(unittest.TestCase):
    def test_prebuilt_binaries_pass(self):
        with tempfile.TemporaryDirectory() as d:
            build = prebuilt(d, "echo \"args: $*\"; echo 'PASS one'; echo '3 passed, 0 failed'")
            result = run_tool("--prebuilt", str(build), "--no-sanitizer", "--seed", "7", out=f"{d}/out")
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            log = pathlib.Path(d, "out", "gpu-test.log").read_text()
            self.assertIn("args: --seed 7", log)  # the seed reaches the test binary
            self.assertIn("CMAKE_CUDA_ARCHITECTURES:STRING=90a", log)
            summary = [line for line in log.splitlines() if line.startswith("gpu-test summary:")]
            self.assertEqual(summary, [f"gpu-test summary: build prebuilt ({build}); test PASS (3 passed, 0 failed);"
                                       " memcheck SKIPPED; racecheck SKIPPED; bench PASS"])

    def test_failures_of_the_test_and_the_bench_fail_the_run(self):
        with tempfile.TemporaryDirectory() as d:
            build = prebuilt(d, "echo 'FAIL two'; echo '2 passed, 1 failed'; exit 1")
            result = run_tool("--prebuilt", str(build), "--no-sanitizer", out=f"{d}/out")
            self.assertEqual(result.returncode, 1)
            self.assertIn("test FAIL (exit 1) (2 passed, 1 failed)", result.stdout)
        with tempfile.TemporaryDirectory() as d:
            build = prebuilt(d, "echo '1 passed, 0 failed'", bench_body="echo 'FAIL a check'; exit 3")
            result = run_tool("--prebuilt", str(build), "--no-sanitizer", out=f"{d}/out")
            self.assertEqual(result.returncode, 1)
            self.assertIn("test PASS (1 passed, 0 failed)", result.stdout)
            self.assertIn("bench FAIL (exit 3)", result.stdout)

    def test_a_missing_binary_is_a_usage_error_before_any_output(self):
        with tempfile.TemporaryDirectory() as d:
            build = prebuilt(d, "echo '1 passed, 0 failed'")
            (build / "mxscope_gpu_bench").unlink()
            result = run_tool("--prebuilt", str(build), out=f"{d}/out")
            self.assertEqual(result.returncode, 2)
            self.assertIn("has no executable mxscope_gpu_bench", result.stderr)
            self.assertFalse(pathlib.Path(d, "out").exists())
        result = run_tool("--no-such-option", out="/nonexistent")
        self.assertEqual(result.returncode, 2)
        self.assertIn("usage: tools/gpu-test", result.stderr)

    def test_the_nvcc_fallback_compiles_the_test_sources_cmake_does(self):
        # Where CMake's CUDA support fails, tools/gpu-test compiles the test with plain nvcc
        # commands; a source file missing there fails only at that link, on a GPU machine.
        cmake = (ROOT / "tests" / "gpu" / "CMakeLists.txt").read_text()
        listed = re.search(r"set\(MXSCOPE_GPU_TEST_SOURCES(.*?)\)", cmake, re.S).group(1)
        cmake_sources = sorted(re.findall(r"\$\{CMAKE_CURRENT_SOURCE_DIR\}/(\S+\.cpp)", listed))
        script = TOOL.read_text()
        loop = re.search(r"for source in (tests/gpu/.*?); do", script, re.S).group(1)
        script_sources = sorted(path.removeprefix("tests/gpu/") for path in re.findall(r"tests/gpu/\S+\.cpp", loop))
        self.assertGreater(len(cmake_sources), 5)
        self.assertEqual(script_sources, cmake_sources)


if __name__ == "__main__":
    unittest.main()
