"""Runs a list of quantization jobs through tools/capture/mxfp_torch.py so that
tests/test_capture_python.cpp can compare every bit with the C++ quantizer.

usage: mxfp_bit_identity.py JOBS.json INPUTS.safetensors OUTPUTS.safetensors
Each job names an input tensor and a recipe; the outputs hold, per job i, "i.dequantized" (F32),
"i.codes" (U8), "i.scales" (U8) and, when the job rotates, "i.rotated" (F32, before quantization).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "capture"))

import mxfp_torch  # noqa: E402
import safetensors_lite  # noqa: E402


def main() -> int:
    jobs_path, inputs_path, outputs_path = sys.argv[1:4]
    with open(jobs_path, encoding="utf-8") as handle:
        jobs = json.load(handle)
    inputs, _ = safetensors_lite.load_file(inputs_path)
    outputs = {}
    for index, job in enumerate(jobs):
        values = inputs[job["input"]]
        recipe = mxfp_torch.OperandRecipe(format=job["format"], block=job["block"], scale_rule=job["scale_rule"],
                                          rounding=job["rounding"], sr_bits=job["sr_bits"], seed=job["seed"],
                                          rotation=job["rotation"], signs=job["signs"])
        axis = job["axis"]
        signs = None
        if recipe.rotation:
            length = values.shape[axis]
            signs = mxfp_torch.rotation_signs(length, recipe.seed, job["step"], job["layer"], recipe.signs)
            outputs[f"{index}.rotated"] = mxfp_torch.rotate(values, axis, recipe.rotation, signs)
        quantized = mxfp_torch.quantize_operand(values, axis, recipe, job["layer"], job["step"], job["role"], signs)
        outputs[f"{index}.dequantized"] = quantized.dequantized
        outputs[f"{index}.codes"] = quantized.codes
        outputs[f"{index}.scales"] = quantized.scales
    safetensors_lite.save_file(outputs, outputs_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
