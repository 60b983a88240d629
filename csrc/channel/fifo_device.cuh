// Producer memory operations for GPU threads writing into mapped host memory: system-scope
// release/acquire, so the CPU proxy sees word1 before the word0 that publishes it.
#pragma once

#include <cstdint>

#include "common/portability.h"

namespace uccl_ep {

struct DeviceFifoOps {
  uint64_t deadline_ns;

  __device__ uint64_t fetch_add_relaxed(uint64_t* addr, uint64_t value) { return fetch_add_device_relaxed(addr, value); }
  __device__ uint64_t load_acquire(const uint64_t* addr) { return load_acquire_system(addr); }
  __device__ void store_relaxed(uint64_t* addr, uint64_t value) { store_relaxed_system(addr, value); }
  __device__ void store_release(uint64_t* addr, uint64_t value) { store_release_system(addr, value); }
  __device__ void pause() { device_pause(); }
  __device__ bool expired() const { return device_time_ns() > deadline_ns; }
};

}  // namespace uccl_ep
