// Command FIFOs between a GPU (the producers) and CPU proxy threads (one consumer per FIFO): the
// slots and each FIFO's tail live in pinned host memory mapped into the GPU's address space, each
// FIFO's head where its producers are (device memory for GPU producers; host memory when host
// threads produce, as tests of the proxy do). Each head and tail has a 64-byte line of its own.
// fifo.h has the protocol.
#pragma once

#include <cstdint>

#include "channel/fifo.h"
#include "common/portability.h"

#if defined(UCCL_EP_GPU_RUNTIME)
namespace uccl_ep {

class MappedFifos {
 public:
  // Allocates and zeroes `num_fifos` FIFOs of `capacity` slots (a power of two) on `device`.
  // Throws std::invalid_argument naming a bad argument, GpuError if an allocation fails.
  MappedFifos(int num_fifos, int64_t capacity, int device, bool host_producers);
  ~MappedFifos();
  MappedFifos(const MappedFifos&) = delete;
  MappedFifos& operator=(const MappedFifos&) = delete;

  int num_fifos() const { return num_fifos_; }
  uint64_t capacity() const { return capacity_; }
  bool host_producers() const { return host_producers_; }
  int device() const { return device_; }

  // Addresses as a host thread uses them (the consumer; a producer too with host_producers). The
  // head is null when the producers are the GPU's.
  FifoView host_view(int fifo) const;
  FifoView device_view(int fifo) const;  // addresses as the GPU uses them
  // A device array of every FIFO's device_view(), for kernels.
  const FifoView* device_views() const { return device_views_; }

  // Frees everything (idempotent); the views are invalid afterwards.
  void release();

 private:
  void check_fifo(int fifo) const;
  uint64_t tail_offset(int fifo) const;
  uint64_t host_head_offset(int fifo) const;
  FifoView view(uint8_t* host_base, int fifo, uint64_t* gpu_head) const;

  int num_fifos_;
  uint64_t capacity_;
  int device_;
  bool host_producers_;
  uint8_t* host_ = nullptr;            // slots of every FIFO, one tail line per FIFO, then (host producers) one head line
  uint8_t* host_on_device_ = nullptr;  // host_ as the GPU addresses it
  uint8_t* device_memory_ = nullptr;          // (GPU producers) one head line per FIFO, then the device views
  FifoView* device_views_ = nullptr;
};

}  // namespace uccl_ep
#endif  // UCCL_EP_GPU_RUNTIME
