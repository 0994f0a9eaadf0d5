// The device timeline's summaries (include/mxscope/timeline.hpp) against brute force: on integer
// times the union of intervals is the number of unit cells [t, t+1) some interval covers.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "mxscope/timeline.hpp"

namespace {

using mxscope::timeline::operation;

double covered_cells(const std::vector<std::pair<double, double>>& intervals) {
  std::set<int> cells;
  for (const auto& [from, to] : intervals) {
    for (int t = static_cast<int>(from); t < static_cast<int>(to); ++t) cells.insert(t);
  }
  return static_cast<double>(cells.size());
}

std::vector<operation> random_operations(std::mt19937& generator, int count) {
  std::uniform_int_distribution<int> start(0, 400), length(0, 60), stream(0, 2), label(0, 3), name(0, 4);
  std::vector<operation> out;
  for (int i = 0; i < count; ++i) {
    operation op;
    op.start_ms = start(generator);
    op.stop_ms = op.start_ms + length(generator);
    op.stream = stream(generator);
    op.label = "label " + std::to_string(label(generator));
    op.name = "kernel_" + std::to_string(name(generator));
    out.push_back(op);
  }
  return out;
}

TEST(Timeline, UnionLengthMatchesCoveredCells) {
  std::mt19937 generator(7);
  for (int trial = 0; trial < 300; ++trial) {
    const auto operations = random_operations(generator, 1 + trial % 40);
    std::vector<std::pair<double, double>> intervals;
    for (const auto& op : operations) intervals.emplace_back(op.start_ms, op.stop_ms);
    EXPECT_DOUBLE_EQ(mxscope::timeline::union_length(intervals), covered_cells(intervals)) << "trial " << trial;
  }
  EXPECT_EQ(mxscope::timeline::union_length({}), 0.0);
  EXPECT_EQ(mxscope::timeline::union_length({{5.0, 5.0}, {7.0, 3.0}}), 0.0);  // empty and reversed add nothing
  EXPECT_EQ(mxscope::timeline::union_length({{0.0, 2.0}, {2.0, 3.0}}), 3.0);  // touching intervals
}

TEST(Timeline, SummaryMatchesBruteForce) {
  std::mt19937 generator(11);
  for (int trial = 0; trial < 100; ++trial) {
    const auto operations = random_operations(generator, 1 + trial % 30);
    const auto summary = mxscope::timeline::summarize(operations);
    std::vector<std::pair<double, double>> all;
    double first = 1e9, last = -1e9, sum = 0.0;
    for (const auto& op : operations) {
      all.emplace_back(op.start_ms, op.stop_ms);
      first = std::min(first, op.start_ms);
      last = std::max(last, op.stop_ms);
      sum += op.stop_ms - op.start_ms;
    }
    EXPECT_EQ(summary.operations, static_cast<std::int64_t>(operations.size()));
    EXPECT_NEAR(summary.span_seconds, (last - first) / 1e3, 1e-12);
    EXPECT_NEAR(summary.busy_seconds, covered_cells(all) / 1e3, 1e-12);
    EXPECT_NEAR(summary.idle_seconds, summary.span_seconds - summary.busy_seconds, 1e-12);
    EXPECT_NEAR(summary.operation_seconds, sum / 1e3, 1e-12);
    // Labels in the order they first appear, each with its own union and extent.
    std::vector<std::string> order;
    for (const auto& op : operations) {
      if (std::find(order.begin(), order.end(), op.label) == order.end()) order.push_back(op.label);
    }
    ASSERT_EQ(summary.labels.size(), order.size());
    for (std::size_t k = 0; k < order.size(); ++k) {
      std::vector<std::pair<double, double>> mine;
      double from = 1e9, to = -1e9;
      for (const auto& op : operations) {
        if (op.label != order[k]) continue;
        mine.emplace_back(op.start_ms, op.stop_ms);
        from = std::min(from, op.start_ms);
        to = std::max(to, op.stop_ms);
      }
      EXPECT_EQ(summary.labels[k].label, order[k]);
      EXPECT_EQ(summary.labels[k].operations, static_cast<std::int64_t>(mine.size()));
      EXPECT_NEAR(summary.labels[k].busy_seconds, covered_cells(mine) / 1e3, 1e-12);
      EXPECT_NEAR(summary.labels[k].span_seconds, (to - from) / 1e3, 1e-12);
    }
    // Names: every call counted once, by total time, largest first.
    std::int64_t calls = 0;
    for (std::size_t k = 0; k < summary.names.size(); ++k) {
      calls += summary.names[k].calls;
      if (k > 0) {
        EXPECT_GE(summary.names[k - 1].seconds, summary.names[k].seconds);
      }
      double seconds = 0.0;
      for (const auto& op : operations) seconds += op.name == summary.names[k].name ? (op.stop_ms - op.start_ms) / 1e3 : 0.0;
      EXPECT_NEAR(summary.names[k].seconds, seconds, 1e-12);
    }
    EXPECT_EQ(calls, static_cast<std::int64_t>(operations.size()));
  }
}

TEST(Timeline, EmptySummary) {
  const auto summary = mxscope::timeline::summarize({});
  EXPECT_EQ(summary.operations, 0);
  EXPECT_EQ(summary.span_seconds, 0.0);
  EXPECT_EQ(summary.busy_seconds, 0.0);
  EXPECT_TRUE(summary.labels.empty());
  EXPECT_TRUE(summary.names.empty());
}

TEST(Timeline, ShortKernelNames) {
  using mxscope::timeline::short_kernel_name;
  EXPECT_EQ(short_kernel_name("void mxscope::gpu::(anonymous namespace)::sliced_block_kernel<false>(mxscope::gpu::"
                              "(anonymous namespace)::sliced_arguments)"),
            "sliced_block_kernel<false>");
  EXPECT_EQ(short_kernel_name("void mxscope::gpu::mx_fused_kernel<__nv_bfloat16, 16, (mxscope::gpu::fused_encoder)2, "
                              "true>(__nv_bfloat16 const*, long)"),
            "mx_fused_kernel<__nv_bfloat16, 16, (fused_encoder)2, true>");
  EXPECT_EQ(short_kernel_name("copy host to device"), "copy host to device");
  EXPECT_EQ(short_kernel_name("kernel at 0x1234"), "kernel at 0x1234");
  EXPECT_EQ(short_kernel_name("_Z6kernelv"), "_Z6kernelv");  // not demangled: kept
}

TEST(Timeline, CsvQuotesTextFields) {
  operation plain{"copy host to device", "upload", 1, 4096, 0.5, 1.25};
  operation templated{"kernel<1, 2>", "bf16: \"gemm\"", 0, 0, 2.0, 3.0};
  EXPECT_EQ(mxscope::timeline::to_csv({plain, templated}),
            "index,stream,label,name,bytes,start_ms,stop_ms\n"
            "0,1,upload,copy host to device,4096,0.500,1.250\n"
            "1,0,\"bf16: \"\"gemm\"\"\",\"kernel<1, 2>\",0,2.000,3.000\n");
}

}  // namespace
