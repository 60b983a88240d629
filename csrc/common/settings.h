// Parsing of settings given as text (environment variables, config values): one rule for every
// module, errors naming the setting.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace uccl_ep {

// A whole unsigned integer (decimal, or 0x-prefixed hex) of at least `minimum`.
inline uint64_t parse_setting_unsigned(const std::string& name, const std::string& text, uint64_t minimum = 0) {
  size_t used = 0;
  unsigned long long value = 0;
  try {
    value = std::stoull(text, &used, 0);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || text[0] == '-' || value < minimum) {
    throw std::invalid_argument(name + "=" + text + " is not an integer >= " + std::to_string(minimum));
  }
  return value;
}

// 1/true/yes/on or 0/false/no/off (empty means off).
inline bool parse_setting_flag(const std::string& name, const std::string& text) {
  if (text == "1" || text == "true" || text == "yes" || text == "on") return true;
  if (text == "0" || text == "false" || text == "no" || text == "off" || text.empty()) return false;
  throw std::invalid_argument(name + "=" + text + " is not a flag (0/1)");
}

}  // namespace uccl_ep
