"""tools/check-ptxas on hand-made ptxas -v outputs (the formats nvcc 13's ptxas prints): clean
kernels pass; a spill, a serialized-wgmma note (which names its function at the end of the line)
or no matching kernel fail; bad arguments exit 2. The real compile is the ctest
gpu_wgmma_kernels_ptxas, where nvcc is installed."""
import importlib.machinery
import importlib.util
import pathlib
import subprocess
import sys
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check-ptxas"

SCALED = "_ZN7mxscope3gpu44_GLOBAL__N__1fb535e9_11_products_cu_b60a1b9225tensor_core_scaled_kernelILb1EEEvPKhPf"
WGMMA = "_ZN7mxscope3gpu44_GLOBAL__N__1fb535e9_11_products_cu_b60a1b9224tensor_core_wgmma_kernelEPKaPf"
OTHER = "_ZN7mxscope3gpu44_GLOBAL__N__1fb535e9_11_products_cu_b60a1b9220integer_fixup_kernelIxEEvPKi"


def entry(name, stores=0, loads=0):
    return (f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'\n"
            f"ptxas info    : Function properties for {name}\n"
            f"    0 bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads\n"
            f"ptxas info    : Used 168 registers, used 1 barriers\n")


def run_tool(*arguments):
    return subprocess.run([sys.executable, str(TOOL), *arguments], capture_output=True, text=True)


class CheckPtxasTest(unittest.TestCase):
    def check_log(self, text, *arguments):
        with tempfile.TemporaryDirectory() as d:
            log = pathlib.Path(d, "ptxas.log")
            log.write_text(text)
            return run_tool("--log", str(log), *arguments)

    def test_clean_kernels_pass_and_others_are_not_checked(self):
        result = self.check_log(entry(SCALED) + entry(WGMMA) + entry(OTHER, 172, 36))
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = result.stdout.splitlines()
        self.assertEqual(len(lines), 2)
        self.assertTrue(lines[0].startswith("PASS _ZN7mxscope3gpu4425tensor_core_scaled_kernelILb1E"), lines[0])
        self.assertNotIn("integer_fixup", result.stdout)

    def test_a_spill_fails_with_its_bytes(self):
        result = self.check_log(entry(SCALED, 164, 216) + entry(WGMMA))
        self.assertEqual(result.returncode, 1)
        self.assertIn("FAIL _ZN7mxscope3gpu4425tensor_core_scaled_kernelILb1EEEvPKhPf: 164 bytes spill stores, "
                      "216 bytes spill loads", result.stdout)
        self.assertIn("PASS _ZN7mxscope3gpu4424tensor_core_wgmma_kernel", result.stdout)
        # Loads alone count too.
        self.assertEqual(self.check_log(entry(SCALED, 0, 8)).returncode, 1)

    def test_a_serialized_wgmma_fails_with_its_code(self):
        note = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                f"due to insufficient register resources for the wgmma pipeline in the function '{SCALED}'\n")
        result = self.check_log(entry(SCALED) + note + entry(WGMMA))
        self.assertEqual(result.returncode, 1)
        self.assertRegex(result.stdout, r"FAIL \S*tensor_core_scaled_kernel\S*: \(C7512\) wgmma.mma_async instructions "
                                        r"are serialized due to insufficient register resources")

    def test_no_matching_kernel_fails(self):
        result = self.check_log(entry(OTHER))
        self.assertEqual(result.returncode, 1)
        self.assertIn("FAIL no kernel's name matches", result.stdout)
        result = self.check_log(entry(SCALED), "--kernels", "no_such_kernel")
        self.assertEqual(result.returncode, 1)

    def test_its_flags_are_the_librarys(self):
        # The code-changing flags the tool compiles with are those of mxscope_gpu's CUDA compile
        # options, so that it checks the code the library runs.
        loader = importlib.machinery.SourceFileLoader("check_ptxas", str(TOOL))
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader("check_ptxas", loader))
        loader.exec_module(module)
        cmake = (ROOT / "src" / "gpu" / "CMakeLists.txt").read_text()
        options = next(line for line in cmake.splitlines() if "COMPILE_LANGUAGE:CUDA>:-std=" in line)
        for flag in ("-std=c++20", "--expt-relaxed-constexpr", "--fmad=false"):
            self.assertIn(flag, module.FLAGS)
            self.assertIn(flag, options.split(">:", 1)[1].split())
        self.assertIn("-DMXSCOPE_HAVE_CUDA=1", module.FLAGS)
        self.assertIn("MXSCOPE_HAVE_CUDA=1", cmake)

    def test_bad_arguments_exit_2(self):
        self.assertEqual(self.check_log(entry(SCALED), "--kernels", "(").returncode, 2)
        result = run_tool("--log", "/nonexistent/ptxas.log")
        self.assertEqual(result.returncode, 2)
        self.assertIn("/nonexistent/ptxas.log", result.stderr)
        result = run_tool("--nvcc", "/nonexistent/nvcc")
        self.assertEqual(result.returncode, 2)
        self.assertEqual(run_tool("--nvcc", "/nonexistent/nvcc", "--skip-without-toolchain").returncode, 77)


if __name__ == "__main__":
    unittest.main()
