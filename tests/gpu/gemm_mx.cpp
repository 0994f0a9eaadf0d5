// GPU test suites: emulated MX products on every path (generic, integer, tensor-core) against the
// host definition: a sweep of shapes and models, edge cases and integer tiles.
#include <cstring>
#include <optional>

#include "support.hpp"
#include "gemm_support.hpp"

namespace gpu_test {

namespace {

// q with device copies of its codes and scales (its host vectors kept).
mxscope::quantized_tensor on_device(mxscope::quantized_tensor q) {
  auto codes = std::make_shared<gpu::device_buffer>(q.codes.size());
  auto scales = std::make_shared<gpu::device_buffer>(q.scales.size());
  codes->upload(q.codes.data(), q.codes.size());
  scales->upload(q.scales.data(), q.scales.size());
  q.device_codes = codes;
  q.device_scales = scales;
  return q;
}

}  // namespace

void gemm_sweep(bool small) {
  struct format_pair {
    int a;
    int b;
  };
  // {4, 3}: e5m2 x e4m3, the per-tensor fp8 hybrid as the GPU multiplies it (unit block scales).
  const format_pair pairs[] = {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}, {0, 3}, {1, 5}, {0, 5}, {4, 3}};
  const mxscope::accumulation_model models[] = {
      model_of(mxscope::accumulation_kind::fp32_block), model_of(mxscope::accumulation_kind::fp32_group, 2),
      model_of(mxscope::accumulation_kind::fp32_group, 5), model_of(mxscope::accumulation_kind::exact),
      model_of(mxscope::accumulation_kind::fp32_seq)};
  int index = 0;
  for (const format_pair& pair : pairs) {
    for (const auto& model : models) {
      for (const gemm_layout_case& layout : gemm_layouts) {
        ++index;
        if (small && index % 41 != 1) continue;
        const std::uint64_t seed = next_seed();
        const int block = index % 9 == 0 ? 16 : (index % 13 == 0 ? 64 : 32);
        const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
        const std::int64_t m = 37 + index % 3, n = 29 + index % 4, k = 70 + 32 * (index % 3);
        const auto output = index % 7 == 0 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
        const auto [qa, qb] = make_operands(m, n, k, pair.a, pair.b, block, layout, kind, seed,
                                            index % 4 == 0 ? core::rounding_mode::sr : core::rounding_mode::rne);
        for (const gpu::gemm_path path :
             {gpu::gemm_path::generic, gpu::gemm_path::integer, gpu::gemm_path::tensor_core,
              gpu::gemm_path::native_mfma}) {
          if (!gpu::gemm_path_covers(path, qa.options.format.element, qb.options.format.element, block, model))
            continue;
          const std::string policy = std::string("A ") + format_names[pair.a] + " axis " +
                                     std::to_string(layout.a_axis) + ", B " + format_names[pair.b] + " axis " +
                                     std::to_string(layout.b_axis) + ", block " + std::to_string(block) + ", model " +
                                     model_name(model) + ", output " +
                                     (output == mxscope::output_rounding::bf16 ? "bf16" : "fp32") + ", path " +
                                     std::string(gpu::gemm_path_name(path)) + ", seed " + hex64(seed);
          const std::string name = std::string("gemm ") + layout.name + " " + format_names[pair.a] + "x" +
                                   format_names[pair.b] + " " + model_name(model) + " " +
                                   std::string(gpu::gemm_path_name(path)) + " M" + std::to_string(m) + " N" +
                                   std::to_string(n) + " K" + std::to_string(k) + " block " + std::to_string(block) +
                                   " " + std::string(test_inputs::value_kind_name(kind));
          run_case(name, [&] {
            const gemm_output got = gpu_product(qa, qb, model, output, path);
            return check_product_entries(qa, qb, model, output, got, {}, policy);
          });
        }
      }
    }
  }
}

// Edge shapes: a single entry, K = 1, K below one block, M and N just past a tensor-core tile.
void gemm_edges(bool small) {
  struct edge {
    std::int64_t m, n, k;
    bool in_small_set;
  };
  const edge edges[] = {{1, 1, 1, true},       {1, 1, 33, true},   {3, 2, 31, true},
                        {130, 200, 96, false}, {129, 1, 64, true}, {17, 131, 250, false}};
  for (const edge& e : edges) {
    if (small && !e.in_small_set) continue;
    for (const auto& model :
         {model_of(mxscope::accumulation_kind::fp32_block), model_of(mxscope::accumulation_kind::exact),
          model_of(mxscope::accumulation_kind::fp32_group, 4)}) {
      const std::uint64_t seed = next_seed();
      const auto [qa, qb] = make_operands(e.m, e.n, e.k, 0, 0, 32, gemm_layouts[2], value_kind::banded, seed);
      for (const gpu::gemm_path path :
           {gpu::gemm_path::generic, gpu::gemm_path::integer, gpu::gemm_path::tensor_core,
            gpu::gemm_path::native_mfma}) {
        if (!gpu::gemm_path_covers(path, qa.options.format.element, qb.options.format.element, 32, model)) continue;
        const std::string name = "gemm edge wgrad mxfp4 " + model_name(model) + " " +
                                 std::string(gpu::gemm_path_name(path)) + " M" + std::to_string(e.m) + " N" +
                                 std::to_string(e.n) + " K" + std::to_string(e.k);
        run_case(name, [&] {
          const gemm_output got = gpu_product(qa, qb, model, mxscope::output_rounding::fp32, path);
          return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {},
                                       name + ", seed " + hex64(seed));
        });
      }
    }
  }
  // The host convenience function on the automatic path.
  const std::uint64_t seed = next_seed();
  const auto [qa, qb] = make_operands(45, 38, 160, 0, 0, 32, gemm_layouts[0], value_kind::extreme, seed);
  run_case("gemm host api gpu::emulate_product mxfp4 fp32-block automatic", [&]() -> std::string {
    const auto model = model_of(mxscope::accumulation_kind::fp32_block);
    const mxscope::product_result result = gpu::emulate_product(qa, qb, model);
    gemm_output got{result.out, matrix64()};
    std::string problem =
        check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {}, "seed " + hex64(seed));
    if (!problem.empty()) return problem;
    // The same product left in device memory.
    const mxscope::product_result kept =
        gpu::emulate_product(qa, qb, model, mxscope::output_rounding::fp32, gpu::gemm_path::automatic, true);
    if (!kept.out.values.empty() || !kept.device_out || kept.device_exact) {
      return std::string("keep_on_device: the result is not (only) in device memory");
    }
    const gemm_output kept_out{kept.device_out->download32(), matrix64()};
    return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, kept_out, {},
                                 "keep_on_device, seed " + hex64(seed));
  });
  run_case("gemm host api gpu::emulate_product mxfp4 fp32-block from codes in device memory", [&]() -> std::string {
    const auto model = model_of(mxscope::accumulation_kind::fp32_block);
    // Device copies of the codes and scales, and host vectors emptied: the product must read them there.
    mxscope::quantized_tensor da = on_device(qa), db = on_device(qb);
    for (auto* q : {&da, &db}) {
      q->codes.clear();
      q->scales.clear();
    }
    const mxscope::product_result result = gpu::emulate_product(da, db, model);
    const gemm_output got{result.out, matrix64()};
    return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {}, "seed " + hex64(seed));
  });
  run_case("gemm host api gpu::emulate_product mxfp4 kept operands", [&]() -> std::string {
    // One cache across fp32-block then exact of the same device codes: the second call reuses the
    // prepared operands (the same storage) and both match the oracle; other codes refill it.
    const mxscope::quantized_tensor da = on_device(qa), db = on_device(qb);
    gpu::prepared_pair_cache kept;
    const auto product = [&](const mxscope::quantized_tensor& x, const mxscope::quantized_tensor& y,
                             const mxscope::accumulation_model& model) {
      const mxscope::product_result r =
          gpu::emulate_product(x, y, model, mxscope::output_rounding::fp32, gpu::gemm_path::automatic, false, &kept);
      return gemm_output{r.out, r.exact};
    };
    const auto block_model = model_of(mxscope::accumulation_kind::fp32_block);
    const auto exact_model = model_of(mxscope::accumulation_kind::exact);
    std::string problem = check_product_entries(qa, qb, block_model, mxscope::output_rounding::fp32,
                                                product(da, db, block_model), {}, "first, seed " + hex64(seed));
    if (!problem.empty()) return problem;
    const auto* first = &kept.operands[0].data();
    problem = check_product_entries(qa, qb, exact_model, mxscope::output_rounding::fp32,
                                    product(da, db, exact_model), {}, "reused, seed " + hex64(seed));
    if (!problem.empty()) return problem;
    if (&kept.operands[0].data() != first) return std::string("the same codes were prepared again");
    const std::uint64_t other_seed = next_seed();
    const auto [oa, ob] = make_operands(45, 38, 160, 0, 0, 32, gemm_layouts[0], value_kind::banded, other_seed);
    problem = check_product_entries(oa, ob, exact_model, mxscope::output_rounding::fp32,
                                    product(on_device(oa), on_device(ob), exact_model), {},
                                    "other codes, seed " + hex64(other_seed));
    if (!problem.empty()) return problem;
    if (&kept.operands[0].data() == first) return std::string("other codes did not refill the cache");
    return std::string();
  });
  run_case("gemm host api gpu::emulate_product mxfp8 kept operands and sliced forms", [&]() -> std::string {
    // fp32-block then exact of the same e4m3 codes with one cache: each operand prepared once, and
    // its sliced form (where the sliced kernel runs) made once, by the device timeline's count.
    const std::uint64_t e4m3_seed = next_seed();
    const auto [ea, eb] = make_operands(70, 45, 160, 3, 3, 32, gemm_layouts[2], value_kind::banded, e4m3_seed);
    const mxscope::quantized_tensor da = on_device(ea), db = on_device(eb);
    // Each product's operations on the device timeline: with the cache (the second finds the
    // operands prepared) and without it.
    gpu::prepared_pair_cache kept;
    std::string problem;
    bool sliced = true;
    const auto timed = [&](mxscope::accumulation_kind kind, gpu::prepared_pair_cache* cache) {
      const auto model = model_of(kind);
      gpu::start_timeline();
      const mxscope::product_result r =
          gpu::emulate_product(da, db, model, mxscope::output_rounding::fp32, gpu::gemm_path::automatic, false, cache);
      auto operations = gpu::finish_timeline();
      sliced = sliced && gpu::last_integer_block_kernel() == gpu::integer_block_kernel::sliced;
      if (problem.empty()) {
        problem = check_product_entries(ea, eb, model, mxscope::output_rounding::fp32, gemm_output{r.out, r.exact},
                                        {}, model_name(model) + ", seed " + hex64(e4m3_seed));
      }
      std::vector<std::string> names;
      for (const auto& op : operations) names.push_back(op.name);
      return names;
    };
    const auto first = timed(mxscope::accumulation_kind::fp32_block, &kept);
    const auto reused = timed(mxscope::accumulation_kind::exact, &kept);
    const auto alone = timed(mxscope::accumulation_kind::exact, nullptr);
    if (!problem.empty()) return problem;
    if (kept.chosen != gpu::gemm_path::integer) return std::string("not on the integer path");
    // The reused product queues what the product alone queues less the preparation: a shorter
    // subsequence (by name, or by kernel address where the backend has no names).
    std::size_t at = 0;
    for (const std::string& name : reused) {
      while (at < alone.size() && alone[at] != name) ++at;
      if (at == alone.size()) return "the reused product queued " + name + ", which the product alone did not";
      ++at;
    }
    if (reused.size() >= alone.size()) return std::string("the reused product queued as much as the product alone");
    const auto count = [](const std::vector<std::string>& names, const char* part) {
      int n = 0;
      for (const std::string& name : names) n += name.find(part) != std::string::npos ? 1 : 0;
      return n;
    };
    if (count(alone, "prepare_elements") == 2) {  // names on this backend
      if (count(first, "prepare_elements") != 2 || count(reused, "prepare_elements") != 0) {
        return std::string("the operands were prepared again");
      }
      const int slicings = sliced ? 2 : 0;
      if (count(first, "prepare_sliced") != slicings || count(reused, "prepare_sliced") != 0 ||
          count(alone, "prepare_sliced") != slicings) {
        return std::string("the sliced forms were not made once per operand");
      }
    }
    return std::string();
  });
  run_case("gemm host api gpu::emulate_product mxfp8 exact product left by the fp32-block one", [&]() -> std::string {
    // With exact_follows the fp32-block product forms the exact one in the same pass and the pair
    // keeps it; the exact call takes it (queuing no product kernel) and gives the host definition's
    // bits; operands prepared again (other codes) drop what was kept.
    const std::uint64_t e4m3_seed = next_seed();
    const auto [ea, eb] = make_operands(70, 45, 160, 3, 3, 32, gemm_layouts[2], value_kind::extreme, e4m3_seed);
    const mxscope::quantized_tensor da = on_device(ea), db = on_device(eb);
    gpu::prepared_pair_cache kept;
    kept.exact_follows = true;
    const auto block_model = model_of(mxscope::accumulation_kind::fp32_block);
    const auto exact_model = model_of(mxscope::accumulation_kind::exact);
    const std::string label = "seed " + hex64(e4m3_seed);
    const mxscope::product_result block = gpu::emulate_product(da, db, block_model, mxscope::output_rounding::bf16,
                                                               gpu::gemm_path::automatic, false, &kept);
    if (kept.chosen != gpu::gemm_path::integer) return std::string("not on the integer path");
    if (!kept.exact_out || !kept.exact_out32) return std::string("the fp32-block product left no exact product");
    gpu::start_timeline();
    const mxscope::product_result exact = gpu::emulate_product(da, db, exact_model, mxscope::output_rounding::fp32,
                                                               gpu::gemm_path::automatic, false, &kept);
    const auto operations = gpu::finish_timeline();
    if (kept.exact_out || kept.exact_out32) return std::string("the exact call left its product in the pair");
    for (const auto& op : operations) {
      if (op.name.find("kernel") != std::string::npos) return "the exact call queued " + op.name;
    }
    std::string problem = check_product_entries(ea, eb, block_model, mxscope::output_rounding::bf16,
                                                gemm_output{block.out, matrix64()}, {}, "fp32-block, " + label);
    if (problem.empty()) {
      problem = check_product_entries(ea, eb, exact_model, mxscope::output_rounding::fp32,
                                      gemm_output{exact.out, exact.exact}, {}, "exact, " + label);
    }
    if (!problem.empty()) return problem;
    (void)gpu::emulate_product(da, db, block_model, mxscope::output_rounding::fp32, gpu::gemm_path::automatic, false,
                               &kept);
    const std::uint64_t other_seed = next_seed();
    const auto others = make_operands(70, 45, 160, 3, 3, 32, gemm_layouts[2], value_kind::extreme, other_seed);
    const mxscope::quantized_tensor other = on_device(others.second);
    const mxscope::product_result again = gpu::emulate_product(da, other, exact_model, mxscope::output_rounding::fp32,
                                                               gpu::gemm_path::automatic, false, &kept);
    if (kept.exact_out) return std::string("operands prepared again kept the earlier exact product");
    return check_product_entries(ea, others.second, exact_model, mxscope::output_rounding::fp32,
                                 gemm_output{again.out, again.exact}, {}, "other B, seed " + hex64(other_seed));
  });
  run_case("gemm multiply_prepared e4m3 one operand on both sides", [&]() -> std::string {
    // A A^T from one prepared operand (its two sides need sliced forms of two shifts), twice.
    const std::uint64_t self_seed = next_seed();
    const auto [ea, unused] = make_operands(40, 40, 96, 3, 3, 32, gemm_layouts[0], value_kind::banded, self_seed);
    (void)unused;
    const device_operand uploaded = upload_operand(ea);
    const gpu::prepared_operand prepared = gpu::prepare_operand(uploaded.view, gpu::gemm_path::integer);
    const auto model = model_of(mxscope::accumulation_kind::fp32_block);
    for (int repeat = 0; repeat < 2; ++repeat) {
      gpu::device_buffer out(static_cast<std::size_t>(ea.rows * ea.rows) * sizeof(float));
      gpu::multiply_prepared(prepared, prepared, model, mxscope::output_rounding::fp32, out.as<float>(), nullptr,
                             gpu::gemm_path::integer);
      matrix got(ea.rows, ea.rows);
      out.download(got.values.data(), got.values.size() * sizeof(float));
      std::string problem = check_product_entries(ea, ea, model, mxscope::output_rounding::fp32,
                                                  gemm_output{got, matrix64()}, {}, "seed " + hex64(self_seed));
      if (!problem.empty()) return problem;
    }
    return std::string();
  });
  run_case("gemm host api gpu::emulate_product mxfp4 exact automatic keep_on_device", [&]() -> std::string {
    const auto model = model_of(mxscope::accumulation_kind::exact);
    const mxscope::product_result kept =
        gpu::emulate_product(qa, qb, model, mxscope::output_rounding::fp32, gpu::gemm_path::automatic, true);
    if (!kept.out.values.empty() || !kept.exact.values.empty() || !kept.device_out || !kept.device_exact) {
      return std::string("keep_on_device: the result is not (only) in device memory");
    }
    const gemm_output got{kept.device_out->download32(), kept.device_exact->download64()};
    return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {}, "seed " + hex64(seed));
  });
}

namespace {

// gpu::multiply_prepared_both on operands prepared for the integer path: fp32-block (with `output`)
// and exact (output fp32) against the host definition in every entry (the extreme values' exact sums
// round in fp64, so their entries take the fix-up), and the same bits as the two products alone;
// false, with the products left to the caller, where a NaN block keeps the sliced kernel out or
// another integer-path kernel is selected.
// With `unchecked`, also whether the pass summed the exact model unchecked (block exponents
// constant along K: gpu::last_both_exact_unchecked).
std::string check_both_models(const mxscope::quantized_tensor& qa, const mxscope::quantized_tensor& qb,
                              mxscope::output_rounding output, bool nan_block, const std::string& label,
                              std::optional<bool> unchecked = std::nullopt) {
  const device_operand a = upload_operand(qa), b = upload_operand(qb);
  const gpu::prepared_operand pa = gpu::prepare_operand(a.view, gpu::gemm_path::integer);
  const gpu::prepared_operand pb = gpu::prepare_operand(b.view, gpu::gemm_path::integer);
  const std::int64_t m = pa.rows(), n = pb.rows();  // the product's shape (the stored shapes follow the axes)
  const auto entries = static_cast<std::size_t>(m * n);
  gpu::device_buffer out(entries * sizeof(float)), exact32(entries * sizeof(float)), exact64(entries * sizeof(double));
  const auto run_both = [&] {
    return gpu::multiply_prepared_both(pa, pb, output, out.as<float>(), exact64.as<double>(), exact32.as<float>());
  };
  gpu::select_integer_block_kernel(gpu::integer_block_kernel::simt);
  const bool ran_under_simt = run_both();
  gpu::select_integer_block_kernel(gpu::integer_block_kernel::automatic);
  if (ran_under_simt) return "ran with the simt kernel selected, " + label;
  for (gpu::device_buffer* poisoned : {&out, &exact32, &exact64}) poisoned->fill_bytes(0xFF);  // every entry written
  if (!run_both()) return nan_block ? std::string() : "did not run, " + label;
  if (nan_block) return "ran with a NaN block, " + label;
  if (gpu::last_integer_block_kernel() != gpu::integer_block_kernel::sliced) return "not the sliced kernel, " + label;
  if (unchecked && gpu::last_both_exact_unchecked() != *unchecked) {
    return std::string("the exact sums ") + (*unchecked ? "checked" : "unchecked") + ", " + label;
  }
  gemm_output block{matrix(m, n), matrix64()};
  gemm_output exact{matrix(m, n), matrix64(m, n)};
  gpu::synchronize();
  out.download(block.out.data(), out.bytes());
  exact32.download(exact.out.data(), exact32.bytes());
  exact64.download(exact.exact.data(), exact64.bytes());
  const auto block_model = model_of(mxscope::accumulation_kind::fp32_block);
  const auto exact_model = model_of(mxscope::accumulation_kind::exact);
  std::string problem = check_product_entries(qa, qb, block_model, output, block, {}, "fp32-block, " + label);
  if (problem.empty()) {
    problem = check_product_entries(qa, qb, exact_model, mxscope::output_rounding::fp32, exact, {}, "exact, " + label);
  }
  if (!problem.empty()) return problem;
  const gemm_output alone_block = gpu_product(qa, qb, block_model, output, gpu::gemm_path::integer);
  const gemm_output alone_exact =
      gpu_product(qa, qb, exact_model, mxscope::output_rounding::fp32, gpu::gemm_path::integer);
  const auto same_bits = [](const auto& x, const auto& y) {
    return x.values.size() == y.values.size() &&
           std::memcmp(x.values.data(), y.values.data(), x.values.size() * sizeof(x.values[0])) == 0;
  };
  if (!same_bits(alone_block.out, block.out) || !same_bits(alone_exact.out, exact.out) ||
      !same_bits(alone_exact.exact, exact.exact)) {
    return "other bits than the two products alone, " + label;
  }
  return std::string();
}

// Calls f(scale, line, block) for every block scale of q (a reference, const where q is), by line
// (a row of the product's operand: q's rows when its blocks run along them, else its columns) and
// block along K.
template <class Tensor, class F>
void for_each_block_scale(Tensor& q, F&& f) {
  const bool along_rows = q.options.axis == 1;
  const std::int64_t lines = along_rows ? q.rows : q.cols;
  const std::int64_t blocks = static_cast<std::int64_t>(q.scales.size()) / lines;
  for (std::int64_t line = 0; line < lines; ++line) {
    for (std::int64_t b = 0; b < blocks; ++b) f(q.scales[along_rows ? line * blocks + b : b * lines + line], line, b);
  }
}

// Whether every line of q has one block scale along K.
bool scales_constant_along_k(const mxscope::quantized_tensor& q) {
  std::vector<int> first(static_cast<std::size_t>(q.rows + q.cols), -1);
  bool constant = true;
  for_each_block_scale(q, [&](const std::uint8_t& scale, std::int64_t line, std::int64_t) {
    int& seen = first[static_cast<std::size_t>(line)];
    if (seen < 0) seen = scale;
    constant = constant && seen == scale;
  });
  return constant;
}

}  // namespace

// The integer path over several of its 64 x 64 tiles with tails in M, N and K (K not a multiple of
// the block): fp8 e4m3 (block dots summed in fp64) and e3m2 x fp4 (in int32), each model, with
// extreme values (block dots many binades apart: the running sums of fp32-group and exact round, so
// those entries take the fix-up kernel) and NaN blocks.
void gemm_integer_tiles(bool small) {
  struct format_pair {
    int a;
    int b;
  };
  const format_pair pairs[] = {{3, 3}, {2, 0}};
  const mxscope::accumulation_model models[] = {model_of(mxscope::accumulation_kind::fp32_block),
                                                model_of(mxscope::accumulation_kind::fp32_group, 3),
                                                model_of(mxscope::accumulation_kind::exact)};
  const value_kind kinds[] = {value_kind::extreme, value_kind::nonfinite, value_kind::ties};
  int index = 0;
  for (const format_pair& pair : pairs) {
    for (const auto& model : models) {
      for (const value_kind kind : kinds) {
        ++index;
        if (small && pair.a != 3 && kind != value_kind::extreme) continue;
        const std::uint64_t seed = next_seed();
        const std::int64_t m = 70, n = 133, k = 100 + 3 * (index % 2);
        const auto output = index % 5 == 0 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
        const auto [qa, qb] = make_operands(m, n, k, pair.a, pair.b, 32, gemm_layouts[index % 3], kind, seed);
        if (!gpu::gemm_path_covers(gpu::gemm_path::integer, qa.options.format.element, qb.options.format.element, 32,
                                   model)) {
          run_case("gemm integer tiles: path coverage", [&] {
            return std::string("the integer path does not cover ") + format_names[pair.a] + " x " +
                   format_names[pair.b] + " " + model_name(model);
          });
          continue;
        }
        const std::string name = std::string("gemm integer tiles ") + format_names[pair.a] + "x" +
                                 format_names[pair.b] + " " + model_name(model) + " M" + std::to_string(m) + " N" +
                                 std::to_string(n) + " K" + std::to_string(k) + " " +
                                 std::string(test_inputs::value_kind_name(kind));
        if (model.kind == mxscope::accumulation_kind::fp32_group) {
          run_case(name, [&] {
            const gemm_output got = gpu_product(qa, qb, model, output, gpu::gemm_path::integer);
            return check_product_entries(qa, qb, model, output, got, {}, name + ", seed " + hex64(seed));
          });
          continue;
        }
        // fp32-block and exact under each of the path's kernels; the sliced ones take these pairs
        // (integers below 2^18, blocks of 32) unless a block is NaN (an E8M0 scale 0xFF).
        const bool nan_block = std::find(qa.scales.begin(), qa.scales.end(), 0xFF) != qa.scales.end() ||
                               std::find(qb.scales.begin(), qb.scales.end(), 0xFF) != qb.scales.end();
        for (const gpu::integer_block_kernel kernel : {gpu::integer_block_kernel::simt, gpu::integer_block_kernel::sliced,
                                                       gpu::integer_block_kernel::sliced_wgmma}) {
          if (!gpu::integer_block_kernel_available(kernel)) continue;  // sliced_wgmma: sm_90a builds on sm_90
          const auto expected = nan_block ? gpu::integer_block_kernel::simt : kernel;
          run_case(name + " " + std::string(gpu::integer_block_kernel_name(kernel)), [&]() -> std::string {
            gpu::select_integer_block_kernel(kernel);
            const gemm_output got = gpu_product(qa, qb, model, output, gpu::gemm_path::integer);
            gpu::select_integer_block_kernel(gpu::integer_block_kernel::automatic);
            if (gpu::last_integer_block_kernel() != expected) {
              return std::string("ran ") + std::string(gpu::integer_block_kernel_name(gpu::last_integer_block_kernel())) +
                     ", expected " + std::string(gpu::integer_block_kernel_name(expected));
            }
            return check_product_entries(qa, qb, model, output, got, {}, name + ", seed " + hex64(seed));
          });
        }
        if (model.kind == mxscope::accumulation_kind::fp32_block) {
          run_case(name + " both models from one pass", [&]() -> std::string {
            return check_both_models(qa, qb, output, nan_block, name + ", seed " + hex64(seed));
          });
        }
      }
    }
  }
  // Block scales constant along K in every row, different between rows (per-tensor scaling is the
  // case of one scale): `exact` takes the whole-K dot (sliced_block_kernel<true, true> where the
  // sliced kernel runs, else integer_mode::whole); then the same with one block's scale changed,
  // which sends the product back to the per-block step. Banded values over 4 K-blocks, and extreme
  // ones (the largest and smallest e4m3 magnitudes) over more K-blocks than the pipeline's stages.
  // Every entry against the host definition. `small` (the CPU simulation under ctest, the
  // sanitizers) takes one layout per case, in turn, instead of all three.
  struct constant_case {
    value_kind kind;
    std::int64_t k;
  };
  int constant_index = -1;  // the cases in order: fprop, dgrad, wgrad, fprop under `small`
  for (const constant_case& c : {constant_case{value_kind::banded, 100}, constant_case{value_kind::extreme, 32 * 9 + 7}}) {
  for (const bool one_differs : {false, true}) {
    ++constant_index;
    for (const auto& layout : gemm_layouts) {
      if (small && &layout != &gemm_layouts[constant_index % 3]) continue;
      const std::uint64_t seed = next_seed();
      const std::int64_t m = 70, n = 133, k = c.k + (one_differs ? 28 : 0);
      auto [qa, qb] = make_operands(m, n, k, 3, 3, 32, layout, c.kind, seed);
      for (auto* q : {&qa, &qb}) {
        for_each_block_scale(*q, [](std::uint8_t& scale, std::int64_t line, std::int64_t) {
          scale = static_cast<std::uint8_t>(120 + (line * 7 + 3) % 15);
        });
      }
      if (one_differs) qb.scales[qb.scales.size() / 2] = static_cast<std::uint8_t>(qb.scales[qb.scales.size() / 2] + 1);
      const auto model = model_of(mxscope::accumulation_kind::exact);
      const std::string name = std::string("gemm integer tiles e4m3 exact, scales constant along K") +
                               (one_differs ? " but one " : " ") + layout.name + " K" + std::to_string(k) + " " +
                               std::string(test_inputs::value_kind_name(c.kind));
      run_case(name, [&]() -> std::string {
        const gemm_output got = gpu_product(qa, qb, model, mxscope::output_rounding::fp32, gpu::gemm_path::integer);
        const bool sliced = gpu::last_integer_block_kernel() == gpu::integer_block_kernel::sliced;
        if (gpu::last_integer_product_whole_k() != (sliced && !one_differs)) {
          return std::string("the whole-K dot ") + (gpu::last_integer_product_whole_k() ? "ran" : "did not run") +
                 " on " + std::string(gpu::integer_block_kernel_name(gpu::last_integer_block_kernel()));
        }
        return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {},
                                     name + ", seed " + hex64(seed));
      });
      // The one-pass pair on the same operands: its exact sums unchecked exactly where the scales
      // are constant along K (no addition can round there, even for the extreme values).
      run_case(name + " both models from one pass", [&]() -> std::string {
        return check_both_models(qa, qb, mxscope::output_rounding::fp32, false, name + ", seed " + hex64(seed),
                                 !one_differs);
      });
    }
  }
  }
}

// The sliced kernels (the automatic choice, sliced, and sliced_wgmma where available) of the
// integer path's fp32-block and exact products over several of their tiles and more K-blocks than
// their pipelines have stages, with tails in M, N and K: every entry (and fp64 entry) equal to the
// integer kernel's (simt) and sampled entries to the host definition, for e4m3 x e4m3 (the
// mxfp8 and per-tensor fp8 products) and fp4 x e4m3, banded and extreme values, fp32 and bf16 output;
// and the one-pass pair (gpu::multiply_prepared_both) on the e4m3 x e4m3 operands, every entry
// against the host definition.
void gemm_sliced_tiles(bool small) {
  struct sliced_case {
    int a, b;
    value_kind kind;
    std::int64_t m, n, k;
    mxscope::output_rounding output;
  };
  const sliced_case cases[] = {
      {3, 3, value_kind::banded, 260, 300, 32 * 9 + 7, mxscope::output_rounding::fp32},
      {3, 3, value_kind::extreme, 131, 129, 32 * 6, mxscope::output_rounding::bf16},
      {0, 3, value_kind::ties, 200, 140, 32 * 5 + 1, mxscope::output_rounding::fp32},
  };
  int index = 0;
  for (const sliced_case& c : cases) {
    ++index;
    if (small && index > 1) continue;
    const std::uint64_t seed = next_seed();
    const auto [qa, qb] = make_operands(c.m, c.n, c.k, c.a, c.b, 32, gemm_layouts[index % 3], c.kind, seed);
    for (const auto& model :
         {model_of(mxscope::accumulation_kind::fp32_block), model_of(mxscope::accumulation_kind::exact)}) {
    const std::string name = std::string("gemm sliced tiles ") + format_names[c.a] + "x" + format_names[c.b] + " " +
                             model_name(model) + " M" + std::to_string(c.m) + " N" + std::to_string(c.n) + " K" +
                             std::to_string(c.k) + " " + std::string(test_inputs::value_kind_name(c.kind));
    for (const gpu::integer_block_kernel kernel :
         {gpu::integer_block_kernel::automatic, gpu::integer_block_kernel::sliced_wgmma}) {
    if (!gpu::integer_block_kernel_available(kernel)) continue;  // sliced_wgmma: sm_90a builds on sm_90
    const auto expected = kernel == gpu::integer_block_kernel::automatic ? gpu::integer_block_kernel::sliced : kernel;
    run_case(name + " " + std::string(gpu::integer_block_kernel_name(expected)), [&]() -> std::string {
      gpu::select_integer_block_kernel(gpu::integer_block_kernel::simt);
      const gemm_output simt = gpu_product(qa, qb, model, c.output, gpu::gemm_path::integer);
      gpu::select_integer_block_kernel(kernel);
      const gemm_output sliced = gpu_product(qa, qb, model, c.output, gpu::gemm_path::integer);
      gpu::select_integer_block_kernel(gpu::integer_block_kernel::automatic);
      if (gpu::last_integer_block_kernel() != expected) {
        return "ran " + std::string(gpu::integer_block_kernel_name(gpu::last_integer_block_kernel())) + ", expected " +
               std::string(gpu::integer_block_kernel_name(expected));
      }
      for (std::size_t i = 0; i < sliced.out.values.size(); ++i) {
        if (std::memcmp(&sliced.out.values[i], &simt.out.values[i], 4) != 0) {
          return "entry " + std::to_string(i) + ": sliced bits " + hex32(core::float_bits(sliced.out.values[i])) + ", simt " +
                 hex32(core::float_bits(simt.out.values[i])) + ", seed " + hex64(seed);
        }
      }
      for (std::size_t i = 0; i < sliced.exact.values.size(); ++i) {
        if (std::memcmp(&sliced.exact.values[i], &simt.exact.values[i], 8) != 0) {
          return "fp64 entry " + std::to_string(i) + ": sliced bits " + hex64(core::double_bits(sliced.exact.values[i])) +
                 ", simt " + hex64(core::double_bits(simt.exact.values[i])) + ", seed " + hex64(seed);
        }
      }
      std::vector<std::pair<std::int64_t, std::int64_t>> entries;
      std::mt19937_64 random(seed);
      for (int s = 0; s < 96; ++s) {
        entries.emplace_back(static_cast<std::int64_t>(random() % static_cast<std::uint64_t>(c.m)),
                             static_cast<std::int64_t>(random() % static_cast<std::uint64_t>(c.n)));
      }
      entries.emplace_back(c.m - 1, c.n - 1);
      return check_product_entries(qa, qb, model, c.output, sliced, entries, name + ", seed " + hex64(seed));
    });
    }
    }
    // The one-pass pair (e4m3 x e4m3: its own, narrower tiles) over the same tiles and K-blocks; its
    // exact sums are checked unless every row's block scales are constant along K.
    if (c.a == 3 && c.b == 3) {
      const bool unchecked = scales_constant_along_k(qa) && scales_constant_along_k(qb);
      const std::string name = std::string("gemm sliced tiles e4m3xe4m3 both models from one pass M") +
                               std::to_string(c.m) + " N" + std::to_string(c.n) + " K" + std::to_string(c.k) + " " +
                               std::string(test_inputs::value_kind_name(c.kind));
      run_case(name, [&]() -> std::string {
        return check_both_models(qa, qb, c.output, false, name + ", seed " + hex64(seed), unchecked);
      });
    }
  }

  // Exactly cancelling sums under `exact`: block 1 of every A row is its block 0 negated (the same
  // block scale, sign-symmetric rounding) and B's first two blocks are equal, so each running sum
  // returns to zero after block 1, where an fma rounded down gives -0; B's block 2 is zero in even
  // rows, whose entries' exact sums are then zero and must be +0 in both results, as the host's.
  // Run on the sliced kernels (mxfp8 e4m3) and on the tensor-core exact kernel (mxfp4).
  struct cancelling_case {
    int format;
    gpu::integer_block_kernel kernel;  // format 3 (the integer path)
    gpu::exact_product_kernel exact_kernel;  // format 0 (the tensor-core path)
  };
  for (const cancelling_case& c :
       {cancelling_case{3, gpu::integer_block_kernel::sliced, gpu::exact_product_kernel::automatic},
        cancelling_case{3, gpu::integer_block_kernel::sliced_wgmma, gpu::exact_product_kernel::automatic},
        cancelling_case{0, gpu::integer_block_kernel::automatic, gpu::exact_product_kernel::mma_sync},
        cancelling_case{0, gpu::integer_block_kernel::automatic, gpu::exact_product_kernel::wgmma},
        cancelling_case{0, gpu::integer_block_kernel::automatic, gpu::exact_product_kernel::automatic}}) {
    // The wgmma kernels: sm_90a builds on sm_90 (and the simulation).
    if (!gpu::integer_block_kernel_available(c.kernel) || !gpu::exact_product_kernel_available(c.exact_kernel)) continue;
    const int format = c.format;
    const std::string name = std::string("gemm exact cancelling sums ") + format_names[format] + " M70 N66 K96 " +
                             std::string(format == 3 ? gpu::integer_block_kernel_name(c.kernel)
                                                     : gpu::exact_product_kernel_name(c.exact_kernel));
    run_case(name, [&]() -> std::string {
      const std::uint64_t seed = next_seed();
      const std::int64_t m = 70, n = 66, k = 96;
      matrix a = test_inputs::make_matrix(m, k, value_kind::banded, seed);
      matrix b = test_inputs::make_matrix(n, k, value_kind::banded, seed + 1);
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t c = 0; c < 32; ++c) a(i, 32 + c) = -a(i, c);
      }
      for (std::int64_t j = 0; j < n; ++j) {
        for (std::int64_t c = 0; c < 32; ++c) {
          b(j, 32 + c) = b(j, c);
          if (j % 2 == 0) b(j, 64 + c) = 0.0f;
        }
      }
      const auto qa = host_reference::quantize_mx(a, mx_options(format, 32, 1, core::rounding_mode::rne,
                                                                core::scale_rule::floor, 32, seed + 2));
      const auto qb = host_reference::quantize_mx(b, mx_options(format, 32, 1, core::rounding_mode::rne,
                                                                core::scale_rule::floor, 32, seed + 3));
      const gpu::gemm_path path = format == 3 ? gpu::gemm_path::integer : gpu::gemm_path::tensor_core;
      const mxscope::accumulation_model model = model_of(mxscope::accumulation_kind::exact);
      gpu::select_integer_block_kernel(c.kernel);
      gpu::select_exact_product_kernel(c.exact_kernel);
      const gemm_output got = gpu_product(qa, qb, model, mxscope::output_rounding::fp32, path);
      gpu::select_integer_block_kernel(gpu::integer_block_kernel::automatic);
      gpu::select_exact_product_kernel(gpu::exact_product_kernel::automatic);
      if (format == 3 && gpu::last_integer_block_kernel() != c.kernel) {
        return "the integer path ran " + std::string(gpu::integer_block_kernel_name(gpu::last_integer_block_kernel())) +
               ", not " + std::string(gpu::integer_block_kernel_name(c.kernel));
      }
      // automatic: the warpgroup kernel where the fp32-block products take theirs (sm_90a on sm_90).
      const gpu::exact_product_kernel expected =
          c.exact_kernel != gpu::exact_product_kernel::automatic ? c.exact_kernel
          : gpu::selected_tensor_core_kernel() == gpu::tensor_core_kernel::wgmma_fp8 ? gpu::exact_product_kernel::wgmma
                                                                                    : gpu::exact_product_kernel::mma_sync;
      if (format == 0 && gpu::last_exact_product_kernel() != expected) {
        return "the tensor-core path ran " +
               std::string(gpu::exact_product_kernel_name(gpu::last_exact_product_kernel())) + ", not " +
               std::string(gpu::exact_product_kernel_name(expected));
      }
      int zeros = 0;
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < n; j += 2) zeros += got.exact(i, j) == 0.0 ? 1 : 0;
      }
      if (zeros != m * (n / 2)) return "only " + std::to_string(zeros) + " of the even columns' sums are zero";
      return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {}, name + ", seed " + hex64(seed));
    });
  }
}

}  // namespace gpu_test
