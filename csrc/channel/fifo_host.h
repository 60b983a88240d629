// Producer memory operations for host threads (tests and CPU-only paths stand in for a GPU).
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

#include "common/portability.h"

namespace uccl_ep {

class HostFifoOps {
 public:
  explicit HostFifoOps(std::chrono::steady_clock::time_point deadline) : deadline_(deadline) {}

  uint64_t fetch_add_relaxed(uint64_t* addr, uint64_t value) { return host_fetch_add_relaxed(addr, value); }
  uint64_t load_acquire(const uint64_t* addr) { return host_load_acquire(addr); }
  void store_relaxed(uint64_t* addr, uint64_t value) { host_store_relaxed(addr, value); }
  void store_release(uint64_t* addr, uint64_t value) { host_store_release(addr, value); }
  void pause() { std::this_thread::yield(); }
  bool expired() const { return std::chrono::steady_clock::now() > deadline_; }

 private:
  std::chrono::steady_clock::time_point deadline_;
};

}  // namespace uccl_ep
