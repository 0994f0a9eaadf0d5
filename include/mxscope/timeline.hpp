// The device timeline of a run (`replay --kernel-times`): every kernel, copy and memset the GPU
// backend queued while it was on, each timed by a pair of device events on its own stream, and
// what a run's report makes of them. Unlike a profiler, which runs the kernels one at a time, the
// events leave the run as it is, so the timeline shows where the device sat idle between the
// operations of a stage (host work, waits, launch gaps) as well as what each operation took.
// The record is a plain type (the GPU backend fills it, include/mxscope/gpu.hpp); the summaries
// are host code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mxscope::timeline {

// One queued operation, in the order the process queued it. Times in milliseconds from the
// timeline's start event; stop_ms >= start_ms.
struct operation {
  std::string name;   // the kernel's name (short_kernel_name), or "copy host to device" etc.
  std::string label;  // what the queuing thread was doing (timeline labels; "" for none)
  int stream = 0;     // the streams numbered in the order they first appear
  std::int64_t bytes = 0;  // copies and memsets; 0 for kernels
  double start_ms = 0.0;
  double stop_ms = 0.0;
};

// The total length of the union of [start, stop) intervals (overlaps counted once); an interval
// with stop <= start adds nothing.
double union_length(std::vector<std::pair<double, double>> intervals);

struct label_total {
  std::string label;
  std::int64_t operations = 0;
  double busy_seconds = 0.0;  // the union of its operations' intervals
  double span_seconds = 0.0;  // its first start to its last stop
};

struct name_total {
  std::string name;
  std::int64_t calls = 0;
  double seconds = 0.0;  // the sum of its operations' durations
};

struct summary {
  std::int64_t operations = 0;
  double span_seconds = 0.0;       // the first start to the last stop
  double busy_seconds = 0.0;       // the union over every stream: the device had work queued and running
  double idle_seconds = 0.0;       // span - busy
  double operation_seconds = 0.0;  // the sum of every operation's duration (> busy where streams overlap)
  std::vector<label_total> labels;  // in the order each label first appears
  std::vector<name_total> names;    // by total seconds, largest first (ties: by name)
};

summary summarize(const std::vector<operation>& operations);

// A demangled kernel name shortened for a report: without the return type, the parameter list,
// and the namespaces mxscope::gpu:: and (anonymous namespace):: (templates keep their arguments).
std::string short_kernel_name(const std::string& demangled);

// The operations as CSV: index,stream,label,name,bytes,start_ms,stop_ms (text fields quoted where
// they hold a comma, a quote or a line break; times with microsecond digits).
std::string to_csv(const std::vector<operation>& operations);

}  // namespace mxscope::timeline
