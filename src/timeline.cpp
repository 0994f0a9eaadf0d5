// The device timeline's summaries (include/mxscope/timeline.hpp).
#include "mxscope/timeline.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace mxscope::timeline {

double union_length(std::vector<std::pair<double, double>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  double total = 0.0;
  bool open = false;
  double start = 0.0, stop = 0.0;
  for (const auto& [from, to] : intervals) {
    if (to <= from) continue;
    if (open && from <= stop) {
      stop = std::max(stop, to);
      continue;
    }
    if (open) total += stop - start;
    open = true;
    start = from;
    stop = to;
  }
  if (open) total += stop - start;
  return total;
}

namespace {

std::pair<double, double> extent(const std::vector<std::pair<double, double>>& intervals) {
  if (intervals.empty()) return {0.0, 0.0};
  double first = intervals.front().first, last = intervals.front().second;
  for (const auto& [from, to] : intervals) {
    first = std::min(first, from);
    last = std::max(last, to);
  }
  return {first, last};
}

}  // namespace

summary summarize(const std::vector<operation>& operations) {
  summary out;
  out.operations = static_cast<std::int64_t>(operations.size());
  std::vector<std::pair<double, double>> all;
  std::vector<std::string> label_order;
  std::map<std::string, std::vector<std::pair<double, double>>> by_label;
  std::map<std::string, name_total> by_name;
  for (const operation& op : operations) {
    all.emplace_back(op.start_ms, op.stop_ms);
    auto [at, fresh] = by_label.try_emplace(op.label);
    if (fresh) label_order.push_back(op.label);
    at->second.emplace_back(op.start_ms, op.stop_ms);
    name_total& named = by_name[op.name];
    named.name = op.name;
    ++named.calls;
    named.seconds += (op.stop_ms - op.start_ms) / 1e3;
    out.operation_seconds += (op.stop_ms - op.start_ms) / 1e3;
  }
  const auto [first, last] = extent(all);
  out.span_seconds = (last - first) / 1e3;
  out.busy_seconds = union_length(all) / 1e3;
  out.idle_seconds = out.span_seconds - out.busy_seconds;
  for (const std::string& label : label_order) {
    const auto& intervals = by_label[label];
    const auto [from, to] = extent(intervals);
    out.labels.push_back({label, static_cast<std::int64_t>(intervals.size()), union_length(intervals) / 1e3,
                          (to - from) / 1e3});
  }
  for (auto& [name, total] : by_name) out.names.push_back(total);
  std::sort(out.names.begin(), out.names.end(), [](const name_total& a, const name_total& b) {
    return a.seconds != b.seconds ? a.seconds > b.seconds : a.name < b.name;
  });
  return out;
}

std::string short_kernel_name(const std::string& demangled) {
  // The parameter list: the last top-level "(...)" (template arguments may hold parentheses).
  std::string name = demangled;
  int depth = 0;
  std::size_t open = std::string::npos;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (c == '<') ++depth;
    if (c == '>') --depth;
    if (c == '(' && depth == 0 && name.compare(i, 21, "(anonymous namespace)") != 0) {
      open = i;
      break;
    }
  }
  if (open != std::string::npos) name.erase(open);
  // The return type: a leading "void " (kernels return nothing).
  if (name.rfind("void ", 0) == 0) name.erase(0, 5);
  for (const std::string prefix : {"mxscope::gpu::", "(anonymous namespace)::"}) {
    for (std::size_t at = name.find(prefix); at != std::string::npos; at = name.find(prefix)) {
      name.erase(at, prefix.size());
    }
  }
  return name;
}

namespace {

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n\r") == std::string::npos) return text;
  std::string quoted = "\"";
  for (const char c : text) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + "\"";
}

}  // namespace

std::string to_csv(const std::vector<operation>& operations) {
  std::string out = "index,stream,label,name,bytes,start_ms,stop_ms\n";
  for (std::size_t i = 0; i < operations.size(); ++i) {
    const operation& op = operations[i];
    out += fmt::format("{},{},{},{},{},{:.3f},{:.3f}\n", i, op.stream, csv_field(op.label), csv_field(op.name),
                       op.bytes, op.start_ms, op.stop_ms);
  }
  return out;
}

}  // namespace mxscope::timeline
