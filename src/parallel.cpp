#include "mxscope/parallel.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "mxscope/errors.hpp"

#ifdef MXSCOPE_HAVE_MPI
#include <mpi.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <thread>
#endif

namespace mxscope {

namespace {

// The launcher's view of this process: (rank, size) from its environment, or nothing when no MPI
// launcher started it. A Slurm batch script alone sets SLURM_PROCID too, so Slurm is recognized
// through the PMI/PMIx variables that `srun --mpi=pmix|pmi2` sets.
struct launch {
  bool launched = false;
  int rank = 0;
  int size = 0;  // 0: not told
};

int integer_from(const char* text) {
  if (text == nullptr) return -1;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || value < 0 || value > 1'000'000'000) return -1;
  return static_cast<int>(value);
}

launch launch_from_environment() {
  launch out;
  const std::pair<const char*, const char*> pairs[] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}, {"PMIX_RANK", "PMIX_SIZE"}, {"PMI_RANK", "PMI_SIZE"}};
  for (const auto& [rank_name, size_name] : pairs) {
    const int rank = integer_from(std::getenv(rank_name));
    if (rank < 0) continue;
    out.launched = true;
    out.rank = rank;
    out.size = std::max(0, integer_from(std::getenv(size_name)));
    return out;
  }
  return out;
}

#ifdef MXSCOPE_HAVE_MPI

void check(int code, std::string_view what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(fmt::format("MPI: {} failed: {}", what, std::string_view(text, static_cast<std::size_t>(length))));
}

class mpi_world final : public process_group {
 public:
  mpi_world() {
    // SIGTERM is blocked in every thread (MPI's and OpenMP's inherit the mask from this one) and
    // taken by the watcher thread alone, which runs the report and exits.
    sigemptyset(&terminate_);
    sigaddset(&terminate_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &terminate_, &previous_mask_);
    watcher_ = std::thread([this] { watch(); });
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      // Only the main thread calls MPI; the OpenMP workers never do.
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
      owns_ = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
    MPI_Comm node = MPI_COMM_NULL;
    check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node),
          "MPI_Comm_split_type");
    check(MPI_Comm_rank(node, &local_rank_), "MPI_Comm_rank (node)");
    MPI_Comm_free(&node);
  }
  ~mpi_world() override {
    closing_ = true;
    pthread_kill(watcher_.native_handle(), SIGTERM);
    watcher_.join();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
    pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
  }
  void on_termination(std::function<void()> report) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    report_ = std::move(report);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  std::vector<std::string> all_gather(const std::string& text) override {
    // Ranks finish at different times. A blocking collective would spin on a CPU while it waits
    // (taking it from the ranks and threads still working on the node), so wait for everyone in a
    // non-blocking barrier polled every few milliseconds, then exchange.
    MPI_Request arrived = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(MPI_COMM_WORLD, &arrived), "MPI_Ibarrier");
    for (int done = 0;;) {
      check(MPI_Test(&arrived, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const int length = static_cast<int>(text.size());
    std::vector<int> lengths(static_cast<std::size_t>(size_));
    check(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD), "MPI_Allgather");
    std::vector<int> offsets(static_cast<std::size_t>(size_));
    long long total = 0;
    for (int r = 0; r < size_; ++r) {
      offsets[static_cast<std::size_t>(r)] = static_cast<int>(total);
      total += lengths[static_cast<std::size_t>(r)];
    }
    if (total > 1'000'000'000) throw std::runtime_error("MPI: all_gather of more than 1 GB");
    std::string all(static_cast<std::size_t>(total), '\0');
    check(MPI_Allgatherv(text.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(), MPI_CHAR,
                         MPI_COMM_WORLD),
          "MPI_Allgatherv");
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r) {
      out.push_back(all.substr(static_cast<std::size_t>(offsets[static_cast<std::size_t>(r)]),
                               static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)])));
    }
    return out;
  }

 private:
  void watch() {
    int signal_number = 0;
    sigwait(&terminate_, &signal_number);
    if (closing_) return;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (report_) {
        try {
          report_();
        } catch (...) {
          // Exiting is what matters now.
        }
      }
    }
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
    _exit(143);
  }

  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  bool owns_ = false;
  sigset_t terminate_{};
  sigset_t previous_mask_{};
  std::thread watcher_;
  std::atomic<bool> closing_{false};
  std::mutex mutex_;
  std::function<void()> report_;
};

#endif

}  // namespace

bool mpi_available() {
#ifdef MXSCOPE_HAVE_MPI
  return true;
#else
  return false;
#endif
}

std::unique_ptr<process_group> join_launched_processes() {
  const launch seen = launch_from_environment();
  if (!seen.launched) return std::make_unique<process_group>();
#ifdef MXSCOPE_HAVE_MPI
  return std::make_unique<mpi_world>();
#else
  if (seen.size > 1 || seen.rank > 0) {
    throw input_error(fmt::format(
        "started by an MPI launcher as rank {} of {}, but this build of mxscope has no MPI: every process would "
        "replay everything on its own; rebuild with MPI (libopenmpi-dev, cmake -DMXSCOPE_ENABLE_MPI=ON) or run "
        "one process",
        seen.rank, seen.size > 0 ? fmt::to_string(seen.size) : std::string("?")));
  }
  return std::make_unique<process_group>();
#endif
}

}  // namespace mxscope
