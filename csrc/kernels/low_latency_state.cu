#include "kernels/low_latency_state.h"

#include <stdexcept>

namespace uccl_ep {

LowLatencyState::LowLatencyState(int device) : device_(device) {
  UCCL_EP_GPU_CHECK(cudaSetDevice(device));
  UCCL_EP_GPU_CHECK(cudaMalloc(&control_, 2 * kControlWords * sizeof(uint64_t)));
  UCCL_EP_GPU_CHECK(cudaHostAlloc(&status_host_, sizeof(LowLatencyStatus), cudaHostAllocMapped));
  UCCL_EP_GPU_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device_), status_host_, 0));
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
  UCCL_EP_GPU_CHECK(cudaSetDevice(device_));
  UCCL_EP_GPU_CHECK(cudaDeviceSynchronize());
  UCCL_EP_GPU_CHECK(cudaMemset(control_, 0, 2 * kControlWords * sizeof(uint64_t)));
  UCCL_EP_GPU_CHECK(cudaDeviceSynchronize());
  *status_host_ = LowLatencyStatus{};
}

void LowLatencyState::release() {
  if (control_ == nullptr && status_host_ == nullptr) return;
  UCCL_EP_GPU_CHECK(cudaSetDevice(device_));
  cudaError_t first = cudaDeviceSynchronize();
  if (control_ != nullptr) {
    const cudaError_t status = cudaFree(control_);
    if (first == cudaSuccess) first = status;
  }
  if (status_host_ != nullptr) {
    const cudaError_t status = cudaFreeHost(status_host_);
    if (first == cudaSuccess) first = status;
  }
  control_ = nullptr;
  status_host_ = status_device_ = nullptr;
  UCCL_EP_GPU_CHECK(first);
}

}  // namespace uccl_ep
