// Distributed replay under a real MPI launcher (docs/scaling.md): mpirun with 2 and 3 ranks gives
// the bytes of one process; a rank killed with SIGKILL stops the run with the rank and its units
// named, and --resume with another rank count finishes to the same bytes; a rank that hits bad
// input stops every rank, names itself and its unit, and exits 2. Skipped, with a message, when
// mpirun is not installed or mxscope was built without MPI.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mxscope/io/safetensors.hpp"
#include "mxscope/parallel.hpp"
#include "mxscope/replay.hpp"

#include "test_files.hpp"

namespace {

namespace fs = std::filesystem;

const fs::path source_dir = MXSCOPE_SOURCE_DIR;

using mxscope::testing::read_text;
using mxscope::testing::wait_for;

fs::path fresh_directory(const std::string& name) { return mxscope::testing::fresh_directory("mpi", name); }

std::string find_mpirun() {
  const char* path = std::getenv("PATH");
  std::stringstream directories(path ? path : "");
  for (std::string directory; std::getline(directories, directory, ':');) {
    const fs::path candidate = fs::path(directory) / "mpirun";
    if (!directory.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate.string();
  }
  return "";
}

#define SKIP_WITHOUT_MPI()                                                                                   \
  do {                                                                                                       \
    if (!mxscope::mpi_available()) GTEST_SKIP() << "mxscope was built without MPI (MXSCOPE_ENABLE_MPI=OFF)"; \
    if (find_mpirun().empty()) {                                                                             \
      GTEST_SKIP() << "mpirun is not on PATH: the distributed replay tests need OpenMPI (tools/bootstrap "   \
                      "installs openmpi-bin)";                                                               \
    }                                                                                                        \
  } while (false)

// Starts `mpirun -np ranks mxscope replay ...` with stdout and stderr going to `log`.
pid_t start_mpirun(int ranks, const std::vector<std::string>& replay_arguments, const fs::path& log) {
  std::vector<std::string> arguments = {find_mpirun(), "-np", std::to_string(ranks), "--oversubscribe",
                                        MXSCOPE_CLI_PATH, "replay"};
  arguments.insert(arguments.end(), replay_arguments.begin(), replay_arguments.end());
  // Test machines and containers often run as root, which OpenMPI refuses unless told. When a rank
  // dies, mpirun gives the others one second between SIGTERM and SIGKILL by default, which a loaded
  // 2-core machine can spend before the surviving rank has written its report (docs/scaling.md).
  return mxscope::testing::spawn_logged(arguments, log,
                                        {{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                                         {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                                         {"OMPI_MCA_odls_base_sigkill_timeout", "10"}});
}

int run_mpirun(int ranks, const std::vector<std::string>& replay_arguments, const fs::path& log) {
  return wait_for(start_mpirun(ranks, replay_arguments, log));
}

// One process, in this process: the bytes every distributed run must reproduce.
void replay_alone(const fs::path& dump, const fs::path& analysis, const fs::path& out, const std::string& steps) {
  mxscope::replay_options options;
  options.dump = dump;
  options.analysis_path = analysis;
  options.out = out;
  options.steps = steps;
  std::ostringstream log;
  ASSERT_TRUE(mxscope::run_replay(options, log).complete);
}

void expect_same_run(const fs::path& expected, const fs::path& actual) {
  for (const char* file : {"steps.csv", "accumulation.csv", "summary.json"}) {
    SCOPED_TRACE(file);
    const std::string reference = read_text(expected / file);
    ASSERT_FALSE(reference.empty());
    EXPECT_TRUE(reference == read_text(actual / file)) << (actual / file) << " differs from " << (expected / file);
  }
  EXPECT_FALSE(fs::exists(actual / ".partial"));
}

const fs::path sample = source_dir / "data" / "sample";

// Four strategies of analyses/wgrad-ablation.toml (the whole set takes too long for CI on two
// cores): 2 layers x 1 gemm x 4 strategies = 8 units of unequal cost.
fs::path write_ablation(const fs::path& root) {
  const fs::path path = root / "ablation.toml";
  std::ofstream(path) << R"(name = "ablation-subset"
gemms = ["wgrad"]
reference = "exact"
[defaults]
accumulation = "fp32-block"
seed = 20241129
[[strategy]]
name = "bf16"
format = "bf16"
[[strategy]]
name = "mxfp4-rne"
format = "mxfp4"
[[strategy]]
name = "mxfp4-sr"
format = "mxfp4"
rounding = "sr"
seed_policy = "per-step"
[[strategy]]
name = "mxfp4-h16"
format = "mxfp4"
rotation = "hadamard:16"
)";
  return path;
}

// Whether a rank's state file lists a unit "(layer, gemm, strategy)" of write_ablation's analysis on
// data/sample whose fragment ("<layer index>-<layer>.<gemm>.<strategy index>.unit", src/replay.cpp)
// is not written yet.
bool owns_unfinished_unit(const fs::path& partial, const nlohmann::json& state) {
  const std::vector<std::string> layers = {"layers.1.attn.o_proj", "layers.2.mlp.down_proj"};
  const std::vector<std::string> strategies = {"bf16", "mxfp4-rne", "mxfp4-sr", "mxfp4-h16"};
  if (!state.contains("units")) return false;
  for (const auto& item : state["units"]) {
    const std::string text = item.get<std::string>();  // "(layer, gemm, strategy)"
    for (std::size_t l = 0; l < layers.size(); ++l) {
      for (std::size_t k = 0; k < strategies.size(); ++k) {
        if (text != "(" + layers[l] + ", wgrad, " + strategies[k] + ")") continue;
        char name[160];
        std::snprintf(name, sizeof(name), "%05zu-%s.wgrad.%03zu.unit", l, layers[l].c_str(), k);
        if (!fs::exists(partial / name)) return true;
      }
    }
  }
  return false;
}

TEST(ReplayMpi, TwoAndThreeRanksGiveTheBytesOfOneProcess) {
  SKIP_WITHOUT_MPI();
  const fs::path root = fresh_directory("bytes");
  const fs::path ablation = write_ablation(root);
  replay_alone(sample, ablation, root / "one", "400-402");
  for (int ranks : {2, 3}) {
    SCOPED_TRACE(ranks);
    const fs::path out = root / ("ranks" + std::to_string(ranks));
    const int code = run_mpirun(ranks,
                                {sample.string(), "--analysis", ablation.string(), "--out", out.string(), "--steps",
                                 "400-402", "--threads", "1"},
                                root / "log.txt");
    const std::string log = read_text(root / "log.txt");
    ASSERT_EQ(code, 0) << log;
    EXPECT_NE(log.find("8 units replayed by " + std::to_string(ranks) + " ranks"), std::string::npos) << log;
    expect_same_run(root / "one", out);
    const auto run = nlohmann::json::parse(read_text(out / "run.json"));
    EXPECT_EQ(run["ranks"], ranks);
    ASSERT_EQ(run["per_rank"].size(), static_cast<std::size_t>(ranks));
    int units = 0;
    for (const auto& item : run["per_rank"]) units += item["units"].get<int>();
    EXPECT_EQ(units, 8);  // each unit replayed once
  }
  fs::remove_all(root);
}

// A real SIGKILL of one rank while it works: mpirun stops the run, the lowest live rank names the
// dead one and its units, and --resume with 2 ranks (instead of 3) gives the bytes of one process.
TEST(ReplayMpi, KilledRankStopsTheRunAndResumeWithOtherRankCountFinishes) {
  SKIP_WITHOUT_MPI();
  const fs::path root = fresh_directory("kill");
  const fs::path ablation = write_ablation(root);
  const std::string steps = "400-402";
  const fs::path out = root / "killed";
  const std::vector<std::string> arguments = {sample.string(), "--analysis", ablation.string(), "--out", out.string(),
                                              "--steps",       steps,          "--threads",       "1"};
  const pid_t launcher = start_mpirun(3, arguments, root / "log.txt");
  // Kill a rank other than 0 that is working while some unit is already complete.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int victim = -1;
  while (victim < 0 && std::chrono::steady_clock::now() < deadline && !fs::exists(out / "steps.csv")) {
    bool some_unit_done = false;
    std::error_code missing;  // the launcher may not have created the directory yet
    for (const auto& item : fs::directory_iterator(out / ".partial", missing)) {
      some_unit_done = some_unit_done || item.path().extension() == ".unit";
    }
    for (int r = 1; r < 3 && some_unit_done && victim < 0; ++r) {
      const auto state = nlohmann::json::parse(read_text(out / ".partial" / ("rank-0000" + std::to_string(r) + ".json")),
                                               nullptr, false);
      if (state.is_object() && state.value("state", "") == "working") {
        // Only while one of its own units is unfinished: a rank that has written its last
        // fragment still says "working" for a moment, and killing it then would leave the other
        // ranks to finish every unit, with nothing left to resume.
        if (!owns_unfinished_unit(out / ".partial", state)) continue;
        ::kill(static_cast<pid_t>(state["pid"].get<std::int64_t>()), SIGKILL);
        victim = r;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const int code = wait_for(launcher);
  const std::string log = read_text(root / "log.txt");
  ASSERT_GE(victim, 1) << "no rank could be killed while working; the test proves nothing\n" << log;
  EXPECT_NE(code, 0) << log;
  EXPECT_FALSE(fs::exists(out / "steps.csv"));
  const std::string named = "rank " + std::to_string(victim) + " of 3 (host ";
  EXPECT_NE(log.find(named), std::string::npos) << log;
  EXPECT_NE(log.find("is gone; it was working on (layers."), std::string::npos) << log;
  EXPECT_NE(log.find("finish the run with --resume"), std::string::npos) << log;

  std::size_t kept = 0;
  for (const auto& item : fs::directory_iterator(out / ".partial")) kept += item.path().extension() == ".unit";
  EXPECT_GT(kept, 0u);
  EXPECT_LT(kept, 8u);
  const int resumed = run_mpirun(2, [&] {
    auto again = arguments;
    again.push_back("--resume");
    return again;
  }(), root / "resume.txt");
  const std::string resume_log = read_text(root / "resume.txt");
  ASSERT_EQ(resumed, 0) << resume_log;
  EXPECT_NE(resume_log.find(std::to_string(kept) + " of 8 units kept"), std::string::npos) << resume_log;
  replay_alone(sample, ablation, root / "one", steps);
  expect_same_run(root / "one", out);
  for (const auto& item : fs::directory_iterator(out)) {
    EXPECT_EQ(item.path().filename().string().find(".tmp."), std::string::npos) << item.path();
  }
  fs::remove_all(root);
}

// Bad input met in the middle of the work (a NaN in one entry of the second layer): the rank that
// meets it is named with what it was doing, the others stop, mpirun exits 2, and the message
// appears once.
TEST(ReplayMpi, RankFailingOnBadInputNamesRankAndStopsTheRun) {
  SKIP_WITHOUT_MPI();
  const fs::path root = fresh_directory("nan");
  const fs::path dump = root / "dump";
  fs::create_directories(dump);
  nlohmann::json manifest;
  manifest["format"] = "mxscope-dump";
  manifest["version"] = 1;
  manifest["source"] = {{"hardware", "synthetic"}, {"framework", "test_replay_mpi"}, {"recipe", "none"},
                        {"model", "none"},         {"notes", "generated in the test"}};
  manifest["entries"] = nlohmann::json::array();
  std::mt19937_64 generator(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto random_matrix = [&](std::int64_t rows, std::int64_t cols) {
    mxscope::matrix m(rows, cols);
    for (auto& v : m.values) v = static_cast<float>(normal(generator));
    return m;
  };
  for (const std::string layer : {"layer.a", "layer.b"}) {
    for (int step = 1; step <= 3; ++step) {
      mxscope::io::safetensors_writer writer;
      mxscope::matrix x = random_matrix(64, 32);
      if (layer == "layer.b" && step == 3) x(5, 7) = std::numeric_limits<float>::quiet_NaN();
      writer.add_matrix("x", x);
      writer.add_matrix("dy", random_matrix(64, 16));
      const std::string file = layer + "_" + std::to_string(step) + ".safetensors";
      writer.write(dump / file);
      manifest["entries"].push_back({{"step", step}, {"layer", layer}, {"file", file}});
    }
  }
  std::ofstream(dump / "manifest.json") << manifest.dump(2);
  std::ofstream(root / "a.toml") << "gemms = [\"wgrad\"]\n"
                                    "[[strategy]]\nname = \"rne\"\nformat = \"mxfp4\"\n"
                                    "[[strategy]]\nname = \"sr\"\nformat = \"mxfp4\"\nrounding = \"sr\"\n";
  const fs::path out = root / "run";
  const int code = run_mpirun(2, {dump.string(), "--analysis", (root / "a.toml").string(), "--out", out.string()},
                              root / "log.txt");
  const std::string log = read_text(root / "log.txt");
  EXPECT_EQ(code, 2) << log;
  // Equal costs: rank 0 owns the units of layer.a, rank 1 those of layer.b.
  EXPECT_NE(log.find("rank 1 of 2 (host "), std::string::npos) << log;
  EXPECT_NE(log.find("failed on reading step 3 of layer layer.b"), std::string::npos) << log;
  EXPECT_NE(log.find("non-finite"), std::string::npos) << log;
  // Whether rank 0 finished layer.a before it saw the stop depends on timing: 0 or 2 units kept.
  EXPECT_TRUE(log.find("2 of 4 units are complete") != std::string::npos ||
              log.find("0 of 4 units are complete") != std::string::npos)
      << log;
  EXPECT_EQ(log.find("rank 0 of 2 (host"), std::string::npos) << log;
  const std::size_t first = log.find("failed on reading");
  EXPECT_EQ(log.find("failed on reading", first + 1), std::string::npos) << "message repeated:\n" << log;
  EXPECT_FALSE(fs::exists(out / "steps.csv"));
  EXPECT_FALSE(fs::exists(out / ".partial" / "00001-layer.b.wgrad.000.unit"));
  fs::remove_all(root);
}

}  // namespace
