// What the transports whose region is GPU memory (cuda-copy, tcp over a device region) share:
// making the region's device current, one-thread kernels that add to or store into an int64 at
// system scope, the RegionWriter built on them, and a bounded wait for an event.
//
// The kernels are compiled by the GPU compiler (device_region_ops.cu) behind a plain interface
// (pointers, integers, a stream, a status), so host-compiled sources call them too.
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/portability.h"
#include "transport/transport.h"

#if !defined(UCCL_EP_GPU_RUNTIME)
#error "device_region_ops.h needs the GPU runtime: include it only in GPU builds (UCCL_EP_WITH_GPU)"
#endif

namespace uccl_ep {

// Loads the two kernels below into the current device's context (gpu_load_kernels): a proxy thread
// launches them while the kernels it serves spin.
void load_region_ops_kernels();

// Launch a one-thread kernel on `stream` and return the launch's status; the kernel runs later.
// `target` is an 8-byte aligned int64 in device memory: ours, or a peer GPU's mapped into this
// process, which that GPU's kernels update concurrently (hence system scope).
gpuError_t launch_atomic_add_system(void* target, int64_t value, gpuStream_t stream);
// The owner's kernels poll the target with system-scope acquires.
gpuError_t launch_store_release_system(void* target, int64_t value, gpuStream_t stream);

// Appended to the message of a copy that timed out: the causes seen on 2x H200 (KERNEL_NOTES.md,
// "Lazy module loading" and "Late delivery"), each of which holds the proxy's copies while a peer's
// kernel waits for them.
constexpr const char* kStalledCopyHint =
    " (copies on this GPU stall while an NCCL collective waits on it (call Buffer.synchronize before "
    "collectives), while another thread runs cudaFree (torch.cuda.empty_cache) or captures a graph with "
    "kernels in flight, or behind a kernel's first launch under lazy module loading (start with "
    "CUDA_MODULE_LOADING=EAGER))";

inline std::string gpu_error_text(gpuError_t status) {
  return std::string(gpu_error_name(status)) + ": " + gpu_error_string(status);
}

// "<transport> transport rank R", as the transports' messages begin.
inline std::string transport_label(const char* transport, int rank) {
  return std::string(transport) + " transport rank " + std::to_string(rank);
}

// Makes `device` current for the calling thread and restores the caller's device on exit: a proxy
// thread or a Python thread may have another device current.
class ScopedDevice {
 public:
  // Throws TransportError naming the transport and rank if the device cannot be made current.
  ScopedDevice(int device, const char* transport, int rank) : status_(switch_to(device)) {
    if (status_ != kGpuSuccess) {
      throw TransportError(transport_label(transport, rank) + ": cannot make device " + std::to_string(device) +
                           " current: " + gpu_error_text(status_));
    }
  }
  // A failure leaves the current device as it was, and status() says why.
  explicit ScopedDevice(int device) : status_(switch_to(device)) {}
  ~ScopedDevice() {
    if (switched_) (void)gpu_set_device(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  gpuError_t status() const { return status_; }

 private:
  gpuError_t switch_to(int device) {
    gpuError_t status = gpu_get_device(&previous_);
    if (status == kGpuSuccess && previous_ != device) {
      status = gpu_set_device(device);
      switched_ = status == kGpuSuccess;
    }
    return status;
  }

  int previous_ = 0;
  bool switched_ = false;
  gpuError_t status_;
};

// A transport's region given as memory of GPU `device`: the device must be one this process sees
// (std::invalid_argument naming the range, or TransportError where no GPU can be used at all) and the
// region must be its memory (std::invalid_argument naming what it is instead). Checks the device
// before making it current: a call that creates a context would create it on the current device.
inline void require_device_region(const char* transport, int rank, int device, MemoryRegion region) {
  int count = 0;
  const gpuError_t status = gpu_device_count(&count);
  if (status != kGpuSuccess) {
    (void)gpu_last_error();
    throw TransportError(transport_label(transport, rank) + ": device=" + std::to_string(device) +
                         " but no GPU can be used: " + gpu_error_text(status));
  }
  if (device < 0 || device >= count) {
    throw std::invalid_argument("device must be in [0, " + std::to_string(count) +
                                ") (the GPUs this process sees; got " + std::to_string(device) + ")");
  }
  if (region.bytes == 0) return;
  ScopedDevice current(device, transport, rank);
  GpuMemory kind = GpuMemory::kHost;
  int owner = -1;
  if (gpu_pointer_kind(region.base, &kind, &owner) != kGpuSuccess) (void)gpu_last_error();  // host memory
  if (kind == GpuMemory::kDevice && owner == device) return;
  std::string what = kind == GpuMemory::kManaged ? "managed memory" : "host memory";
  if (kind == GpuMemory::kDevice) what = "memory of device " + std::to_string(owner);
  throw std::invalid_argument("region_ptr is " + what + ", not memory of device=" + std::to_string(device) +
                              " (give no device for a host region)");
}

// Transport::bind_thread of the transports over GPU memory: the device, and the relaxed capture mode
// (the proxy runs while the application captures graphs). A failure is left for the next
// ScopedDevice of that thread to report, with the transport's name.
inline void bind_thread_to_device(int device) {
  if (gpu_set_device(device) != kGpuSuccess || gpu_relax_stream_capture() != kGpuSuccess) (void)gpu_last_error();
}

// Polls `event` until the work before it is done. Returns kGpuSuccess, that work's failure, or
// kGpuErrorNotReady once `deadline` has passed. Polls rather than blocks: no runtime wait has a
// timeout.
inline gpuError_t wait_for_event(gpuEvent_t event, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const gpuError_t status = gpu_event_query(event);
    if (status != kGpuErrorNotReady) return status;
    // Not a failure, but the runtime may keep it as the thread's last error, which the next
    // launch's check would then report.
    (void)gpu_last_error();
    if (std::chrono::steady_clock::now() >= deadline) return kGpuErrorNotReady;
    std::this_thread::yield();
  }
}

// Counter adds and flag stores on a region in device memory: one-thread kernels on `stream`, so
// they follow what was queued on it before them. They return once launched and throw
// TransportError if a launch fails.
class DeviceRegionWriter final : public RegionWriter {
 public:
  // `transport` (a string literal) and `rank` name the owner in errors.
  DeviceRegionWriter(MemoryRegion region, int device, gpuStream_t stream, const char* transport, int rank)
      : base_(static_cast<uint8_t*>(region.base)), device_(device), stream_(stream), transport_(transport),
        rank_(rank) {}

  void add(uint64_t offset, int64_t amount) override {
    ScopedDevice current(device_, transport_, rank_);
    check(launch_atomic_add_system(base_ + offset, amount, stream_), "a counter add");
  }
  void store_release(uint64_t offset, int64_t value) override {
    ScopedDevice current(device_, transport_, rank_);
    check(launch_store_release_system(base_ + offset, value, stream_), "a flag store");
  }

 private:
  void check(gpuError_t status, const char* what) const {
    if (status != kGpuSuccess) {
      throw TransportError(transport_label(transport_, rank_) + ": " + what +
                           " on its own region could not be launched: " + gpu_error_text(status));
    }
  }

  uint8_t* const base_;
  const int device_;
  const gpuStream_t stream_;
  const char* const transport_;
  const int rank_;
};

}  // namespace uccl_ep
