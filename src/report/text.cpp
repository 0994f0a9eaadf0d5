#include "text.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>

namespace mxscope::report {

namespace {

// The length of the valid UTF-8 sequence starting at text[index], or 0 when it is not one
// (overlong forms, surrogates and code points above U+10FFFF are invalid).
std::size_t utf8_sequence_length(std::string_view text, std::size_t index) {
  const auto byte = [&](std::size_t offset) { return static_cast<unsigned char>(text[index + offset]); };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  std::size_t length = 0;
  std::uint32_t code_point = 0;
  if ((lead & 0xE0) == 0xC0) {
    length = 2;
    code_point = lead & 0x1FU;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3;
    code_point = lead & 0x0FU;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4;
    code_point = lead & 0x07U;
  } else {
    return 0;
  }
  if (index + length > text.size()) return 0;
  for (std::size_t offset = 1; offset < length; ++offset) {
    if ((byte(offset) & 0xC0) != 0x80) return 0;
    code_point = (code_point << 6) | (byte(offset) & 0x3FU);
  }
  constexpr std::uint32_t smallest_for_length[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (code_point < smallest_for_length[length]) return 0;
  if (code_point > 0x10FFFF) return 0;
  if (code_point >= 0xD800 && code_point <= 0xDFFF) return 0;
  return length;
}

}  // namespace

std::string valid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  std::size_t index = 0;
  while (index < text.size()) {
    const std::size_t length = utf8_sequence_length(text, index);
    if (length == 0) {
      out += "\xEF\xBF\xBD";
      ++index;
    } else {
      out.append(text.substr(index, length));
      index += length;
    }
  }
  return out;
}

std::string printable(std::string_view text, std::size_t limit) {
  std::string out;
  std::size_t index = 0;
  while (index < text.size() && out.size() < limit) {
    const auto byte = static_cast<unsigned char>(text[index]);
    const std::size_t length = utf8_sequence_length(text, index);
    if (byte < 0x20 || byte == 0x7F || length == 0) {
      out += fmt::format("\\x{:02X}", byte);
      ++index;
    } else {
      out.append(text.substr(index, length));
      index += length;
    }
  }
  if (index < text.size()) out += "...";
  return out;
}

std::string html_escape(std::string_view text) {
  const std::string repaired = valid_utf8(text);
  std::string out;
  out.reserve(repaired.size() + repaired.size() / 8);
  for (const char c : repaired) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string gnuplot_quoted(std::string_view text) {
  const std::string repaired = valid_utf8(text);
  std::string out = "'";
  for (const char c : repaired) {
    if (c == '\'') {
      out += "''";
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string short_number(double value) {
  if (std::isnan(value)) return "n/a";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  if (value == 0.0) return "0";
  return fmt::format("{:.4g}", value);
}

std::string data_number(double value) {
  if (!std::isfinite(value)) return "NaN";
  return fmt::format("{:.17g}", value);
}

std::string base64_encode(std::string_view bytes) {
  static constexpr char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t index = 0;
  for (; index + 3 <= bytes.size(); index += 3) {
    const std::uint32_t group = (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[index])) << 16) |
                                (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[index + 1])) << 8) |
                                static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[index + 2]));
    out += alphabet[(group >> 18) & 63U];
    out += alphabet[(group >> 12) & 63U];
    out += alphabet[(group >> 6) & 63U];
    out += alphabet[group & 63U];
  }
  const std::size_t remaining = bytes.size() - index;
  if (remaining > 0) {
    std::uint32_t group = static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[index])) << 16;
    if (remaining == 2) group |= static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[index + 1])) << 8;
    out += alphabet[(group >> 18) & 63U];
    out += alphabet[(group >> 12) & 63U];
    out += remaining == 2 ? alphabet[(group >> 6) & 63U] : '=';
    out += '=';
  }
  return out;
}

}  // namespace mxscope::report
