// The device timeline (gpu.hpp: start_timeline, finish_timeline; runtime.hpp: timed_operation):
// two events per queued operation on the queuing thread's stream, read back when it ends.
#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <map>

#include "common.cuh"

namespace mxscope::gpu {

namespace {

struct recorded {
  runtime::event_t start{};
  runtime::event_t stop{};
  bool ended = false;
  const void* kernel = nullptr;  // null for copies and memsets, named by `what`
  const char* what = nullptr;
  std::string label;
  void* stream = nullptr;
  std::int64_t bytes = 0;
};

struct recorder {
  std::mutex mutex;
  std::size_t capacity = 0;
  runtime::event_t origin{};
  bool has_origin = false;
  std::vector<recorded> operations;
  std::int64_t not_recorded = 0;
};

recorder& the_recorder() {
  static recorder instance;
  return instance;
}

thread_local std::string current_label;

void destroy(recorded& operation) {
  (void)runtime::event_destroy(operation.start);
  (void)runtime::event_destroy(operation.stop);
}

// The kernel's demangled name: from the runtime where it knows it (CUDA), else from the host
// symbol of its launch stub, else its address.
std::string kernel_name(const void* kernel) {
  const char* raw = nullptr;
#if defined(__CUDACC__) && !defined(__HIP__) && !defined(MXSCOPE_GPU_SIMULATE)
  if (cudaFuncGetName(&raw, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    raw = nullptr;
  }
#endif
  Dl_info info{};
  if (raw == nullptr && dladdr(kernel, &info) != 0 && info.dli_sname != nullptr) raw = info.dli_sname;
  if (raw == nullptr) {
    char text[48];
    std::snprintf(text, sizeof text, "kernel at %p", kernel);
    return text;
  }
  int status = 0;
  char* demangled = abi::__cxa_demangle(raw, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled != nullptr ? demangled : raw;
  std::free(demangled);
  return name;
}

}  // namespace

namespace runtime {

int timeline_begin(const void* kernel, const char* what, std::int64_t bytes) {
  recorder& r = the_recorder();
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    if (r.operations.size() >= r.capacity) {
      ++r.not_recorded;
      return -1;
    }
  }
  recorded operation;
  operation.kernel = kernel;
  operation.what = what;
  operation.label = current_label;
  operation.stream = current_stream;
  operation.bytes = bytes;
  MXSCOPE_GPU_CHECK(event_create(&operation.start));
  MXSCOPE_GPU_CHECK(event_create(&operation.stop));
  MXSCOPE_GPU_CHECK(event_record(operation.start));
  const std::lock_guard<std::mutex> lock(r.mutex);
  if (!timeline_on.load(std::memory_order_relaxed)) {
    destroy(operation);
    return -1;
  }
  r.operations.push_back(std::move(operation));
  return static_cast<int>(r.operations.size() - 1);
}

void timeline_end(int index) {
  recorder& r = the_recorder();
  const std::lock_guard<std::mutex> lock(r.mutex);
  if (index < 0 || static_cast<std::size_t>(index) >= r.operations.size()) return;  // a timeline ended meanwhile
  recorded& operation = r.operations[static_cast<std::size_t>(index)];
  if (event_record(operation.stop) == success) operation.ended = true;
}

}  // namespace runtime

void start_timeline(std::size_t capacity) {
  recorder& r = the_recorder();
  const std::lock_guard<std::mutex> lock(r.mutex);
  r.capacity = capacity;
  for (recorded& operation : r.operations) destroy(operation);
  r.operations.clear();
  r.not_recorded = 0;
  if (!r.has_origin) {
    MXSCOPE_GPU_CHECK(runtime::event_create(&r.origin));
    r.has_origin = true;
  }
  MXSCOPE_GPU_CHECK(runtime::event_record(r.origin));
  runtime::timeline_on.store(true);
}

std::vector<timeline::operation> finish_timeline(std::int64_t* not_recorded) {
  recorder& r = the_recorder();
  std::vector<recorded> taken;
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    runtime::timeline_on.store(false);
    taken.swap(r.operations);
    if (not_recorded != nullptr) *not_recorded = r.not_recorded;
  }
  synchronize();
  std::vector<timeline::operation> out;
  std::map<void*, int> streams;
  std::map<const void*, std::string> names;
  for (recorded& operation : taken) {
    if (operation.ended && r.has_origin) {
      float start = 0.0f, stop = 0.0f;
      MXSCOPE_GPU_CHECK(runtime::event_elapsed_ms(&start, r.origin, operation.start));
      MXSCOPE_GPU_CHECK(runtime::event_elapsed_ms(&stop, r.origin, operation.stop));
      timeline::operation entry;
      if (operation.kernel != nullptr) {
        auto [at, fresh] = names.try_emplace(operation.kernel);
        if (fresh) at->second = kernel_name(operation.kernel);
        entry.name = at->second;
      } else {
        entry.name = operation.what != nullptr ? operation.what : "";
      }
      entry.label = std::move(operation.label);
      entry.stream = streams.try_emplace(operation.stream, static_cast<int>(streams.size())).first->second;
      entry.bytes = operation.bytes;
      entry.start_ms = start;
      entry.stop_ms = std::max(stop, start);
      out.push_back(std::move(entry));
    }
    destroy(operation);
  }
  return out;
}

std::string set_timeline_label(std::string label) {
  std::swap(current_label, label);
  return label;
}

}  // namespace mxscope::gpu
