#include <fmt/format.h>

#include <charconv>

#include "commands.hpp"
#include "validators.hpp"
#include "mxscope/core/hadamard.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/version.hpp"

namespace mxscope::cli {

namespace {

// The formats of the CLI contract (parse_format also knows fp32, which is no quantization).
constexpr std::string_view contract_formats[] = {"mxfp4",    "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2",
                                                 "mxint8",   "nvfp4",      "fp8_e4m3",   "fp8_e5m2",   "bf16"};
constexpr int max_block = 1 << 20;

std::string format_list() {
  std::string list;
  for (const auto name : contract_formats) {
    if (!list.empty()) list += ' ';
    list += name;
  }
  return list;
}

}  // namespace

std::string version_text() { return fmt::format("{} (git {})", version_string, git_hash); }

void add_strategy_flags(CLI::App& command, strategy_flags& flags, bool format_required) {
  auto* format = command.add_option("--format", flags.format, "Element format: " + format_list());
  if (format_required) format->required();
  flags.block_option =
      command.add_option("--block", flags.block, "Block size along the axis (default: 32 for MX, 16 for nvfp4)")
          ->check(digits_only());
  command.add_option("--rounding", flags.rounding, "Element rounding: rne rna rtz sr")->capture_default_str();
  command.add_option("--scale-rule", flags.scale_rule, "MX shared-exponent rule: floor ceil even")->capture_default_str();
  command.add_option("--rotation", flags.rotation, "none or hadamard:B (B a power of two, 2..4096)")->capture_default_str();
  command.add_option("--signs", flags.signs, "Random signs of the rotation: none fixed per-step")->capture_default_str();
  command.add_option("--seed", flags.seed, "Philox seed (64-bit)")->check(digits_only())->capture_default_str();
  command.add_option("--step", flags.step, "Training step (enters the random streams)")
      ->check(digits_only())
      ->capture_default_str();
  command.add_option("--sr-bits", flags.sr_bits, "Random bits of stochastic rounding, 1..32")
      ->check(digits_only())
      ->capture_default_str();
  command.add_option("--layer", flags.layer, "Layer name (its FNV-1a hash tags the random streams)");
  command.add_option("--seed-policy", flags.seed_policy, "Stochastic rounding stream: per-step fixed")
      ->capture_default_str();
}

strategy resolve_strategy(const strategy_flags& flags) {
  strategy chosen;
  bool known = false;
  for (const auto name : contract_formats) known = known || name == flags.format;
  const auto format = known ? parse_format(flags.format) : std::nullopt;
  if (!format) {
    throw input_error(fmt::format("--format: unknown format '{}' (expected one of: {})", flags.format, format_list()));
  }
  chosen.quantize.format = *format;

  const bool block_given = flags.block_given || (flags.block_option != nullptr && flags.block_option->count() > 0);
  if (block_given) {
    if (flags.block < 1 || flags.block > max_block) {
      throw input_error(fmt::format("--block: must be in 1..{}, got {}", max_block, flags.block));
    }
    if (format->scheme == quant_scheme::nvfp4 && flags.block != 16) {
      throw input_error(fmt::format("--block: nvfp4 uses blocks of 16, got {}", flags.block));
    }
    // Per-tensor fp8 and bf16 have no blocks; the flag is accepted so that one flag set can
    // sweep every format, and ignored.
    if (format->scheme == quant_scheme::mx || format->scheme == quant_scheme::nvfp4) chosen.quantize.block = flags.block;
  }

  const auto rounding = parse_rounding(flags.rounding);
  if (!rounding) throw input_error(fmt::format("--rounding: unknown rounding '{}' (expected rne, rna, rtz or sr)", flags.rounding));
  chosen.quantize.rounding = *rounding;

  const auto rule = parse_scale_rule(flags.scale_rule);
  if (!rule) {
    throw input_error(fmt::format("--scale-rule: unknown scale rule '{}' (expected floor, ceil or even)", flags.scale_rule));
  }
  chosen.quantize.rule = *rule;

  if (flags.sr_bits < 1 || flags.sr_bits > 32) {
    throw input_error(fmt::format("--sr-bits: must be in 1..32, got {}", flags.sr_bits));
  }
  chosen.quantize.sr_bits = flags.sr_bits;

  if (flags.seed_policy == "per-step") {
    chosen.seed_policy = core::seed_policy::per_step;
  } else if (flags.seed_policy == "fixed") {
    chosen.seed_policy = core::seed_policy::fixed;
  } else {
    throw input_error(fmt::format("--seed-policy: unknown policy '{}' (expected per-step or fixed)", flags.seed_policy));
  }

  const auto signs = parse_sign_policy(flags.signs);
  if (!signs) throw input_error(fmt::format("--signs: unknown sign policy '{}' (expected none, fixed or per-step)", flags.signs));

  chosen.rotation_text = flags.rotation;
  if (flags.rotation == "none") {
    if (*signs != sign_policy::none) {
      throw input_error(fmt::format("--signs: '{}' needs a rotation (--rotation hadamard:B)", flags.signs));
    }
  } else {
    constexpr std::string_view prefix = "hadamard:";
    const std::string_view text = flags.rotation;
    if (text.substr(0, prefix.size()) != prefix) {
      throw input_error(fmt::format("--rotation: unknown rotation '{}' (expected none or hadamard:B)", flags.rotation));
    }
    const std::string_view digits = text.substr(prefix.size());
    long long size = 0;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), size);
    if (digits.empty() || error != std::errc() || end != digits.data() + digits.size()) {
      throw input_error(fmt::format("--rotation: '{}': the size after 'hadamard:' must be an integer", flags.rotation));
    }
    if (!core::is_valid_rotation_size(size)) {
      throw input_error(fmt::format("--rotation: '{}': size {} is not a power of two in [{}, {}]", flags.rotation, size,
                                    core::rotation_size_min, core::rotation_size_max));
    }
    chosen.rotation.size = static_cast<int>(size);
  }
  chosen.rotation.signs = *signs;
  chosen.rotation.seed = flags.seed;
  chosen.rotation.step = flags.step;
  chosen.rotation.layer_hash = core::fnv1a32(flags.layer.data(), flags.layer.size());
  chosen.layer = flags.layer;
  chosen.quantize.stream.seed = flags.seed;
  chosen.quantize.stream.step = core::policy_step(chosen.seed_policy, flags.step);
  return chosen;
}

namespace {

// The formats a GEMM operand accepts: the quantization formats of the CLI contract plus fp32
// (the operand as captured, no quantization).
bool known_gemm_format(std::string_view name) { return name == "fp32" || parse_format(name).has_value(); }

// Resolves the shared strategy flags for one operand whose format is `format` (named by `flag`).
strategy resolve_operand(const strategy_flags& flags, const std::string& format, std::string_view flag) {
  if (!known_gemm_format(format)) {
    throw input_error(fmt::format(
        "{}: unknown format '{}' (expected one of: mxfp4 mxfp6_e2m3 mxfp6_e3m2 mxfp8_e4m3 mxfp8_e5m2 mxint8 nvfp4 "
        "fp8_e4m3 fp8_e5m2 bf16 fp32)",
        flag, format));
  }
  strategy_flags operand_flags = flags;
  // fp32 is no quantization: the remaining flags are checked as for bf16 (which ignores --block).
  operand_flags.format = format == "fp32" ? "bf16" : format;
  strategy resolved = resolve_strategy(operand_flags);
  if (format == "fp32") resolved.quantize.format = *parse_format("fp32");
  return resolved;
}

}  // namespace

mxscope::strategy resolve_gemm_strategy(const strategy_flags& flags, const std::string& format_a,
                                        const std::string& format_b, const accumulation_model& model,
                                        output_rounding output, std::string_view flag_a, std::string_view flag_b) {
  const strategy resolved_a = resolve_operand(flags, format_a, flag_a);
  const strategy resolved_b = resolve_operand(flags, format_b, flag_b);
  mxscope::strategy chosen;
  chosen.name = "cli";
  chosen.a.quantize = resolved_a.quantize;
  chosen.a.seeds = resolved_a.seed_policy;
  chosen.b.quantize = resolved_b.quantize;
  chosen.b.seeds = resolved_b.seed_policy;
  chosen.seed = flags.seed;
  chosen.rotation_size = resolved_a.rotation.size;
  chosen.rotation_signs = resolved_a.rotation.signs;
  chosen.accumulation = model;
  chosen.output = output;
  return chosen;
}

core::random_stream strategy::stream_for(core::random_role role) const {
  return core::random_stream{quantize.stream.seed, quantize.stream.step,
                             core::stream_tag(rotation.layer_hash, role)};
}

void check_rotation_fits(const strategy& chosen, int axis, std::int64_t rows, std::int64_t cols,
                         const std::string& tensor_what) {
  if (chosen.rotation.size == 0) return;
  const std::int64_t length = axis == 1 ? cols : rows;
  if (length % chosen.rotation.size != 0) {
    throw input_error(fmt::format("--rotation: '{}': size {} does not divide the length {} of axis {} of {} [{}, {}]",
                                  chosen.rotation_text, chosen.rotation.size, length, axis, tensor_what, rows, cols));
  }
}

core::random_role role_for_tensor(std::string_view tensor_name) {
  if (tensor_name == "dy") return core::random_role::dy;
  if (tensor_name == "x") return core::random_role::x;
  if (tensor_name == "w") return core::random_role::w;
  return core::random_role::none;
}

std::string_view role_name(core::random_role role) {
  switch (role) {
    case core::random_role::none: return "none";
    case core::random_role::dy: return "dy";
    case core::random_role::x: return "x";
    case core::random_role::w: return "w";
    case core::random_role::signs: return "signs";
  }
  return "?";
}

}  // namespace mxscope::cli
