// Internal to the CLI: each subcommand lives in its own src/cli/cmd_<name>.cpp and contributes one
// add_<name>_command function, listed once in cli.cpp. A command binds its flags to an options
// struct it owns and returns a runner that cli.cpp calls after a successful parse; runners throw
// input_error (exit 2) or check_failed (exit 1) and cli.cpp turns those into messages.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

#include "mxscope/core/philox.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/quantize.hpp"

namespace mxscope::cli {

struct command {
  CLI::App* subcommand = nullptr;
  std::function<int(std::ostream& out, std::ostream& err)> run;
};
using command_list = std::vector<command>;

void add_inspect_command(CLI::App& app, command_list& commands);
void add_quantize_command(CLI::App& app, command_list& commands);
void add_gemm_command(CLI::App& app, command_list& commands);
void add_report_command(CLI::App& app, command_list& commands);
void add_notebook_command(CLI::App& app, command_list& commands);
void add_replay_command(CLI::App& app, command_list& commands);
void add_conform_command(CLI::App& app, command_list& commands);

// ------------------------------------------------------------------------------------------------
// The quantization strategy flags, shared by every command that quantizes an operand
// (--format --block --rounding --scale-rule --rotation --signs --seed --step --sr-bits --layer
// --seed-policy). The axis is not among them: quantize takes it as a flag, a GEMM derives it.

struct strategy_flags {
  std::string format;
  int block = 0;
  CLI::Option* block_option = nullptr;  // to tell "--block 0" from "not given"
  bool block_given = false;             // the same for callers without CLI11 (the C API)
  std::string rounding = "rne";
  std::string scale_rule = "floor";
  std::string rotation = "none";
  std::string signs = "none";
  std::uint64_t seed = 0;
  std::uint32_t step = 0;
  int sr_bits = 32;
  std::string layer;
  std::string seed_policy = "per-step";
};

// Registers the flags on `command`; `format_required` makes --format mandatory.
void add_strategy_flags(CLI::App& command, strategy_flags& flags, bool format_required);

struct strategy {
  quantize_options quantize;   // stream left default: it depends on the operand's role
  rotation_options rotation;   // size 0 for none
  std::string rotation_text;   // "none" or "hadamard:B"
  core::seed_policy seed_policy = core::seed_policy::per_step;
  std::string layer;

  // The canonical stochastic-rounding stream of an operand (NUMERICS.md section 4).
  core::random_stream stream_for(core::random_role role) const;
};

// Checks every name and range; throws input_error naming the flag and the offending value.
strategy resolve_strategy(const strategy_flags& flags);

// The strategy of one emulated GEMM: `flags` for both operands, each with its own format (fp32: the
// operand unquantized; the other names of --format), the accumulation model and output rounding.
// `flag_a` and `flag_b` name the format flags in errors.
mxscope::strategy resolve_gemm_strategy(const strategy_flags& flags, const std::string& format_a,
                                        const std::string& format_b, const accumulation_model& model,
                                        output_rounding output, std::string_view flag_a = "--format-a",
                                        std::string_view flag_b = "--format-b");

// Checks what depends on the operand: the rotation size must divide the length of `axis`.
void check_rotation_fits(const strategy& chosen, int axis, std::int64_t rows, std::int64_t cols,
                         const std::string& tensor_what);

// dy -> dy, x -> x, w -> w, anything else -> none (NUMERICS.md section 4 roles).
core::random_role role_for_tensor(std::string_view tensor_name);
std::string_view role_name(core::random_role role);

// "0.1.0 (git 0123456789ab)".
std::string version_text();

}  // namespace mxscope::cli
