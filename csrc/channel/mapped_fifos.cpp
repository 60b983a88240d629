#include "channel/mapped_fifos.h"

#if defined(UCCL_EP_GPU_RUNTIME)
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace uccl_ep {

namespace {

constexpr uint64_t kLine = 64;
constexpr int kMaxFifos = 1024;

}  // namespace

MappedFifos::MappedFifos(int num_fifos, int64_t capacity, int device, bool host_producers)
    : num_fifos_(num_fifos), capacity_(static_cast<uint64_t>(capacity)), device_(device),
      host_producers_(host_producers) {
  if (num_fifos < 1 || num_fifos > kMaxFifos) {
    throw std::invalid_argument("num_fifos must be in [1, " + std::to_string(kMaxFifos) + "] (got " +
                                std::to_string(num_fifos) + ")");
  }
  check_fifo_capacity(capacity);
  int previous = 0;
  UCCL_EP_GPU_CHECK(gpu_get_device(&previous));
  UCCL_EP_GPU_CHECK(gpu_set_device(device));
  try {
    const size_t host_bytes = num_fifos_ * (capacity_ * sizeof(Command) + (host_producers_ ? 2 : 1) * kLine);
    UCCL_EP_GPU_CHECK(gpu_host_alloc_mapped(reinterpret_cast<void**>(&host_), reinterpret_cast<void**>(&host_on_device_),
                                            host_bytes));
    std::memset(host_, 0, host_bytes);

    const size_t head_bytes = host_producers_ ? 0 : num_fifos_ * kLine;
    UCCL_EP_GPU_CHECK(
        gpu_device_alloc(reinterpret_cast<void**>(&device_memory_), head_bytes + num_fifos_ * sizeof(FifoView)));
    if (head_bytes > 0) UCCL_EP_GPU_CHECK(gpu_memset(device_memory_, 0, head_bytes));
    device_views_ = reinterpret_cast<FifoView*>(device_memory_ + head_bytes);
    std::vector<FifoView> views;
    for (int f = 0; f < num_fifos_; ++f) views.push_back(device_view(f));
    UCCL_EP_GPU_CHECK(gpu_copy(device_views_, views.data(), views.size() * sizeof(FifoView)));
  } catch (...) {
    release();
    (void)gpu_set_device(previous);
    throw;
  }
  UCCL_EP_GPU_CHECK(gpu_set_device(previous));
}

MappedFifos::~MappedFifos() { release(); }

void MappedFifos::release() {
  if (host_ != nullptr) (void)gpu_host_free(host_);
  if (device_memory_ != nullptr) (void)gpu_device_free(device_memory_);
  host_ = host_on_device_ = device_memory_ = nullptr;
  device_views_ = nullptr;
}

void MappedFifos::check_fifo(int fifo) const {
  if (host_ == nullptr) throw std::runtime_error("MappedFifos: released");
  if (fifo < 0 || fifo >= num_fifos_) {
    throw std::invalid_argument("fifo must be in [0, " + std::to_string(num_fifos_) + ") (got " +
                                std::to_string(fifo) + ")");
  }
}

// Byte offsets in the host allocation.
uint64_t MappedFifos::tail_offset(int fifo) const { return num_fifos_ * capacity_ * sizeof(Command) + fifo * kLine; }
uint64_t MappedFifos::host_head_offset(int fifo) const { return tail_offset(num_fifos_) + fifo * kLine; }

FifoView MappedFifos::view(uint8_t* host_base, int fifo, uint64_t* gpu_head) const {
  check_fifo(fifo);
  auto* head = host_producers_ ? reinterpret_cast<uint64_t*>(host_base + host_head_offset(fifo)) : gpu_head;
  return FifoView{reinterpret_cast<Command*>(host_base) + fifo * capacity_,
                  reinterpret_cast<uint64_t*>(host_base + tail_offset(fifo)), head, capacity_};
}

FifoView MappedFifos::host_view(int fifo) const { return view(host_, fifo, nullptr); }

FifoView MappedFifos::device_view(int fifo) const {
  return view(host_on_device_, fifo, host_producers_ ? nullptr : reinterpret_cast<uint64_t*>(device_memory_ + fifo * kLine));
}

}  // namespace uccl_ep
#endif  // UCCL_EP_GPU_RUNTIME
