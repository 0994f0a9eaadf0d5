// GPU backend benchmark: device-to-device copy bandwidth (the memory ceiling), the MX quantizer
// (bf16 -> mxfp4, fused Hadamard-16 + quantize, stochastic rounding) as bandwidth and as a fraction
// of the copy, the MXFP4 fp32-block GEMM at n_out 4096, n_in 14336, K 8192 in TFLOP/s and its
// exact model on the tensor-core path's exact kernels, the MXFP8 e4m3 product (fp32-block and
// exact) on the integer path's kernels at that shape, and there,
// for unscaled bf16-valued operands, the exact reference and the fp32-block product in
// TFLOP/s (2 M N K / time, to set beside the fp64 peak: their chunk sums are fp64 FMAs).
// Times come from device events; every number is the median of the repeats after warm-up runs.
// With --sustain=S every row with warm-up runs first repeats its work back to back for S seconds,
// so that it times the card's sustained rate (its clock held under the power limit) rather than a
// burst's; tools/bench/gpu-baselines.py --sustain S does the same for the baselines.
// The GEMM result of the tensor-core path is checked against the integer path in every entry and
// against the host definition in sampled entries (PASS/FAIL lines; exit code 1 on a mismatch).
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "host_reference.hpp"
#include "mxscope/gpu.hpp"
#include "test_inputs.hpp"

namespace {

namespace core = mxscope::core;
namespace gpu = mxscope::gpu;

double sustain_seconds = 0.0;  // --sustain=S

double median_ms(int warmup, int repeats, const std::function<void()>& work) {
  for (int i = 0; i < warmup; ++i) work();
  gpu::synchronize();
  if (warmup > 0 && sustain_seconds > 0.0) {
    const auto begin = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() < sustain_seconds) {
      for (int i = 0; i < 4; ++i) work();
      gpu::synchronize();
    }
  }
  std::vector<double> times;
  gpu::device_timer timer;
  for (int i = 0; i < repeats; ++i) {
    timer.start();
    work();
    timer.stop();
    times.push_back(timer.elapsed_ms());
  }
  gpu::synchronize();
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// One timed run, and where that took under two seconds the median of three more: a slow kernel
// keeps the benchmark short.
double quick_median_ms(const std::function<void()>& work) {
  const double first = median_ms(0, 1, work);
  return first < 2000.0 ? median_ms(0, 3, work) : first;
}

std::uint64_t xorshift(std::uint64_t& state) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}

int failures = 0;

void verdict(bool ok, const std::string& name, const std::string& detail) {
  std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  if (!ok) ++failures;
  std::fflush(stdout);
}


// ---- Copy bandwidth: 1 GiB device to device, bytes read + bytes written.
double copy_baseline() {
  const std::size_t copy_bytes = std::size_t{1} << 30;
  double copy_bandwidth = 0.0;
  {
    gpu::device_buffer from(copy_bytes), to(copy_bytes);
    from.fill_bytes(0x5A);
    const double ms = median_ms(3, 20, [&] { gpu::copy_on_device(to.get(), from.get(), copy_bytes); });
    copy_bandwidth = 2.0 * static_cast<double>(copy_bytes) / (ms * 1e-3) / 1e9;
    std::printf("copy d2d 1 GiB: %.3f ms, %.0f GB/s (read + write)\n", ms, copy_bandwidth);
  }
  return copy_bandwidth;
}

// ---- Quantizer: bf16 [16384, 16384] -> mxfp4 codes + e8m0 scales along rows (block 32).
void bench_quantizer(double copy_bandwidth) {
  const std::int64_t rows = 16384, cols = 16384;
  std::vector<std::uint16_t> host(static_cast<std::size_t>(rows * cols));
  std::uint64_t state = 0x9E3779B97F4A7C15ULL;
  for (auto& v : host) {
    // A bf16 of random sign, exponent in [2^-8, 2^7) and mantissa: realistic activations / gradients.
    const std::uint64_t r = xorshift(state);
    const std::uint32_t exponent = 119U + static_cast<std::uint32_t>(r % 15U);
    v = static_cast<std::uint16_t>(((r >> 8) & 0x8000U) | (exponent << 7) | ((r >> 20) & 0x7FU));
  }
  gpu::device_buffer input(host.size() * 2);
  input.upload(host.data(), input.bytes());
  mxscope::quantize_options options;
  options.format = {mxscope::quant_scheme::mx, core::element_kind::fp4_e2m1, 32};
  options.axis = 1;
  options.stream = core::random_stream{1234, 5, 0xABCD};
  const gpu::mx_plan rne = gpu::make_mx_plan(options);
  options.rounding = core::rounding_mode::sr;
  const gpu::mx_plan sr = gpu::make_mx_plan(options);
  gpu::device_buffer codes(static_cast<std::size_t>(gpu::mx_code_bytes(rne, rows, cols)));
  gpu::device_buffer scales(static_cast<std::size_t>(rows * (cols / 32)));
  const gpu::mx_device_output output{codes.as<std::uint8_t>(), scales.as<std::uint8_t>(), nullptr, nullptr};
  // The statistics counters (flushed, saturated, nonzero, nonfinite) as the library's quantize()
  // asks for them: one row measures what they cost.
  gpu::device_buffer counters(4 * sizeof(unsigned long long));
  counters.fill_bytes(0);
  gpu::mx_device_output counted = output;
  counted.counters = counters.as<unsigned long long>();
  const double bytes = static_cast<double>(rows * cols * 2 + codes.bytes() + scales.bytes());
  gpu::rotation_plan none;
  gpu::rotation_plan h16;
  h16.size = 16;
  struct variant {
    const char* name;
    const gpu::mx_plan* plan;
    const gpu::rotation_plan* rotation;
    gpu::quantize_path path;
    const gpu::mx_device_output* output;
  };
  const variant variants[] = {
      {"quantize bf16->mxfp4 rne (fused path)", &rne, &none, gpu::quantize_path::fused, &output},
      {"quantize bf16->mxfp4 rne (fused path, with counters)", &rne, &none, gpu::quantize_path::fused, &counted},
      {"quantize bf16->mxfp4 rne (generic two-pass path)", &rne, &none, gpu::quantize_path::generic, &output},
      {"fused H16 + quantize bf16->mxfp4 rne", &rne, &h16, gpu::quantize_path::fused, &output},
      {"quantize bf16->mxfp4 sr (fused path)", &sr, &none, gpu::quantize_path::fused, &output},
      {"fused H16 + quantize bf16->mxfp4 sr", &sr, &h16, gpu::quantize_path::fused, &output},
  };
  std::printf("quantizer tensor: bf16 [%" PRId64 ", %" PRId64
              "], %.0f MB moved per run (bf16 in, codes + scales out)\n",
              rows, cols, bytes / 1e6);
  for (const variant& v : variants) {
    const double ms = median_ms(3, 15, [&] {
      gpu::quantize_on_device(input.get(), gpu::input_format::bf16, rows, cols, *v.plan, *v.rotation, *v.output,
                              v.path);
    });
    const double bandwidth = bytes / (ms * 1e-3) / 1e9;
    std::printf("%s: %.3f ms, %.0f GB/s, %.2f of copy bandwidth\n", v.name, ms, bandwidth,
                bandwidth / copy_bandwidth);
  }
}

// ---- The MXFP4 exact product at the same shape on the tensor-core path's exact kernels
// (mma_sync, and wgmma where available): each result and fp64 result equal in every entry to
// mma_sync's, 16 sampled entries equal to the host definition, and wgmma's time over mma_sync's.
void bench_mxfp4_exact(const gpu::prepared_operand& left, const gpu::prepared_operand& right,
                       const mxscope::quantized_tensor& a, const mxscope::quantized_tensor& b) {
  const std::int64_t n_out = a.rows, n_in = b.rows, k = a.cols;
  mxscope::accumulation_model model;
  model.kind = mxscope::accumulation_kind::exact;
  gpu::device_buffer out(static_cast<std::size_t>(n_out * n_in) * 4);
  gpu::device_buffer exact_out(static_cast<std::size_t>(n_out * n_in) * 8);
  std::vector<float> results[2];
  std::vector<double> exact_results[2];
  double times[2] = {};
  const gpu::exact_product_kernel kernels[2] = {gpu::exact_product_kernel::mma_sync, gpu::exact_product_kernel::wgmma};
  for (int v = 0; v < 2; ++v) {
    const std::string name(gpu::exact_product_kernel_name(kernels[v]));
    if (!gpu::exact_product_kernel_available(kernels[v])) {
      std::printf("gemm mxfp4 exact tensor_core %s: not available in this build on this device\n", name.c_str());
      continue;
    }
    gpu::select_exact_product_kernel(kernels[v]);
    out.fill_bytes(0xFF);
    exact_out.fill_bytes(0xFF);
    times[v] = median_ms(2, 7, [&] {
      gpu::multiply_prepared(left, right, model, mxscope::output_rounding::fp32, out.as<float>(),
                             exact_out.as<double>(), gpu::gemm_path::tensor_core);
    });
    const std::string ran(gpu::exact_product_kernel_name(gpu::last_exact_product_kernel()));
    std::printf("gemm mxfp4 exact tensor_core %s%s n_out %" PRId64 " n_in %" PRId64 " K %" PRId64 ": %.3f ms\n",
                name.c_str(), ran == name ? "" : (" (ran " + ran + ")").c_str(), n_out, n_in, k, times[v]);
    results[v].resize(static_cast<std::size_t>(n_out * n_in));
    exact_results[v].resize(results[v].size());
    out.download(results[v].data(), out.bytes());
    exact_out.download(exact_results[v].data(), exact_out.bytes());
  }
  gpu::select_exact_product_kernel(gpu::exact_product_kernel::automatic);
  if (!results[0].empty() && !results[1].empty()) {
    std::int64_t mismatches = 0;
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      mismatches += std::memcmp(&results[0][i], &results[1][i], 4) != 0 ? 1 : 0;
      mismatches += std::memcmp(&exact_results[0][i], &exact_results[1][i], 8) != 0 ? 1 : 0;
    }
    verdict(mismatches == 0, "bench gemm mxfp4 exact: wgmma == mma_sync in all entries",
            mismatches == 0 ? "" : std::to_string(mismatches) + " entries differ");
    std::printf("gemm mxfp4 exact tensor_core: wgmma %.3f ms = %.2fx mma_sync's %.3f ms\n", times[1],
                times[1] / times[0], times[0]);
  }
  const std::vector<float>& got = !results[1].empty() ? results[1] : results[0];
  if (got.empty()) return;
  const host_reference::operand_reader left_reader(a), right_reader(b);
  std::mt19937_64 random(5);
  int bad = 0;
  for (int s = 0; s < 16; ++s) {
    const std::int64_t i = static_cast<std::int64_t>(random() % n_out), j = static_cast<std::int64_t>(random() % n_in);
    const float want =
        host_reference::product_entry(left_reader, right_reader, i, j, model, mxscope::output_rounding::fp32).value;
    bad += std::memcmp(&want, &got[static_cast<std::size_t>(i * n_in + j)], 4) != 0 ? 1 : 0;
  }
  verdict(bad == 0, "bench gemm mxfp4 exact: 16 sampled entries == host definition",
          bad == 0 ? "" : std::to_string(bad) + " differ");
}

// ---- MXFP4 fp32-block GEMM: C [4096, 14336] = A [4096, 8192] B [14336, 8192]^T, random MX operands.
// Returns the automatic tensor-core kernel's time in ms (0 without the path).
double bench_mxfp4_gemm() {
  const std::int64_t n_out = 4096, n_in = 14336, k = 8192;
  std::uint64_t state = 0x1234567887654321ULL;
  const auto make_operand = [&](std::int64_t operand_rows) {
    mxscope::quantized_tensor q;
    q.rows = operand_rows;
    q.cols = k;
    q.options.format = {mxscope::quant_scheme::mx, core::element_kind::fp4_e2m1, 32};
    q.options.axis = 1;
    q.block = 32;
    q.scale_rows = operand_rows;
    q.scale_cols = k / 32;
    q.codes.resize(static_cast<std::size_t>(operand_rows * k / 2));
    for (std::size_t i = 0; i < q.codes.size(); i += 8) {
      const std::uint64_t r = xorshift(state);
      std::memcpy(q.codes.data() + i, &r, std::min<std::size_t>(8, q.codes.size() - i));
    }
    q.scales.resize(static_cast<std::size_t>(operand_rows * (k / 32)));
    for (auto& s : q.scales) s = static_cast<std::uint8_t>(127 - 8 + xorshift(state) % 16);  // 2^-8 .. 2^7
    return q;
  };
  const mxscope::quantized_tensor a = make_operand(n_out);
  const mxscope::quantized_tensor b = make_operand(n_in);
  const auto upload = [](const mxscope::quantized_tensor& q, gpu::device_buffer& codes, gpu::device_buffer& scales) {
    codes = gpu::device_buffer(q.codes.size());
    codes.upload(q.codes.data(), q.codes.size());
    scales = gpu::device_buffer(q.scales.size());
    scales.upload(q.scales.data(), q.scales.size());
    gpu::mx_operand_view view;
    view.codes = codes.as<const std::uint8_t>();
    view.scales = scales.as<const std::uint8_t>();
    view.element = q.options.format.element;
    view.block = 32;
    view.axis = 1;
    view.rows = q.rows;
    view.cols = q.cols;
    return view;
  };
  gpu::device_buffer a_codes, a_scales, b_codes, b_scales;
  const gpu::mx_operand_view a_view = upload(a, a_codes, a_scales);
  const gpu::mx_operand_view b_view = upload(b, b_codes, b_scales);
  mxscope::accumulation_model model;
  model.kind = mxscope::accumulation_kind::fp32_block;
  const double flops = 2.0 * static_cast<double>(n_out) * static_cast<double>(n_in) * static_cast<double>(k);
  gpu::device_buffer out(static_cast<std::size_t>(n_out * n_in) * 4);
  std::vector<float> tensor_core_result(static_cast<std::size_t>(n_out * n_in));
  bool have_tensor_core = false;
  double automatic_ms = 0.0;
  if (gpu::gemm_path_covers(gpu::gemm_path::tensor_core, core::element_kind::fp4_e2m1, core::element_kind::fp4_e2m1,
                            32, model)) {
    gpu::device_timer timer;
    timer.start();
    const gpu::prepared_operand left = gpu::prepare_operand(a_view, gpu::gemm_path::tensor_core);
    const gpu::prepared_operand right = gpu::prepare_operand(b_view, gpu::gemm_path::tensor_core);
    timer.stop();
    std::printf("gemm operand preparation (codes -> int8 2q, exponents): %.3f ms\n", timer.elapsed_ms());
    // Every tensor-core kernel of this build and device, mma_sync first; the others are compared
    // with it in every entry, and it (the automatic choice) with the integer path below.
    const gpu::tensor_core_kernel automatic_kernel = gpu::selected_tensor_core_kernel();
    for (const gpu::tensor_core_kernel kernel :
         {gpu::tensor_core_kernel::mma_sync, gpu::tensor_core_kernel::wgmma, gpu::tensor_core_kernel::wgmma_bf16,
          gpu::tensor_core_kernel::wgmma_fp8}) {
      const std::string name(gpu::tensor_core_kernel_name(kernel));
      if (!gpu::tensor_core_kernel_available(kernel)) {
        std::printf("gemm tensor_core kernel %s: not available in this build on this device\n", name.c_str());
        continue;
      }
      gpu::select_tensor_core_kernel(kernel);
      out.fill_bytes(0xFF);
      const double ms = median_ms(2, 7, [&] {
        gpu::multiply_prepared(left, right, model, mxscope::output_rounding::fp32, out.as<float>(), nullptr,
                               gpu::gemm_path::tensor_core);
      });
      const gpu::tensor_core_kernel ran = gpu::last_tensor_core_kernel();
      std::printf("gemm mxfp4 fp32-block tensor_core %s%s%s n_out %" PRId64 " n_in %" PRId64 " K %" PRId64
                  ": %.3f ms, %.1f TFLOP/s\n",
                  name.c_str(), kernel == automatic_kernel ? " (automatic)" : "",
                  ran == kernel ? "" : (" (ran " + std::string(gpu::tensor_core_kernel_name(ran)) + ")").c_str(),
                  n_out, n_in, k, ms, flops / (ms * 1e-3) / 1e12);
      if (kernel == automatic_kernel) automatic_ms = ms;
      if (!have_tensor_core) {
        out.download(tensor_core_result.data(), out.bytes());
        have_tensor_core = true;
      } else {
        std::vector<float> kernel_result(tensor_core_result.size());
        out.download(kernel_result.data(), out.bytes());
        std::int64_t mismatches = 0;
        for (std::size_t i = 0; i < kernel_result.size(); ++i) {
          mismatches += std::memcmp(&kernel_result[i], &tensor_core_result[i], 4) != 0 ? 1 : 0;
        }
        verdict(mismatches == 0, "bench gemm: tensor_core " + name + " == mma_sync in all entries",
                mismatches == 0 ? "" : std::to_string(mismatches) + " entries differ");
      }
    }
    gpu::select_tensor_core_kernel(gpu::tensor_core_kernel::automatic);
    bench_mxfp4_exact(left, right, a, b);
  } else {
    std::printf("gemm tensor_core path not available on this device\n");
  }
  {
    const gpu::prepared_operand left = gpu::prepare_operand(a_view, gpu::gemm_path::integer);
    const gpu::prepared_operand right = gpu::prepare_operand(b_view, gpu::gemm_path::integer);
    out.fill_bytes(0xFF);
    gpu::select_integer_block_kernel(gpu::integer_block_kernel::simt);
    const double ms = median_ms(0, 1, [&] {
      gpu::multiply_prepared(left, right, model, mxscope::output_rounding::fp32, out.as<float>(), nullptr,
                             gpu::gemm_path::integer);
    });
    gpu::select_integer_block_kernel(gpu::integer_block_kernel::automatic);
    std::printf("gemm mxfp4 fp32-block integer (SIMT) same shape: %.3f ms, %.1f TFLOP/s\n", ms,
                flops / (ms * 1e-3) / 1e12);
    std::vector<float> integer_result(static_cast<std::size_t>(n_out * n_in));
    out.download(integer_result.data(), out.bytes());
    if (have_tensor_core) {
      std::int64_t mismatches = 0, first = -1;
      for (std::size_t i = 0; i < integer_result.size(); ++i) {
        if (std::memcmp(&integer_result[i], &tensor_core_result[i], 4) != 0) {
          if (first < 0) first = static_cast<std::int64_t>(i);
          ++mismatches;
        }
      }
      char detail[160] = "";
      if (mismatches > 0) {
        std::snprintf(detail, sizeof(detail),
                      "%" PRId64 " entries differ, first (%" PRId64 ", %" PRId64 "): %a vs %a", mismatches,
                      first / n_in, first % n_in,
                      static_cast<double>(integer_result[static_cast<std::size_t>(first)]),
                      static_cast<double>(tensor_core_result[static_cast<std::size_t>(first)]));
      }
      verdict(mismatches == 0, "bench gemm: tensor_core == integer path in all entries", detail);
    }
    // Sampled entries against the host definition (src/gemm.cpp generic_entry).
    const host_reference::operand_reader left_reader(a), right_reader(b);
    std::mt19937_64 random(99);
    int bad = 0;
    std::string detail;
    for (int s = 0; s < 64; ++s) {
      const std::int64_t i = static_cast<std::int64_t>(random() % n_out),
                         j = static_cast<std::int64_t>(random() % n_in);
      const float want =
          host_reference::product_entry(left_reader, right_reader, i, j, model, mxscope::output_rounding::fp32).value;
      const float got = integer_result[static_cast<std::size_t>(i * n_in + j)];
      if (std::memcmp(&want, &got, 4) != 0) {
        if (bad++ == 0) {
          char text[160];
          std::snprintf(text, sizeof(text), "entry (%" PRId64 ", %" PRId64 "): expected %a got %a", i, j,
                        static_cast<double>(want), static_cast<double>(got));
          detail = text;
        }
      }
    }
    verdict(bad == 0, "bench gemm: 64 sampled entries == host definition", detail);
  }
  return automatic_ms;
}

// ---- MXFP8 (e4m3) fp32-block GEMM at the same shape, the mxfp8 and per-tensor fp8 strategies'
// product: the integer path's kernels (simt, sliced, and sliced_wgmma where available), each sliced
// one equal to simt in every entry and to the host definition in sampled ones, and their times
// over the MXFP4 product's (`mxfp4_ms`) and sliced_wgmma's over sliced's.
constexpr std::int64_t e4m3_n_out = 4096, e4m3_n_in = 14336, e4m3_k = 8192;

// Gaussian values with a scale per row of 2^-4 .. 2^4, quantized by the host definition (rne,
// floor): block dots as quantized training operands make them, ties in the fp32 steps included.
mxscope::quantized_tensor gaussian_e4m3_operand(std::int64_t rows, std::uint64_t seed) {
  mxscope::matrix values(rows, e4m3_k);
  std::mt19937_64 random(seed);
  std::normal_distribution<float> normal;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::ldexp(1.0f, static_cast<int>(random() % 9) - 4);
    for (std::int64_t c = 0; c < e4m3_k; ++c) {
      values.values[static_cast<std::size_t>(r * e4m3_k + c)] = normal(random) * row_scale;
    }
  }
  mxscope::quantize_options options;
  options.format = {mxscope::quant_scheme::mx, core::element_kind::fp8_e4m3, 32};
  options.block = 32;
  options.axis = 1;
  return host_reference::quantize_mx(values, options);
}

// An integer-path operand of `q` (e4m3 along rows, blocks of 32), its device copies kept in `buffers`.
gpu::prepared_operand prepared_e4m3(const mxscope::quantized_tensor& q, std::vector<gpu::device_buffer>& buffers) {
  buffers.emplace_back(q.codes.size());
  buffers.back().upload(q.codes.data(), q.codes.size());
  buffers.emplace_back(q.scales.size());
  buffers.back().upload(q.scales.data(), q.scales.size());
  gpu::mx_operand_view view;
  view.codes = buffers[buffers.size() - 2].as<const std::uint8_t>();
  view.scales = buffers.back().as<const std::uint8_t>();
  view.element = core::element_kind::fp8_e4m3;
  view.block = 32;
  view.axis = 1;
  view.rows = q.rows;
  view.cols = q.cols;
  return gpu::prepare_operand(view, gpu::gemm_path::integer);
}

// The same operands with every block's scale set to its row's first (one scale per row along K, as
// per-tensor scaling gives): the `exact` product on sliced, which takes its whole-K dot there,
// against simt's whole-K dot in every entry and its time over the per-block exact product's
// (`per_block_ms`, sliced on the MX operands) and the MXFP4 product's.
void bench_e4m3_whole_k(const mxscope::quantized_tensor& a_mx, const mxscope::quantized_tensor& b_mx, double mxfp4_ms,
                        double per_block_ms) {
  mxscope::quantized_tensor a = a_mx, b = b_mx;
  for (mxscope::quantized_tensor* q : {&a, &b}) {
    const std::int64_t blocks = e4m3_k / 32;
    for (std::int64_t r = 0; r < q->rows; ++r) {
      for (std::int64_t blk = 1; blk < blocks; ++blk) {
        q->scales[static_cast<std::size_t>(r * blocks + blk)] = q->scales[static_cast<std::size_t>(r * blocks)];
      }
    }
  }
  std::vector<gpu::device_buffer> buffers;
  buffers.reserve(4);
  const gpu::prepared_operand left = prepared_e4m3(a, buffers);
  const gpu::prepared_operand right = prepared_e4m3(b, buffers);
  mxscope::accumulation_model model;
  model.kind = mxscope::accumulation_kind::exact;
  const std::size_t entries = static_cast<std::size_t>(e4m3_n_out * e4m3_n_in);
  gpu::device_buffer out(entries * 4), exact_out(entries * 8);
  std::vector<float> results[2];
  std::vector<double> exact_results[2];
  double ms[2] = {};
  const gpu::integer_block_kernel kernels[2] = {gpu::integer_block_kernel::simt, gpu::integer_block_kernel::sliced};
  for (int v = 0; v < 2; ++v) {
    if (!gpu::integer_block_kernel_available(kernels[v])) return;
    gpu::select_integer_block_kernel(kernels[v]);
    out.fill_bytes(0xFF);
    exact_out.fill_bytes(0xFF);
    ms[v] = median_ms(v == 0 ? 0 : 2, v == 0 ? 1 : 7, [&] {
      gpu::multiply_prepared(left, right, model, mxscope::output_rounding::fp32, out.as<float>(),
                             exact_out.as<double>(), gpu::gemm_path::integer);
    });
    results[v].resize(entries);
    exact_results[v].resize(entries);
    out.download(results[v].data(), out.bytes());
    exact_out.download(exact_results[v].data(), exact_out.bytes());
  }
  const bool whole = gpu::last_integer_product_whole_k();
  gpu::select_integer_block_kernel(gpu::integer_block_kernel::automatic);
  const double flops = 2.0 * static_cast<double>(e4m3_n_out) * static_cast<double>(e4m3_n_in) * e4m3_k;
  std::printf("gemm e4m3 exact, one scale per row along K, integer sliced%s: %.3f ms, %.1f TFLOP/s, %.2fx the "
              "per-block exact product (%.3f ms), %.2fx the MXFP4 tensor-core product; simt %.3f ms\n",
              whole ? " (whole K)" : " (per block: no whole-K dot)", ms[1], flops / (ms[1] * 1e-3) / 1e12,
              per_block_ms > 0.0 ? ms[1] / per_block_ms : 0.0, per_block_ms, mxfp4_ms > 0.0 ? ms[1] / mxfp4_ms : 0.0,
              ms[0]);
  std::int64_t mismatches = 0;
  for (std::size_t i = 0; i < entries; ++i) {
    mismatches += std::memcmp(&results[0][i], &results[1][i], 4) != 0 ? 1 : 0;
    mismatches += std::memcmp(&exact_results[0][i], &exact_results[1][i], 8) != 0 ? 1 : 0;
  }
  verdict(whole, "bench gemm e4m3 exact, one scale per row: sliced took the whole-K dot", "");
  verdict(mismatches == 0, "bench gemm e4m3 exact, one scale per row: sliced == simt in all entries",
          mismatches == 0 ? "" : std::to_string(mismatches) + " entries differ");
}

void bench_mxfp8_gemm(double mxfp4_ms) {
  const std::int64_t n_out = e4m3_n_out, n_in = e4m3_n_in, k = e4m3_k;
  const mxscope::quantized_tensor a = gaussian_e4m3_operand(n_out, 0x0F1E2D3C4B5A6978ULL);
  const mxscope::quantized_tensor b = gaussian_e4m3_operand(n_in, 0x1F2E3D4C5B6A7988ULL);
  std::vector<gpu::device_buffer> buffers;
  buffers.reserve(4);
  const gpu::prepared_operand left = prepared_e4m3(a, buffers);
  const gpu::prepared_operand right = prepared_e4m3(b, buffers);
  const double flops = 2.0 * static_cast<double>(n_out) * static_cast<double>(n_in) * static_cast<double>(k);
  const host_reference::operand_reader left_reader(a), right_reader(b);
  double per_block_exact_ms = 0.0;
  gpu::device_buffer out(static_cast<std::size_t>(n_out * n_in) * 4);
  gpu::device_buffer exact_out(static_cast<std::size_t>(n_out * n_in) * 8);
  for (const mxscope::accumulation_kind kind : {mxscope::accumulation_kind::fp32_block, mxscope::accumulation_kind::exact}) {
    mxscope::accumulation_model model;
    model.kind = kind;
    const bool exact = kind == mxscope::accumulation_kind::exact;
    const char* model_name = exact ? "exact" : "fp32-block";
    constexpr int kernel_count = 3;
    std::vector<float> results[kernel_count];
    std::vector<double> exact_results[kernel_count];
    double times[kernel_count] = {};
    const gpu::integer_block_kernel kernels[kernel_count] = {
        gpu::integer_block_kernel::simt, gpu::integer_block_kernel::sliced, gpu::integer_block_kernel::sliced_wgmma};
    for (int v = 0; v < kernel_count; ++v) {
      const std::string name(gpu::integer_block_kernel_name(kernels[v]));
      if (!gpu::integer_block_kernel_available(kernels[v])) {
        std::printf("gemm mxfp8 integer %s: not available in this build on this device\n", name.c_str());
        continue;
      }
      gpu::select_integer_block_kernel(kernels[v]);
      out.fill_bytes(0xFF);
      exact_out.fill_bytes(0xFF);
      const bool slow = kernels[v] == gpu::integer_block_kernel::simt;
      const double ms = median_ms(slow ? 0 : 2, slow ? 1 : 7, [&] {
        gpu::multiply_prepared(left, right, model, mxscope::output_rounding::fp32, out.as<float>(),
                               exact ? exact_out.as<double>() : nullptr, gpu::gemm_path::integer);
      });
      times[v] = ms;
      const std::string ran(gpu::integer_block_kernel_name(gpu::last_integer_block_kernel()));
      std::printf("gemm mxfp8_e4m3 %s integer %s%s n_out %" PRId64 " n_in %" PRId64 " K %" PRId64
                  ": %.3f ms, %.1f TFLOP/s",
                  model_name, name.c_str(), ran == name ? "" : (" (ran " + ran + ")").c_str(), n_out, n_in, k, ms,
                  flops / (ms * 1e-3) / 1e12);
      if (mxfp4_ms > 0.0) std::printf(", %.2fx the MXFP4 tensor-core product", ms / mxfp4_ms);
      std::printf("\n");
      results[v].resize(static_cast<std::size_t>(n_out * n_in));
      out.download(results[v].data(), out.bytes());
      if (exact) {
        exact_results[v].resize(results[v].size());
        exact_out.download(exact_results[v].data(), exact_out.bytes());
      }
    }
    gpu::select_integer_block_kernel(gpu::integer_block_kernel::automatic);
    for (int v = 1; v < kernel_count; ++v) {
      if (results[0].empty() || results[v].empty()) continue;
      std::int64_t mismatches = 0;
      for (std::size_t i = 0; i < results[0].size(); ++i) {
        mismatches += std::memcmp(&results[0][i], &results[v][i], 4) != 0 ? 1 : 0;
        if (exact) mismatches += std::memcmp(&exact_results[0][i], &exact_results[v][i], 8) != 0 ? 1 : 0;
      }
      verdict(mismatches == 0,
              std::string("bench gemm mxfp8 ") + model_name + ": " +
                  std::string(gpu::integer_block_kernel_name(kernels[v])) + " == simt in all entries",
              mismatches == 0 ? "" : std::to_string(mismatches) + " entries differ");
    }
    if (times[1] > 0.0 && times[2] > 0.0) {
      std::printf("gemm mxfp8_e4m3 %s integer: sliced_wgmma %.3f ms = %.2fx sliced's %.3f ms\n", model_name, times[2],
                  times[2] / times[1], times[1]);
    }
    const std::vector<float>& got = !results[2].empty() ? results[2] : !results[1].empty() ? results[1] : results[0];
    std::mt19937_64 random(7);
    int bad = 0;
    for (int s = 0; s < 64; ++s) {
      const std::int64_t i = static_cast<std::int64_t>(random() % n_out), j = static_cast<std::int64_t>(random() % n_in);
      const float want =
          host_reference::product_entry(left_reader, right_reader, i, j, model, mxscope::output_rounding::fp32).value;
      bad += std::memcmp(&want, &got[static_cast<std::size_t>(i * n_in + j)], 4) != 0 ? 1 : 0;
    }
    verdict(bad == 0, std::string("bench gemm mxfp8 ") + model_name + ": 64 sampled entries == host definition",
            bad == 0 ? "" : std::to_string(bad) + " differ");
    if (exact) per_block_exact_ms = times[1];
  }
  bench_e4m3_whole_k(a, b, mxfp4_ms, per_block_exact_ms);
}

// ---- Unscaled bf16-valued operands at the same shape: the exact reference and the fp32-block
// product (K-block 32), whose chunks of 32 products are summed in fp64 where that is exact. Two
// operand sets: bf16 values over 10 binades, and the Llama-shaped capture's (Gaussian values
// times a log-normal scale per token, k), whose wider chunks make every entry step per chunk.
// fp32-block runs on both kernels of plain_block_kernel, alternating, and is checked equal.
void bench_plain_products(bool per_token) {
  const std::int64_t n_out = 4096, n_in = 14336, k = 8192;
  const char* const set = per_token ? "per-token scale" : "bf16 values";
  std::uint64_t state = 0x0123456789ABCDEFULL;
  std::mt19937_64 gaussian_source(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> token_scale(static_cast<std::size_t>(k));
  for (double& t : token_scale) t = std::exp(normal(gaussian_source));
  const auto make_values = [&](std::int64_t operand_rows) {
    mxscope::matrix values(operand_rows, k);
    for (std::int64_t r = 0; r < operand_rows; ++r) {
      for (std::int64_t c = 0; c < k; ++c) {
        float& v = values(r, c);
        if (per_token) {
          const auto x = static_cast<float>(normal(gaussian_source) * token_scale[static_cast<std::size_t>(c)]);
          v = test_inputs::from_bf16_bits(test_inputs::to_bf16_bits(x));
          continue;
        }
        // bf16 values of random sign and mantissa, exponents in [2^-8, 2^2): weights / activations.
        const std::uint64_t bits_source = xorshift(state);
        const std::uint32_t exponent = 119U + static_cast<std::uint32_t>(bits_source % 10U);
        const std::uint32_t bits = (static_cast<std::uint32_t>((bits_source >> 8) & 0x8000U) | (exponent << 7) |
                                    static_cast<std::uint32_t>((bits_source >> 20) & 0x7FU))
                                   << 16;
        std::memcpy(&v, &bits, 4);
      }
    }
    return values;
  };
  const mxscope::matrix a = make_values(n_out);
  const mxscope::matrix b = make_values(n_in);
  gpu::device_buffer left(a.values.size() * 4), right(b.values.size() * 4);
  left.upload(a.data(), left.bytes());
  right.upload(b.data(), right.bytes());
  const double flops = 2.0 * static_cast<double>(n_out) * static_cast<double>(n_in) * static_cast<double>(k);
  gpu::device_buffer out64(static_cast<std::size_t>(n_out * n_in) * 8), out32(static_cast<std::size_t>(n_out * n_in) * 4);
  std::mt19937_64 random(7);
  std::vector<std::pair<std::int64_t, std::int64_t>> samples;
  for (int s = 0; s < 32; ++s) {
    samples.emplace_back(static_cast<std::int64_t>(random() % n_out), static_cast<std::int64_t>(random() % n_in));
  }
  // The reference as chosen (automatic), and where that took the int8 slices, on the fp64 tiles as
  // well: two rounds, alternating. Each run's sampled entries are checked against the definition.
  std::vector<gpu::reference_kernel> choices = {gpu::reference_kernel::automatic};
  for (int round = 0; round < 2; ++round) {
    for (const gpu::reference_kernel choice : std::vector<gpu::reference_kernel>(choices)) {
      gpu::select_reference_kernel(choice);
      out64.fill_bytes(0xFF);
      out32.fill_bytes(0xFF);
      const double ms = quick_median_ms([&] {
        gpu::reference_on_device(left.as<const float>(), right.as<const float>(), n_out, n_in, k, out64.as<double>(),
                                 out32.as<float>());
      });
      const gpu::reference_kernel took = gpu::last_reference_kernel();
      gpu::select_reference_kernel(gpu::reference_kernel::automatic);
      std::printf("reference exact, %s, %s kernel (%s, round %d), n_out %" PRId64 " n_in %" PRId64 " K %" PRId64
                  ": %.3f ms, %.2f TFLOP/s%s\n",
                  set, std::string(gpu::reference_kernel_name(took)).c_str(),
                  std::string(gpu::reference_kernel_name(choice)).c_str(), round + 1, n_out, n_in, k, ms,
                  flops / (ms * 1e-3) / 1e12, gpu::last_reference_reordered() ? " (K reordered)" : "");
      if (round == 0 && choice == gpu::reference_kernel::automatic && took == gpu::reference_kernel::sliced) {
        choices.push_back(gpu::reference_kernel::tiles);
      }
      std::vector<double> got64(static_cast<std::size_t>(n_out * n_in));
      std::vector<float> got32(static_cast<std::size_t>(n_out * n_in));
      out64.download(got64.data(), out64.bytes());
      out32.download(got32.data(), out32.bytes());
      int bad = 0;
      for (const auto& [i, j] : samples) {
        const host_reference::reference_value want = host_reference::reference_entry(a, b, i, j);
        const auto at = static_cast<std::size_t>(i * n_in + j);
        if (std::memcmp(&want.fp64, &got64[at], 8) != 0 || std::memcmp(&want.fp32, &got32[at], 4) != 0) ++bad;
      }
      verdict(bad == 0,
              std::string("bench reference, ") + set + ", " + std::string(gpu::reference_kernel_name(took)) +
                  " kernel: 32 sampled entries == host definition",
              bad == 0 ? "" : std::to_string(bad) + " differ");
    }
  }
  mxscope::accumulation_model model;
  model.kind = mxscope::accumulation_kind::fp32_block;
  std::vector<std::vector<float>> results;
  std::vector<gpu::plain_block_kernel> kernels;
  for (const gpu::plain_block_kernel kernel : {gpu::plain_block_kernel::tile, gpu::plain_block_kernel::warp}) {
    if (gpu::plain_block_kernel_available(kernel)) kernels.push_back(kernel);
  }
  for (int round = 0; round < 2; ++round) {
    for (const gpu::plain_block_kernel kernel : kernels) {
      gpu::select_plain_block_kernel(kernel);
      out32.fill_bytes(0xFF);
      const double ms = quick_median_ms([&] {
        gpu::plain_product_on_device(left.as<const float>(), right.as<const float>(), n_out, n_in, k, 32, model,
                                     mxscope::output_rounding::fp32, out32.as<float>());
      });
      std::printf("gemm fp32-block, %s, %s kernel (round %d), n_out %" PRId64 " n_in %" PRId64 " K %" PRId64
                  ": %.3f ms, %.2f TFLOP/s\n",
                  set, std::string(gpu::plain_block_kernel_name(kernel)).c_str(), round + 1, n_out, n_in, k, ms,
                  flops / (ms * 1e-3) / 1e12);
      if (round == 0) {
        results.emplace_back(static_cast<std::size_t>(n_out * n_in));
        out32.download(results.back().data(), out32.bytes());
      }
    }
  }
  gpu::select_plain_block_kernel(gpu::plain_block_kernel::automatic);
  for (std::size_t v = 1; v < results.size(); ++v) {
    const bool equal = std::memcmp(results[v].data(), results[0].data(), results[0].size() * 4) == 0;
    verdict(equal, std::string("bench plain fp32-block, ") + set + ": " +
                       std::string(gpu::plain_block_kernel_name(kernels[v])) + " == " +
                       std::string(gpu::plain_block_kernel_name(kernels[0])) + " in every entry",
            "");
  }
  int bad = 0;
  for (const auto& [i, j] : samples) {
    const float want = host_reference::plain_product_entry(a, b, i, j, 32, model, mxscope::output_rounding::fp32);
    for (const std::vector<float>& got : results) {
      if (std::memcmp(&want, &got[static_cast<std::size_t>(i * n_in + j)], 4) != 0) ++bad;
    }
  }
  verdict(bad == 0, std::string("bench plain fp32-block, ") + set + ": 32 sampled entries == host definition",
          bad == 0 ? "" : std::to_string(bad) + " differ");
}

}  // namespace

int main(int argc, char** argv) {
  // --quantize-only: the copy baseline and the quantizer rows, without the GEMMs.
  // --gemm-only: the copy baseline and the MXFP4 GEMM rows (for profilers).
  // --reference-only: the copy baseline, the exact reference and the plain-operand product rows.
  // --sustain=S (with any of them): each row's work runs back to back for S seconds before it is timed.
  std::string mode;
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument.rfind("--sustain=", 0) == 0) {
      char* end = nullptr;
      sustain_seconds = std::strtod(argument.c_str() + 10, &end);
      if (end == argument.c_str() + 10 || *end != '\0' || !(sustain_seconds >= 0.0 && sustain_seconds <= 600.0)) {
        std::fprintf(stderr, "mxscope_gpu_bench: --sustain wants seconds in [0, 600], got '%s'\n", argument.c_str());
        return 2;
      }
    } else if (mode.empty()) {
      mode = argument;
    } else {
      std::fprintf(stderr, "mxscope_gpu_bench: unexpected argument '%s'\n", argument.c_str());
      return 2;
    }
  }
  const bool quantize_only = mode == "--quantize-only";
  const bool gemm_only = mode == "--gemm-only";
  const bool reference_only = mode == "--reference-only";
  if (gpu::device_count() == 0) {
    std::printf("FAIL no GPU device found\n");
    return 1;
  }
  const gpu::device_description device = gpu::describe_device();
  std::printf("device: %s (compute capability %d.%d, %d multiprocessors)\n", device.name.c_str(), device.major,
              device.minor, device.multiprocessors);

  const double copy_bandwidth = copy_baseline();
  if (!gemm_only && !reference_only) bench_quantizer(copy_bandwidth);
  if (quantize_only) return failures == 0 ? 0 : 1;
  if (!reference_only) bench_mxfp8_gemm(bench_mxfp4_gemm());
  if (!gemm_only) {
    bench_plain_products(false);
    bench_plain_products(true);
  }
  std::printf("bench: %s\n", failures == 0 ? "all checks passed" : "CHECKS FAILED");
  return failures == 0 ? 0 : 1;
}
