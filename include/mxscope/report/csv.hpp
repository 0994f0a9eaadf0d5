// A small, strict reader for the tidy CSV files a replay writes (docs/metrics.md): one header line,
// one observation per row. Quoted fields (RFC 4180: commas, doubled quotes and line breaks inside
// quotes) are accepted so that a hand-edited file still reads, but every irregularity is an
// input_error that names the file, the line and the column: a row with the wrong number of fields,
// an unterminated quote, a duplicate or missing column, a value that is not a number.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace mxscope::report {

class csv_table {
 public:
  // Reads and splits the whole file, which must end with a line break (mxscope replay ends every
  // line; a file cut inside a line is refused). `label` is how errors name it (e.g. "RUN/steps.csv").
  static csv_table read_file(const std::filesystem::path& path, const std::string& label);
  // Splits `text` as if it were the contents of a file named `label`.
  static csv_table parse(std::string_view text, const std::string& label);

  const std::string& label() const { return label_; }
  const std::vector<std::string>& header() const { return header_; }
  std::size_t row_count() const { return rows_.size(); }

  // The index of `name` in the header; throws input_error naming the file and the column when the
  // header lacks it.
  std::size_t require_column(std::string_view name) const;
  // The index of `name`, or header().size() when absent.
  std::size_t find_column(std::string_view name) const;

  const std::string& text(std::size_t row, std::size_t column) const { return rows_[row].fields[column]; }
  // The field as a double: decimal text as %.17g prints it, plus nan, -nan, inf and -inf.
  // Throws input_error naming file, line, column and the offending text.
  double number(std::size_t row, std::size_t column) const;
  // The field as a whole number (steps, T); same errors.
  long long integer(std::size_t row, std::size_t column) const;

  // The physical line on which `row` starts (the header is line 1).
  std::size_t line_of(std::size_t row) const { return rows_[row].line; }
  // "FILE: line L, column C (NAME)" for messages about one field.
  std::string where(std::size_t row, std::size_t column) const;

 private:
  struct row {
    std::size_t line = 0;
    std::vector<std::string> fields;
  };

  std::string label_;
  std::vector<std::string> header_;
  std::vector<row> rows_;
};

}  // namespace mxscope::report
