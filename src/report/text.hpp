// Text helpers of the report: escaping for HTML and gnuplot, UTF-8 repair, number formatting,
// base64. Internal to src/report.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace mxscope::report {

// `text` with invalid UTF-8 sequences replaced by U+FFFD, so that HTML and JSON outputs stay valid
// whatever bytes a CSV field holds.
std::string valid_utf8(std::string_view text);

// For error messages: control characters and invalid bytes shown as \xNN, cut to `limit` bytes.
std::string printable(std::string_view text, std::size_t limit);

// Escapes & < > " ' for HTML text and attribute values (after valid_utf8).
std::string html_escape(std::string_view text);

// A gnuplot single-quoted string literal. Inside single quotes gnuplot expands neither backquoted
// commands nor @macros; the only special character is the quote itself, written twice. Control
// characters become spaces (a literal must stay on one line).
std::string gnuplot_quoted(std::string_view text);

// A value for a table cell: 4 significant digits, "n/a" for NaN, "inf"/"-inf".
std::string short_number(double value);

// A value for gnuplot's data blocks: round-trip exact, NaN for undefined points.
std::string data_number(double value);

std::string base64_encode(std::string_view bytes);

}  // namespace mxscope::report
