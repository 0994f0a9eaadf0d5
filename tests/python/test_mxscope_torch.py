"""The Python package against independent oracles: the mxscope CLI (quantize, gemm, conform), the
pure-PyTorch quantizer tools/capture/mxfp_torch.py, exact rational arithmetic and plain nn.Linear.

Environment: MXSCOPE_CLI (the CLI binary), MXSCOPE_LIBRARY (libmxscope_c), PYTHONPATH holding
python/ and tools/capture/; MXSCOPE_TEST_DEVICE=cuda also runs every check on the GPU against the
CPU (tools/gpu-python-test does this on a GPU machine).
"""

from __future__ import annotations

import copy
import fractions
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
import warnings

import torch

import mxscope
import mxscope.torch as mt
from mxscope import safetensors_lite
from mxscope.capture import Capture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.environ.get("MXSCOPE_CLI", os.path.join(ROOT, "build", "mxscope"))
DEVICE = os.environ.get("MXSCOPE_TEST_DEVICE", "cpu")
TRAINER = os.path.join(ROOT, "tools", "capture", "train_tiny_llama.py")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (NaN payloads and signed zeros compare exactly)."""
    views = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}
    return t.contiguous().view(views[t.dtype]) if t.dtype in views else t


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True)


def sample(rows: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Values over many binades with exact zeros, ties and outliers (blocks that flush and clip)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 6, (rows, 1), generator=g).float())
    values[torch.rand(rows, cols, generator=g) < 0.05] = 0.0
    values[0, :4] = torch.tensor([0.25, -0.75, 1.25, 5.0])  # fp4 ties at the block's scale
    values[1, 3] = 3.0e4
    return values.to(dtype)


# Every rounding, scale rule and rotation policy, on every format family.
CASES = [
    dict(format="mxfp4"), dict(format="mxfp4", rounding="sr"), dict(format="mxfp4", rounding="rna"),
    dict(format="mxfp4", rounding="rtz", scale_rule="ceil"), dict(format="mxfp4", scale_rule="even"),
    dict(format="mxfp4", rotation=16), dict(format="mxfp4", rotation=16, signs="per-step", rounding="sr"),
    dict(format="mxfp4", rotation=32, signs="fixed"), dict(format="mxfp4", rounding="sr", sr_bits=8),
    dict(format="mxfp4", rounding="sr", seed_policy="fixed"), dict(format="mxfp4", block=16),
    dict(format="mxfp6_e2m3"), dict(format="mxfp6_e3m2", rounding="sr"), dict(format="mxfp8_e4m3"),
    dict(format="mxfp8_e5m2", rotation=16), dict(format="mxint8"), dict(format="nvfp4"),
    dict(format="nvfp4", rounding="sr", rotation=16, signs="fixed"), dict(format="fp8_e4m3"),
    dict(format="fp8_e5m2", rounding="sr"), dict(format="bf16"), dict(format="bf16", rounding="sr"),
]


def cli_flags(case: dict, axis: int, seed: int, step: int, layer: str) -> list:
    flags = ["--format", case["format"], "--axis", str(axis), "--seed", str(seed), "--step", str(step),
             "--layer", layer, "--rounding", case.get("rounding", "rne"),
             "--scale-rule", case.get("scale_rule", "floor"), "--signs", case.get("signs", "none"),
             "--sr-bits", str(case.get("sr_bits", 32)), "--seed-policy", case.get("seed_policy", "per-step")]
    if case.get("rotation"):
        flags += ["--rotation", f"hadamard:{case['rotation']}"]
    if case.get("block"):
        flags += ["--block", str(case["block"])]
    return flags


def api_kwargs(case: dict, seed: int, step: int, layer: str) -> dict:
    return dict(rounding=case.get("rounding", "rne"), scale_rule=case.get("scale_rule", "floor"),
                rotation=case.get("rotation"), signs=case.get("signs", "none"), seed=seed, step=step, layer=layer,
                sr_bits=case.get("sr_bits", 32), seed_policy=case.get("seed_policy", "per-step"),
                block=case.get("block"))


class QuantizeAgainstCli(unittest.TestCase):
    """mxscope.quantize gives the bytes `mxscope quantize` writes for the same flags."""

    def test_every_case_matches_the_cli(self):
        with tempfile.TemporaryDirectory() as work:
            for index, case in enumerate(CASES):
                for axis, dtype in ((1, torch.float32), (0, torch.bfloat16)):
                    with self.subTest(case=case, axis=axis, dtype=dtype):
                        values = sample(64, 96, seed=index, dtype=dtype)
                        source = os.path.join(work, "in.safetensors")
                        safetensors_lite.save_file({"dy": values}, source)
                        target = os.path.join(work, "out.safetensors")
                        done = cli("quantize", "--in", source, "--tensor", "dy", "--out", target,
                                   *cli_flags(case, axis, 7 + index, 11, "layers.3.mlp.up_proj"))
                        self.assertEqual(done.returncode, 0, done.stderr)
                        expected, _ = safetensors_lite.load_file(target)
                        q = mxscope.quantize(values.to(DEVICE), case["format"], axis=axis, role="dy",
                                             **api_kwargs(case, 7 + index, 11, "layers.3.mlp.up_proj"))
                        self.assertTrue(torch.equal(q.codes.cpu(), expected["dy.codes"]))
                        self.assertTrue(torch.equal(bits(q.scales.cpu()), bits(expected["dy.scales"])))
                        self.assertTrue(torch.equal(bits(q.dequantized.cpu()), bits(expected["dy"])))

    def test_counts_match_the_cli_table(self):
        with tempfile.TemporaryDirectory() as work:
            values = sample(32, 64, seed=3)
            source = os.path.join(work, "in.safetensors")
            safetensors_lite.save_file({"t": values}, source)
            done = cli("quantize", "--in", source, "--tensor", "t", "--format", "mxfp4", "--out",
                       os.path.join(work, "o.safetensors"))
            self.assertEqual(done.returncode, 0, done.stderr)
            table = dict(line.split()[:2] for line in done.stdout.splitlines()[2:])
            q = mxscope.quantize(values.to(DEVICE), "mxfp4")
            self.assertEqual((q.nonzero, q.flushed, q.saturated, q.nonfinite),
                             tuple(int(table[k]) for k in ("nonzero", "flushed", "saturated", "nonfinite")))
            self.assertGreater(q.flushed, 0)
            self.assertGreater(q.saturated, 0)


class Operands(unittest.TestCase):
    """The bf16 GEMM operand times the tensor scale is the dequantized tensor."""

    def test_operand_times_scale_is_the_dequantized_value(self):
        for fmt in ("mxfp4", "mxfp6_e2m3", "mxfp8_e4m3", "nvfp4", "fp8_e4m3", "fp8_e5m2", "bf16"):
            for axis in (0, 1):
                with self.subTest(format=fmt, axis=axis):
                    q = mxscope.quantize(sample(48, 64, seed=5).to(DEVICE), fmt, axis=axis, operand=True)
                    scaled = (q.operand.float() * torch.tensor(q.tensor_scale, dtype=torch.float32)).cpu()
                    self.assertTrue(torch.equal(bits(scaled), bits(q.dequantized.cpu())))

    def test_nd_tensors_fold_leading_dimensions(self):
        t = sample(6 * 8, 64, seed=9).reshape(6, 8, 64).to(DEVICE)
        folded = mxscope.quantize(t.reshape(48, 64), "mxfp4")
        whole = mxscope.quantize(t, "mxfp4")
        self.assertEqual(whole.dequantized.shape, t.shape)
        self.assertTrue(torch.equal(whole.codes, folded.codes))
        q = mxscope.quantize(torch.randn(64, 64), "mxfp4")
        self.assertEqual(tuple(q.codes.shape), (64, 32))
        self.assertEqual(tuple(q.scales.shape), (64, 2))


@unittest.skipUnless(DEVICE == "cuda", "MXSCOPE_TEST_DEVICE=cuda compares the GPU with the CPU")
class CudaAgainstCpu(unittest.TestCase):
    def test_every_case_gives_the_cpu_bits(self):
        for index, case in enumerate(CASES):
            # Both layouts and input types; along axis 0 shapes whose last block is short and whose
            # columns do not fill the column kernel's groups of four.
            for axis, dtype, shape in ((1, torch.bfloat16, (256, 512)), (0, torch.float32, (512, 128)),
                                       (1, torch.float32, (33, 96)), (0, torch.bfloat16, (96, 1024)),
                                       (0, torch.bfloat16, (70, 46)), (0, torch.float32, (45, 33))):
                if case.get("rotation") and shape[axis] % case["rotation"] != 0:
                    continue  # a rotation must divide its axis (the ValueError is tested in Errors)
                with self.subTest(case=case, axis=axis, dtype=dtype, shape=shape):
                    values = sample(*shape, seed=100 + index, dtype=dtype)
                    kwargs = api_kwargs(case, 3, 5, "model.layers.0.self_attn.o_proj")
                    cpu = mxscope.quantize(values, case["format"], axis=axis, role="x", operand=True, **kwargs)
                    gpu = mxscope.quantize(values.cuda(), case["format"], axis=axis, role="x", operand=True, **kwargs)
                    for field in ("codes", "scales", "dequantized", "operand"):
                        self.assertTrue(torch.equal(bits(getattr(gpu, field).cpu()), bits(getattr(cpu, field))), field)
                    self.assertEqual((gpu.nonzero, gpu.flushed, gpu.saturated, gpu.nonfinite),
                                     (cpu.nonzero, cpu.flushed, cpu.saturated, cpu.nonfinite))

    def test_side_stream(self):
        values = sample(512, 1024, seed=1, dtype=torch.bfloat16).cuda()
        expected = mxscope.quantize(values, "mxfp4", rounding="sr", rotation=16, signs="per-step", step=4)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = mxscope.quantize(values, "mxfp4", rounding="sr", rotation=16, signs="per-step", step=4)
        torch.cuda.current_stream().wait_stream(stream)
        self.assertTrue(torch.equal(got.codes, expected.codes))
        self.assertTrue(torch.equal(bits(got.dequantized), bits(expected.dequantized)))


class Errors(unittest.TestCase):
    def test_bad_input_raises_the_right_exception(self):
        t = torch.randn(32, 64)
        for call, exception, words in [
            (lambda: mxscope.quantize([1.0], "mxfp4"), TypeError, "torch.Tensor"),
            (lambda: mxscope.quantize(t.double(), "mxfp4"), TypeError, "dtype"),
            (lambda: mxscope.quantize(t.int(), "mxfp4"), TypeError, "dtype"),
            (lambda: mxscope.quantize(t.t(), "mxfp4"), ValueError, "contiguous"),
            (lambda: mxscope.quantize(t, "mxfp3"), ValueError, "format"),
            (lambda: mxscope.quantize(t, "mxfp4", rounding="up"), ValueError, "rounding"),
            (lambda: mxscope.quantize(t, "mxfp4", sr_bits=0), ValueError, "sr_bits"),
            (lambda: mxscope.quantize(t, "mxfp4", rotation=24), ValueError, "rotation"),
            (lambda: mxscope.quantize(t, "mxfp4", rotation=128), ValueError, "does not divide"),
            (lambda: mxscope.quantize(t, "nvfp4", block=32), ValueError, "block"),
            (lambda: mxscope.quantize(t, "mxfp4", signs="fixed"), ValueError, "signs"),
            (lambda: mxscope.quantize(t, "mxfp4", axis=2), ValueError, "axis"),
            (lambda: mxscope.quantize(t, "mxfp4", seed=-1), ValueError, "seed"),
            (lambda: mxscope.quantize(t, "mxfp4", role="q"), ValueError, "role"),
            (lambda: mxscope.quantize(torch.tensor(1.0), "mxfp4"), ValueError, "scalar"),
            (lambda: mxscope.gemm(t, t, kind="xgrad"), ValueError, "kind"),
            (lambda: mxscope.gemm(t, torch.randn(16, 32), kind="fprop"), ValueError, ""),
            (lambda: mxscope.gemm(t, t, kind="fprop", accumulation="fp33"), ValueError, "accum"),
            (lambda: mt.convert(torch.nn.Linear(4, 4), mt.LADDER["mxfp4-fdw"], include="nothing"), ValueError,
             "include"),
            (lambda: mt.set_step(torch.nn.Linear(4, 4), -1), ValueError, "step"),
        ]:
            with self.subTest(words=words):
                with self.assertRaises(exception) as caught:
                    call()
                self.assertIn(words, str(caught.exception))


class GemmAndReference(unittest.TestCase):
    def test_gemm_matches_the_cli_json(self):
        g = torch.Generator().manual_seed(2)
        x, dy, w = (torch.randn(64, 96, generator=g), torch.randn(64, 32, generator=g),
                    torch.randn(32, 96, generator=g))
        with tempfile.TemporaryDirectory() as work:
            source = os.path.join(work, "in.safetensors")
            safetensors_lite.save_file({"x": x, "dy": dy, "w": w}, source)
            for kind, a, b in (("fprop", x, w), ("dgrad", dy, w), ("wgrad", dy, x)):
                for accumulation in ("fp32-block", "exact", "fp32-seq"):
                    with self.subTest(kind=kind, accumulation=accumulation):
                        target = os.path.join(work, "out.safetensors")
                        done = cli("gemm", "--gemm", kind, "--in", source, "--format", "mxfp4", "--rounding", "sr",
                                   "--rotation", "hadamard:16", "--seed", "5", "--step", "2", "--layer", "l",
                                   "--accum", accumulation, "--out", target, "--json")
                        self.assertEqual(done.returncode, 0, done.stderr)
                        report = json.loads(done.stdout)
                        expected, _ = safetensors_lite.load_file(target)
                        got = mxscope.gemm(a.to(DEVICE), b.to(DEVICE), kind=kind, accumulation=accumulation,
                                           strategy={"format": "mxfp4", "rounding": "sr", "rotation": 16, "seed": 5,
                                                     "step": 2, "layer": "l"})
                        self.assertTrue(torch.equal(bits(got.out), bits(expected["out"])))
                        self.assertTrue(torch.equal(bits(got.reference), bits(expected["ref"])))
                        self.assertEqual(got.metrics["rel_err"], report["metrics"]["rel_err"])
                        self.assertEqual(got.metrics["bias"], report["metrics"]["bias"])

    def test_reference_is_the_rounded_exact_sum(self):
        g = torch.Generator().manual_seed(4)
        a = torch.randn(6, 40, generator=g) * torch.exp2(torch.randint(-30, 30, (6, 40), generator=g).float())
        b = torch.randn(40, 5, generator=g)
        got = mxscope.reference(a.to(DEVICE), b.to(DEVICE))
        for i in range(6):
            for j in range(5):
                exact = sum(fractions.Fraction(float(a[i, k])) * fractions.Fraction(float(b[k, j])) for k in range(40))
                self.assertEqual(got[i, j].item(), float(exact))  # float(Fraction) rounds to nearest even


def linear_model(recipe: mt.Recipe, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32, bias=False))
    return mt.convert(model, recipe) if recipe.quantized else model


class MXLinearSemantics(unittest.TestCase):
    def test_bf16_recipe_is_nn_linear(self):
        reference, converted = linear_model(mt.Recipe()), linear_model(mt.Recipe())
        mt.convert(converted, mt.LADDER["bf16"])
        x = torch.randn(16, 64)
        self.assertTrue(torch.equal(reference(x), converted(x)))

    def test_gemms_multiply_the_library_operands(self):
        """y, dx and dw against products of mxscope.quantize operands along each reduction axis."""
        recipe = mt.LADDER["mxfp4-fdw-sr-rht"].with_seed(9)
        layer = mt.MXLinear(64, 32, bias=False, recipe=recipe, layer_name="blk.0.up")
        layer.step = 6
        x = sample(128, 64, seed=1).to(DEVICE).requires_grad_(True)
        layer = layer.to(DEVICE)
        y = layer(x)
        dy = sample(128, 32, seed=2).to(DEVICE)
        y.backward(dy)

        def q(t, gemm, role, axis):
            g = recipe.gemm(gemm)
            gradient = role == "dy" and gemm != "fprop"
            out = mxscope.quantize(t.detach().contiguous(), g.operand_format(gradient), axis=axis, role=role,
                                   layer="blk.0.up", step=6, seed=9, rounding=g.operand_rounding(gradient),
                                   rotation=g.rotation or None, signs=g.signs, operand=True)
            return out.operand.float() if t.is_cuda else out.dequantized

        w = layer.weight
        tolerance = dict(rtol=1e-5, atol=1e-5) if DEVICE == "cuda" else dict(rtol=0, atol=0)
        torch.testing.assert_close(y.detach(), q(x, "fprop", "x", 1) @ q(w, "fprop", "w", 1).t(), **tolerance)
        torch.testing.assert_close(x.grad, q(dy, "dgrad", "dy", 1) @ q(w, "dgrad", "w", 0), **tolerance)
        torch.testing.assert_close(w.grad, q(dy, "wgrad", "dy", 0).t() @ q(x, "wgrad", "x", 0), **tolerance)

    def test_layer_operands_are_the_quantize_bits(self):
        """Every operand MXLinear multiplies (the bf16 operand on CUDA, the fp32 values on the CPU)
        equals mxscope.quantize's for the same recipe, layer and step, bit for bit, over steps that
        reuse the layer's buffers."""
        sr_h16 = mt.GemmRecipe(rounding="sr", rotation=16)
        cases = [(mt.LADDER["mxfp4-fdw-sr-rht"], torch.float32), (mt.LADDER["mxfp4-fdw-h16"], torch.bfloat16),
                 (mt.LADDER["nvfp4-te"], torch.float32), (mt.Recipe("sr-h16", sr_h16, sr_h16, sr_h16), torch.bfloat16)]
        for recipe, dtype in cases:
            name = recipe.name
            recipe = recipe.with_seed(4)
            layer = mt.MXLinear(64, 96, bias=False, recipe=recipe, layer_name="blk.1.down").to(DEVICE)
            multiplied = []
            original = mt._product

            def recording(a, b, *rest):
                multiplied.append((a, b))
                return original(a, b, *rest)

            mt._product = recording
            try:
                for step in (3, 4):
                    layer.step = step
                    multiplied.clear()
                    x = sample(128, 64, seed=step).to(DEVICE, dtype).requires_grad_(True)
                    dy = sample(128, 96, seed=10 + step).to(DEVICE, dtype)
                    layer(x).backward(dy)
                    expected = {"fprop": ((x, "x", 1), (layer.weight, "w", 1)),
                                "dgrad": ((dy, "dy", 1), (layer.weight, "w", 0)),
                                "wgrad": ((dy, "dy", 0), (x, "x", 0))}
                    self.assertEqual(len(multiplied), 3)
                    for gemm, pair in zip(("fprop", "dgrad", "wgrad"), multiplied):
                        g = recipe.gemm(gemm)
                        for got, (t, role, axis) in zip(pair, expected[gemm]):
                            gradient = role == "dy"
                            want = mxscope.quantize(t.detach().contiguous(), g.operand_format(gradient), axis=axis,
                                                    role=role, layer="blk.1.down", step=step, seed=4,
                                                    rounding=g.operand_rounding(gradient), rotation=g.rotation or None,
                                                    signs=g.signs, operand=True)
                            with self.subTest(recipe=name, step=step, gemm=gemm, role=role):
                                if DEVICE == "cuda":
                                    self.assertTrue(torch.equal(got.operand.view(torch.int16),
                                                                want.operand.view(torch.int16)))
                                    self.assertEqual(got.tensor_scale, want.tensor_scale)
                                else:
                                    self.assertTrue(torch.equal(got.dequantized.view(torch.int32),
                                                                want.dequantized.view(torch.int32)))
            finally:
                mt._product = original

    def test_layers_sharing_an_input_share_its_operand_only_where_the_bits_agree(self):
        """Three projections of one input (q, k, v): under a recipe whose x operand depends on neither
        layer nor step, the input is quantized once per GEMM and outputs and gradients are those of
        quantizing it in every layer; stochastic rounding or random signs quantize it per layer; an
        in-place write to the input between two layers makes the second quantize it again."""

        class Projections(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.q, self.k, self.v = (torch.nn.Linear(64, 32, bias=False) for _ in range(3))

            def forward(self, x):
                return self.q(x) * self.k(x) + self.v(x)

        original_new, original_size = mt._quantize_new, mt._SharedInputs.default_size
        calls = []

        def counting(module, t, gemm, index, recipe):
            calls.append((module.layer_name, gemm, index))
            return original_new(module, t, gemm, index, recipe)

        def run(recipe, share, autocast):
            torch.manual_seed(5)
            mt._SharedInputs.default_size = original_size if share else 0
            model = mt.convert(Projections(), recipe.with_seed(2)).to(DEVICE)
            mt.set_step(model, 7)
            x = sample(96, 64, seed=8).to(DEVICE).requires_grad_(True)
            calls.clear()
            # Under autocast each layer casts x to bf16 itself (a new tensor per layer).
            with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16, enabled=autocast):
                y = model(x)
            y.float().backward(sample(96, 32, seed=9).to(DEVICE))
            grads = [x.grad] + [getattr(model, n).weight.grad for n in "qkv"]
            return len(calls), grads

        mt._quantize_new = counting
        try:
            for name, recipe, shared_calls in (("mxfp4-fdw-h16", mt.LADDER["mxfp4-fdw-h16"], 14),
                                               ("nvfp4-fdw", mt.LADDER["nvfp4-fdw"], 14),
                                               ("mxfp4-fdw-sr", mt.LADDER["mxfp4-fdw-sr"], 16),
                                               ("mxfp4-fdw-rht", mt.LADDER["mxfp4-fdw-rht"], 16),
                                               ("sr-everywhere", mt.Recipe("sr", *(mt.GemmRecipe(rounding="sr"),) * 3),
                                                18)):
                for autocast in (False, True):
                    with self.subTest(recipe=name, autocast=autocast):
                        count, grads = run(recipe, True, autocast)
                        alone_count, alone = run(recipe, False, autocast)
                        self.assertEqual((count, alone_count), (shared_calls, 18))
                        for got, want in zip(grads, alone):
                            self.assertTrue(torch.equal(bits(got), bits(want)))
            # A model copied or saved between a backward and the next set_step (an EMA copy, a
            # checkpoint) copies no cached activation, and its layers still share one cache.
            mt._SharedInputs.default_size = original_size
            model = mt.convert(Projections(), mt.LADDER["mxfp4-fdw"]).to(DEVICE)
            x = sample(96, 64, seed=8).to(DEVICE).requires_grad_(True)
            model(x).sum().backward()
            self.assertTrue(model.q._mxs_shared.entries)
            copied = copy.deepcopy(model)
            self.assertEqual(copied.q._mxs_shared.entries, [])
            self.assertIs(copied.q._mxs_shared, copied.k._mxs_shared)
            torch.save(model.q, io.BytesIO())  # (Projections is local to this test: not picklable)
            with torch.no_grad():
                self.assertTrue(torch.equal(bits(copied(x)), bits(model(x))))
            # An in-place write between two layers: the second quantizes the new values.
            mt._SharedInputs.default_size = original_size
            model = mt.convert(Projections(), mt.LADDER["mxfp4-f"]).to(DEVICE)
            x = sample(96, 64, seed=8).to(DEVICE)
            with torch.no_grad():
                model.q(x)
                x.mul_(3.0)
                calls.clear()
                k_out = model.k(x)
            self.assertEqual(len(calls), 2)
            fresh = mt.MXLinear(64, 32, bias=False, recipe=mt.LADDER["mxfp4-f"]).to(DEVICE)
            fresh.weight = model.k.weight
            with torch.no_grad():
                self.assertTrue(torch.equal(bits(k_out), bits(fresh(x))))
        finally:
            mt._quantize_new, mt._SharedInputs.default_size = original_new, original_size

    def test_the_step_changes_stochastic_rounding(self):
        layer = mt.MXLinear(64, 32, bias=False, recipe=mt.LADDER["mxfp4-fdw-sr"], layer_name="l").to(DEVICE)
        x = sample(64, 64, seed=3).to(DEVICE)
        grads = []
        for step in (1, 1, 2):
            layer.step = step
            layer.weight.grad = None
            layer(x).sum().backward()
            grads.append(layer.weight.grad.clone())
        self.assertTrue(torch.equal(grads[0], grads[1]))
        self.assertFalse(torch.equal(grads[0], grads[2]))

    def test_autocast_and_gradient_accumulation(self):
        model = linear_model(mt.LADDER["mxfp4-fdw-h16"]).to(DEVICE)
        x = torch.randn(2, 16, 64, device=DEVICE)
        with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
            y = model(x)
        self.assertEqual(y.dtype, torch.bfloat16)
        y.float().sum().backward()
        once = model[0].weight.grad.clone()
        model.zero_grad()
        for half in (x[:1], x[1:]):
            with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
                model(half).float().sum().backward()
        self.assertEqual(model[0].weight.grad.dtype, torch.float32)
        self.assertGreater(float(model[0].weight.grad.abs().sum()), 0.0)
        self.assertEqual(once.shape, model[0].weight.grad.shape)


class TrainerAndCapture(unittest.TestCase):
    """A dump captured from MXLinear training holds the operands conform reproduces; on the CPU the
    library and the pure-PyTorch quantizer give byte-identical dumps."""

    def train(self, out: str, *extra: str) -> None:
        done = subprocess.run([sys.executable, TRAINER, "--tiny", "--steps", "3", "--capture-steps", "2,3",
                               "--out", out, "--device", DEVICE, *extra], capture_output=True, text=True)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def test_conform_reproduces_every_operand(self):
        for recipe in (["--recipe", "mxfp4", "--rounding", "sr", "--wgrad-rotation", "h16-random-per-step"],
                       ["--ladder", "mxfp4-fdw-h16"]):
            with self.subTest(recipe=recipe), tempfile.TemporaryDirectory() as work:
                self.train(os.path.join(work, "dump"), *recipe)
                done = cli("conform", os.path.join(work, "dump"))
                self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                self.assertIn("summary: 8 of 8 operands reproduce exactly", done.stdout)

    @unittest.skipUnless(DEVICE == "cpu", "both quantizers multiply in fp32 on the CPU only")
    def test_library_and_pure_torch_paths_give_the_same_dump(self):
        with tempfile.TemporaryDirectory() as work:
            flags = ["--recipe", "mxfp4", "--rounding", "sr", "--wgrad-rotation", "h16"]
            self.train(os.path.join(work, "a"), *flags)
            self.train(os.path.join(work, "b"), *flags, "--quantizer", "torch")
            with open(os.path.join(work, "a", "manifest.json")) as manifest:
                entries = json.load(manifest)["entries"]
            self.assertEqual(len(entries), 4)
            for entry in entries:
                with open(os.path.join(work, "a", entry["file"]), "rb") as a, \
                        open(os.path.join(work, "b", entry["file"]), "rb") as b:
                    self.assertEqual(a.read(), b.read(), entry["file"])

    def test_functional_module_is_left_out_and_silent_one_loses_nothing(self):
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.attention = torch.nn.MultiheadAttention(32, 2, batch_first=True)
                self.used = torch.nn.Linear(32, 32)
                self.unused = torch.nn.Linear(32, 32)

            def forward(self, x):
                return self.used(self.attention(x, x, x)[0])

        model = Model()
        with tempfile.TemporaryDirectory() as work:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                capture = Capture(model, os.path.join(work, "dump"), layers=r".*", steps=[1])
            self.assertTrue(any("attention.out_proj" in str(w.message) for w in caught))
            capture.begin_step(1)
            model(torch.randn(2, 4, 32)).sum().backward()
            with self.assertRaises(RuntimeError) as failure:
                capture.after_backward(1)
            self.assertIn("unused", str(failure.exception))
            capture.close()
            with open(os.path.join(work, "dump", "manifest.json")) as manifest:
                layers = [e["layer"] for e in json.load(manifest)["entries"]]
            self.assertEqual(layers, ["used"])


if __name__ == "__main__":
    unittest.main()
