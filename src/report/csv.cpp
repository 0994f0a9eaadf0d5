#include "mxscope/report/csv.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "mxscope/errors.hpp"
#include "text.hpp"

namespace mxscope::report {

namespace {

// What a field looks like in a message: quoted, control characters escaped, long text cut short.
std::string shown(std::string_view field) { return fmt::format("'{}'", printable(field, 60)); }

}  // namespace

csv_table csv_table::read_file(const std::filesystem::path& path, const std::string& label) {
  std::error_code status_error;
  if (!std::filesystem::exists(path, status_error)) {
    throw input_error(fmt::format("{}: no such file (a run directory holds steps.csv, accumulation.csv and "
                                  "summary.json, written by mxscope replay)",
                                  label));
  }
  if (std::filesystem::is_directory(path, status_error)) {
    throw input_error(fmt::format("{}: is a directory, expected a CSV file", label));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw input_error(fmt::format("{}: cannot open the file for reading", label));
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) throw input_error(fmt::format("{}: read error", label));
  const std::string text = contents.str();
  // mxscope replay ends every line, the last included: a file that stops inside a line was cut
  // short (a full disk, a copy that did not finish), and its last row would be read as data.
  if (!text.empty() && text.back() != '\n') {
    const auto lines = static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')) + 1;
    throw input_error(fmt::format("{}: line {}: the file ends inside a line (cut short?); every line mxscope "
                                  "replay writes ends with a line break",
                                  label, lines));
  }
  return parse(text, label);
}

csv_table csv_table::parse(std::string_view text, const std::string& label) {
  csv_table table;
  table.label_ = label;

  // A UTF-8 byte order mark is not part of the first column's name.
  if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);

  std::vector<row> records;
  row current;
  std::string field;
  std::size_t line = 1;
  current.line = 1;
  bool in_quotes = false;
  bool field_was_quoted = false;
  std::size_t quote_opened_on = 0;
  bool record_has_content = false;

  auto end_field = [&] {
    current.fields.push_back(std::move(field));
    field.clear();
    field_was_quoted = false;
  };
  auto end_record = [&] {
    end_field();
    // Blank lines carry no observation; they are skipped rather than read as one empty field.
    const bool blank = current.fields.size() == 1 && current.fields[0].empty() && !record_has_content;
    if (!blank) records.push_back(std::move(current));
    current = row{};
    record_has_content = false;
  };

  for (std::size_t index = 0; index < text.size(); ++index) {
    const char c = text[index];
    if (in_quotes) {
      if (c == '"') {
        if (index + 1 < text.size() && text[index + 1] == '"') {
          field += '"';
          ++index;
        } else {
          in_quotes = false;
        }
      } else {
        if (c == '\n') ++line;
        field += c;
      }
      continue;
    }
    if (c == '"') {
      if (!field.empty() || field_was_quoted) {
        throw input_error(fmt::format("{}: line {}, column {}: a quote inside an unquoted field", label, line,
                                      current.fields.size() + 1));
      }
      in_quotes = true;
      field_was_quoted = true;
      record_has_content = true;
      quote_opened_on = line;
    } else if (c == ',') {
      end_field();
      record_has_content = true;
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && index + 1 < text.size() && text[index + 1] == '\n') ++index;
      end_record();
      ++line;
      current.line = line;
    } else {
      if (field_was_quoted) {
        throw input_error(fmt::format("{}: line {}, column {}: text after the closing quote of a field", label, line,
                                      current.fields.size() + 1));
      }
      field += c;
      record_has_content = true;
    }
  }
  if (in_quotes) {
    throw input_error(fmt::format("{}: line {}: a quoted field is never closed", label, quote_opened_on));
  }
  if (record_has_content || !field.empty()) end_record();

  if (records.empty()) throw input_error(fmt::format("{}: the file is empty (expected a header line)", label));
  table.header_ = std::move(records.front().fields);
  for (std::size_t column = 0; column < table.header_.size(); ++column) {
    if (table.header_[column].empty()) {
      throw input_error(fmt::format("{}: line 1, column {}: empty column name in the header", label, column + 1));
    }
    for (std::size_t earlier = 0; earlier < column; ++earlier) {
      if (table.header_[earlier] == table.header_[column]) {
        throw input_error(fmt::format("{}: line 1: column '{}' appears twice (columns {} and {})", label,
                                      printable(table.header_[column], 60), earlier + 1, column + 1));
      }
    }
  }
  for (std::size_t record = 1; record < records.size(); ++record) {
    if (records[record].fields.size() != table.header_.size()) {
      throw input_error(fmt::format("{}: line {}: {} fields, but the header has {} columns", label,
                                    records[record].line, records[record].fields.size(), table.header_.size()));
    }
    table.rows_.push_back(std::move(records[record]));
  }
  return table;
}

std::size_t csv_table::find_column(std::string_view name) const {
  for (std::size_t column = 0; column < header_.size(); ++column) {
    if (header_[column] == name) return column;
  }
  return header_.size();
}

std::size_t csv_table::require_column(std::string_view name) const {
  const std::size_t column = find_column(name);
  if (column == header_.size()) {
    throw input_error(fmt::format("{}: line 1: missing column '{}' (the header has {} columns: {})", label_, name,
                                  header_.size(), printable(fmt::format("{}", fmt::join(header_, ",")), 400)));
  }
  return column;
}

std::string csv_table::where(std::size_t row, std::size_t column) const {
  return fmt::format("{}: line {}, column {} ({})", label_, rows_[row].line, column + 1,
                     printable(header_[column], 60));
}

double csv_table::number(std::size_t row, std::size_t column) const {
  const std::string& field = rows_[row].fields[column];
  std::string_view digits = field;
  // %.17g never writes a leading '+', but other writers do; from_chars does not take it.
  if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
  if (digits.empty()) throw input_error(fmt::format("{}: empty value, expected a number", where(row, column)));
  double value = 0.0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (error == std::errc::result_out_of_range) {
    // Beyond the double range: the sign of the text decides between +-inf and +-0.
    throw input_error(fmt::format("{}: {} is out of the range of a double", where(row, column), shown(field)));
  }
  if (error != std::errc() || end != digits.data() + digits.size()) {
    throw input_error(fmt::format("{}: {} is not a number", where(row, column), shown(field)));
  }
  return value;
}

long long csv_table::integer(std::size_t row, std::size_t column) const {
  const std::string& field = rows_[row].fields[column];
  if (field.empty()) throw input_error(fmt::format("{}: empty value, expected a whole number", where(row, column)));
  long long value = 0;
  const auto [end, error] = std::from_chars(field.data(), field.data() + field.size(), value);
  if (error != std::errc() || end != field.data() + field.size()) {
    throw input_error(fmt::format("{}: {} is not a whole number", where(row, column), shown(field)));
  }
  return value;
}

}  // namespace mxscope::report
