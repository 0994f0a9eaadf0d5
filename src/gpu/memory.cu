// The GPU backend's devices, device memory (buffers, the cache that keeps them for reuse,
// matrices, timers) and the quantizers' plans.
#include "common.cuh"

namespace mxscope::gpu {

// ================================================================================================
// Devices and memory.

int device_count() {
  int count = 0;
  if (runtime::device_count(&count) != runtime::success) {
    (void)runtime::last_error();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

void select_device(int index) {
  const int count = device_count();
  if (index < 0 || index >= count) {
    throw gpu_error("gpu: device " + std::to_string(index) + " does not exist (this machine has " +
                    std::to_string(count) + ")");
  }
  MXSCOPE_GPU_CHECK(runtime::set_device(index));
}

device_description describe_device() {
  int device = 0;
  MXSCOPE_GPU_CHECK(runtime::get_device(&device));
  runtime::device_properties properties{};
  MXSCOPE_GPU_CHECK(runtime::properties(&properties, device));
  device_description out;
  out.name = properties.name;
  out.major = properties.major;
  out.minor = properties.minor;
  out.multiprocessors = properties.multiProcessorCount;
  out.global_memory_bytes = properties.totalGlobalMem;
  return out;
}

// The current device's properties, or nothing where no device answers (the error cleared): for
// the feature checks that report absence instead of throwing.
std::optional<runtime::device_properties> current_device_properties() {
  int device = 0;
  runtime::device_properties properties{};
  if (runtime::get_device(&device) != runtime::success ||
      runtime::properties(&properties, device) != runtime::success) {
    (void)runtime::last_error();
    return std::nullopt;
  }
  return properties;
}

namespace {

// Device buffers given back outside stream order are kept for reuse instead of freed: cudaFree
// waits for the whole device, so a free between two stages left the device idle while the host
// queued the next stage's work (BENCHMARKS.md, "The device buffers kept for reuse"), and the set-up
// buffers (scratch_buffer: the exact reference's operands in chunk tiles, 0.6 GB at the benchmark's
// shape, the rows' descriptions) are not allocated from the driver on every call. A buffer is
// taken again only by an allocation on the default stream, where all the backend's kernels run:
// work queued on it before it was given back runs before work queued after it is taken.
// Allocations on another stream (the uploads beside the work) never take one, since that stream
// does not wait for the default stream's kernels. The cache keeps the last buffer_cache_entries
// buffers given back while they total at most 1/8 of the device's memory; release_kept_buffers
// empties it where a cross-step state would not fit beside it (require_cross_step_room) and before
// an allocation is retried, so what it keeps never makes a stage run out of memory.
constexpr std::size_t buffer_cache_entries = 64;

struct buffer_cache {
  struct entry {
    int device;
    std::size_t capacity;
    void* data;
  };
  std::mutex mutex;
  std::vector<entry> entries;  // oldest first
  std::size_t bytes = 0;
};

buffer_cache& the_buffer_cache() {
  static buffer_cache* cache = new buffer_cache;  // never destroyed: no cudaFree after the runtime's teardown
  return *cache;
}

// A kept buffer of `device` of at least `bytes` and at most about twice that (the smallest such),
// into data and capacity; false where none is kept.
bool take_cached_buffer(int device, std::size_t bytes, void*& data, std::size_t& capacity) {
  buffer_cache& cache = the_buffer_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  auto best = cache.entries.end();
  for (auto it = cache.entries.begin(); it != cache.entries.end(); ++it) {
    if (it->device == device && it->capacity >= bytes && it->capacity - bytes <= bytes + 65536 &&
        (best == cache.entries.end() || it->capacity < best->capacity)) {
      best = it;
    }
  }
  if (best == cache.entries.end()) return false;
  data = best->data;
  capacity = best->capacity;
  cache.bytes -= best->capacity;
  cache.entries.erase(best);
  return true;
}

void free_buffers(const std::vector<buffer_cache::entry>& released) {
  for (const buffer_cache::entry& e : released) (void)runtime::free(e.data);
}

// Keeps the buffer for reuse, or frees it where it belongs to another device than the current
// one or the device's memory cannot be read; drops the oldest kept buffers beyond the limits.
void give_back_buffer(int device, std::size_t capacity, void* data) {
  int current = 0;
  if (runtime::get_device(&current) != runtime::success || current != device) {
    (void)runtime::last_error();
    (void)runtime::free(data);
    return;
  }
  std::vector<buffer_cache::entry> dropped;
  {
    buffer_cache& cache = the_buffer_cache();
    const std::lock_guard<std::mutex> lock(cache.mutex);
    // The devices' memory sizes, read once each (a query per free would cost a driver call).
    static std::vector<std::size_t> totals;
    const auto index = static_cast<std::size_t>(device);
    try {
      // Every allocation first, so that the updates below cannot throw (this runs in destructors).
      if (totals.size() <= index) totals.resize(index + 1, 0);
      cache.entries.reserve(cache.entries.size() + 1);
      dropped.reserve(cache.entries.size() + 1);
    } catch (const std::bad_alloc&) {
      (void)runtime::free(data);
      return;
    }
    if (totals[index] == 0) {
      std::size_t free_bytes = 0, total_bytes = 0;
      if (runtime::memory_info(&free_bytes, &total_bytes) != runtime::success) {
        (void)runtime::last_error();
      } else {
        totals[index] = total_bytes;
      }
    }
    const std::size_t total_bytes = totals[index];
    cache.entries.push_back({device, capacity, data});
    cache.bytes += capacity;
    while (!cache.entries.empty() &&
           (cache.entries.size() > buffer_cache_entries || cache.bytes > total_bytes / 8)) {
      cache.bytes -= cache.entries.front().capacity;
      dropped.push_back(cache.entries.front());
      cache.entries.erase(cache.entries.begin());
    }
  }
  free_buffers(dropped);
}

}  // namespace

void release_kept_buffers() {
  std::vector<buffer_cache::entry> released;
  {
    buffer_cache& cache = the_buffer_cache();
    const std::lock_guard<std::mutex> lock(cache.mutex);
    released.swap(cache.entries);
    cache.bytes = 0;
  }
  free_buffers(released);
}

// Multiprocessors of the current device, queried once per device.
int multiprocessor_count() {
  static std::mutex mutex;
  static std::vector<int> counts;
  int device = 0;
  MXSCOPE_GPU_CHECK(runtime::get_device(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto index = static_cast<std::size_t>(device);
  if (counts.size() <= index) counts.resize(index + 1, 0);
  if (counts[index] == 0) {
    runtime::device_properties properties{};
    MXSCOPE_GPU_CHECK(runtime::properties(&properties, device));
    counts[index] = std::max(properties.multiProcessorCount, 1);
  }
  return counts[index];
}

device_buffer::device_buffer(std::size_t bytes) : bytes_(bytes), capacity_(bytes) {
  if (bytes == 0) return;
  if (runtime::stream_ordered) {
    ordered_ = true;
    stream_ = runtime::current_stream;
    MXSCOPE_GPU_CHECK(runtime::malloc_ordered(&data_, bytes));
    return;
  }
  MXSCOPE_GPU_CHECK(runtime::get_device(&device_));
  if (runtime::current_stream == nullptr && take_cached_buffer(device_, bytes, data_, capacity_)) return;
  if (runtime::malloc(&data_, bytes) != runtime::success) {
    // Out of memory, perhaps because of what the cache keeps: once more without it.
    (void)runtime::last_error();
    data_ = nullptr;
    release_kept_buffers();
    MXSCOPE_GPU_CHECK(runtime::malloc(&data_, bytes));
  }
}

void release_cached_memory() { release_kept_buffers(); }

std::size_t cached_memory_bytes() {
  buffer_cache& cache = the_buffer_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  return cache.bytes;
}

void device_buffer::free_memory() noexcept {
  if (data_ == nullptr) return;
  if (ordered_) {
    (void)runtime::free_ordered(data_, stream_);
  } else {
    give_back_buffer(device_, capacity_, data_);
  }
  data_ = nullptr;
}

device_buffer::~device_buffer() { free_memory(); }

device_buffer::device_buffer(device_buffer&& other) noexcept
    : data_(other.data_),
      bytes_(other.bytes_),
      capacity_(other.capacity_),
      device_(other.device_),
      ordered_(other.ordered_),
      stream_(other.stream_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
  other.capacity_ = 0;
}

device_buffer& device_buffer::operator=(device_buffer&& other) noexcept {
  if (this != &other) {
    free_memory();
    data_ = other.data_;
    bytes_ = other.bytes_;
    capacity_ = other.capacity_;
    device_ = other.device_;
    ordered_ = other.ordered_;
    stream_ = other.stream_;
    other.data_ = nullptr;
    other.bytes_ = 0;
    other.capacity_ = 0;
  }
  return *this;
}

stream_scope::stream_scope(void* stream, bool stream_ordered)
    : previous_stream_(runtime::current_stream), previous_ordered_(runtime::stream_ordered) {
  runtime::current_stream = stream;
  runtime::stream_ordered = stream_ordered;
}

stream_scope::~stream_scope() {
  runtime::current_stream = previous_stream_;
  runtime::stream_ordered = previous_ordered_;
}

void device_buffer::upload(const void* host, std::size_t bytes, std::size_t offset) {
  if (offset + bytes > bytes_) throw gpu_error("device_buffer::upload: " + std::to_string(bytes) + " bytes do not fit");
  char* to = static_cast<char*>(data_) + offset;
  if (bytes > 0 && !staged_upload(to, host, bytes)) MXSCOPE_GPU_CHECK(runtime::copy_to_device(to, host, bytes));
}

void device_buffer::download(void* host, std::size_t bytes, std::size_t offset) const {
  if (offset + bytes > bytes_)
    throw gpu_error("device_buffer::download: " + std::to_string(bytes) + " bytes do not fit");
  if (bytes > 0) MXSCOPE_GPU_CHECK(runtime::copy_to_host(host, static_cast<const char*>(data_) + offset, bytes));
}

void device_buffer::fill_bytes(int value) {
  if (bytes_ > 0) MXSCOPE_GPU_CHECK(runtime::memset(data_, value, bytes_));
}

device_matrix::device_matrix(std::int64_t rows, std::int64_t cols, element kind)
    : buffer_(static_cast<std::size_t>(rows * cols) * (kind == element::fp32 ? sizeof(float) : sizeof(double))),
      rows_(rows),
      cols_(cols),
      kind_(kind) {}

device_matrix device_matrix::upload(const matrix& values) {
  device_matrix out(values.rows, values.cols, element::fp32);
  out.buffer_.upload(values.data(), out.buffer_.bytes());
  return out;
}

namespace {
// A stream that runs beside the default stream, destroyed with its owner.
class side_stream {
 public:
  side_stream() { MXSCOPE_GPU_CHECK(runtime::stream_create_beside(&stream_)); }
  ~side_stream() {
    if (stream_ != nullptr) (void)runtime::stream_destroy(stream_);
  }
  side_stream(const side_stream&) = delete;
  side_stream& operator=(const side_stream&) = delete;
  void* get() const { return stream_; }

 private:
  void* stream_ = nullptr;
};

// One stream per thread that uploads beside the default stream, made on its first use.
void* side_stream_of_thread() {
  static thread_local const side_stream stream;
  return stream.get();
}
}  // namespace

device_matrix upload_beside(const matrix& values) {
  const stream_scope scope(side_stream_of_thread(), false);  // plain allocation: freed by cudaFree, on any thread
  return device_matrix::upload(values);
}

device_matrix allocate_beside(std::int64_t rows, std::int64_t cols) {
  const stream_scope scope(side_stream_of_thread(), false);
  return device_matrix(rows, cols, device_matrix::element::fp32);
}

void upload_beside(device_matrix& values, const float* host, std::int64_t first, std::int64_t count) {
  const stream_scope scope(side_stream_of_thread(), false);
  values.upload_part(host, first, count);
}

void device_matrix::upload_part(const float* host, std::int64_t first, std::int64_t count) {
  if (kind_ != element::fp32) throw std::logic_error("device_matrix::upload_part: an fp64 matrix");
  if (first < 0 || count < 0 || first + count > size()) {
    throw std::logic_error("device_matrix::upload_part: elements outside the matrix");
  }
  buffer_.upload(host, static_cast<std::size_t>(count) * sizeof(float), static_cast<std::size_t>(first) * sizeof(float));
}

device_matrix device_matrix::upload(const matrix64& values) {
  device_matrix out(values.rows, values.cols, element::fp64);
  out.buffer_.upload(values.data(), out.buffer_.bytes());
  return out;
}

float* device_matrix::fp32() const {
  if (kind_ != element::fp32) throw std::logic_error("device_matrix: an fp64 matrix read as fp32");
  return buffer_.as<float>();
}

double* device_matrix::fp64() const {
  if (kind_ != element::fp64) throw std::logic_error("device_matrix: an fp32 matrix read as fp64");
  return buffer_.as<double>();
}

matrix device_matrix::download32() const {
  matrix out(rows_, cols_);
  buffer_.download(out.data(), static_cast<std::size_t>(size()) * sizeof(float));
  return out;
}

matrix64 device_matrix::download64() const {
  matrix64 out(rows_, cols_);
  buffer_.download(out.data(), static_cast<std::size_t>(size()) * sizeof(double));
  return out;
}

void synchronize() {
  MXSCOPE_GPU_CHECK(runtime::synchronize());
  MXSCOPE_GPU_CHECK(runtime::last_error());
}

void release_after_kernels() {
  if (!(runtime::has_ordered_allocation && runtime::stream_ordered)) synchronize();
}

void copy_on_device(void* destination, const void* source, std::size_t bytes) {
  if (bytes > 0) MXSCOPE_GPU_CHECK(runtime::copy_on_device_async(destination, source, bytes));
}

device_timer::device_timer() {
  runtime::event_t start{}, stop{};
  MXSCOPE_GPU_CHECK(runtime::event_create(&start));
  MXSCOPE_GPU_CHECK(runtime::event_create(&stop));
  start_ = static_cast<void*>(start);
  stop_ = static_cast<void*>(stop);
}

device_timer::~device_timer() {
  (void)runtime::event_destroy(static_cast<runtime::event_t>(start_));
  (void)runtime::event_destroy(static_cast<runtime::event_t>(stop_));
}

void device_timer::start() { MXSCOPE_GPU_CHECK(runtime::event_record(static_cast<runtime::event_t>(start_))); }
void device_timer::stop() { MXSCOPE_GPU_CHECK(runtime::event_record(static_cast<runtime::event_t>(stop_))); }

double device_timer::elapsed_ms() {
  MXSCOPE_GPU_CHECK(runtime::event_synchronize(static_cast<runtime::event_t>(stop_)));
  float milliseconds = 0.0f;
  MXSCOPE_GPU_CHECK(runtime::event_elapsed_ms(&milliseconds, static_cast<runtime::event_t>(start_),
                                              static_cast<runtime::event_t>(stop_)));
  return milliseconds;
}

// ================================================================================================
// Plans.

rotation_plan make_rotation_plan(const rotation_options& options) {
  rotation_plan plan;
  plan.size = options.size;
  plan.random_signs = options.signs != sign_policy::none;
  plan.signs =
      core_ns::random_stream{options.seed,
                             core_ns::policy_step(options.signs == sign_policy::fixed ? core_ns::seed_policy::fixed
                                                                                      : core_ns::seed_policy::per_step,
                                                  options.step),
                             core_ns::stream_tag(options.layer_hash, core_ns::random_role::signs)};
  return plan;
}

void check_rotation(const rotation_plan& rotation, std::int64_t rows, std::int64_t cols, int axis,
                    const std::string& what) {
  if (rotation.size == 0) return;
  if (axis != 0 && axis != 1) throw input_error(what + ": rotation axis must be 0 or 1, got " + to_text(axis));
  if (!core_ns::is_valid_rotation_size(rotation.size)) {
    throw input_error(what + ": field 'rotation': size " + to_text(rotation.size) + " is not a power of two in [" +
                      to_text(core_ns::rotation_size_min) + ", " + to_text(core_ns::rotation_size_max) + "]");
  }
  const std::int64_t length = axis == 1 ? cols : rows;
  if (length % rotation.size != 0) {
    throw input_error(what + ": field 'rotation': size " + to_text(rotation.size) + " does not divide the length " +
                      to_text(length) + " of axis " + to_text(axis));
  }
}

mx_plan make_mx_plan(const quantize_options& options, const std::string& what) {
  if (options.format.scheme != quant_scheme::mx) {
    throw input_error(what + ": field 'format': the GPU backend quantizes MX formats only");
  }
  const element_kind kind = options.format.element;
  if (kind == element_kind::e8m0 || kind == element_kind::ue4m3) {
    throw input_error(what + ": field 'format': not an MX element format");
  }
  if (options.axis != 0 && options.axis != 1) {
    throw input_error(what + ": field 'axis' must be 0 or 1, got " + to_text(options.axis));
  }
  if (options.block < 0 || options.block > (1 << 20)) {
    throw input_error(what + ": field 'block' must be in 1.." + to_text(1 << 20) + ", got " + to_text(options.block));
  }
  if (options.sr_bits < 1 || options.sr_bits > 32) {
    throw input_error(what + ": field 'sr_bits' must be in 1..32, got " + to_text(options.sr_bits));
  }
  mx_plan plan;
  plan.element = kind;
  plan.block =
      options.block > 0 ? options.block : (options.format.default_block > 0 ? options.format.default_block : 32);
  plan.axis = options.axis;
  plan.rounding = options.rounding;
  plan.rule = options.rule;
  plan.sr_bits = options.sr_bits;
  plan.stream = options.stream;
  return plan;
}

std::int64_t mx_code_row_bytes(const mx_plan& plan, std::int64_t cols) {
  return core_ns::spec(plan.element).bits == 4 ? (cols + 1) / 2 : cols;
}
std::int64_t mx_code_bytes(const mx_plan& plan, std::int64_t rows, std::int64_t cols) {
  return rows * mx_code_row_bytes(plan, cols);
}
std::int64_t mx_scale_rows(const mx_plan& plan, std::int64_t rows, std::int64_t) {
  return plan.axis == 1 ? rows : (rows + plan.block - 1) / plan.block;
}
std::int64_t mx_scale_cols(const mx_plan& plan, std::int64_t, std::int64_t cols) {
  return plan.axis == 1 ? (cols + plan.block - 1) / plan.block : cols;
}

}  // namespace mxscope::gpu
