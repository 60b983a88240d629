// The StagedRegion of a region in GPU memory (tcp_staging.h): pinned staging, and a stream per role
// so that each role's wait covers its own work only:
//   send     (the I/O thread) device -> staging copies of what goes out
//   receive  (the I/O thread) staging -> device copies of what came in, and the peers' atomic adds
//   local    this rank's requests to itself (device -> device copies, adds), and the RegionWriter's
//            counter adds and flag stores
#include "common/portability.h"
#include "common/deadline.h"

#if defined(UCCL_EP_GPU_RUNTIME)
#include <array>
#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>

#include "transport/device_region_ops.h"
#include "transport/tcp_staging.h"

namespace uccl_ep {

namespace {

constexpr const char* kTransport = "tcp";

// A stream, and the event recorded on it where a wait ends.
struct Lane {
  gpuStream_t stream = nullptr;
  gpuEvent_t done = nullptr;
};

std::string failed(const char* what, gpuError_t status) {
  return std::string(what) + " failed: " + gpu_error_text(status);
}

class DeviceStagedRegion final : public StagedRegion {
 public:
  DeviceStagedRegion(int device, MemoryRegion region, uint64_t staging_bytes, int rank, double timeout_s)
      : device_(device),
        timeout_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(timeout_s))),
        timeout_text_(format_seconds(timeout_s)) {
    require_device_region(kTransport, rank, device, region);
    ScopedDevice current(device, kTransport, rank);
    load_region_ops_kernels();
    try {
      for (Lane* lane : lanes()) create(*lane, rank);
      const gpuError_t status = gpu_host_alloc(reinterpret_cast<void**>(&staging_), staging_bytes);
      if (status != kGpuSuccess) {
        staging_ = nullptr;
        throw TransportError(transport_label(kTransport, rank) + ": cannot allocate " + std::to_string(staging_bytes) +
                             " bytes of pinned staging memory: " + gpu_error_text(status));
      }
      writer_ = std::make_unique<DeviceRegionWriter>(region, device, local_.stream, kTransport, rank);
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
  }

  ~DeviceStagedRegion() override { release(); }

  uint8_t* staging() override { return staging_; }
  RegionWriter& writer() override { return *writer_; }

  std::string stage(uint8_t* staged, const uint8_t* source, uint64_t bytes) override {
    return copy(send_, staged, source, bytes, "copying a write out of device memory");
  }
  void bind_thread() noexcept override { bind_thread_to_device(device_); }

  std::string wait_staged() override { return wait(send_, "copying writes out of device memory"); }

  std::string land(uint8_t* dest, const uint8_t* staged, uint64_t bytes) override {
    return copy(receive_, dest, staged, bytes, "copying a write into device memory");
  }
  std::string add(uint8_t* target, int64_t value) override { return launch_add(receive_, target, value); }
  std::string wait_landed() override { return wait(receive_, "applying writes and atomic adds to device memory"); }

  std::string copy_local(uint8_t* dest, const uint8_t* source, uint64_t bytes) override {
    const char* what = "a copy within device memory";
    const std::string error = copy(local_, dest, source, bytes, what);
    return error.empty() ? wait(local_, what) : error;
  }
  std::string add_local(uint8_t* target, int64_t value) override {
    const std::string error = launch_add(local_, target, value);
    return error.empty() ? wait(local_, "an atomic add to device memory") : error;
  }

  void release() override {
    ScopedDevice current(device_);
    // The staging is freed only once no copy uses it: one that never finishes (a hung GPU) keeps it.
    const bool copying = drain(send_) == kGpuErrorNotReady || drain(receive_) == kGpuErrorNotReady;
    for (Lane* lane : lanes()) {
      if (lane->done != nullptr) (void)gpu_event_destroy(lane->done);
      if (lane->stream != nullptr) (void)gpu_stream_destroy(lane->stream);  // safe with kernels still queued
      *lane = Lane{};
    }
    if (staging_ != nullptr && copying) {
      std::fprintf(stderr, "[uccl-ep] tcp transport: a staging copy never finished; its pinned memory stays\n");
    } else if (staging_ != nullptr) {
      (void)gpu_host_free(staging_);
    }
    staging_ = nullptr;
    (void)gpu_last_error();  // none of those failures concerns later calls of this thread
  }

 private:
  std::array<Lane*, 3> lanes() { return {&send_, &receive_, &local_}; }

  static void create(Lane& lane, int rank) {
    gpuError_t status = gpu_stream_create_nonblocking(&lane.stream);
    if (status == kGpuSuccess) status = gpu_event_create(&lane.done);
    if (status != kGpuSuccess) {
      throw TransportError(transport_label(kTransport, rank) + ": cannot create a stream for staging: " +
                           gpu_error_text(status));
    }
  }

  std::string copy(Lane& lane, void* dest, const void* source, uint64_t bytes, const char* what) {
    const ScopedDevice current(device_);
    gpuError_t status = current.status();
    if (status == kGpuSuccess) status = gpu_copy_async(dest, source, bytes, lane.stream);
    return status == kGpuSuccess ? std::string() : failed(what, status);
  }

  std::string launch_add(Lane& lane, uint8_t* target, int64_t value) {
    const ScopedDevice current(device_);
    gpuError_t status = current.status();
    if (status == kGpuSuccess) status = launch_atomic_add_system(target, value, lane.stream);
    return status == kGpuSuccess ? std::string() : failed("launching an atomic add", status);
  }

  // Waits (up to the timeout) for everything queued on `lane` so far: kGpuSuccess, the failure of
  // that work, or kGpuErrorNotReady when it is still running at the deadline.
  gpuError_t drain(Lane& lane) {
    if (lane.stream == nullptr || lane.done == nullptr) return kGpuSuccess;
    const ScopedDevice current(device_);
    gpuError_t status = current.status();
    if (status == kGpuSuccess) status = gpu_event_record(lane.done, lane.stream);
    if (status == kGpuSuccess) status = wait_for_event(lane.done, std::chrono::steady_clock::now() + timeout_);
    return status;
  }

  std::string wait(Lane& lane, const char* what) {
    const gpuError_t status = drain(lane);
    if (status == kGpuErrorNotReady) {
      return std::string(what) + " did not finish within " + timeout_text_ + kStalledCopyHint;
    }
    return status == kGpuSuccess ? std::string() : failed(what, status);
  }

  const int device_;
  const std::chrono::steady_clock::duration timeout_;
  const std::string timeout_text_;
  Lane send_;
  Lane receive_;
  Lane local_;
  uint8_t* staging_ = nullptr;
  std::unique_ptr<DeviceRegionWriter> writer_;
};

}  // namespace

std::unique_ptr<StagedRegion> make_device_staged_region(int device, MemoryRegion region, uint64_t staging_bytes,
                                                        int rank, double timeout_s) {
  return std::make_unique<DeviceStagedRegion>(device, region, staging_bytes, rank, timeout_s);
}

}  // namespace uccl_ep
#endif  // UCCL_EP_GPU_RUNTIME
