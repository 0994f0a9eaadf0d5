// Host-to-device copy of a replay step's operands: which way is fastest from the memory a capture
// is read into (a std::vector<float> advised onto transparent huge pages, as src/io/safetensors.cpp
// reserves it)? Prints, for the same bytes on the same device:
//   - pageable: one cudaMemcpy from that memory (what backend::upload does);
//   - register: cudaHostRegister of that memory, the copy, cudaHostUnregister (each timed);
//   - staged T: T host threads, each copying its share of 16 MiB pieces into two pinned slots of
//     its own and queuing each slot's copy on its own stream (the copy of one slot while the
//     thread fills the other);
//   - pinned: one cudaMemcpy from cudaMallocHost memory (the bus's ceiling);
// then the time to make 128 MiB of pinned memory by cudaMallocHost and by faulting in huge pages
// and registering them (the replay's upload slots).
// Every method's device bytes are compared with the source's (a wrong copy fails the run).
//
// Usage: mxscope_h2d_copy [MiB] (default 576: x and dy of the Llama-shaped Wgrad step as fp32)
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr std::size_t piece = std::size_t{16} << 20;

// T threads; thread w copies pieces w, w + T, ... through its two pinned slots and its stream.
void staged_copy(const unsigned char* source, unsigned char* device, std::size_t bytes, int threads,
                 const std::vector<unsigned char*>& slots, const std::vector<cudaStream_t>& streams,
                 const std::vector<cudaEvent_t>& events) {
  std::vector<std::thread> workers;
  const std::size_t pieces = (bytes + piece - 1) / piece;
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&, w] {
      int turn = 0;
      for (std::size_t p = static_cast<std::size_t>(w); p < pieces; p += static_cast<std::size_t>(threads)) {
        const int slot = 2 * w + turn;
        check(cudaEventSynchronize(events[slot]), "cudaEventSynchronize");  // its previous copy is done
        const std::size_t offset = p * piece;
        const std::size_t n = std::min(piece, bytes - offset);
        std::memcpy(slots[slot], source + offset, n);
        check(cudaMemcpyAsync(device + offset, slots[slot], n, cudaMemcpyHostToDevice, streams[w]), "cudaMemcpyAsync");
        check(cudaEventRecord(events[slot], streams[w]), "cudaEventRecord");
        turn ^= 1;
      }
      check(cudaStreamSynchronize(streams[w]), "cudaStreamSynchronize");
    });
  }
  for (auto& t : workers) t.join();
}

bool same_bytes(const unsigned char* device, const unsigned char* host, std::size_t bytes) {
  std::vector<unsigned char> back(bytes);
  check(cudaMemcpy(back.data(), device, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy back");
  return std::memcmp(back.data(), host, bytes) == 0;
}

void report(const char* name, std::vector<double> ms, std::size_t bytes) {
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  std::printf("%-34s median %8.3f ms (%.3f .. %.3f), %6.2f GB/s\n", name, median, ms.front(), ms.back(),
              static_cast<double>(bytes) / median / 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 576;
  const std::size_t bytes = mib << 20;
  const int rounds = 5;
  check(cudaFree(nullptr), "cudaFree");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s; %zu MiB a copy, %d rounds\n", prop.name, mib, rounds);

  std::vector<float> values;
  values.reserve(bytes / sizeof(float));
  {
    constexpr std::uintptr_t huge = std::uintptr_t{2} << 20;
    const auto begin = reinterpret_cast<std::uintptr_t>(values.data());
    const std::uintptr_t first = (begin + huge - 1) & ~(huge - 1);
    const std::uintptr_t last = (begin + bytes) & ~(huge - 1);
    if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
  values.resize(bytes / sizeof(float));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 65521) * 0.5f;
  const auto* source = reinterpret_cast<const unsigned char*>(values.data());
  unsigned char* device = nullptr;
  check(cudaMalloc(&device, bytes), "cudaMalloc");
  bool all_same = true;

  std::vector<double> ms;
  for (int r = 0; r < rounds; ++r) {
    check(cudaMemset(device, 0, bytes), "cudaMemset");
    check(cudaDeviceSynchronize(), "sync");
    const double t = now_ms();
    check(cudaMemcpy(device, source, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    ms.push_back(now_ms() - t);
  }
  all_same = all_same && same_bytes(device, source, bytes);
  report("pageable", ms, bytes);

  std::vector<double> reg, copy, unreg, whole;
  for (int r = 0; r < rounds; ++r) {
    check(cudaMemset(device, 0, bytes), "cudaMemset");
    check(cudaDeviceSynchronize(), "sync");
    const double t0 = now_ms();
    check(cudaHostRegister(values.data(), bytes, cudaHostRegisterDefault), "cudaHostRegister");
    const double t1 = now_ms();
    check(cudaMemcpy(device, source, bytes, cudaMemcpyHostToDevice), "cudaMemcpy registered");
    const double t2 = now_ms();
    check(cudaHostUnregister(values.data()), "cudaHostUnregister");
    const double t3 = now_ms();
    reg.push_back(t1 - t0);
    copy.push_back(t2 - t1);
    unreg.push_back(t3 - t2);
    whole.push_back(t3 - t0);
  }
  all_same = all_same && same_bytes(device, source, bytes);
  report("register + copy + unregister", whole, bytes);
  report("  of which register", reg, bytes);
  report("  of which the copy", copy, bytes);
  report("  of which unregister", unreg, bytes);

  for (int threads : {1, 2, 4, 8}) {
    std::vector<unsigned char*> slots(static_cast<std::size_t>(2 * threads));
    std::vector<cudaStream_t> streams(static_cast<std::size_t>(threads));
    std::vector<cudaEvent_t> events(slots.size());
    for (auto& s : slots) check(cudaMallocHost(&s, piece), "cudaMallocHost slot");
    for (auto& s : streams) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    for (auto& e : events) {
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventRecord(e, streams[0]), "cudaEventRecord");
    }
    check(cudaDeviceSynchronize(), "sync");
    ms.clear();
    for (int r = 0; r < rounds; ++r) {
      check(cudaMemset(device, 0, bytes), "cudaMemset");
      check(cudaDeviceSynchronize(), "sync");
      const double t = now_ms();
      staged_copy(source, device, bytes, threads, slots, streams, events);
      ms.push_back(now_ms() - t);
    }
    all_same = all_same && same_bytes(device, source, bytes);
    char name[64];
    std::snprintf(name, sizeof(name), "staged, %d thread(s)", threads);
    report(name, ms, bytes);
    for (auto& e : events) check(cudaEventDestroy(e), "cudaEventDestroy");
    for (auto& s : streams) check(cudaStreamDestroy(s), "cudaStreamDestroy");
    for (auto& s : slots) check(cudaFreeHost(s), "cudaFreeHost");
  }

  unsigned char* pinned = nullptr;
  const double a0 = now_ms();
  check(cudaMallocHost(&pinned, bytes), "cudaMallocHost");
  const double a1 = now_ms();
  std::memcpy(pinned, source, bytes);
  ms.clear();
  for (int r = 0; r < rounds; ++r) {
    const double t = now_ms();
    check(cudaMemcpy(device, pinned, bytes, cudaMemcpyHostToDevice), "cudaMemcpy pinned");
    ms.push_back(now_ms() - t);
  }
  all_same = all_same && same_bytes(device, source, bytes);
  report("pinned (cudaMallocHost) source", ms, bytes);
  std::printf("cudaMallocHost of %zu MiB: %.3f ms\n", mib, a1 - a0);
  check(cudaFreeHost(pinned), "cudaFreeHost");
  check(cudaFree(device), "cudaFree");

  // 128 MiB of pinned memory (the replay's upload slots, src/gpu/upload.cu) made two ways.
  const std::size_t slots = std::size_t{128} << 20;
  std::vector<double> by_malloc_host, by_register;
  for (int r = 0; r < rounds; ++r) {
    double t = now_ms();
    check(cudaMallocHost(&pinned, slots), "cudaMallocHost slots");
    by_malloc_host.push_back(now_ms() - t);
    check(cudaFreeHost(pinned), "cudaFreeHost slots");
    t = now_ms();
    void* block = std::aligned_alloc(std::size_t{2} << 20, slots);
    if (block == nullptr) return 1;
    (void)madvise(block, slots, MADV_HUGEPAGE);
    std::memset(block, 0, slots);
    check(cudaHostRegister(block, slots, cudaHostRegisterDefault), "cudaHostRegister slots");
    by_register.push_back(now_ms() - t);
    check(cudaHostUnregister(block), "cudaHostUnregister slots");
    std::free(block);
  }
  report("128 MiB slots by cudaMallocHost", by_malloc_host, slots);
  report("128 MiB slots: huge pages + register", by_register, slots);
  std::printf("%s\n", all_same ? "every method copied the same bytes" : "FAIL: a method copied other bytes");
  return all_same ? 0 : 1;
}
