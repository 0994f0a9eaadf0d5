// GPU test suites: the comparison metrics and the replay's cross-step state against the library's
// own CPU implementations (src/compare.cpp, src/cross_step.cpp).
#include "support.hpp"

namespace gpu_test {

std::string compare_fields(const mxscope::comparison& want, const mxscope::comparison& got) {
  const auto check = [](const char* field, double expected, double actual) -> std::string {
    const bool ok =
        (std::isnan(expected) && std::isnan(actual)) || core::double_bits(expected) == core::double_bits(actual);
    return ok ? "" : std::string(field) + ": expected " + show(expected) + " got " + show(actual);
  };
  for (const auto& [field, expected, actual] :
       {std::tuple{"rel_err", want.rel_err, got.rel_err}, std::tuple{"cosine", want.cosine, got.cosine},
        std::tuple{"bias", want.bias, got.bias}, std::tuple{"orth_err", want.orth_err, got.orth_err},
        std::tuple{"max_abs_err", want.max_abs_err, got.max_abs_err},
        std::tuple{"error_norm", want.error_norm, got.error_norm},
        std::tuple{"reference_norm", want.reference_norm, got.reference_norm},
        std::tuple{"estimate_norm", want.estimate_norm, got.estimate_norm},
        std::tuple{"error_dot_reference", want.error_dot_reference, got.error_dot_reference},
        std::tuple{"estimate_dot_reference", want.estimate_dot_reference, got.estimate_dot_reference},
        std::tuple{"ulp.mean", want.ulp.mean, got.ulp.mean}}) {
    const std::string problem = check(field, expected, actual);
    if (!problem.empty()) return problem;
  }
  if (want.zero_reference != got.zero_reference) return "zero_reference differs";
  if (want.nonfinite_estimate != got.nonfinite_estimate) return "nonfinite_estimate differs";
  if (want.ulp.histogram != got.ulp.histogram) return "ulp histogram differs";
  if (want.ulp.max != got.ulp.max || want.ulp.compared != got.ulp.compared || want.ulp.nan_pairs != got.ulp.nan_pairs) {
    return "ulp max/compared/nan_pairs differ";
  }
  if (want.row_error_norms.size() != got.row_error_norms.size()) return "row norm count differs";
  for (std::size_t r = 0; r < want.row_error_norms.size(); ++r) {
    const std::string problem = check("row_error_norms", want.row_error_norms[r], got.row_error_norms[r]);
    if (!problem.empty()) return problem + " (row " + std::to_string(r) + ")";
  }
  if (want.column_error_norms.size() != got.column_error_norms.size()) return "column norm count differs";
  for (std::size_t c = 0; c < want.column_error_norms.size(); ++c) {
    const std::string problem = check("column_error_norms", want.column_error_norms[c], got.column_error_norms[c]);
    if (!problem.empty()) return problem + " (column " + std::to_string(c) + ")";
  }
  return "";
}

void compare_checks(bool small) {
  struct shape {
    std::int64_t rows, cols;
  };
  const shape shapes[] = {{1, 1}, {37, 29}, {300, 300}, {3, 9000}, {9000, 5}, {1024, 1500}};
  int index = 0;
  for (const shape& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      ++index;
      if (small && s.rows * s.cols > 100000) continue;
      const std::uint64_t seed = next_seed();
      std::mt19937_64 random(seed);
      std::normal_distribution<double> normal(0.0, 1.0);
      matrix64 reference(s.rows, s.cols);
      matrix estimate(s.rows, s.cols);
      matrix reference32(s.rows, s.cols);
      for (std::int64_t i = 0; i < s.rows * s.cols; ++i) {
        const double g = variant == 2 ? 0.0 : normal(random) * std::ldexp(1.0, static_cast<int>(random() % 9) - 4);
        reference.values[static_cast<std::size_t>(i)] = g;
        reference32.values[static_cast<std::size_t>(i)] = static_cast<float>(g);
        estimate.values[static_cast<std::size_t>(i)] = static_cast<float>(g * (1.0 + 0.01 * normal(random)));
      }
      if (variant == 1 && s.rows * s.cols > 3) {
        estimate.values[1] = std::numeric_limits<float>::quiet_NaN();
        estimate.values[2] = std::numeric_limits<float>::infinity();
      }
      const std::string name = "compare " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
                               (variant == 0   ? " finite"
                                : variant == 1 ? " with NaN and inf"
                                               : " zero reference");
      run_case(name, [&]() -> std::string {
        const mxscope::comparison want = mxscope::compare(estimate, reference, reference32);
        const mxscope::comparison got = gpu::compare(estimate, reference, reference32);
        std::string problem = compare_fields(want, got);
        if (!problem.empty()) return problem + "; seed " + hex64(seed);
        // The overload on matrices already in device memory.
        const mxscope::comparison resident =
            gpu::compare(gpu::device_matrix::upload(estimate), gpu::device_matrix::upload(reference),
                         gpu::device_matrix::upload(reference32));
        problem = compare_fields(want, resident);
        return problem.empty() ? "" : "device_matrix overload: " + problem + "; seed " + hex64(seed);
      });
    }
  }
}

// The replay's cross-step state: T steps of the reference and of two units fed the same inputs on
// the CPU (src/cross_step.cpp) and on the GPU; every returned norm and, after the last step, every
// state element must have the same bits.
std::string same_matrix(const char* what, const matrix64& want, const matrix64& got) {
  if (want.rows != got.rows || want.cols != got.cols) return std::string(what) + ": shapes differ";
  for (std::size_t i = 0; i < want.values.size(); ++i) {
    if (core::double_bits(want.values[i]) != core::double_bits(got.values[i])) {
      return std::string(what) + "[" + std::to_string(i) + "]: expected " + show(want.values[i]) + " got " +
             show(got.values[i]);
    }
  }
  return "";
}

std::string same_norms(const char* what, int step, std::initializer_list<std::tuple<const char*, double, double>> fields) {
  for (const auto& [field, expected, actual] : fields) {
    if (core::double_bits(expected) != core::double_bits(actual)) {
      return std::string(what) + " step " + std::to_string(step) + " " + field + ": expected " + show(expected) +
             " got " + show(actual);
    }
  }
  return "";
}

namespace {

// Reference and unit states stepped on the device against the CPU's, over several steps and shapes.
void cross_step_steps(bool small) {
  struct shape {
    std::int64_t rows, cols;
  };
  const shape shapes[] = {{1, 1}, {37, 300}, {5, 8200}, {3, 4096}, {300, 300}};
  constexpr int steps = 3;
  for (const shape& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      if (small && s.rows * s.cols > 50000 && variant != 0) continue;
      const std::uint64_t seed = next_seed();
      const std::string name = "cross-step " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
                               (variant == 0   ? " random"
                                : variant == 1 ? " zero reference and an exact unit"
                                               : " scales and zeros");
      run_case(name, [&]() -> std::string {
        std::mt19937_64 random(seed);
        std::normal_distribution<double> normal(0.0, 1.0);
        mxscope::optimizer_settings settings;
        if (variant == 2) {
          settings.sgd_momentum = 0.5;
          settings.adamw_beta1 = 0.8;
          settings.adamw_beta2 = 0.999;
          settings.adamw_eps = 1e-6;
        }
        mxscope::reference_accumulators cpu_reference;
        std::vector<mxscope::unit_accumulators> cpu_units(2);
        const std::int64_t count = s.rows * s.cols;
        // The states' memory as a first step may find it: buffers of their size given back earlier
        // and kept by the buffer cache, full of NaN bits rather than zeros (the first step writes
        // every state value without reading it).
        gpu::release_cached_memory();
        {
          std::vector<gpu::device_buffer> planted;
          for (int k = 0; k < 3; ++k) {
            planted.emplace_back(static_cast<std::size_t>(7 * count) * sizeof(double));
            planted.back().fill_bytes(0xFF);
          }
        }
        gpu::reference_cross_step gpu_reference;
        std::vector<gpu::unit_cross_step> gpu_units(2);
        for (int t = 1; t <= steps; ++t) {
          matrix64 g(s.rows, s.cols);
          for (std::int64_t i = 0; i < count; ++i) {
            double value = normal(random) * std::ldexp(1.0, static_cast<int>(random() % 17) - 8);
            if (variant == 1) value = 0.0;
            if (variant == 2 && random() % 5 == 0) value = 0.0;
            g.values[static_cast<std::size_t>(i)] = value;
          }
          const mxscope::reference_step_norms want = mxscope::reference_step(cpu_reference, g, settings);
          // Even steps take G from device memory (the replay's way), odd ones from the host.
          const mxscope::reference_step_norms got =
              t % 2 == 0 ? gpu_reference.step(gpu::device_matrix::upload(g), settings) : gpu_reference.step(g, settings);
          std::string problem =
              same_norms("reference", t, {{"reference", want.reference, got.reference},
                                          {"sum", want.sum, got.sum},
                                          {"sgd_update", want.sgd_update, got.sgd_update},
                                          {"sgd_displacement", want.sgd_displacement, got.sgd_displacement},
                                          {"adamw_update", want.adamw_update, got.adamw_update},
                                          {"adamw_displacement", want.adamw_displacement, got.adamw_displacement}});
          if (!problem.empty()) return problem + "; seed " + hex64(seed);
          for (std::size_t u = 0; u < cpu_units.size(); ++u) {
            // Unit 0: Ghat and X near G; unit 1: Ghat = X = G rounded to fp32 (zero errors where exact).
            matrix estimate(s.rows, s.cols);
            matrix64 exact(s.rows, s.cols);
            for (std::int64_t i = 0; i < count; ++i) {
              const double value = g.values[static_cast<std::size_t>(i)];
              const double x = u == 0 ? value * (1.0 + 0x1p-20 * normal(random)) : value;
              exact.values[static_cast<std::size_t>(i)] = x;
              estimate.values[static_cast<std::size_t>(i)] =
                  static_cast<float>(u == 0 ? x * (1.0 + 0x1p-12 * normal(random)) : x);
            }
            const mxscope::unit_step_norms w =
                mxscope::unit_step(cpu_units[u], cpu_reference, estimate, exact, g, settings);
            // Unit 0 reads its inputs from device memory, unit 1 from the host.
            const mxscope::unit_step_norms h =
                u == 0 ? gpu_units[u].step(gpu_reference, gpu::device_matrix::upload(estimate),
                                           gpu::device_matrix::upload(exact), settings)
                       : gpu_units[u].step(gpu_reference, estimate, exact, settings);
            problem = same_norms(
                u == 0 ? "unit 0" : "unit 1", t,
                {{"quantization", w.quantization, h.quantization},
                 {"accumulation", w.accumulation, h.accumulation},
                 {"error_energy", w.error_energy, h.error_energy},
                 {"previous_error_energy", w.previous_error_energy, h.previous_error_energy},
                 {"lag1_dot", w.lag1_dot, h.lag1_dot},
                 {"error_sum", w.error_sum, h.error_sum},
                 {"sgd_update_difference", w.sgd_update_difference, h.sgd_update_difference},
                 {"sgd_displacement_difference", w.sgd_displacement_difference, h.sgd_displacement_difference},
                 {"adamw_update_difference", w.adamw_update_difference, h.adamw_update_difference},
                 {"adamw_displacement_difference", w.adamw_displacement_difference,
                  h.adamw_displacement_difference}});
            if (!problem.empty()) return problem + "; seed " + hex64(seed);
          }
        }
        // The states themselves (what a unit on the host would read from a device reference).
        mxscope::reference_accumulators downloaded;
        gpu_reference.download(downloaded);
        if (downloaded.steps != cpu_reference.steps) return "reference steps differ";
        for (const auto& [what, want, got] :
             {std::tuple{"sum", &cpu_reference.sum, &downloaded.sum},
              std::tuple{"sgd_momentum", &cpu_reference.sgd_momentum, &downloaded.sgd_momentum},
              std::tuple{"sgd_displacement", &cpu_reference.sgd_displacement, &downloaded.sgd_displacement},
              std::tuple{"adamw_first", &cpu_reference.adamw_first, &downloaded.adamw_first},
              std::tuple{"adamw_second", &cpu_reference.adamw_second, &downloaded.adamw_second},
              std::tuple{"adamw_direction", &cpu_reference.adamw_direction, &downloaded.adamw_direction},
              std::tuple{"adamw_displacement", &cpu_reference.adamw_displacement, &downloaded.adamw_displacement}}) {
          const std::string problem = same_matrix(what, *want, *got);
          if (!problem.empty()) return "reference state " + problem + "; seed " + hex64(seed);
        }
        for (std::size_t u = 0; u < cpu_units.size(); ++u) {
          mxscope::unit_accumulators unit;
          gpu_units[u].download(unit);
          const mxscope::unit_accumulators& want = cpu_units[u];
          if (unit.steps != want.steps) return "unit steps differ";
          for (const auto& [what, w, h] :
               {std::tuple{"error_sum", &want.error_sum, &unit.error_sum},
                std::tuple{"previous_error", &want.previous_error, &unit.previous_error},
                std::tuple{"sgd_momentum", &want.sgd_momentum, &unit.sgd_momentum},
                std::tuple{"sgd_displacement", &want.sgd_displacement, &unit.sgd_displacement},
                std::tuple{"adamw_first", &want.adamw_first, &unit.adamw_first},
                std::tuple{"adamw_second", &want.adamw_second, &unit.adamw_second},
                std::tuple{"adamw_displacement", &want.adamw_displacement, &unit.adamw_displacement}}) {
            const std::string problem = same_matrix(what, *w, *h);
            if (!problem.empty()) return "unit state " + problem + "; seed " + hex64(seed);
          }
        }
        return "";
      });
    }
  }
}

// Misuse refused as on the CPU, and a state that cannot keep its reserve.
void cross_step_refusals() {
  // Misuse is refused as on the CPU: a unit ahead of its reference, a shape that changes.
  run_case("cross-step misuse", []() -> std::string {
    const mxscope::optimizer_settings settings;
    gpu::reference_cross_step reference;
    gpu::unit_cross_step unit;
    const matrix64 g(3, 5);
    reference.step(g, settings);
    bool refused = false;
    try {
      reference.step(matrix64(5, 3), settings);
    } catch (const mxscope::input_error&) {
      refused = true;
    }
    if (!refused || reference.steps() != 1) return "a G of another shape was accepted";
    unit.step(reference, matrix(3, 5), matrix64(3, 5), settings);
    refused = false;
    try {
      unit.step(reference, matrix(3, 5), matrix64(3, 5), settings);
    } catch (const std::logic_error&) {
      refused = true;
    }
    if (!refused || unit.steps() != 1) return "a unit step ahead of the reference was accepted";
    return "";
  });
  // A state that cannot keep its reserve free refuses its first step and stays at step 0, so the
  // replay can run it on the host; the other states are unaffected.
  run_case("cross-step reserve", []() -> std::string {
    const mxscope::optimizer_settings settings;
    const gpu::cross_step_reserve impossible{~std::uint64_t{0}, 0};
    matrix64 g(4, 6);
    for (std::size_t i = 0; i < g.values.size(); ++i) g.values[i] = static_cast<double>(i) - 7.5;
    gpu::reference_cross_step crowded(impossible);
    bool refused = false;
    try {
      crowded.step(g, settings);
    } catch (const gpu::gpu_error&) {
      refused = true;
    }
    if (!refused || crowded.steps() != 0) return "a reference state allocated beyond its reserve";
    gpu::reference_cross_step reference;
    const mxscope::reference_step_norms norms = reference.step(g, settings);
    mxscope::reference_accumulators host;
    const mxscope::reference_step_norms want = mxscope::reference_step(host, g, settings);
    if (core::double_bits(norms.adamw_displacement) != core::double_bits(want.adamw_displacement)) {
      return "the reference after a refused state differs";
    }
    gpu::unit_cross_step unit(impossible);
    refused = false;
    try {
      unit.step(reference, matrix(4, 6), matrix64(4, 6), settings);
    } catch (const gpu::gpu_error&) {
      refused = true;
    }
    if (!refused || unit.steps() != 0) return "a unit state allocated beyond its reserve";
    return "";
  });
  // A state that fits its reserve leaves the buffers kept for reuse where they are (the next
  // stages take them again); one that does not empties them before it measures again.
  run_case("cross-step reserve and the kept buffers", []() -> std::string {
    const mxscope::optimizer_settings settings;
    matrix64 g(4, 6);
    for (std::size_t i = 0; i < g.values.size(); ++i) g.values[i] = static_cast<double>(i) * 0.25;
    gpu::release_cached_memory();
    if (gpu::cached_memory_bytes() != 0) return "release_cached_memory left memory kept";
    constexpr std::size_t bytes = 2345679;
    { const gpu::device_buffer buffer(bytes); }
    if (gpu::cached_memory_bytes() < bytes) return "the buffer given back was not kept";
    gpu::reference_cross_step fitting(gpu::cross_step_reserve{0, 0});
    fitting.step(g, settings);
    if (gpu::cached_memory_bytes() < bytes) return "a state with room emptied the buffer cache";
    gpu::reference_cross_step crowded(gpu::cross_step_reserve{~std::uint64_t{0}, 0});
    try {
      crowded.step(g, settings);
    } catch (const gpu::gpu_error&) {
      if (gpu::cached_memory_bytes() != 0) return "a state without room kept the buffer cache";
      return "";
    }
    return "a reference state allocated beyond its reserve";
  });
}

}  // namespace

void cross_step_checks(bool small) {
  cross_step_steps(small);
  cross_step_refusals();
}

}  // namespace gpu_test
