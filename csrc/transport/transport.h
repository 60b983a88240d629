// The one interface every transport implements: verbs, tcp, cuda-copy.
//
// Each rank registers one memory region (a base pointer and a size). Requests name byte
// offsets into the local region (the source) and the peer's region (the destination):
//
//   post_write(peer, local_offset, remote_offset, length, imm, id)
//       copies `length` bytes; with an immediate, the peer's poll_immediates() reports
//       (our rank, imm) once, after those bytes have landed in its region.
//   post_atomic_add(peer, remote_offset, value, id)
//       adds `value` atomically to the 8-byte aligned int64 at the peer's remote_offset.
//
// A request is complete when the peer has applied it (the peer acknowledges it); its id
// then comes back from poll_completions(), once per request. Ids need not be unique: the
// proxy encodes in them what a request was, and requests in flight may share one. Requests to one peer may complete, and be applied,
// in any order: no transport promises ordering (EFA SRD does not, and reorder injection makes
// every transport behave that way on demand). Callers that need ordering use immediates and
// counters.
//
// Errors: argument errors (bad peer, offsets out of either region, misaligned atomic) throw
// std::invalid_argument naming the argument, before anything is sent. Everything else
// throws TransportError naming this rank, the peer and what happened. A request that the
// peer rejects (its own bounds check failed) is reported to the poster: its id never
// completes and the next poll_completions()/quiet() throws the peer's message.
//
// Threading: post_*, poll_* and quiet() may be called from any thread, but the intended
// user is one proxy thread per transport; close() must not race with the others.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

namespace uccl_ep {

// A runtime failure of a transport (connection lost, peer rejected a request, timeout).
// Derives from std::runtime_error, so pybind11 turns it into RuntimeError.
class TransportError : public std::runtime_error {
 public:
  explicit TransportError(const std::string& what) : std::runtime_error(what) {}
};

// An errno in words, for the transports' messages: "Connection refused (errno 111)".
inline std::string errno_text(int error) {
  return std::string(std::strerror(error)) + " (errno " + std::to_string(error) + ")";
}

// The memory a rank registers: every offset of every request is relative to a region.
struct MemoryRegion {
  void* base = nullptr;
  uint64_t bytes = 0;
};

// How a rank changes its own region when an immediate says so (the ordering layer's counter adds and
// flag stores): host atomics for host memory, device operations for GPU memory. Offsets are into the
// transport's region, 8-byte aligned and checked by the caller.
class RegionWriter {
 public:
  virtual ~RegionWriter() = default;
  virtual void add(uint64_t offset, int64_t amount) = 0;           // atomic with the owner's own updates
  virtual void store_release(uint64_t offset, int64_t value) = 0;  // visible after every earlier change
};

class HostRegionWriter final : public RegionWriter {
 public:
  explicit HostRegionWriter(MemoryRegion region) : base_(static_cast<uint8_t*>(region.base)) {}
  void add(uint64_t offset, int64_t amount) override {
    __atomic_fetch_add(reinterpret_cast<int64_t*>(base_ + offset), amount, __ATOMIC_ACQ_REL);
  }
  void store_release(uint64_t offset, int64_t value) override {
    __atomic_store_n(reinterpret_cast<int64_t*>(base_ + offset), value, __ATOMIC_RELEASE);
  }

 private:
  uint8_t* base_;
};

// One write-with-immediate delivered to this rank.
struct ImmediateEvent {
  uint32_t src_rank;
  uint32_t imm;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual const char* name() const = 0;  // "tcp", "verbs", "cuda-copy"
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;
  virtual MemoryRegion region() const = 0;
  // Whether region() is host memory the CPU may read and write directly.
  virtual bool region_is_host_memory() const = 0;
  // How this rank's own region is changed by what immediates announce.
  virtual RegionWriter& region_writer() = 0;
  // Called first by each thread that will use this transport and that this library started (the
  // proxy's, the tcp I/O thread): a transport over GPU memory makes its device current there once.
  // Otherwise such a thread starts on the runtime's default device 0, and switching back to it
  // after each call creates a context on a GPU this rank does not use (where another rank's
  // kernels then share the GPU with it).
  virtual void bind_thread() noexcept {}

  // Queue a write of [local_offset, local_offset + length) of the local region to
  // [remote_offset, remote_offset + length) of `peer`'s region. peer == rank() is allowed
  // (a local copy that completes like any other request). length may be 0 (an
  // immediate alone). The source bytes must stay unchanged until the request completes.
  virtual void post_write(int peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                          std::optional<uint32_t> imm, uint64_t request_id) = 0;

  // Queue an atomic add of `value` to the int64 at `remote_offset` (a multiple of 8) of
  // `peer`'s region.
  virtual void post_atomic_add(int peer, uint64_t remote_offset, int64_t value, uint64_t request_id) = 0;

  // Writes the ids of up to `max` completed requests to `out`; returns how many. Throws
  // TransportError if a peer rejected a request or a connection with requests in flight
  // failed (each such error is thrown once).
  virtual size_t poll_completions(uint64_t* out, size_t max) = 0;

  // Writes up to `max` immediates that arrived (each after its bytes) to `out`; returns how many.
  virtual size_t poll_immediates(ImmediateEvent* out, size_t max) = 0;

  // Releases anything held back (reorder injection) and waits until every posted request
  // has completed. Their ids stay available to poll_completions(). Throws TransportError
  // on a failure, or after the transport's timeout naming the rank, the peer and how many
  // requests are outstanding.
  virtual void quiet() = 0;

  // Flushes what was posted, tells the peers, joins every thread and closes every socket or
  // handle. Idempotent; the destructor calls it. Requests still in flight are abandoned
  // (call quiet() first).
  virtual void close() = 0;

  // Orders every write posted after this call after every write posted before it, on the device and
  // without waiting here. Returns false if this transport cannot do so now; the caller then waits for
  // the completions instead (what a QUIET otherwise does). Requests with immediates or atomic adds in
  // flight make it false: what they change is not ordered by the device.
  virtual bool fence() { return false; }

  // Requests posted and not yet completed (or failed), over all peers.
  virtual uint64_t outstanding() const = 0;

  // The oldest unfinished request in words (what, which peer, where it waits and for how long), for
  // timeout messages; empty if the transport keeps no such record or nothing is outstanding.
  virtual std::string oldest_outstanding() const { return {}; }
};

}  // namespace uccl_ep
