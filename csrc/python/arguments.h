// Argument checks the Python bindings share: a bad argument raises std::invalid_argument (ValueError
// in Python) naming it, before anything is done.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/require.h"
#include "transport/transport.h"

namespace uccl_ep {
namespace bindings {

using ::uccl_ep::require;

inline uint64_t non_negative(const char* name, int64_t value) {
  require(value >= 0, std::string(name) + " must be >= 0 (got " + std::to_string(value) + ")");
  return static_cast<uint64_t>(value);
}

// The region Python names by an address and a size (e.g. a tensor's data_ptr() and numel()).
inline MemoryRegion region_at(int64_t region_ptr, int64_t region_bytes) {
  MemoryRegion region;
  region.base = reinterpret_cast<void*>(static_cast<uintptr_t>(non_negative("region_ptr", region_ptr)));
  region.bytes = non_negative("region_bytes", region_bytes);
  return region;
}

// A pointer Python passes as an integer (a tensor's data_ptr(); 0 is null).
template <typename T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

#if defined(UCCL_EP_GPU_RUNTIME)
// A stream Python passes as an integer (torch.cuda.Stream.cuda_stream).
inline gpuStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<gpuStream_t>(stream); }
#endif

}  // namespace bindings
}  // namespace uccl_ep
