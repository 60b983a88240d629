// Staging for the tcp transport over a region the CPU cannot touch (GPU memory): the bytes a write
// sends are first copied into host memory, and the bytes it brings are received into host memory
// and then copied into the region. tcp_transport.h says which thread does what, and when.
//
// StagedRegion is what the transport asks of such a region; make_device_staged_region() (GPU builds)
// gives one over device memory (pinned staging, copies on streams of its own), and
// make_host_staged_region() one over host memory with CPU copies, so tests of the staging logic run
// without a GPU. ChunkPool and StagingFifo share the send part of the staging among the connections.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace uccl_ep {

// Operations on a staged region. The ones that return text return "" on success, else what failed
// (the transport adds its rank and the peer).
class StagedRegion {
 public:
  virtual ~StagedRegion() = default;

  // The staging memory: staging_bytes of host memory (pinned for a device region).
  virtual uint8_t* staging() = 0;
  virtual RegionWriter& writer() = 0;
  // Makes the region's device current on the calling thread (Transport::bind_thread).
  virtual void bind_thread() noexcept {}

  // Sending (the I/O thread): queue a copy of region bytes into staging; wait for every such copy.
  virtual std::string stage(uint8_t* staged, const uint8_t* source, uint64_t bytes) = 0;
  virtual std::string wait_staged() = 0;

  // Receiving (the I/O thread): queue a copy of staged bytes into the region, or an atomic add to an
  // int64 of it; wait for every such operation.
  virtual std::string land(uint8_t* dest, const uint8_t* staged, uint64_t bytes) = 0;
  virtual std::string add(uint8_t* target, int64_t value) = 0;
  virtual std::string wait_landed() = 0;

  // A request of this rank to itself (a posting thread, one at a time): done when they return.
  virtual std::string copy_local(uint8_t* dest, const uint8_t* source, uint64_t bytes) = 0;
  virtual std::string add_local(uint8_t* target, int64_t value) = 0;

  // Waits (bounded) for what is queued, then frees the staging memory and every stream. Idempotent.
  virtual void release() = 0;
};

// A region in the memory of GPU `device` (checked: std::invalid_argument naming device or region_ptr),
// staged through `staging_bytes` of pinned host memory. Waits give up after timeout_s. Throws
// TransportError naming `rank` if a stream or the staging cannot be had. Defined in GPU builds only.
std::unique_ptr<StagedRegion> make_device_staged_region(int device, MemoryRegion region, uint64_t staging_bytes,
                                                        int rank, double timeout_s);

// A host region staged the same way, with CPU copies and host atomics: tests of the staging logic.
std::unique_ptr<StagedRegion> make_host_staged_region(MemoryRegion region, uint64_t staging_bytes);

// Equal pieces of the send staging, lent to the connections. Owned by the I/O thread.
class ChunkPool {
 public:
  void reset(uint8_t* base, uint64_t bytes, uint64_t chunk_bytes);
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  size_t chunks() const { return chunks_; }
  uint8_t* take();  // nullptr when every chunk is lent out
  void give(uint8_t* chunk) { free_.push_back(chunk); }

 private:
  std::vector<uint8_t*> free_;
  uint64_t chunk_bytes_ = 0;
  size_t chunks_ = 0;
};

// The staged bytes of one connection, in the order they are sent: a FIFO over chunks borrowed from a
// ChunkPool. Positions count the bytes staged since the connection began, so a frame remembers where
// its payload starts.
class StagingFifo {
 public:
  uint64_t end() const { return end_; }

  // Room after end() (a pointer and its size), borrowing a chunk when the last one is full and fewer
  // than `max_chunks` are held; no room (nullptr, 0) when the pool is out or the limit reached.
  std::pair<uint8_t*, uint64_t> room(ChunkPool& pool, size_t max_chunks);
  void commit(uint64_t bytes) { end_ += bytes; }

  // Appends to iov[count, max) the pieces of positions [from, to) (staged, not released), advancing
  // `count`; stops early when iov is full.
  void gather(const ChunkPool& pool, uint64_t from, uint64_t to, iovec* iov, size_t& count, size_t max) const;

  // Returns every chunk whose bytes all lie before `position` (all of them once everything staged
  // is before it).
  void release_before(uint64_t position, ChunkPool& pool);
  void release_all(ChunkPool& pool) { release_before(end_, pool); }

 private:
  std::deque<uint8_t*> chunks_;
  uint64_t begin_ = 0;  // the position of chunks_.front()[0]
  uint64_t end_ = 0;
};

}  // namespace uccl_ep
