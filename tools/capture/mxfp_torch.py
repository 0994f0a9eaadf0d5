"""MX block quantization in PyTorch, bit-identical to mxscope's C++ quantizer.

This is the fake quantizer the tiny-model trainer uses, and the reference a training recipe can be
checked against: for the same fp32 (or bf16 / fp16) input and the same recipe it produces the same
element codes, the same e8m0 scale codes and the same dequantized fp32 bits as
src/quantize.cpp + include/mxscope/core (NUMERICS.md sections 2 to 5).

Supported: MX formats whose elements have no special codes or only a NaN/Inf top code that the MX
block never produces (fp4_e2m1 = "mxfp4", fp6_e2m3, fp6_e3m2, fp8_e4m3, fp8_e5m2), any block size,
either axis (short last block allowed), scale rules floor / ceil / even, rounding rne / rna / rtz /
sr (any sr_bits in 1..32), and block Hadamard rotations with sign policies none / fixed / per-step.

Why the bits agree (the exactness argument, step by step):
* Inputs widen to fp32 exactly (bf16 and fp16 are subsets of fp32).
* amax is a maximum of absolute values: exact whatever the reduction order, so the torch reduction
  and the C++ loop give the same fp32 value.
* floor(log2 amax) comes from the exponent field of amax widened to fp64 (fp32 subnormals are fp64
  normals), exactly as core::floor_log2 reads it from the bits; no libm log2 anywhere.
* v / 2^e is computed as fp64(v) * 2^-e with 2^-e built from its bit pattern. |e| <= 127 and v has
  24 significant bits, so the product is an fp64 normal number and exact: no rounding happens, the
  same as core::quantize_element, which multiplies in a double.
* The element rounding works on fp64 values that are all exact (splitting into integer and fraction,
  scaling by powers of two), then compares; the only "rounding" is the decision, which follows
  core::round_to_integer literally, including floor(F * 2^R) + r >= 2^R for stochastic rounding.
* The dequantized value decode(code) * 2^e is exact in fp64 and is rounded once to fp32 (round to
  nearest even, as the C++ static_cast<float> does).
* Rotations run in fp32 with one IEEE operation per step in the canonical FWHT order; each
  butterfly output is fl32(a + c) or fl32(a - c) of the same a and c as in core::fwht, because the
  vectorized pass at distance h reads only values written by the pass at h / 2. Sign flips and the
  final multiplication by fl32(1/sqrt(b)) are single fp32 multiplications, like the C++ ones.
  PyTorch eager mode launches each of these as its own elementwise kernel: nothing is fused into an
  FMA and nothing is reassociated. (Do not run this file under torch.compile or any fusing JIT.)
* Philox4x32-10 runs in int64 tensors masked to 32 bits. The 32x32 -> 64-bit products are split
  into 16-bit halves so that no intermediate exceeds 2^49: int64 never overflows, on CPU or CUDA.

Works with PyTorch 1.13 (CPU) and 2.x (CUDA): only int32 / int64 / fp32 / fp64 tensors are used for
the bit manipulation; no float8 or float4 dtypes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Dict, Optional

import torch

MASK32 = 0xFFFFFFFF

# Random stream roles (NUMERICS.md section 4).
ROLE_DY = 1
ROLE_X = 2
ROLE_W = 3
ROLE_SIGNS = 7
ROLES = {"dy": ROLE_DY, "x": ROLE_X, "w": ROLE_W, "signs": ROLE_SIGNS}

SCALE_EXPONENT_MIN = -127
SCALE_EXPONENT_MAX = 127
SCALE_NAN_CODE = 0xFF


# ------------------------------------------------------------------------------------------------
# Element formats (the rows of include/mxscope/core/formats.hpp that this module supports).


@dataclass(frozen=True)
class ElementFormat:
    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_finite_magnitude_code: int

    @property
    def min_normal_exponent(self) -> int:
        return 1 - self.bias

    @property
    def subnormal_ulp_exponent(self) -> int:
        return self.min_normal_exponent - self.mantissa_bits

    def decode_magnitude(self, magnitude_code: int) -> float:
        exponent_field = magnitude_code >> self.mantissa_bits
        mantissa = magnitude_code & ((1 << self.mantissa_bits) - 1)
        if exponent_field == 0:
            return math.ldexp(mantissa, self.subnormal_ulp_exponent)
        return math.ldexp((1 << self.mantissa_bits) | mantissa,
                          exponent_field - self.bias - self.mantissa_bits)

    @property
    def max_normal(self) -> float:
        return self.decode_magnitude(self.max_finite_magnitude_code)

    @property
    def emax_elem(self) -> int:
        return math.frexp(self.max_normal)[1] - 1

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)


ELEMENT_FORMATS: Dict[str, ElementFormat] = {
    "fp4_e2m1": ElementFormat("fp4_e2m1", 4, 2, 1, 1, 0x7),
    "fp6_e2m3": ElementFormat("fp6_e2m3", 6, 2, 3, 1, 0x1F),
    "fp6_e3m2": ElementFormat("fp6_e3m2", 6, 3, 2, 3, 0x1F),
    "fp8_e4m3": ElementFormat("fp8_e4m3", 8, 4, 3, 7, 0x7E),
    "fp8_e5m2": ElementFormat("fp8_e5m2", 8, 5, 2, 15, 0x7B),
}
# The CLI names of the MX formats (mxscope quantize --format).
MX_FORMATS: Dict[str, str] = {
    "mxfp4": "fp4_e2m1",
    "mxfp6_e2m3": "fp6_e2m3",
    "mxfp6_e3m2": "fp6_e3m2",
    "mxfp8_e4m3": "fp8_e4m3",
    "mxfp8_e5m2": "fp8_e5m2",
}

# Spec pins (OCP MX v1.0), the same numbers include/mxscope/core/formats.hpp pins.
assert ELEMENT_FORMATS["fp4_e2m1"].max_normal == 6.0 and ELEMENT_FORMATS["fp4_e2m1"].emax_elem == 2
assert ELEMENT_FORMATS["fp6_e2m3"].max_normal == 7.5 and ELEMENT_FORMATS["fp6_e3m2"].max_normal == 28.0
assert ELEMENT_FORMATS["fp8_e4m3"].max_normal == 448.0 and ELEMENT_FORMATS["fp8_e5m2"].max_normal == 57344.0
assert ELEMENT_FORMATS["fp8_e4m3"].emax_elem == 8 and ELEMENT_FORMATS["fp8_e5m2"].emax_elem == 15


def element_format(format_name: str) -> ElementFormat:
    if format_name in MX_FORMATS:
        return ELEMENT_FORMATS[MX_FORMATS[format_name]]
    if format_name in ELEMENT_FORMATS:
        return ELEMENT_FORMATS[format_name]
    raise ValueError(f"unsupported MX format {format_name!r}; supported: {sorted(MX_FORMATS)}")


# ------------------------------------------------------------------------------------------------
# Exact fp64 bit helpers.


def pow2_tensor(exponent: torch.Tensor) -> torch.Tensor:
    """2^e as fp64 from its bit pattern; e is an int64 tensor in [-1022, 1023]."""
    return ((exponent + 1023) << 52).view(torch.float64)


def floor_log2_tensor(positive: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) of positive normal fp64 values (every fp32 value widened is one), from the bits."""
    return (positive.view(torch.int64) >> 52) - 1023


# ------------------------------------------------------------------------------------------------
# Philox4x32-10 and the canonical random stream (include/mxscope/core/philox.hpp).

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85


def fnv1a32(text: str) -> int:
    """FNV-1a 32-bit hash over the UTF-8 bytes of `text` (the layer part of a stream tag)."""
    value = 2166136261
    for byte in text.encode("utf-8"):
        value ^= byte
        value = (value * 16777619) & MASK32
    return value


def stream_tag(layer: str, role: int) -> int:
    return fnv1a32(layer) ^ role


def _multiply_high_low(constant: int, word: torch.Tensor):
    """(hi, lo) 32-bit halves of constant * word, for word in [0, 2^32), without int64 overflow."""
    word_low = word & 0xFFFF
    word_high = word >> 16
    low_product = word_low * constant            # < 2^48
    high_product = word_high * constant          # < 2^48
    middle = low_product + ((high_product & 0xFFFF) << 16)  # < 2^49
    return (high_product >> 16) + (middle >> 32), middle & MASK32


def philox4x32(counter0, counter1, counter2, counter3, key0: int, key1: int, rounds: int = 10):
    """Philox4x32 on int64 tensors holding 32-bit words; returns the four output words."""
    for round_index in range(rounds):
        if round_index > 0:
            key0 = (key0 + PHILOX_W0) & MASK32
            key1 = (key1 + PHILOX_W1) & MASK32
        hi0, lo0 = _multiply_high_low(PHILOX_M0, counter0)
        hi1, lo1 = _multiply_high_low(PHILOX_M1, counter2)
        counter0, counter1, counter2, counter3 = (hi1 ^ counter1 ^ key0, lo1, hi0 ^ counter3 ^ key1, lo0)
    return counter0, counter1, counter2, counter3


def random_words(count: int, seed: int, step: int, tag: int, device=None) -> torch.Tensor:
    """Words 0..count-1 of the stream (seed, step, tag): element n uses word n % 4 of
    philox(counter = (n/4 lo, n/4 hi, step, tag), key = (seed lo, seed hi)). int64 values in [0, 2^32)."""
    blocks = (count + 3) // 4
    block_index = torch.arange(blocks, dtype=torch.int64, device=device)
    counter0 = block_index & MASK32
    counter1 = block_index >> 32
    counter2 = torch.full_like(block_index, step & MASK32)
    counter3 = torch.full_like(block_index, tag & MASK32)
    words = philox4x32(counter0, counter1, counter2, counter3, seed & MASK32, (seed >> 32) & MASK32)
    return torch.stack(words, dim=1).reshape(-1)[:count]


# Random123 known-answer vectors (philox4x32 10 rounds), checked on import.
def _check_philox_known_answers() -> None:
    def one(counter, key):
        words = philox4x32(*(torch.tensor([c], dtype=torch.int64) for c in counter), key[0], key[1])
        return [int(w.item()) for w in words]

    assert one((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert one((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert one((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


_check_philox_known_answers()


# ------------------------------------------------------------------------------------------------
# Rotations (NUMERICS.md section 5).

SIGN_POLICIES = ("none", "fixed", "per-step")


def hadamard_scale(size: int) -> float:
    """fl32(1/sqrt(b)) for b = 2^k (core::hadamard_scale), returned as a Python float that holds the
    fp32 value exactly: 2^-(k/2) for even k, else 2^-((k-1)/2) * fl32(1/sqrt 2) (0x3F3504F3), a power
    of two times an fp32 value. Multiplying an fp32 tensor by it gives fl32(v * scale) whether the
    backend converts the scalar to fp32 first (exact) or multiplies in fp64 and rounds once (the
    fp64 product of two fp32 values is exact)."""
    log2_size = size.bit_length() - 1
    power = 2.0 ** -(log2_size // 2)
    if log2_size % 2 == 0:
        return power
    inverse_sqrt2 = struct.unpack("<f", struct.pack("<I", 0x3F3504F3))[0]
    return power * inverse_sqrt2


def rotation_signs(length: int, seed: int, step: int, layer: str, policy: str, device=None) -> Optional[torch.Tensor]:
    """The +-1 vector for positions 0..length-1 along the rotated axis, or None for policy none.
    The stream's step is 0 for `fixed` and the true step for `per-step`; bit 0 set means -1."""
    if policy == "none":
        return None
    if policy not in SIGN_POLICIES:
        raise ValueError(f"unknown sign policy {policy!r}; expected one of {SIGN_POLICIES}")
    stream_step = 0 if policy == "fixed" else step
    words = random_words(length, seed, stream_step, stream_tag(layer, ROLE_SIGNS), device=device)
    return (1 - 2 * (words & 1)).float()  # bit 0 set -> -1.0, else +1.0


def _fwht_last_dim(values: torch.Tensor) -> torch.Tensor:
    """Unnormalized FWHT of the last dimension (length b), canonical butterfly order."""
    size = values.shape[-1]
    leading = values.shape[:-1]
    half = 1
    while half < size:
        pairs = values.reshape(*leading, size // (2 * half), 2, half)
        first = pairs[..., 0, :]
        second = pairs[..., 1, :]
        values = torch.stack((first + second, first - second), dim=-2).reshape(*leading, size)
        half *= 2
    return values


def rotate(values: torch.Tensor, axis: int, size: int, signs: Optional[torch.Tensor]) -> torch.Tensor:
    """Q = H_b diag(s) / sqrt(b) applied to consecutive segments of `size` elements along `axis` of a
    2-D tensor; returns a new fp32 tensor. `signs` has one entry per position along the axis."""
    if size == 0:
        return values.float()
    if size < 2 or size > 4096 or size & (size - 1):
        raise ValueError(f"rotation size {size} is not a power of two in [2, 4096]")
    if axis not in (0, 1):
        raise ValueError(f"rotation axis must be 0 or 1, got {axis}")
    rotated = values.float()
    if axis == 0:
        rotated = rotated.t()
    lines, length = rotated.shape
    if length % size:
        raise ValueError(f"rotation size {size} does not divide the length {length} of axis {axis}")
    if signs is not None:
        rotated = rotated * signs.to(device=rotated.device, dtype=torch.float32).reshape(1, length)
    segments = rotated.reshape(lines, length // size, size)
    segments = _fwht_last_dim(segments) * hadamard_scale(size)
    rotated = segments.reshape(lines, length)
    if axis == 0:
        rotated = rotated.t()
    return rotated.contiguous()


def parse_rotation(name: str) -> int:
    """"none" -> 0, "hadamard:B" or "hB" -> B."""
    if name in ("none", "", None):
        return 0
    if name.startswith("hadamard:"):
        return int(name.split(":", 1)[1])
    if name.startswith("h") and name[1:].isdigit():
        return int(name[1:])
    raise ValueError(f"unknown rotation {name!r}; expected none, hadamard:B or hB")


# ------------------------------------------------------------------------------------------------
# MX block quantization (NUMERICS.md sections 2 and 3).

ROUNDING_MODES = ("rne", "rna", "rtz", "sr")
SCALE_RULES = ("floor", "ceil", "even")


@dataclass
class MxQuantized:
    dequantized: torch.Tensor  # fp32, the input's shape
    codes: torch.Tensor        # uint8 [rows, ceil(cols/2)] for 4-bit elements (2i in the low nibble), else [rows, cols]
    scales: torch.Tensor       # uint8 e8m0 codes: [rows, ceil(cols/block)] (axis 1) or [ceil(rows/block), cols] (axis 0)

    def nonfinite_blocks(self) -> int:
        """Blocks whose scale is NaN (their input held NaN or Inf); synchronizes a GPU."""
        return int((self.scales == SCALE_NAN_CODE).sum().item())


def _shared_exponent(element: ElementFormat, rule: str, amax: torch.Tensor) -> torch.Tensor:
    """core::shared_exponent on a tensor of block amax values (fp64, exact widenings of fp32)."""
    positive = amax > 0
    safe = torch.where(positive, amax, torch.ones_like(amax))
    leading = floor_log2_tensor(safe)
    exponent = leading - element.emax_elem
    if rule == "ceil":
        exponent = exponent + (safe > element.max_normal * pow2_tensor(exponent)).long()
    elif rule == "even":
        mantissa_bits = element.mantissa_bits
        scaled = safe * pow2_tensor(mantissa_bits - leading)
        rounded = _round_to_integer(scaled, "rne", None, 32)
        leading = leading + (rounded >= float(1 << (mantissa_bits + 1))).long()
        exponent = leading - element.emax_elem
    elif rule != "floor":
        raise ValueError(f"unknown scale rule {rule!r}; expected one of {SCALE_RULES}")
    exponent = torch.where(positive, exponent, torch.full_like(exponent, SCALE_EXPONENT_MIN))
    return exponent.clamp(SCALE_EXPONENT_MIN, SCALE_EXPONENT_MAX)


def _round_to_integer(scaled: torch.Tensor, mode: str, words: Optional[torch.Tensor], sr_bits: int) -> torch.Tensor:
    """core::round_to_integer on non-negative fp64 values: integer part plus the mode's decision
    (returned as fp64 holding an integer)."""
    integer = torch.floor(scaled)
    fraction = scaled - integer  # exact: both are fp64 and integer <= scaled < 2^53
    if mode == "rne":
        odd = torch.remainder(integer, 2.0) == 1.0
        up = (fraction > 0.5) | ((fraction == 0.5) & odd)
    elif mode == "rna":
        up = fraction >= 0.5
    elif mode == "rtz":
        up = torch.zeros_like(fraction, dtype=torch.bool)
    elif mode == "sr":
        # F_R = floor(F * 2^R) (exact: F * 2^R is an fp64 times a power of two, below 2^32);
        # r = the word's top R bits; up iff F_R + r >= 2^R.
        top_fraction = torch.floor(fraction * float(1 << sr_bits)).long()
        draw = words >> (32 - sr_bits)
        up = top_fraction + draw >= (1 << sr_bits)
    else:
        raise ValueError(f"unknown rounding {mode!r}; expected one of {ROUNDING_MODES}")
    return integer + up.double()


def _encode_elements(element: ElementFormat, scaled: torch.Tensor, negative: torch.Tensor, mode: str,
                     words: Optional[torch.Tensor], sr_bits: int) -> torch.Tensor:
    """core::encode for finite fp64 inputs already divided by their block scale; int64 codes."""
    magnitude = scaled.abs()
    maximum = element.max_normal
    # At or beyond twice the maximum every mode gives the maximum code (the C++ skips the arithmetic).
    beyond = magnitude >= 2.0 * maximum
    finite_magnitude = torch.where(beyond, torch.zeros_like(magnitude), magnitude)
    below_normal = finite_magnitude < 2.0 ** element.min_normal_exponent
    normal_input = torch.where(below_normal, torch.ones_like(finite_magnitude), finite_magnitude)
    ulp_exponent = torch.where(below_normal, torch.full_like(normal_input, element.subnormal_ulp_exponent, dtype=torch.int64),
                               floor_log2_tensor(normal_input) - element.mantissa_bits)
    steps = _round_to_integer(finite_magnitude * pow2_tensor(-ulp_exponent), mode, words, sr_bits)
    rounded = steps * pow2_tensor(ulp_exponent)

    overflow = beyond | (rounded > maximum)
    rounded_below_normal = rounded < 2.0 ** element.min_normal_exponent
    subnormal_code = (rounded * 2.0 ** (-element.subnormal_ulp_exponent)).long()
    normal_rounded = torch.where(rounded_below_normal | overflow, torch.ones_like(rounded), rounded)
    exponent = floor_log2_tensor(normal_rounded)
    mantissa = (normal_rounded * pow2_tensor(element.mantissa_bits - exponent)).long() - (1 << element.mantissa_bits)
    normal_code = ((exponent + element.bias) << element.mantissa_bits) | mantissa
    code = torch.where(rounded_below_normal, subnormal_code, normal_code)
    code = torch.where(overflow, torch.full_like(code, element.max_finite_magnitude_code), code)
    return code | (negative.long() * element.sign_bit)


_DECODE_TABLES: Dict[tuple, torch.Tensor] = {}


def _decode_table(element: ElementFormat, device) -> torch.Tensor:
    """fp64 value of every code (sign included): finite codes only ever come out of the encoder.
    Cached per device, so the host-to-device copy (which synchronizes) happens once."""
    key = (element.name, str(device))
    if key not in _DECODE_TABLES:
        magnitudes = [element.decode_magnitude(c) for c in range(element.sign_bit)]
        values = magnitudes + [-m for m in magnitudes]
        _DECODE_TABLES[key] = torch.tensor(values, dtype=torch.float64, device=device)
    return _DECODE_TABLES[key]


def quantize_mx(values: torch.Tensor, axis: int = 1, block: int = 32, format_name: str = "mxfp4",
                rounding: str = "rne", scale_rule: str = "floor", seed: int = 0, step: int = 0,
                layer: str = "", role: int = ROLE_X, sr_bits: int = 32) -> MxQuantized:
    """Quantizes a 2-D tensor in MX blocks along `axis` (mxscope::quantize with quant_scheme::mx).

    For rounding `sr`, element n (flat row-major index of `values` as given) uses word n of the
    stream (seed, step, fnv1a32(layer) ^ role); pass the step after the seed policy (0 for `fixed`)."""
    if values.dim() != 2:
        raise ValueError(f"quantize_mx expects a 2-D tensor, got shape {tuple(values.shape)}")
    if axis not in (0, 1):
        raise ValueError(f"axis must be 0 or 1, got {axis}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {ROUNDING_MODES}")
    if not 1 <= sr_bits <= 32:
        raise ValueError(f"sr_bits must be in 1..32, got {sr_bits}")
    element = element_format(format_name)
    device = values.device
    source = values.detach().float().contiguous()
    rows, cols = source.shape

    words = None
    if rounding == "sr":
        words = random_words(rows * cols, seed, step, stream_tag(layer, role), device=device).reshape(rows, cols)

    # Work on lines along the axis: [lines, length], then pad each line to whole blocks with zeros
    # (zeros never change a block's amax, and padded positions are dropped afterwards).
    lines_view = source if axis == 1 else source.t()
    words_view = None if words is None else (words if axis == 1 else words.t())
    lines, length = lines_view.shape
    blocks_per_line = (length + block - 1) // block
    padded_length = blocks_per_line * block
    padding = padded_length - length

    def pad(tensor, fill):
        if padding == 0:
            return tensor
        extra = torch.full((lines, padding), fill, dtype=tensor.dtype, device=device)
        return torch.cat((tensor, extra), dim=1)

    blocks = pad(lines_view, 0.0).reshape(lines, blocks_per_line, block)
    finite = torch.isfinite(blocks)
    block_nonfinite = ~finite.all(dim=2)
    wide = torch.where(finite, blocks, torch.zeros_like(blocks)).double()
    amax = wide.abs().amax(dim=2)
    exponent = _shared_exponent(element, scale_rule, amax)                      # [lines, blocks]

    negative = pad(lines_view, 0.0).reshape(lines, blocks_per_line, block).view(torch.int32) < 0
    scaled = wide * pow2_tensor(-exponent).unsqueeze(2)                          # exact
    block_words = None
    if words_view is not None:
        block_words = pad(words_view, 0).reshape(lines, blocks_per_line, block)
    codes = _encode_elements(element, scaled, negative, rounding, block_words, sr_bits)
    codes = torch.where(block_nonfinite.unsqueeze(2), torch.zeros_like(codes), codes)

    table = _decode_table(element, device)
    dequantized = (table[codes] * pow2_tensor(exponent).unsqueeze(2)).float()
    dequantized = torch.where(block_nonfinite.unsqueeze(2), torch.full_like(dequantized, float("nan")), dequantized)
    scale_codes = torch.where(block_nonfinite, torch.full_like(exponent, SCALE_NAN_CODE), exponent + 127)

    codes = codes.reshape(lines, padded_length)[:, :length]
    dequantized = dequantized.reshape(lines, padded_length)[:, :length]
    if axis == 0:
        codes = codes.t()
        dequantized = dequantized.t()
        scale_codes = scale_codes.t()
    codes = codes.contiguous()
    if element.bits == 4:
        if cols % 2:
            codes = torch.cat((codes, torch.zeros((rows, 1), dtype=codes.dtype, device=device)), dim=1)
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    # (No .item() anywhere on this path: a GPU training step never waits for the quantizer.)
    return MxQuantized(dequantized=dequantized.contiguous(), codes=codes.to(torch.uint8).contiguous(),
                       scales=scale_codes.to(torch.uint8).contiguous())


# ------------------------------------------------------------------------------------------------
# One GEMM operand: rotate (optional) then quantize, with the recipe recorded.


@dataclass(frozen=True)
class OperandRecipe:
    format: str = "mxfp4"
    block: int = 32
    scale_rule: str = "floor"
    rounding: str = "rne"
    sr_bits: int = 32
    seed: int = 0
    rotation: int = 0        # Hadamard block size, 0 for none
    signs: str = "none"      # none | fixed | per-step (only with a rotation)

    def rotation_name(self) -> str:
        return "none" if self.rotation == 0 else f"hadamard:{self.rotation}"


def quantize_operand(values: torch.Tensor, axis: int, recipe: OperandRecipe, layer: str, step: int, role: int,
                     signs: Optional[torch.Tensor] = None) -> MxQuantized:
    """Rotates `values` along `axis` (with the GEMM's shared `signs`) when the recipe asks for it, then
    quantizes along the same axis. The stochastic-rounding stream uses the true step."""
    rotated = rotate(values, axis, recipe.rotation, signs) if recipe.rotation else values.float()
    return quantize_mx(rotated, axis=axis, block=recipe.block, format_name=recipe.format, rounding=recipe.rounding,
                       scale_rule=recipe.scale_rule, seed=recipe.seed, step=step, layer=layer, role=role,
                       sr_bits=recipe.sr_bits)


def recipe_metadata(prefix: str, recipe: OperandRecipe, axis: int, layer: str, step: int) -> Dict[str, str]:
    """The dump's __metadata__ keys describing a quantized operand (docs/dump-format.md)."""
    fields = {
        "format": recipe.format,
        "block": str(recipe.block),
        "axis": str(axis),
        "scale_rule": recipe.scale_rule,
        "rounding": recipe.rounding,
        "seed": str(recipe.seed),
        "rotation": recipe.rotation_name(),
        "signs": recipe.signs if recipe.rotation else "none",
        "layer": layer,
        "step": str(step),
        "sr_bits": str(recipe.sr_bits),
    }
    return {f"{prefix}.{key}": value for key, value in fields.items()}
