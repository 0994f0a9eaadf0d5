// Part of host.cu (included there, in order, inside namespace mxscope::gpu):
// the replay's cross-step state on the device.
// ================================================================================================
// The replay's cross-step state on the device: the shared per-element functions
// (include/mxscope/core/cross_step.hpp) run on every element, and each canonical chunk's partial
// sums are formed in index order (cross_step_chunks), so each state element and each chunk partial
// has the CPU's bits; the host combines the partials by canonical_tree and takes the square roots
// as src/cross_step.cpp does.

namespace {

constexpr int cross_step_matrices = 7;  // fp64 state matrices per reference or unit state

// One thread block of ordered_sum_lanes threads per canonical chunk (ordered_chunk_sums,
// common.cuh). Every accumulator slot of the per-element functions is updated as acc = acc + t with
// t = fl(x y) (no contraction); each element starts from slots set to +0, which leaves it t
// (0 + t = t; a -0 term becomes +0, which adds like -0 to a partial that is never -0 itself).
constexpr int cross_step_lanes = ordered_sum_lanes;

template <int Sums, class Element>
__device__ inline void cross_step_chunks(std::int64_t count, std::int64_t chunk_count, double* partials,
                                         const Element& element) {
  ordered_chunk_sums<Sums>(chunk_count, canonical_chunks{count}, [&](std::int64_t i, double* t) { element(i, t); },
                           partials);
}

// First: a fresh state's first step. Its values are +0 (what a zeroed matrix holds) without being
// read, and every one is written, so the state's memory needs no zeroing before.
template <bool First>
__global__ void reference_cross_step_kernel(core_ns::reference_state_view state, const double* g, double beta,
                                            core_ns::adamw_step_constants adamw, std::int64_t count,
                                            std::int64_t chunk_count, double* partials) {
  cross_step_chunks<core_ns::reference_sum_count>(count, chunk_count, partials, [&](std::int64_t i, double* acc) {
    if constexpr (First) {
      double v[cross_step_matrices] = {};
      core_ns::reference_element_of({v[0], v[1], v[2], v[3], v[4], v[5], v[6]}, beta, adamw, g[i], acc);
      state.sum[i] = v[0];
      state.sgd_momentum[i] = v[1];
      state.sgd_displacement[i] = v[2];
      state.adamw_first[i] = v[3];
      state.adamw_second[i] = v[4];
      state.adamw_direction[i] = v[5];
      state.adamw_displacement[i] = v[6];
    } else {
      core_ns::reference_element(state, beta, adamw, g[i], i, acc);
    }
  });
}

template <bool First>
__global__ void unit_cross_step_kernel(core_ns::unit_state_view state, core_ns::reference_optimizer_view reference,
                                       const float* estimate, const double* exact, const double* g, double beta,
                                       core_ns::adamw_step_constants adamw, std::int64_t count,
                                       std::int64_t chunk_count, double* partials) {
  cross_step_chunks<core_ns::unit_sum_count>(count, chunk_count, partials, [&](std::int64_t i, double* acc) {
    if constexpr (First) {
      double v[cross_step_matrices] = {};
      core_ns::unit_element_of({v[0], v[1], v[2], v[3], v[4], v[5], v[6]}, reference, beta, adamw, estimate[i],
                               exact[i], g[i], i, acc);
      state.error_sum[i] = v[0];
      state.previous_error[i] = v[1];
      state.sgd_momentum[i] = v[2];
      state.sgd_displacement[i] = v[3];
      state.adamw_first[i] = v[4];
      state.adamw_second[i] = v[5];
      state.adamw_displacement[i] = v[6];
    } else {
      core_ns::unit_element(state, reference, beta, adamw, estimate[i], exact[i], g[i], i, acc);
    }
  });
}


std::string shape_text(std::int64_t rows, std::int64_t cols) {
  std::string text = "[";  // appended piece by piece: "[" + std::string trips GCC 12's -Wrestrict
  text += to_text(rows);
  text += ", ";
  text += to_text(cols);
  text += "]";
  return text;
}

void require_cross_step_shape(std::int64_t rows, std::int64_t cols, std::int64_t want_rows, std::int64_t want_cols,
                              const char* what, const char* where) {
  if (rows != want_rows || cols != want_cols) {
    throw input_error(std::string(where) + ": " + what + " is " + shape_text(rows, cols) + ", expected " +
                      shape_text(want_rows, want_cols));
  }
}

// The canonical totals of `width` sums from their chunk partials on the device.
template <int width>
std::array<double, width> cross_step_totals(const device_buffer& partials, std::int64_t chunk_count) {
  std::vector<double> host(static_cast<std::size_t>(width * chunk_count));
  partials.download(host.data(), host.size() * sizeof(double));
  std::array<double, width> totals{};
  for (int s = 0; s < width; ++s) {
    totals[static_cast<std::size_t>(s)] =
        tree_of(host, static_cast<std::size_t>(s * chunk_count), static_cast<std::size_t>(chunk_count));
  }
  return totals;
}

core_ns::adamw_step_constants adamw_constants_of(const optimizer_settings& settings, std::int64_t t) {
  return core_ns::make_adamw_step_constants(settings.adamw_beta1, settings.adamw_beta2, settings.adamw_eps, t);
}

// Throws gpu_error when allocating `bytes` now would leave less than the reserve free. What the
// buffer cache keeps counts as free (the other stages get it back when an allocation fails): it is
// emptied, and the free memory measured again, only where the first measure falls short, so that
// a state that fits leaves the kept buffers to the next stages.
void require_cross_step_room(std::size_t bytes, std::int64_t count, const cross_step_reserve& reserve,
                             const char* what) {
  std::size_t free_bytes = 0, total_bytes = 0;
  const std::uint64_t keep = reserve.fixed + reserve.per_element * static_cast<std::uint64_t>(count);
  const auto fits = [&] {
    return static_cast<std::uint64_t>(free_bytes) >= keep && static_cast<std::uint64_t>(free_bytes) - keep >= bytes;
  };
  MXSCOPE_GPU_CHECK(runtime::memory_info(&free_bytes, &total_bytes));
  if (!fits()) {
    release_kept_buffers();
    MXSCOPE_GPU_CHECK(runtime::memory_info(&free_bytes, &total_bytes));
  }
  if (!fits()) {
    throw gpu_error(std::string(what) + ": " + std::to_string(bytes) + " bytes of device memory would leave less than " +
                    std::to_string(keep) + " of the " + std::to_string(free_bytes) + " free");
  }
}

// Downloads matrix `index` of a state allocation of `count` elements per matrix.
void download_state_matrix(const device_buffer& state, int index, std::int64_t rows, std::int64_t cols,
                           matrix64& out) {
  out = matrix64(rows, cols);
  const std::size_t bytes = static_cast<std::size_t>(rows * cols) * sizeof(double);
  if (bytes > 0) state.download(out.data(), bytes, static_cast<std::size_t>(index) * bytes);
}

}  // namespace

struct reference_cross_step::storage {
  cross_step_reserve reserve;
  std::int64_t steps = 0;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  device_buffer state;     // sum, SGD momentum and displacement, AdamW first, second, direction, displacement
  device_buffer g;         // G_t of the last step
  device_buffer partials;  // reference_sum_count x chunks
  // Upload buffers of a unit's Ghat_t and X_t for unit steps given host matrices, shared by the
  // units of this (layer, GEMM) (one step at a time), allocated by the first such step (a replay
  // passes device matrices and never needs them).
  device_buffer estimate;
  device_buffer exact;

  std::int64_t count() const { return rows * cols; }
  double* matrix_at(int index) const { return state.as<double>() + static_cast<std::int64_t>(index) * count(); }
};

reference_cross_step::reference_cross_step(cross_step_reserve reserve) : storage_(std::make_unique<storage>()) {
  storage_->reserve = reserve;
}
reference_cross_step::~reference_cross_step() = default;
reference_cross_step::reference_cross_step(reference_cross_step&&) noexcept = default;
reference_cross_step& reference_cross_step::operator=(reference_cross_step&&) noexcept = default;
std::int64_t reference_cross_step::steps() const { return storage_->steps; }

namespace {

// The reference state's device memory, allocated and zeroed at its first step (everything first,
// then commit: a failed allocation leaves the state at step 0); then the shape check.
void prepare_reference_step(reference_cross_step::storage& s, std::int64_t rows, std::int64_t cols);

// The step itself, once G_t is in s.g.
reference_step_norms run_reference_step(reference_cross_step::storage& s, const optimizer_settings& settings);

}  // namespace

reference_step_norms reference_cross_step::step(const matrix64& g, const optimizer_settings& settings) {
  storage& s = *storage_;
  prepare_reference_step(s, g.rows, g.cols);
  s.g.upload(g.data(), static_cast<std::size_t>(s.count()) * sizeof(double));
  return run_reference_step(s, settings);
}

reference_step_norms reference_cross_step::step(const device_matrix& g, const optimizer_settings& settings) {
  storage& s = *storage_;
  prepare_reference_step(s, g.rows(), g.cols());
  copy_on_device(s.g.get(), g.fp64(), static_cast<std::size_t>(s.count()) * sizeof(double));
  return run_reference_step(s, settings);
}

namespace {

void prepare_reference_step(reference_cross_step::storage& s, std::int64_t rows, std::int64_t cols) {
  if (s.steps == 0) {
    const std::int64_t count = rows * cols;
    const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(double);
    const std::size_t partial_bytes =
        static_cast<std::size_t>(core_ns::reference_sum_count * chunk_count) * sizeof(double);
    require_cross_step_room((cross_step_matrices + 1) * bytes + partial_bytes, count, s.reserve,
                            "reference_cross_step");
    device_buffer state(cross_step_matrices * bytes);
    device_buffer gradient(bytes);
    device_buffer partials(partial_bytes);  // the state is not zeroed: the first step writes it whole
    s.state = std::move(state);
    s.g = std::move(gradient);
    s.partials = std::move(partials);
    s.rows = rows;
    s.cols = cols;
  }
  require_cross_step_shape(rows, cols, s.rows, s.cols, "G", "reference_step");
}

reference_step_norms run_reference_step(reference_cross_step::storage& s, const optimizer_settings& settings) {
  const std::int64_t t = s.steps + 1;
  const std::int64_t count = s.count();
  const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
  std::array<double, core_ns::reference_sum_count> sums{};
  if (count > 0) {
    const core_ns::reference_state_view view{s.matrix_at(0), s.matrix_at(1), s.matrix_at(2), s.matrix_at(3),
                                             s.matrix_at(4), s.matrix_at(5), s.matrix_at(6)};
    runtime::launch(s.steps == 0 ? reference_cross_step_kernel<true> : reference_cross_step_kernel<false>,
                    grid_for(chunk_count, 1), cross_step_lanes, 0, view,
                    s.g.as<const double>(),
                    settings.sgd_momentum, adamw_constants_of(settings, t), count, chunk_count,
                    s.partials.as<double>());
    sums = cross_step_totals<core_ns::reference_sum_count>(s.partials, chunk_count);
  }
  s.steps = t;
  return reference_norms(sums);
}

}  // namespace

void reference_cross_step::download(reference_accumulators& out) const {
  const storage& s = *storage_;
  out.steps = s.steps;
  matrix64* matrices[cross_step_matrices] = {&out.sum,         &out.sgd_momentum, &out.sgd_displacement,
                                             &out.adamw_first, &out.adamw_second, &out.adamw_direction,
                                             &out.adamw_displacement};
  for (int m = 0; m < cross_step_matrices; ++m) {
    if (s.steps == 0) {
      *matrices[m] = matrix64();
    } else {
      download_state_matrix(s.state, m, s.rows, s.cols, *matrices[m]);
    }
  }
}

struct unit_cross_step::storage {
  cross_step_reserve reserve;
  std::int64_t steps = 0;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  double previous_error_energy = 0.0;
  device_buffer state;  // error sum, previous error, SGD momentum and displacement, AdamW first, second, displacement
  device_buffer partials;

  std::int64_t count() const { return rows * cols; }
  double* matrix_at(int index) const { return state.as<double>() + static_cast<std::int64_t>(index) * count(); }
};

unit_cross_step::unit_cross_step(cross_step_reserve reserve) : storage_(std::make_unique<storage>()) {
  storage_->reserve = reserve;
}
unit_cross_step::~unit_cross_step() = default;
unit_cross_step::unit_cross_step(unit_cross_step&&) noexcept = default;
unit_cross_step& unit_cross_step::operator=(unit_cross_step&&) noexcept = default;
std::int64_t unit_cross_step::steps() const { return storage_->steps; }

unit_step_norms unit_cross_step::step(const reference_cross_step& reference, const matrix& estimate,
                                      const matrix64& exact, const optimizer_settings& settings) {
  reference_cross_step::storage& r = reference.data();  // its upload buffers are the unit's
  require_cross_step_shape(exact.rows, exact.cols, r.rows, r.cols, "the exact product X", "unit_step");
  require_cross_step_shape(estimate.rows, estimate.cols, r.rows, r.cols, "the estimate Ghat", "unit_step");
  const std::int64_t count = r.count();
  if (count > 0) {
    const std::size_t estimate_bytes = static_cast<std::size_t>(count) * sizeof(float);
    const std::size_t exact_bytes = static_cast<std::size_t>(count) * sizeof(double);
    if (r.estimate.bytes() != estimate_bytes) r.estimate = device_buffer(estimate_bytes);
    if (r.exact.bytes() != exact_bytes) r.exact = device_buffer(exact_bytes);
    r.estimate.upload(estimate.data(), estimate_bytes);
    r.exact.upload(exact.data(), exact_bytes);
  }
  return step_on_device(reference, r.estimate.as<const float>(), r.exact.as<const double>(), settings);
}

unit_step_norms unit_cross_step::step(const reference_cross_step& reference, const device_matrix& estimate,
                                      const device_matrix& exact, const optimizer_settings& settings) {
  const reference_cross_step::storage& r = reference.data();
  require_cross_step_shape(exact.rows(), exact.cols(), r.rows, r.cols, "the exact product X", "unit_step");
  require_cross_step_shape(estimate.rows(), estimate.cols(), r.rows, r.cols, "the estimate Ghat", "unit_step");
  return step_on_device(reference, estimate.fp32(), exact.fp64(), settings);
}

unit_step_norms unit_cross_step::step_on_device(const reference_cross_step& reference, const float* estimate,
                                                const double* exact, const optimizer_settings& settings) {
  storage& s = *storage_;
  const reference_cross_step::storage& r = reference.data();
  if (r.steps != s.steps + 1) {
    throw std::logic_error("unit_step: step " + to_text(s.steps + 1) +
                           " of a unit needs the reference at that step, not at step " + to_text(r.steps));
  }
  const std::int64_t count = r.count();
  const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
  if (s.steps == 0) {
    const std::size_t state_bytes = cross_step_matrices * static_cast<std::size_t>(count) * sizeof(double);
    const std::size_t partial_bytes = static_cast<std::size_t>(core_ns::unit_sum_count * chunk_count) * sizeof(double);
    require_cross_step_room(state_bytes + partial_bytes, count, s.reserve, "unit_cross_step");
    device_buffer state(state_bytes);
    device_buffer partials(partial_bytes);  // the state is not zeroed: the first step writes it whole
    s.state = std::move(state);
    s.partials = std::move(partials);
    s.rows = r.rows;
    s.cols = r.cols;
  }
  require_cross_step_shape(s.rows, s.cols, r.rows, r.cols, "the unit state", "unit_step");
  const std::int64_t t = s.steps + 1;
  std::array<double, core_ns::unit_sum_count> sums{};
  if (count > 0) {
    const core_ns::unit_state_view view{s.matrix_at(0), s.matrix_at(1), s.matrix_at(2), s.matrix_at(3),
                                        s.matrix_at(4), s.matrix_at(5), s.matrix_at(6)};
    const core_ns::reference_optimizer_view reference_view{r.matrix_at(1), r.matrix_at(2), r.matrix_at(5),
                                                           r.matrix_at(6)};
    runtime::launch(s.steps == 0 ? unit_cross_step_kernel<true> : unit_cross_step_kernel<false>,
                    grid_for(chunk_count, 1), cross_step_lanes, 0, view, reference_view,
                    estimate, exact,
                    r.g.as<const double>(), settings.sgd_momentum, adamw_constants_of(settings, t), count,
                    chunk_count, s.partials.as<double>());
    sums = cross_step_totals<core_ns::unit_sum_count>(s.partials, chunk_count);
  }
  s.steps = t;
  const unit_step_norms out = unit_norms(sums, t, s.previous_error_energy);  // as src/cross_step.cpp
  s.previous_error_energy = out.error_energy;
  return out;
}

void unit_cross_step::download(unit_accumulators& out) const {
  const storage& s = *storage_;
  out.steps = s.steps;
  out.previous_error_energy = s.previous_error_energy;
  matrix64* matrices[cross_step_matrices] = {&out.error_sum,   &out.previous_error, &out.sgd_momentum,
                                             &out.sgd_displacement, &out.adamw_first, &out.adamw_second,
                                             &out.adamw_displacement};
  for (int m = 0; m < cross_step_matrices; ++m) {
    if (s.steps == 0) {
      *matrices[m] = matrix64();
    } else {
      download_state_matrix(s.state, m, s.rows, s.cols, *matrices[m]);
    }
  }
}


