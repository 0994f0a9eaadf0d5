// Hardware conformance (docs/conformance.md): does a piece of hardware compute what a recipe or an
// accumulation model says it computes, bit for bit?
//
// Two checks:
// - Quantizer conformance. A dump entry that carries hardware-quantized operands ("<t>.codes",
//   "<t>.scales" and their recipe, docs/dump-format.md) also holds the high-precision operand t.
//   The recipe is replayed on t (rotation, then mxscope::quantize) and every scale and element code
//   is compared with the hardware's. Disagreements are classified (a scale exponent off by one, an
//   element off by one code, an input exactly at a midpoint of two codes, saturation, NaN), and a
//   fit searches scale rules x rounding modes for the recipe that explains the hardware exactly.
// - GEMM conformance. A conformance case (format "mxscope-conformance", docs/dump-format.md) holds a
//   hardware GEMM output "out" [M, N] fp32 and its operands a [M, K], b [N, K] (plain values or codes
//   and scales). Every accumulation model runs on the hardware's own operands; the report says how
//   many output bits each model reproduces, and a fit finds the model that reproduces the most.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "mxscope/compare.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/tensor.hpp"

namespace mxscope::conform {

// ------------------------------------------------------------------------------------------------
// Quantizer conformance.

enum class mismatch_kind : std::uint8_t {
  scale_off_by_one,     // block scale exponents differ by exactly one
  scale_other,          // block scale exponents differ by more than one
  scale_nan,            // exactly one of the two scales is the NaN code 0xFF
  element_tie,          // input exactly at the midpoint of two element values: a tie rule differs
  element_saturation,   // the input lies beyond the largest element value (clipping differs)
  element_off_by_one,   // the element values are neighbours (one code apart in magnitude)
  element_nan,          // the input is NaN or infinite
  element_other,        // any other element difference
  element_in_bad_block, // an element of a block whose scale already differs (not classified further)
};
inline constexpr int mismatch_kind_count = 9;
std::string_view mismatch_kind_name(mismatch_kind kind);

struct quantizer_mismatch {
  mismatch_kind kind = mismatch_kind::element_other;
  bool scale = false;        // a block scale (row, col give the block's first element) or an element
  std::int64_t row = 0;      // coordinates in the operand as stored
  std::int64_t col = 0;
  std::uint32_t input_bits = 0;  // the (rotated) fp32 input; for a scale, the block's largest magnitude
  std::uint8_t hardware_code = 0;
  std::uint8_t recomputed_code = 0;
  std::uint8_t hardware_scale = 0;    // e8m0 codes of the element's block
  std::uint8_t recomputed_scale = 0;
};

struct quantizer_check {
  std::string recipe;  // the options that were replayed, in words
  std::int64_t elements = 0;
  std::int64_t blocks = 0;
  std::int64_t matching_elements = 0;
  std::int64_t matching_scales = 0;
  std::array<std::int64_t, mismatch_kind_count> counts{};
  std::vector<quantizer_mismatch> listed;  // the first ones, in (scales first, then row-major) order

  std::int64_t mismatches() const { return (elements - matching_elements) + (blocks - matching_scales); }
  bool exact() const { return mismatches() == 0; }
};

// Compares the hardware's codes and scales (an MX quantized_tensor, as dump_reader reads it) with
// what `options` produces from `rotated_input` (the operand after its rotation). Throws input_error
// when the shapes or the layout disagree.
quantizer_check check_quantizer(const matrix& rotated_input, const quantized_tensor& hardware,
                                const quantize_options& options, std::size_t max_listed = 10);

// A scale rule and a rounding mode (sr uses the recorded stream and sr_bits).
struct quantizer_candidate {
  core::scale_rule rule = core::scale_rule::floor;
  core::rounding_mode rounding = core::rounding_mode::rne;
  std::string name() const;  // "floor/rne"
};

struct quantizer_fit_row {
  quantizer_candidate candidate;
  std::int64_t mismatches = 0;  // over every operand fitted
  std::int64_t compared = 0;    // elements + blocks
};

// Every scale rule x rounding mode, fewest mismatches first (ties in the candidate order: floor,
// ceil, even x rne, rna, rtz, sr).
std::vector<quantizer_candidate> quantizer_candidates();

// One hardware-quantized operand of a dump, ready to check.
struct quantizer_operand {
  std::string label;         // "layer step 3 tensor dy"
  matrix rotated_input;      // the high-precision operand after the recipe's rotation
  quantized_tensor hardware; // codes and scales as stored
  quantize_options recorded; // the recipe
};

// Loads every hardware-quantized operand of a dump directory (format "mxscope-dump").
std::vector<quantizer_operand> load_quantizer_operands(const std::filesystem::path& dump);

// Replays every candidate on every operand; rows sorted by mismatches, then candidate order.
std::vector<quantizer_fit_row> fit_quantizer(const std::vector<quantizer_operand>& operands);

// ------------------------------------------------------------------------------------------------
// GEMM conformance.

inline constexpr const char* conformance_format_name = "mxscope-conformance";
inline constexpr int conformance_format_version = 1;

struct gemm_case {
  std::string name;
  std::string kind;        // "out.kind": fprop, dgrad, wgrad or product
  quantized_tensor a;      // [M, K], blocked along axis 1 (plain values: quant_scheme::none)
  quantized_tensor b;      // [N, K], likewise
  matrix out;              // [M, N] what the hardware produced
  std::map<std::string, std::string> metadata;
};

// A hardware conversion captured element by element ("mxscope.case": "convert"): fp32 inputs and
// the 8-bit codes the hardware wrote for them (an fp8 cast or cvt instruction, no scaling).
struct convert_case {
  std::string name;
  core::element_kind kind = core::element_kind::fp8_e4m3;  // "format": fp8_e4m3 or fp8_e5m2
  std::vector<float> in;
  std::vector<std::uint8_t> out;
  std::map<std::string, std::string> metadata;
};

struct conformance_set {
  std::string source_json = "{}";  // the manifest's "source" object
  std::vector<gemm_case> cases;
  std::vector<convert_case> converts;
};

// How a conversion model treats a finite value whose rounded magnitude exceeds the largest finite
// one (and an infinity): saturate to +-max (mxscope's encoders, PTX cvt ... .satfinite), give NaN
// (torch's float8_e4m3fn cast) or +-infinity (formats that have one: torch's float8_e5m2 cast).
enum class overflow_rule : std::uint8_t { saturate, nan, infinity };

struct convert_model {
  core::rounding_mode rounding = core::rounding_mode::rne;
  overflow_rule overflow = overflow_rule::saturate;
  std::string name() const;  // "rne/saturate", ...
};

// The code of `value` under `model`: core::encode's rounding (mxscope's element encoder) with the
// model's overflow rule; NaN gives the format's NaN code.
std::uint8_t convert_code(core::element_kind kind, float value, const convert_model& model);

struct convert_agreement {
  std::string name;
  std::int64_t compared = 0;
  std::int64_t matches = 0;  // equal codes, or NaN codes on both sides (any sign or payload)
  std::vector<std::int64_t> first_mismatches;  // indices, up to max_listed
  bool exact() const { return compared > 0 && matches == compared; }
};

// Every rne/rtz/rna x overflow rule on one case, in that order.
std::vector<convert_agreement> check_converts(const convert_case& one, std::size_t max_listed = 10);

// The manifest's "format" field ("mxscope-dump", "mxscope-conformance", ...); throws input_error
// when the directory holds no readable manifest.json.
std::string manifest_format(const std::filesystem::path& directory);

// Reads and validates a conformance directory; throws input_error naming the file and the field.
conformance_set read_conformance_set(const std::filesystem::path& directory);

// The cases whose names start with `prefix` (all of them for an empty prefix); throws input_error
// naming `field` when none does.
std::vector<gemm_case> cases_named(const std::vector<gemm_case>& cases, const std::string& prefix,
                                   std::string_view field);

// The hardware path a case was captured on: its "call" metadata (the operation and its input
// dtypes, as the capture wrote it; else the operands' formats) and its output rounding, e.g.
// "torch._scaled_mm(e4m3, e4m3, unit scales, out_dtype=float32), out fp32". Cases of different
// paths accumulate differently and are fitted apart.
std::string hardware_path(const gemm_case& one);

// The cases grouped by hardware_path, the groups in the order of their first case, each group's
// cases in directory order.
std::vector<std::pair<std::string, std::vector<gemm_case>>> cases_by_path(const std::vector<gemm_case>& cases);

// Plain values as an unquantized operand (bf16 / fp16 inputs are exact in fp32).
quantized_tensor plain_operand(const matrix& values);

struct worst_entry {
  std::string case_name;
  std::int64_t row = 0;
  std::int64_t col = 0;
  float hardware = 0.0f;
  float model = 0.0f;
  std::uint64_t ulps = 0;  // UINT64_MAX when exactly one of the two is NaN
};

struct case_agreement {
  std::string case_name;
  std::int64_t compared = 0;
  std::int64_t matches = 0;
};

struct model_agreement {
  accumulation_model model;
  std::string name;
  std::int64_t compared = 0;
  std::int64_t matches = 0;         // identical bits (any NaN matches any NaN)
  std::int64_t nan_mismatches = 0;  // exactly one of the two is NaN
  std::array<std::int64_t, ulp_bucket_count> histogram{};  // ulp distances of the non-NaN pairs
  std::uint64_t max_ulps = 0;
  std::vector<worst_entry> worst;  // largest distances first (ties: case, row, col order)
  std::vector<case_agreement> per_case;  // the same counts case by case, in the cases' order
  double match_rate() const { return compared == 0 ? 1.0 : static_cast<double>(matches) / static_cast<double>(compared); }
  bool exact() const { return matches == compared; }
};

// Runs `model` on every case and compares with the hardware output.
model_agreement check_model(const std::vector<gemm_case>& cases, const accumulation_model& model,
                            std::size_t max_listed = 10, const gemm_options& options = {});

// The models a plain `conform` runs: exact, fp32-block, fp32-group:2, :4, :8, fp32-seq.
std::vector<accumulation_model> standard_models();
// The --fit family: trunc-align:n,G,mode for n in 8..30, G in {1, 2, 4, 8}, mode rtz / rne;
// trunc-promote:n,k,w,c for n in 8..30, k in {8, 16, 32, 64}, w in {12, ..., 16, 24}, c in
// {none, 2k, 4k, 8k}; then fp32-block, fp32-group:2, :4, :8, fp32-seq and exact.
std::vector<accumulation_model> fit_family();

struct gemm_fit {
  std::size_t screened = 0;                // models screened on the sample
  std::int64_t sample_entries = 0;         // entries of the screening sample
  std::vector<model_agreement> finalists;  // full evaluations, most matches first (then family order)
  std::vector<std::string> tied;           // names of the finalists with the most matches
  bool exact() const { return !finalists.empty() && finalists.front().exact(); }
};

// Two stages: every model of `family` runs on a sample of every case (up to `sample_rows` rows of
// a and of b each, spread evenly); the models with the most sample matches, and the next best up to
// `finalists` in all, run on the whole cases. A model that reproduces every output also reproduces
// the sample, so it is never screened out.
gemm_fit fit_gemm(const std::vector<gemm_case>& cases, const std::vector<accumulation_model>& family,
                  std::int64_t sample_rows = 8, std::size_t finalists = 8, std::size_t max_listed = 10,
                  const gemm_options& options = {});

// A held-out check of generality: the cases of one hardware path split in two, the family fitted on
// `fitted` alone and the fitted model asked to predict `held_out` bit for bit.
struct holdout_split {
  std::string rule;  // "by K" or "by operand class"
  std::string fitted_label;
  std::string held_out_label;
  std::vector<gemm_case> fitted;
  std::vector<gemm_case> held_out;
};

// A case's operand class: its name without a trailing "_K<digits>" (fp8_randn_K256 -> fp8_randn).
std::string operand_class(const std::string& case_name);

// The splits of a path's cases: by K (the distinct K values in ascending order, alternately to the
// fitted and the held-out half, so that both halves span short and long K: a fit on short K alone
// cannot see a promotion interval) and by operand class (classes in order of first appearance,
// alternately). A rule with fewer than two distinct values gives no split.
std::vector<holdout_split> holdout_splits(const std::vector<gemm_case>& cases);

// ------------------------------------------------------------------------------------------------
// Self-test: the fast paths against the canonical generic paths on generated inputs.

struct self_test_row {
  std::string kernel;  // "quantize mxfp4 floor/rne axis 1", "gemm fp32-block mxfp4 x mxfp4", ...
  std::int64_t compared = 0;
  std::int64_t differing = 0;
  bool identical() const { return differing == 0; }
};

enum class self_test_device : std::uint8_t { cpu, gpu };

// Whether this build has a GPU backend (include/mxscope/gpu.hpp compiled in) and a usable device.
bool gpu_backend_available();

// cpu: the fast CPU quantizer and GEMM paths against the canonical ones. gpu: the GPU kernels
// against the canonical CPU paths; throws input_error when the build has no GPU backend.
std::vector<self_test_row> self_test(self_test_device device, std::uint64_t seed = 1);

}  // namespace mxscope::conform
