// Per-Buffer state of the low-latency kernels that stays on this rank: each half's control
// words on the device and the failure status in mapped host memory (readable without a sync).
#pragma once

#include <cstdint>

#include "kernels/low_latency.h"

namespace uccl_ep {

class LowLatencyState {
 public:
  // Per half: uses (in shares), spare, aborted, spare; the normal mode's own state (intranode.h) uses
  // the first spare to count a kernel's finished blocks.
  static constexpr int kControlWords = 4;

  explicit LowLatencyState(int device);
  ~LowLatencyState();
  LowLatencyState(const LowLatencyState&) = delete;
  LowLatencyState& operator=(const LowLatencyState&) = delete;

  std::uintptr_t control(int half) const;    // device uint64 [kControlWords]
  std::uintptr_t status_device() const;      // LowLatencyStatus*, as kernels see it
  LowLatencyStatus status() const;           // read from the host, no sync
  void reset();                              // zero both halves and the status (synchronises)
  void release();
  bool released() const { return control_ == nullptr; }

 private:
  int device_;
  uint64_t* control_ = nullptr;
  LowLatencyStatus* status_host_ = nullptr;
  LowLatencyStatus* status_device_ = nullptr;
};

}  // namespace uccl_ep
