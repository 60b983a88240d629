// Timeouts are given in seconds; waits compare against a steady-clock deadline.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace uccl_ep {

// The moment `seconds` from now.
inline std::chrono::steady_clock::time_point deadline_after(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

// "2.5 s", for messages.
inline std::string format_seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", seconds);
  return text;
}

}  // namespace uccl_ep
