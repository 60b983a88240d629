#include "kernels/low_latency_state.h"

#include <stdexcept>

namespace uccl_ep {

LowLatencyState::LowLatencyState(int device) : device_(device) {
  UCCL_EP_GPU_CHECK(gpu_set_device(device));
  UCCL_EP_GPU_CHECK(gpu_device_alloc(reinterpret_cast<void**>(&control_), 2 * kControlWords * sizeof(uint64_t)));
  UCCL_EP_GPU_CHECK(gpu_host_alloc_mapped(reinterpret_cast<void**>(&status_host_),
                                          reinterpret_cast<void**>(&status_device_), sizeof(LowLatencyStatus)));
  reset();
}

LowLatencyState::~LowLatencyState() {
  try {
    release();
  } catch (...) {
    // Destructors must not throw.
  }
}

std::uintptr_t LowLatencyState::control(int half) const {
  if (half != 0 && half != 1) throw std::invalid_argument("LowLatencyState.control: half must be 0 or 1");
  if (control_ == nullptr) throw std::runtime_error("LowLatencyState: released");
  return reinterpret_cast<std::uintptr_t>(control_ + half * kControlWords);
}

std::uintptr_t LowLatencyState::status_device() const { return reinterpret_cast<std::uintptr_t>(status_device_); }

LowLatencyStatus LowLatencyState::status() const {
  LowLatencyStatus copy{};
  if (status_host_ == nullptr) return copy;
  const volatile LowLatencyStatus* live = status_host_;
  copy.code = live->code;
  copy.phase = live->phase;
  copy.peer = live->peer;
  copy.detail = live->detail;
  return copy;
}

void LowLatencyState::reset() {
  if (control_ == nullptr) throw std::runtime_error("LowLatencyState: released");
  UCCL_EP_GPU_CHECK(gpu_set_device(device_));
  UCCL_EP_GPU_CHECK(gpu_device_synchronize());
  UCCL_EP_GPU_CHECK(gpu_memset(control_, 0, 2 * kControlWords * sizeof(uint64_t)));
  UCCL_EP_GPU_CHECK(gpu_device_synchronize());
  *status_host_ = LowLatencyStatus{};
}

void LowLatencyState::release() {
  if (control_ == nullptr && status_host_ == nullptr) return;
  UCCL_EP_GPU_CHECK(gpu_set_device(device_));
  gpuError_t first = gpu_device_synchronize();
  if (control_ != nullptr) {
    const gpuError_t status = gpu_device_free(control_);
    if (first == kGpuSuccess) first = status;
  }
  if (status_host_ != nullptr) {
    const gpuError_t status = gpu_host_free(status_host_);
    if (first == kGpuSuccess) first = status;
  }
  control_ = nullptr;
  status_host_ = status_device_ = nullptr;
  UCCL_EP_GPU_CHECK(first);
}

}  // namespace uccl_ep
