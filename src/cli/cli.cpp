// The CLI entry: builds the CLI11 application from the registered commands, parses, runs the chosen
// command and maps failures to the exit codes of the contract (0 ok, 1 check failed, 2 bad input).
#include "mxscope/cli/cli.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <new>
#include <ostream>
#include <system_error>

#include "commands.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/safetensors.hpp"

namespace mxscope::cli {

namespace {

using registration = void (*)(CLI::App&, command_list&);

// One line per command.
constexpr registration registrations[] = {
    add_inspect_command,
    add_quantize_command,
    add_gemm_command,
    add_replay_command,
    add_report_command,
    add_notebook_command,
    add_conform_command,
};

int execute(const command& chosen, std::ostream& out, std::ostream& err) {
  const std::string prefix = "mxscope " + chosen.subcommand->get_name();
  int code = 2;
  try {
    code = chosen.run(out, err);
  } catch (const reported_elsewhere& error) {
    code = error.code();
  } catch (const input_error& error) {
    err << prefix << ": error: " << error.what() << '\n';
    code = 2;
  } catch (const check_failed& error) {
    err << prefix << ": check failed: " << error.what() << '\n';
    code = 1;
  } catch (const std::bad_alloc&) {
    err << prefix << ": error: out of memory\n";
    code = 2;
  } catch (const std::system_error& error) {
    // EAGAIN: a thread that could not start under a memory or process limit, whose bare text
    // ("Resource temporarily unavailable") does not say what was refused.
    err << prefix << ": error: ";
    if (error.code() == std::errc::resource_unavailable_try_again) {
      err << "could not start a thread (a memory or process limit; fewer --threads or a higher limit may help): ";
    }
    err << error.what() << '\n';
    code = 2;
  } catch (const std::exception& error) {
    err << prefix << ": error: " << error.what() << '\n';
    code = 2;
  }
  out.flush();
  err.flush();
  return code;
}

}  // namespace

int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{"mxscope: replay captured GEMM operands under MX microscaling formats and measure the error",
               "mxscope"};
  app.set_version_flag("--version", fmt::format("mxscope {}", version_text()), "Print the version and git hash");
  app.require_subcommand(1);
  command_list commands;
  for (const registration add : registrations) add(app, commands);

  // CLI11 reports an unknown first word only as "A subcommand is required".
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> names;
    for (const auto& candidate : commands) names.push_back(candidate.subcommand->get_name());
    if (std::find(names.begin(), names.end(), argv[1]) == names.end()) {
      err << fmt::format("mxscope: usage error: unknown command '{}' (commands: {})\n(run 'mxscope --help')\n",
                         io::printable_name(argv[1]), fmt::join(names, " "));
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      app.exit(error, out, err);  // --help, --help-all, --version
      return 0;
    }
    err << "mxscope: usage error: " << error.what() << "\n(run 'mxscope --help' or 'mxscope COMMAND --help')\n";
    return 2;
  }
  for (const auto& candidate : commands) {
    if (candidate.subcommand->parsed()) return execute(candidate, out, err);
  }
  err << "mxscope: usage error: no command given\n";
  return 2;
}

}  // namespace mxscope::cli
