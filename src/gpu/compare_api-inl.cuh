// Part of host.cu (included there, in order, inside namespace mxscope::gpu): the host functions of
// include/mxscope/gpu.hpp that compare.

comparison compare(const matrix& estimate, const matrix64& reference, const matrix& reference_fp32) {
  for (const auto& [rows, cols, what] : {std::tuple{estimate.rows, estimate.cols, "the estimate"},
                                         std::tuple{reference_fp32.rows, reference_fp32.cols, "the fp32 reference"}}) {
    if (rows != reference.rows || cols != reference.cols) {
      throw input_error(std::string("compare: ") + what + " is [" + to_text(rows) + ", " + to_text(cols) +
                        "] but the reference is [" + to_text(reference.rows) + ", " + to_text(reference.cols) + "]");
    }
  }
  return compare(device_matrix::upload(estimate), device_matrix::upload(reference),
                 device_matrix::upload(reference_fp32));
}

comparison compare(const device_matrix& estimate, const device_matrix& reference, const device_matrix& reference_fp32) {
  for (const auto& [rows, cols, what] : {std::tuple{estimate.rows(), estimate.cols(), "the estimate"},
                                         std::tuple{reference_fp32.rows(), reference_fp32.cols(), "the fp32 reference"}}) {
    if (rows != reference.rows() || cols != reference.cols()) {
      throw input_error(std::string("compare: ") + what + " is [" + to_text(rows) + ", " + to_text(cols) +
                        "] but the reference is [" + to_text(reference.rows()) + ", " + to_text(reference.cols()) +
                        "]");
    }
  }
  comparison out;
  out.rows = estimate.rows();
  out.cols = estimate.cols();
  const std::int64_t rows = estimate.rows();
  const std::int64_t cols = estimate.cols();
  const std::int64_t count = rows * cols;
  out.row_error_norms.assign(static_cast<std::size_t>(rows), 0.0);
  out.column_error_norms.assign(static_cast<std::size_t>(cols), 0.0);
  if (count == 0) {
    out.zero_reference = true;
    out.rel_err = 0.0;
    out.orth_err = 0.0;
    out.cosine = 1.0;
    return out;
  }
  const float* hat = estimate.fp32();
  const double* g = reference.fp64();
  const float* g32 = reference_fp32.fp32();
  const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
  device_buffer partials(static_cast<std::size_t>(compare_sum_count * chunk_count) * sizeof(double));
  device_buffer counters(sizeof(compare_counters));
  counters.fill_bytes(0);
  runtime::launch(compare_chunks_kernel, grid_for(chunk_count, 1), ordered_sum_lanes, 0, hat, g,
                  g32, count, chunk_count, partials.as<double>(), counters.as<compare_counters>());
  std::vector<double> host_partials(static_cast<std::size_t>(compare_sum_count * chunk_count));
  partials.download(host_partials.data(), partials.bytes());
  compare_counters host_counters{};
  counters.download(&host_counters, sizeof(host_counters));
  double sums[compare_sum_count];
  for (int s = 0; s < compare_sum_count; ++s) {
    sums[s] = tree_of(host_partials, static_cast<std::size_t>(s * chunk_count), static_cast<std::size_t>(chunk_count));
  }

  // The ratios as on the CPU (compare.hpp: finish_from_sums, finish_orthogonal).
  if (finish_from_sums(out, sums)) {
    device_buffer orthogonal(static_cast<std::size_t>(chunk_count) * sizeof(double));
    runtime::launch(orthogonal_chunks_kernel, grid_for(chunk_count, 1), ordered_sum_lanes, 0, hat,
                    g, count, chunk_count, out.bias, orthogonal.as<double>());
    std::vector<double> orthogonal_partials(static_cast<std::size_t>(chunk_count));
    orthogonal.download(orthogonal_partials.data(), orthogonal.bytes());
    finish_orthogonal(out, canonical_tree(orthogonal_partials));
  }
  for (int b = 0; b < ulp_bucket_count; ++b)
    out.ulp.histogram[static_cast<std::size_t>(b)] = static_cast<std::int64_t>(host_counters.histogram[b]);
  out.ulp.max = host_counters.max_ulp;
  out.ulp.compared = static_cast<std::int64_t>(host_counters.compared);
  out.ulp.nan_pairs = static_cast<std::int64_t>(host_counters.nan_pairs);
  out.nonfinite_estimate = static_cast<std::int64_t>(host_counters.nonfinite_estimate);
  out.max_abs_err = host_counters.saw_nan != 0 ? std::numeric_limits<double>::quiet_NaN()
                                               : core_ns::bits_double(host_counters.max_abs_bits);
  out.ulp.mean = out.ulp.compared == 0 ? 0.0 : sums[5] / static_cast<double>(out.ulp.compared);

  const std::int64_t chunks_per_row = (cols + canonical_chunk - 1) / canonical_chunk;
  device_buffer row_partials(static_cast<std::size_t>(rows * chunks_per_row) * sizeof(double));
  runtime::launch(row_chunks_kernel, grid_for(rows * chunks_per_row, 1), ordered_sum_lanes, 0, hat,
                  g, rows, cols, chunks_per_row, row_partials.as<double>());
  std::vector<double> host_rows(static_cast<std::size_t>(rows * chunks_per_row));
  row_partials.download(host_rows.data(), row_partials.bytes());
  for (std::int64_t r = 0; r < rows; ++r) {
    out.row_error_norms[static_cast<std::size_t>(r)] = std::sqrt(
        tree_of(host_rows, static_cast<std::size_t>(r * chunks_per_row), static_cast<std::size_t>(chunks_per_row)));
  }
  const std::int64_t chunks_per_column = (rows + canonical_chunk - 1) / canonical_chunk;
  device_buffer column_partials(static_cast<std::size_t>(chunks_per_column * cols) * sizeof(double));
  // One thread per column chunk, few of them (14336 for the Llama-shaped Wgrad): blocks of
  // column_chunk_threads spread them over every multiprocessor.
  runtime::launch(column_chunks_kernel, grid_for(chunks_per_column * cols, column_chunk_threads),
                  column_chunk_threads, 0, hat, g, rows, cols, chunks_per_column, column_partials.as<double>());
  std::vector<double> host_columns(static_cast<std::size_t>(chunks_per_column * cols));
  column_partials.download(host_columns.data(), column_partials.bytes());
  std::vector<double> column(static_cast<std::size_t>(chunks_per_column));
  for (std::int64_t c = 0; c < cols; ++c) {
    for (std::int64_t chunk = 0; chunk < chunks_per_column; ++chunk) {
      column[static_cast<std::size_t>(chunk)] = host_columns[static_cast<std::size_t>(chunk * cols + c)];
    }
    out.column_error_norms[static_cast<std::size_t>(c)] = std::sqrt(canonical_tree(column));
  }
  return out;
}

