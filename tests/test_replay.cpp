// Replay on synthetic dumps built in the test, where the truth is known: a strategy whose error is
// the same every step must show coherence sqrt(T) and alpha 1; independent errors must average
// out (alpha near 0.5); bias, cosine and the optimizer replays are recomputed here from their
// definitions; results do not depend on thread count or on interruption.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mxscope/analysis.hpp"
#include "mxscope/cli/cli.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/io/safetensors.hpp"
#include "mxscope/io/sha256.hpp"
#include "mxscope/reference.hpp"
#include "mxscope/replay.hpp"

#include "test_files.hpp"

namespace {

namespace fs = std::filesystem;

using mxscope::testing::read_text;

fs::path fresh_directory(const std::string& name) { return mxscope::testing::fresh_directory("replay", name); }

// Random operands with a realistic spread of magnitudes (log-normal), so that MXFP4 flushes and clips.
mxscope::matrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  mxscope::matrix out(rows, cols);
  for (auto& v : out.values) v = static_cast<float>(normal(generator) * std::exp(normal(generator)));
  return out;
}

// Writes a dump of `steps` entries per layer. With `same_operands`, every step holds the same x and dy.
void write_dump(const fs::path& directory, const std::vector<std::string>& layers, int steps, bool same_operands,
                std::int64_t tokens = 64, std::int64_t n_in = 32, std::int64_t n_out = 16) {
  fs::create_directories(directory);
  nlohmann::json manifest;
  manifest["format"] = "mxscope-dump";
  manifest["version"] = 1;
  manifest["source"] = {{"hardware", "synthetic"},
                        {"framework", "test_replay"},
                        {"recipe", "none"},
                        {"model", "none"},
                        {"notes", "generated in the test"}};
  manifest["entries"] = nlohmann::json::array();
  for (std::size_t l = 0; l < layers.size(); ++l) {
    for (int step = 1; step <= steps; ++step) {
      const std::uint64_t seed = 1000 * (l + 1) + static_cast<std::uint64_t>(same_operands ? 0 : step);
      mxscope::io::safetensors_writer writer;
      writer.add_matrix("x", random_matrix(tokens, n_in, seed));
      writer.add_matrix("dy", random_matrix(tokens, n_out, seed + 500));
      writer.add_matrix("w", random_matrix(n_out, n_in, seed + 900));
      const std::string file = fmt::format("l{}_s{}.safetensors", l, step);  // (operator+ on "l" trips GCC 12's -Wrestrict)
      writer.write(directory / file);
      manifest["entries"].push_back({{"step", step}, {"layer", layers[l]}, {"file", file}});
    }
  }
  std::ofstream(directory / "manifest.json") << manifest.dump(2);
}

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

// A CSV as rows of column -> text.
std::vector<std::map<std::string, std::string>> read_csv(const fs::path& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  std::vector<std::string> header;
  std::stringstream header_stream(line);
  for (std::string cell; std::getline(header_stream, cell, ',');) header.push_back(cell);
  std::vector<std::map<std::string, std::string>> rows;
  while (std::getline(file, line)) {
    std::stringstream row_stream(line);
    std::map<std::string, std::string> row;
    std::size_t column = 0;
    for (std::string cell; std::getline(row_stream, cell, ',');) row[header.at(column++)] = cell;
    EXPECT_EQ(column, header.size()) << path << ": " << line;
    rows.push_back(row);
  }
  return rows;
}

double value(const std::map<std::string, std::string>& row, const std::string& column) {
  return std::stod(row.at(column));
}

const char* analysis_text = R"(
name = "synthetic"
gemms = ["wgrad"]
[defaults]
seed = 7
accumulation = "fp32-block"
[[strategy]]
name = "rne"
format = "mxfp4"
[[strategy]]
name = "sr-per-step"
format = "mxfp4"
rounding = "sr"
seed_policy = "per-step"
[[strategy]]
name = "sr-ceil-per-step"
format = "mxfp4"
rounding = "sr"
scale_rule = "ceil"
seed_policy = "per-step"
[[strategy]]
name = "sr-fixed"
format = "mxfp4"
rounding = "sr"
seed_policy = "fixed"
[[strategy]]
name = "h16"
format = "mxfp4"
rotation = "hadamard:16"
)";

mxscope::replay_outcome replay(const fs::path& dump, const fs::path& analysis, const fs::path& out, int threads = 0,
                               bool resume = false, int stop_after = 0) {
  mxscope::replay_options options;
  options.dump = dump;
  options.analysis_path = analysis;
  options.out = out;
  options.threads = threads;
  options.resume = resume;
  options.stop_after_layers = stop_after;
  std::ostringstream log;
  return mxscope::run_replay(options, log);
}

std::map<std::string, std::string> final_row(const std::vector<std::map<std::string, std::string>>& rows,
                                             const std::string& layer, const std::string& strategy) {
  std::map<std::string, std::string> last;
  for (const auto& row : rows) {
    if (row.at("layer") == layer && row.at("strategy") == strategy) last = row;
  }
  return last;
}

TEST(Replay, IdenticalErrorEveryStepIsCoherentAndRandomErrorsAverageOut) {
  const fs::path root = fresh_directory("coherence");
  write_dump(root / "dump", {"layer.a"}, 64, /*same_operands=*/true);
  write_text(root / "a.toml", analysis_text);
  const auto outcome = replay(root / "dump", root / "a.toml", root / "run");
  ASSERT_TRUE(outcome.complete);
  const auto rows = read_csv(root / "run" / "accumulation.csv");
  const double steps = 64.0;
  for (const char* deterministic : {"rne", "sr-fixed", "h16"}) {
    SCOPED_TRACE(deterministic);
    const auto row = final_row(rows, "layer.a", deterministic);
    ASSERT_EQ(row.at("T"), "64");
    EXPECT_NEAR(value(row, "coherence"), std::sqrt(steps), 1e-9 * std::sqrt(steps));
    EXPECT_NEAR(value(row, "alpha"), 1.0, 1e-9);
    EXPECT_NEAR(value(row, "structural_share"), 1.0, 1e-9);
    EXPECT_NEAR(value(row, "lag1_corr"), 1.0, 1e-9);
  }
  // Stochastic rounding with a fresh pattern every step and a scale rule that never clips: every
  // element's error is an independent, zero-mean draw (sr_bits = 32 is unbiased), so the error sum
  // is a random walk. With T = 64 the fitted slope has a spread of about 0.1 around 0.5.
  const auto random_row = final_row(rows, "layer.a", "sr-ceil-per-step");
  EXPECT_NEAR(value(random_row, "alpha"), 0.5, 0.2);
  EXPECT_LT(value(random_row, "coherence"), 2.5);
  EXPECT_LT(value(random_row, "structural_share"), 0.1);
  EXPECT_LT(std::fabs(value(random_row, "lag1_corr")), 0.15);
  // The ordering the study reports: errors that average out accumulate less than coherent ones.
  EXPECT_LT(value(random_row, "acc_err"), value(final_row(rows, "layer.a", "rne"), "acc_err"));
  // With the OCP floor rule, stochastic rounding cannot undo clipping: the clipped elements give
  // the same error every step, a structural component that fresh random draws do not remove.
  const auto clipped_row = final_row(rows, "layer.a", "sr-per-step");
  EXPECT_GT(value(clipped_row, "structural_share"), value(random_row, "structural_share"));
  EXPECT_GT(value(clipped_row, "alpha"), value(random_row, "alpha"));
  fs::remove_all(root);
}

// bias, cosine, rel_err and the optimizer replays recomputed from their definitions, with the
// strategy's results and the reference taken from the GEMM and reference APIs (tested on their own).
TEST(Replay, MetricsAndOptimizerReplayMatchADirectRecomputation) {
  const fs::path root = fresh_directory("definitions");
  const int steps = 6;
  write_dump(root / "dump", {"layer.b"}, steps, /*same_operands=*/false, 64, 32, 16);
  write_text(root / "a.toml", analysis_text);
  ASSERT_TRUE(replay(root / "dump", root / "a.toml", root / "run").complete);
  const auto step_rows = read_csv(root / "run" / "steps.csv");
  const auto accumulation_rows = read_csv(root / "run" / "accumulation.csv");
  const auto parsed = mxscope::parse_analysis(analysis_text, "a.toml");
  const mxscope::strategy& chosen = parsed.strategies[1].for_gemm(mxscope::gemm_kind::wgrad);  // sr-per-step
  ASSERT_EQ(chosen.name, "sr-per-step");

  const std::size_t count = 16 * 32;
  std::vector<long double> sgd_m(count), sgd_m_hat(count), sgd_sum(count), sgd_sum_hat(count);
  std::vector<long double> m(count), v(count), m_hat(count), v_hat(count), adam_sum(count), adam_sum_hat(count);
  std::vector<long double> u(count), u_hat(count);
  for (int step = 1; step <= steps; ++step) {
    mxscope::io::safetensors_reader reader(root / "dump" / ("l0_s" + std::to_string(step) + ".safetensors"));
    const mxscope::matrix x = reader.read_matrix("x");
    const mxscope::matrix dy = reader.read_matrix("dy");
    const mxscope::gemm_result result =
        mxscope::run_gemm(mxscope::gemm_kind::wgrad, {&x, &dy, nullptr}, chosen, {"layer.b", static_cast<std::uint32_t>(step)});
    const auto reference = mxscope::reference_gemm(mxscope::transposed(dy), mxscope::transposed(x),
                                                   mxscope::reference_kind::exact);
    long double ee = 0, gg = 0, hh = 0, eg = 0, hg = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const long double g = reference.fp64.values[i];
      const long double h = result.out.values[i];
      ee += (h - g) * (h - g);
      gg += g * g;
      hh += h * h;
      eg += (h - g) * g;
      hg += h * g;
    }
    std::map<std::string, std::string> row;
    for (const auto& candidate : step_rows) {
      if (candidate.at("strategy") == "sr-per-step" && candidate.at("step") == std::to_string(step)) row = candidate;
    }
    ASSERT_FALSE(row.empty());
    EXPECT_NEAR(value(row, "rel_err"), static_cast<double>(std::sqrt(ee / gg)), 1e-12);
    EXPECT_NEAR(value(row, "cosine"), static_cast<double>(hg / std::sqrt(hh * gg)), 1e-12);
    EXPECT_NEAR(value(row, "bias"), static_cast<double>(eg / gg), 1e-12);
    const long double bias = eg / gg;
    long double orth = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const long double g = reference.fp64.values[i];
      const long double e = result.out.values[i] - g;
      orth += (e - bias * g) * (e - bias * g);
    }
    EXPECT_NEAR(value(row, "orth_err"), static_cast<double>(std::sqrt(orth / gg)), 1e-12);

    // Optimizer replays, written from docs/metrics.md.
    const long double beta1 = 0.9L, beta2 = 0.95L, eps = 1e-8L;
    for (std::size_t i = 0; i < count; ++i) {
      const long double g = reference.fp64.values[i];
      const long double h = result.out.values[i];
      sgd_m[i] = 0.9L * sgd_m[i] + g;
      sgd_m_hat[i] = 0.9L * sgd_m_hat[i] + h;
      sgd_sum[i] += sgd_m[i];
      sgd_sum_hat[i] += sgd_m_hat[i];
      m[i] = beta1 * m[i] + (1 - beta1) * g;
      v[i] = beta2 * v[i] + (1 - beta2) * g * g;
      m_hat[i] = beta1 * m_hat[i] + (1 - beta1) * h;
      v_hat[i] = beta2 * v_hat[i] + (1 - beta2) * h * h;
      const long double c1 = 1 - std::pow(beta1, step), c2 = 1 - std::pow(beta2, step);
      u[i] = (m[i] / c1) / (std::sqrt(v[i] / c2) + eps);
      u_hat[i] = (m_hat[i] / c1) / (std::sqrt(v_hat[i] / c2) + eps);
      adam_sum[i] += u[i];
      adam_sum_hat[i] += u_hat[i];
    }
    const auto relative = [&](const std::vector<long double>& estimate, const std::vector<long double>& truth) {
      long double num = 0, den = 0;
      for (std::size_t i = 0; i < count; ++i) {
        num += (estimate[i] - truth[i]) * (estimate[i] - truth[i]);
        den += truth[i] * truth[i];
      }
      return static_cast<double>(std::sqrt(num / den));
    };
    std::map<std::string, std::string> acc_row;
    for (const auto& candidate : accumulation_rows) {
      if (candidate.at("strategy") == "sr-per-step" && candidate.at("T") == std::to_string(step)) acc_row = candidate;
    }
    ASSERT_FALSE(acc_row.empty());
    EXPECT_NEAR(value(acc_row, "sgd_upd_err"), relative(sgd_m_hat, sgd_m), 1e-10);
    EXPECT_NEAR(value(acc_row, "sgd_disp_err"), relative(sgd_sum_hat, sgd_sum), 1e-10);
    EXPECT_NEAR(value(acc_row, "adamw_upd_err"), relative(u_hat, u), 1e-9);
    EXPECT_NEAR(value(acc_row, "adamw_disp_err"), relative(adam_sum_hat, adam_sum), 1e-9);
  }
  fs::remove_all(root);
}

TEST(Replay, BytesDoNotDependOnThreadsOrInterruption) {
  const fs::path root = fresh_directory("determinism");
  write_dump(root / "dump", {"layer.a", "layer.b", "layer.c"}, 5, /*same_operands=*/false);
  write_text(root / "a.toml", analysis_text);
  ASSERT_TRUE(replay(root / "dump", root / "a.toml", root / "one", 1).complete);
  ASSERT_TRUE(replay(root / "dump", root / "a.toml", root / "two", 2).complete);
  // Interrupted after one layer, then resumed (in a different thread count).
  const auto first = replay(root / "dump", root / "a.toml", root / "resumed", 2, false, 1);
  EXPECT_FALSE(first.complete);
  EXPECT_FALSE(fs::exists(root / "resumed" / "steps.csv"));
  // Without --resume the interrupted run is refused rather than overwritten.
  EXPECT_THROW(replay(root / "dump", root / "a.toml", root / "resumed", 1), mxscope::input_error);
  const auto second = replay(root / "dump", root / "a.toml", root / "resumed", 1, true);
  EXPECT_TRUE(second.complete);
  EXPECT_EQ(second.layers_resumed, 1);
  for (const char* file : {"steps.csv", "accumulation.csv", "summary.json"}) {
    SCOPED_TRACE(file);
    const std::string reference = read_text(root / "one" / file);
    EXPECT_FALSE(reference.empty());
    EXPECT_EQ(reference, read_text(root / "two" / file));
    EXPECT_EQ(reference, read_text(root / "resumed" / file));
  }
  EXPECT_FALSE(fs::exists(root / "resumed" / ".partial"));
  // A fresh run read its first step ahead (run.json times that read on its own); the resumed one,
  // which could start anywhere, did not.
  const auto seconds_of = [&](const char* run) {
    return nlohmann::json::parse(read_text(root / run / "run.json")).at("seconds");
  };
  EXPECT_TRUE(seconds_of("one").at("first_read").is_number());
  EXPECT_GE(seconds_of("one").at("first_read").get<double>(), 0.0);
  EXPECT_TRUE(seconds_of("resumed").at("first_read").is_null());
  // Nothing goes to a GPU on the CPU: no share of the first upload during the read.
  EXPECT_TRUE(nlohmann::json::parse(read_text(root / "one" / "run.json")).at("first_upload_during_read").is_null());
  fs::remove_all(root);
}

// A real kill -9 of the CLI in the middle of a run, then --resume: the same final bytes.
TEST(Replay, KillNineThenResumeGivesTheSameBytes) {
  const fs::path root = fresh_directory("kill");
  write_dump(root / "dump", {"layer.a", "layer.b", "layer.c", "layer.d"}, 8, /*same_operands=*/false, 128, 64, 32);
  write_text(root / "a.toml", analysis_text);
  ASSERT_TRUE(replay(root / "dump", root / "a.toml", root / "clean").complete);

  const std::string dump = (root / "dump").string(), analysis = (root / "a.toml").string(),
                    out = (root / "killed").string();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    execl(MXSCOPE_CLI_PATH, MXSCOPE_CLI_PATH, "replay", dump.c_str(), "--analysis", analysis.c_str(), "--out",
          out.c_str(), "--threads", "1", static_cast<char*>(nullptr));
    _exit(127);
  }
  // Kill it as soon as the first layer's units are checkpointed (or when it is about to finish).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool killed_midway = false;
  while (std::chrono::steady_clock::now() < deadline) {
    // The last unit of layer.a (one fragment per (layer, gemm, strategy); 5 strategies).
    if (fs::exists(root / "killed" / ".partial" / "00000-layer.a.wgrad.004.unit")) {
      killed_midway = !fs::exists(root / "killed" / "steps.csv");
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(killed_midway) << "the run finished before it could be killed; the test proves less";
  const auto resumed = replay(root / "dump", root / "a.toml", root / "killed", 2, true);
  EXPECT_TRUE(resumed.complete);
  for (const char* file : {"steps.csv", "accumulation.csv", "summary.json"}) {
    SCOPED_TRACE(file);
    EXPECT_EQ(read_text(root / "clean" / file), read_text(root / "killed" / file));
  }
  for (const auto& item : fs::directory_iterator(root / "killed")) {
    EXPECT_EQ(item.path().filename().string().find(".tmp."), std::string::npos) << item.path();
  }
  fs::remove_all(root);
}

TEST(Replay, BadInputsAreRefusedBeforeAnyOutput) {
  const fs::path root = fresh_directory("bad");
  write_dump(root / "dump", {"layer.a"}, 2, true, 48, 32, 16);
  write_text(root / "a.toml", "[[strategy]]\nname = \"h32\"\nformat = \"mxfp4\"\nrotation = \"hadamard:32\"\n");
  std::ostringstream out, err;
  const std::string dump = (root / "dump").string(), analysis = (root / "a.toml").string(),
                    run = (root / "run").string();
  const char* argv[] = {"mxscope", "replay", dump.c_str(), "--analysis", analysis.c_str(), "--out", run.c_str()};
  EXPECT_EQ(mxscope::cli::run(7, argv, out, err), 2);
  EXPECT_NE(err.str().find("strategy 'h32'"), std::string::npos) << err.str();
  EXPECT_NE(err.str().find("48"), std::string::npos) << err.str();
  EXPECT_FALSE(fs::exists(root / "run" / "steps.csv"));

  write_text(root / "b.toml", "[[strategy]]\nname = \"x\"\nformat = \"mxfp4\"\nblok = 32\n");
  const std::string bad_analysis = (root / "b.toml").string();
  const char* argv_b[] = {"mxscope", "replay", dump.c_str(), "--analysis", bad_analysis.c_str(), "--out", run.c_str()};
  std::ostringstream err_b;
  EXPECT_EQ(mxscope::cli::run(7, argv_b, out, err_b), 2);
  EXPECT_NE(err_b.str().find("b.toml:4:"), std::string::npos) << err_b.str();

  write_text(root / "c.toml", "gemms = [\"fprop\"]\n[[strategy]]\nname = \"x\"\nformat = \"mxfp4\"\n");
  write_dump(root / "nodw", {"layer.a"}, 1, true);
  // Remove w from the entry: fprop needs it.
  {
    mxscope::io::safetensors_writer writer;
    writer.add_matrix("x", random_matrix(64, 32, 1));
    writer.add_matrix("dy", random_matrix(64, 16, 2));
    writer.write(root / "nodw" / "l0_s1.safetensors");
  }
  const std::string nodw = (root / "nodw").string(), c = (root / "c.toml").string();
  const char* argv_c[] = {"mxscope", "replay", nodw.c_str(), "--analysis", c.c_str(), "--out", run.c_str()};
  std::ostringstream err_c;
  EXPECT_EQ(mxscope::cli::run(7, argv_c, out, err_c), 2);
  EXPECT_NE(err_c.str().find("'w' is missing"), std::string::npos) << err_c.str();

  // --layers patterns that std::regex would compile by deep recursion (a stack overflow at 20,000
  // nested groups) are refused before anything is written; a pattern at the limits is taken.
  const auto layers_error = [&](const std::string& pattern) {
    const std::string good = (root / "a2.toml").string();
    write_text(root / "a2.toml", "[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n");
    const char* argv_l[] = {"mxscope", "replay", dump.c_str(), "--analysis", good.c_str(), "--out", run.c_str(),
                            "--layers", pattern.c_str()};
    std::ostringstream out_l, err_l;
    const int code = mxscope::cli::run(9, argv_l, out_l, err_l);
    fs::remove_all(root / "run");
    return std::pair{code, err_l.str()};
  };
  for (const int depth : {33, 20000}) {
    const auto [code, message] = layers_error(std::string(depth, '(') + "layer.a" + std::string(depth, ')'));
    EXPECT_EQ(code, 2) << depth;
    EXPECT_NE(message.find("--layers"), std::string::npos) << message;
  }
  EXPECT_NE(layers_error(std::string(1025, 'a')).second.find("at most 1024"), std::string::npos);
  EXPECT_EQ(layers_error(std::string(32, '(') + "layer[.]a" + std::string(32, ')')).first, 0);
  fs::remove_all(root);
}

// `mxscope gemm` and the replay study the same GEMM: on one entry file and one strategy every
// metric they both report is the same number. (saturate_frac was over the nonzero inputs in gemm
// and over all inputs in the replay; docs/metrics.md says all inputs.)
TEST(Replay, GemmAndReplayAgreeOnEverySharedColumn) {
  const fs::path root = fresh_directory("gemm-agrees");
  fs::create_directories(root / "dump");
  mxscope::matrix x = random_matrix(64, 32, 41), dy = random_matrix(64, 16, 42);
  for (std::size_t i = 0; i < x.values.size(); i += 3) x.values[i] = 0.0f;  // nonzero and all inputs differ
  for (std::size_t i = 0; i < dy.values.size(); i += 5) dy.values[i] = 0.0f;
  {
    mxscope::io::safetensors_writer writer;
    writer.add_matrix("x", x);
    writer.add_matrix("dy", dy);
    writer.write(root / "dump" / "l0_s1.safetensors");
  }
  nlohmann::json manifest = {{"format", "mxscope-dump"}, {"version", 1},
                             {"source", {{"hardware", "synthetic"}, {"framework", "test_replay"}, {"recipe", "none"},
                                         {"model", "none"}, {"notes", "gemm against replay"}}},
                             {"entries", {{{"step", 1}, {"layer", "layer.a"}, {"file", "l0_s1.safetensors"}}}}};
  std::ofstream(root / "dump" / "manifest.json") << manifest.dump(2);
  write_text(root / "a.toml", "gemms = [\"wgrad\"]\n[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n"
                              "accumulation = \"fp32-block\"\n");
  const std::string dump = (root / "dump").string(), analysis = (root / "a.toml").string(),
                    run = (root / "run").string(), entry = (root / "dump" / "l0_s1.safetensors").string(),
                    product = (root / "product.safetensors").string();
  std::ostringstream out, err;
  const char* replay_argv[] = {"mxscope", "replay", dump.c_str(), "--analysis", analysis.c_str(), "--out", run.c_str()};
  ASSERT_EQ(mxscope::cli::run(7, replay_argv, out, err), 0) << err.str();
  const auto rows = read_csv(root / "run" / "steps.csv");
  ASSERT_EQ(rows.size(), 1U);
  const auto& row = rows[0];
  std::ostringstream gemm_out, gemm_err;
  const char* gemm_argv[] = {"mxscope", "gemm", "--gemm", "wgrad", "--in", entry.c_str(), "--format", "mxfp4",
                             "--accum", "fp32-block", "--json", "--out", product.c_str()};
  ASSERT_EQ(mxscope::cli::run(13, gemm_argv, gemm_out, gemm_err), 0) << gemm_err.str();
  const auto study = nlohmann::json::parse(gemm_out.str());
  const auto same = [&](const std::string& column, const nlohmann::json& value) {
    EXPECT_EQ(std::stod(row.at(column)), value.get<double>()) << column;
  };
  for (const char* metric : {"rel_err", "cosine", "bias", "orth_err", "max_abs_err"}) same(metric, study["metrics"][metric]);
  for (const char* side : {"a", "b"}) {
    const auto& operand = study["operands"][side];
    for (const char* field : {"underflow_frac", "saturate_frac", "snr_db"}) {
      same(std::string(side) + "_" + field, operand[field]);
    }
    EXPECT_DOUBLE_EQ(operand["saturate_frac"].get<double>(),
                     operand["saturated"].get<double>() / operand["elements"].get<double>()) << side;
  }
  // The comparison means something only if the operands clip and flush.
  EXPECT_GT(study["operands"]["a"]["saturated"].get<std::int64_t>() + study["operands"]["b"]["saturated"].get<std::int64_t>(), 0);
  EXPECT_LT(study["operands"]["b"]["nonzero"].get<std::int64_t>(), study["operands"]["b"]["elements"].get<std::int64_t>());
  fs::remove_all(root);
}

// A step whose capture turns out to hold NaN is refused when its turn comes, after the steps before
// it ran (it is read on a background thread while the step before it is worked on, and its error
// must surface then, naming the file): exit 2, no steps.csv. The same dump without the NaN
// replays, and its steps.csv has every step.
TEST(Replay, NonFiniteCaptureMidRunIsRefusedNamingItsFile) {
  const fs::path root = fresh_directory("midrun");
  write_dump(root / "dump", {"layer.a"}, 4, false);
  write_text(root / "a.toml", "[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n");
  const std::string dump = (root / "dump").string(), analysis = (root / "a.toml").string();
  const std::string good_run = (root / "good").string();
  std::ostringstream out, err;
  const char* argv_good[] = {"mxscope", "replay", dump.c_str(), "--analysis", analysis.c_str(), "--out",
                             good_run.c_str()};
  ASSERT_EQ(mxscope::cli::run(7, argv_good, out, err), 0) << err.str();
  EXPECT_EQ(read_csv(root / "good" / "steps.csv").size(), 4U);

  {
    mxscope::matrix x = random_matrix(64, 32, 3003);
    x(5, 7) = std::numeric_limits<float>::quiet_NaN();
    mxscope::io::safetensors_writer writer;
    writer.add_matrix("x", x);
    writer.add_matrix("dy", random_matrix(64, 16, 3503));
    writer.add_matrix("w", random_matrix(16, 32, 3903));
    writer.write(root / "dump" / "l0_s3.safetensors");
  }
  const std::string bad_run = (root / "bad").string();
  const char* argv_bad[] = {"mxscope", "replay", dump.c_str(), "--analysis", analysis.c_str(), "--out",
                            bad_run.c_str()};
  std::ostringstream err_bad;
  EXPECT_EQ(mxscope::cli::run(7, argv_bad, out, err_bad), 2);
  EXPECT_NE(err_bad.str().find("l0_s3.safetensors"), std::string::npos) << err_bad.str();
  EXPECT_NE(err_bad.str().find("non-finite"), std::string::npos) << err_bad.str();
  EXPECT_FALSE(fs::exists(root / "bad" / "steps.csv"));
  fs::remove_all(root);
}

// A fresh single-process run hashes its inputs while it works: its first checkpoint carries the
// run key (every entry file's SHA-256, computed here independently), and a run that fails before
// any checkpoint leaves no interrupted state behind, so the same command runs again afresh.
TEST(Replay, FreshRunWritesItsKeyWithItsFirstCheckpoint) {
  const fs::path root = fresh_directory("fresh-key");
  write_dump(root / "dump", {"layer.a", "layer.b"}, 3, false);
  write_text(root / "a.toml", "[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n");
  EXPECT_FALSE(replay(root / "dump", root / "a.toml", root / "run", 1, false, 1).complete);
  const std::string key = read_text(root / "run" / ".partial" / "run-key.json");
  ASSERT_FALSE(key.empty());
  EXPECT_EQ(key, read_text(root / "run" / ".mxscope-run"));
  const auto parsed = nlohmann::json::parse(key);
  std::size_t files = 0;
  for (const auto& item : fs::directory_iterator(root / "dump")) {
    if (item.path().extension() != ".safetensors") continue;
    ++files;
    const std::string name = item.path().filename().string();
    ASSERT_TRUE(parsed["input_sha256"].contains(name)) << name;
    EXPECT_EQ(parsed["input_sha256"][name], mxscope::io::sha256_file(item.path())) << name;
  }
  EXPECT_EQ(files, 6U);
  EXPECT_TRUE(replay(root / "dump", root / "a.toml", root / "run", 2, true).complete);

  // A non-finite capture in the first layer stops the run before its first checkpoint.
  {
    mxscope::matrix x = random_matrix(64, 32, 4004);
    x(1, 2) = std::numeric_limits<float>::infinity();
    mxscope::io::safetensors_writer writer;
    writer.add_matrix("x", x);
    writer.add_matrix("dy", random_matrix(64, 16, 4005));
    writer.add_matrix("w", random_matrix(16, 32, 4006));
    writer.write(root / "dump" / "l0_s2.safetensors");
  }
  const auto failure = [&] {
    try {
      replay(root / "dump", root / "a.toml", root / "failed", 1);
    } catch (const mxscope::input_error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(failure().find("non-finite"), std::string::npos);
  EXPECT_FALSE(fs::exists(root / "failed" / ".partial"));
  EXPECT_FALSE(fs::exists(root / "failed" / ".mxscope-run"));
  // The same command again: a fresh run (the same capture error), not "an interrupted run".
  EXPECT_NE(failure().find("non-finite"), std::string::npos);
  fs::remove_all(root);
}

// The CLI on a replay, in-process: exit code and both streams.
struct cli_outcome {
  int code = -1;
  std::string out, err;
};
cli_outcome replay_cli(const std::vector<std::string>& arguments) {
  std::vector<const char*> argv{"mxscope", "replay"};
  for (const auto& argument : arguments) argv.push_back(argument.c_str());
  std::ostringstream out, err;
  const int code = mxscope::cli::run(static_cast<int>(argv.size()), argv.data(), out, err);
  return {code, out.str(), err.str()};
}

// A run directory is recognisably mxscope's: a non-empty directory without the marker is refused
// whatever it holds, and in a run directory only the tool's own leftovers are removed.
TEST(Replay, FilesThatAreNotTheToolsOwnAreNeverTouched) {
  const fs::path root = fresh_directory("foreign");
  write_dump(root / "dump", {"layer.a", "layer.b"}, 2, false);
  write_text(root / "a.toml", "[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n");
  const fs::path foreign = root / "foreign";
  fs::create_directories(foreign);
  for (const char* name : {"stop", "rank-notes.txt", "thesis.tmp.docx"}) write_text(foreign / name, name);
  const auto refused = replay_cli({(root / "dump").string(), "--analysis", (root / "a.toml").string(), "--out",
                                   foreign.string()});
  EXPECT_EQ(refused.code, 2);
  EXPECT_NE(refused.err.find("not a run directory of mxscope"), std::string::npos) << refused.err;
  for (const char* name : {"stop", "rank-notes.txt", "thesis.tmp.docx"}) EXPECT_EQ(read_text(foreign / name), name);
  EXPECT_FALSE(fs::exists(foreign / ".partial"));

  // --out inside the dump is refused and writes nothing there.
  const auto into_dump = replay_cli({(root / "dump").string(), "--analysis", (root / "a.toml").string(), "--out",
                                     (root / "dump").string()});
  EXPECT_EQ(into_dump.code, 2);
  EXPECT_NE(into_dump.err.find("dump directory"), std::string::npos) << into_dump.err;
  EXPECT_FALSE(fs::exists(root / "dump" / ".partial"));

  // An interrupted run: the user's files in it survive the resume, the tool's leftovers do not.
  const fs::path run = root / "run";
  EXPECT_FALSE(replay(root / "dump", root / "a.toml", run, 1, false, 1).complete);
  write_text(run / "thesis.tmp.docx", "mine");
  write_text(run / "stop", "mine");
  write_text(run / "steps.csv.tmp.12345", "garbage");
  write_text(run / ".partial" / "rank-00003.json", "{}");
  write_text(run / ".partial" / "stop", "an earlier launch failed");
  EXPECT_TRUE(replay(root / "dump", root / "a.toml", run, 1, true).complete);
  EXPECT_EQ(read_text(run / "thesis.tmp.docx"), "mine");
  EXPECT_EQ(read_text(run / "stop"), "mine");
  EXPECT_FALSE(fs::exists(run / "steps.csv.tmp.12345"));
  EXPECT_EQ(read_csv(run / "steps.csv").size(), 4U);
  fs::remove_all(root);
}

// The run key covers every entry file: after an edit (same shape, other values) --resume refuses
// instead of mixing old and new results, on an interrupted and on a finished run.
TEST(Replay, ResumeAfterAnEntryFileChangedIsRefused) {
  const fs::path root = fresh_directory("edited");
  write_dump(root / "dump", {"layer.a", "layer.b"}, 2, false);
  write_text(root / "a.toml", "[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n");
  EXPECT_FALSE(replay(root / "dump", root / "a.toml", root / "run", 1, false, 1).complete);
  ASSERT_TRUE(replay(root / "dump", root / "a.toml", root / "finished", 1).complete);
  const std::string finished_steps = read_text(root / "finished" / "steps.csv");
  {
    mxscope::io::safetensors_writer writer;
    writer.add_matrix("x", random_matrix(64, 32, 77));
    writer.add_matrix("dy", random_matrix(64, 16, 78));
    writer.add_matrix("w", random_matrix(16, 32, 79));
    writer.write(root / "dump" / "l0_s1.safetensors");
  }
  const std::vector<std::string> common = {(root / "dump").string(), "--analysis", (root / "a.toml").string(),
                                           "--resume", "--out"};
  for (const char* run : {"run", "finished"}) {
    SCOPED_TRACE(run);
    std::vector<std::string> arguments = common;
    arguments.push_back((root / run).string());
    const auto refused = replay_cli(arguments);
    EXPECT_EQ(refused.code, 2);
    EXPECT_NE(refused.err.find("input files"), std::string::npos) << refused.err;
    EXPECT_EQ(refused.out.find("wrote"), std::string::npos) << refused.out;
  }
  EXPECT_FALSE(fs::exists(root / "run" / "steps.csv"));
  EXPECT_EQ(read_text(root / "finished" / "steps.csv"), finished_steps);

  // The same inputs again on the finished run: nothing to do, and nothing claimed as written.
  write_dump(root / "dump2", {"layer.a"}, 1, false);
  ASSERT_TRUE(replay(root / "dump2", root / "a.toml", root / "again", 1).complete);
  const auto again = replay_cli({(root / "dump2").string(), "--analysis", (root / "a.toml").string(), "--resume",
                                 "--out", (root / "again").string()});
  EXPECT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(again.out.find("wrote"), std::string::npos) << again.out;
  EXPECT_NE(again.err.find("already holds a finished run"), std::string::npos) << again.err;
  fs::remove_all(root);
}

// Layer names go unquoted into the CSV rows: a comma, quote, CR or LF is refused up front, naming
// the manifest, the entry and the field, before the run directory exists.
TEST(Replay, LayerNamesThatCsvCannotCarryAreRefused) {
  const fs::path root = fresh_directory("csvnames");
  write_text(root / "a.toml", "[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n");
  int index = 0;
  for (const std::string& name : std::vector<std::string>{"l1,x", "l1\"x", "l1\rx", "l1\nx", std::string(2000, 'a')}) {
    SCOPED_TRACE(index);
    const fs::path dump = root / fmt::format("dump{}", index++);
    write_dump(dump, {name}, 1, false);
    const auto refused =
        replay_cli({dump.string(), "--analysis", (root / "a.toml").string(), "--out", (root / "run").string()});
    EXPECT_EQ(refused.code, 2);
    EXPECT_NE(refused.err.find("manifest.json: entries[0]: field 'layer'"), std::string::npos) << refused.err;
    EXPECT_FALSE(fs::exists(root / "run"));
  }
  fs::remove_all(root);
}

// A second replay on a directory another one holds (flock on the directory) is refused.
TEST(Replay, ASecondReplayOnTheSameOutIsLockedOut) {
  const fs::path root = fresh_directory("locked");
  write_dump(root / "dump", {"layer.a"}, 1, false);
  write_text(root / "a.toml", "[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n");
  fs::create_directories(root / "run");
  const int held = ::open((root / "run").c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX), 0);
  const auto refused = replay_cli({(root / "dump").string(), "--analysis", (root / "a.toml").string(), "--out",
                                   (root / "run").string()});
  EXPECT_EQ(refused.code, 2);
  EXPECT_NE(refused.err.find("another mxscope replay"), std::string::npos) << refused.err;
  ::close(held);
  EXPECT_TRUE(replay(root / "dump", root / "a.toml", root / "run", 1).complete);
  fs::remove_all(root);
}

// The final assembly fails part way (here summary.json cannot be written): no final file is left,
// the directory stays an interrupted run (not "finished"), and --resume then completes it with the
// bytes of a clean run.
TEST(Replay, AFailedAssemblyLeavesAnInterruptedRunThatResumes) {
  const fs::path root = fresh_directory("assembly");
  write_dump(root / "dump", {"layer.a", "layer.b"}, 2, false);
  write_text(root / "a.toml", "[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n");
  ASSERT_TRUE(replay(root / "dump", root / "a.toml", root / "clean", 1).complete);
  const fs::path run = root / "run";
  EXPECT_FALSE(replay(root / "dump", root / "a.toml", run, 1, false, 1).complete);
  fs::create_directories(run / "summary.json" / "blocker");
  EXPECT_THROW(replay(root / "dump", root / "a.toml", run, 1, true), std::exception);
  EXPECT_FALSE(fs::exists(run / "steps.csv"));
  EXPECT_FALSE(fs::exists(run / "accumulation.csv"));
  EXPECT_TRUE(fs::exists(run / ".partial" / "run-key.json"));
  const auto plain = replay_cli({(root / "dump").string(), "--analysis", (root / "a.toml").string(), "--out",
                                 run.string()});
  EXPECT_EQ(plain.code, 2);
  EXPECT_NE(plain.err.find("interrupted run"), std::string::npos) << plain.err;
  fs::remove_all(run / "summary.json");
  EXPECT_TRUE(replay(root / "dump", root / "a.toml", run, 1, true).complete);
  for (const char* file : {"steps.csv", "accumulation.csv", "summary.json"}) {
    EXPECT_EQ(read_text(run / file), read_text(root / "clean" / file)) << file;
  }
  fs::remove_all(root);
}

// In a log (stderr not a terminal) the replay prints whole progress lines: entries done, units
// done, rate and ETA, the last one at the end of the work.
TEST(Replay, ProgressLinesGoToALogThatIsNotATerminal) {
  const fs::path root = fresh_directory("progress");
  write_dump(root / "dump", {"layer.a", "layer.b"}, 2, false);
  write_text(root / "a.toml", "[[strategy]]\nname = \"mx\"\nformat = \"mxfp4\"\n");
  mxscope::replay_options options;
  options.dump = root / "dump";
  options.analysis_path = root / "a.toml";
  options.out = root / "run";
  options.threads = 1;
  options.progress_log_seconds = 1e-9;  // every entry
  std::ostringstream log;
  ASSERT_TRUE(mxscope::run_replay(options, log).complete);
  const std::string text = log.str();
  EXPECT_EQ(text.find('\r'), std::string::npos) << text;
  const std::regex line(R"(replay: ([0-9]+)/4 entries, ([0-9]+) units done, [0-9.]+ entries/s, ETA [0-9]+ s\n)");
  std::vector<int> done;
  for (std::sregex_iterator it(text.begin(), text.end(), line), end; it != end; ++it) done.push_back(std::stoi((*it)[1]));
  EXPECT_EQ(done, (std::vector<int>{1, 2, 3, 4})) << text;
  fs::remove_all(root);
}

// The static assignment of units to ranks: contiguous, every rank's load within the largest unit's
// cost of the mean (the bound docs/scaling.md states), the same answer every time, and one rank
// gets everything.
TEST(Replay, UnitAssignmentIsContiguousAndBalanced) {
  std::mt19937_64 generator(11);
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t count = 1 + generator() % 300;
    std::vector<std::uint64_t> costs(count);
    // Shapes from tiny to Llama-8B-sized products times 1000 steps (needs more than 64 bits inside).
    for (auto& c : costs) c = generator() % 3 == 0 ? generator() % 100 : (generator() % 4096) * 14336ull * 8192ull * 1000ull;
    const int ranks = 1 + static_cast<int>(generator() % 40);
    const std::vector<int> owners = mxscope::assign_units(costs, ranks);
    ASSERT_EQ(owners.size(), count);
    EXPECT_EQ(owners, mxscope::assign_units(costs, ranks));
    long double total = 0, largest = 0;
    for (const auto c : costs) {
      total += static_cast<long double>(c);
      largest = std::max(largest, static_cast<long double>(c));
    }
    std::vector<long double> load(static_cast<std::size_t>(ranks), 0);
    for (std::size_t i = 0; i < count; ++i) {
      ASSERT_GE(owners[i], 0);
      ASSERT_LT(owners[i], ranks);
      if (i > 0) {
        EXPECT_LE(owners[i - 1], owners[i]) << "not contiguous at unit " << i;
      }
      load[static_cast<std::size_t>(owners[i])] += static_cast<long double>(costs[i]);
    }
    for (int r = 0; r < ranks; ++r) {
      EXPECT_LE(std::fabs(static_cast<double>(load[static_cast<std::size_t>(r)] - total / ranks)),
                static_cast<double>(largest) * (1 + 1e-12))
          << "rank " << r << " of " << ranks << ", " << count << " units";
    }
  }
  EXPECT_EQ(mxscope::assign_units({5, 5, 5}, 1), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(mxscope::assign_units({1, 1, 1, 1}, 2), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(mxscope::assign_units({0, 0, 0, 0}, 2), (std::vector<int>{0, 0, 1, 1}));
}

TEST(Replay, StepListsParse) {
  EXPECT_EQ(mxscope::parse_step_list("3,5-7,12", "--steps"), (std::vector<std::int64_t>{3, 5, 6, 7, 12}));
  EXPECT_THROW(mxscope::parse_step_list("3,a", "--steps"), mxscope::input_error);
  EXPECT_THROW(mxscope::parse_step_list("7-5", "--steps"), mxscope::input_error);
}

}  // namespace
