// Argument checks every transport makes before it queues a request (std::invalid_argument naming
// the argument; TransportError for a transport that cannot take requests).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "transport/transport.h"

namespace uccl_ep {

inline void check_usable(const std::string& who, bool closed, bool connected, int peer, int num_ranks,
                         const char* op) {
  if (closed) throw TransportError(who + ": " + op + " after close()");
  if (!connected) throw TransportError(who + ": " + op + " before connect()");
  if (peer < 0 || peer >= num_ranks) {
    throw std::invalid_argument("peer must be in [0, num_ranks=" + std::to_string(num_ranks) + ") (got " +
                                std::to_string(peer) + ")");
  }
}

// [offset, offset + length) must lie inside `bytes` (the region `whose`).
inline void check_range(const char* offset_name, uint64_t offset, uint64_t length, uint64_t bytes,
                        const std::string& whose) {
  if (offset > bytes) {
    throw std::invalid_argument(std::string(offset_name) + " " + std::to_string(offset) + " is beyond the end of " +
                                whose + " (" + std::to_string(bytes) + " bytes)");
  }
  if (length > bytes - offset) {
    throw std::invalid_argument("length " + std::to_string(length) + " at " + offset_name + " " +
                                std::to_string(offset) + " runs past the end of " + whose + " (" +
                                std::to_string(bytes) + " bytes)");
  }
}

}  // namespace uccl_ep
