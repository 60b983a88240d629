// Argument checks of the host code: a false condition throws std::invalid_argument (ValueError in
// Python) carrying the message, before anything is done.
#pragma once

#include <stdexcept>
#include <string>

namespace uccl_ep {

inline void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}
// A literal message stays a pointer until it is needed: the checks of every launch make no string.
inline void require(bool ok, const char* message) {
  if (!ok) throw std::invalid_argument(message);
}

}  // namespace uccl_ep
