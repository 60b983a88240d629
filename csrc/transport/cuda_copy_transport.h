// The `cuda-copy` transport: the full proxy path on one multi-GPU host, and the EP
// path for boxes whose GPUs talk over PCIe only.
//
// Region: this rank's PeerMemory buffer (device memory). Every other rank's buffer is already
// mapped into this process with CUDA IPC (PeerMemory::open_peers), so a request reaches a peer
// without any help from the peer's process:
//
//   data     post_write queues a copy engine transfer from our buffer into the peer's mapping
//            (cudaMemcpyAsync on a non-blocking stream of our device, one stream per peer) and
//            records an event from a pool. peer == rank() is a local copy.
//   atomics  post_atomic_add launches a one-thread kernel doing a system-scope atomic add on
//            the peer's int64 (the GPUs must support peer atomics, as NVLink does).
//   control  an owned TcpTransport with an empty region carries the immediates: once a write's
//            event has completed, a zero-length tcp write carrying its immediate goes to the
//            peer, whose poll_immediates() therefore reports it after the bytes landed; the
//            write completes when the peer acknowledges that tcp write.
// A request without an immediate completes when its event has completed.
//
// Progress needs no thread of its own: poll_completions(), poll_immediates() and quiet() check
// the events of each peer's stream in issue order, forward the immediates of finished copies
// and collect completions (the control transport has its own I/O thread).
//
// Bootstrapping is the tcp transport's: listen_address() is the control transport's address
// with this rank's region size appended ("ip:port/region_bytes"), so the caller's all-gather of
// the addresses also tells every rank the size of every region, for the bounds checks of
// requests. UCCL_SOCKET_IFNAME picks the control transport's interface.
//
// Reorder injection (reorder.h; the constructor's reorder_seed, else UCCL_EP_TRANSPORT_REORDER):
// each peer's requests wait in a reorder window before they are issued to the copy engine (a
// window whose oldest request waited max_hold_us is released by the next poll), and the control
// transport reorders immediates and acknowledgements with the same seed.
//
// Throughput: each cudaMemcpyAsync costs about 2.3 us of CPU (measured), so callers must
// coalesce writes (one large write per peer per phase). Small scattered writes are what verbs
// is for; this transport exists next to it for hosts without RDMA between their GPUs.
//
// A local copy (peer == rank()) whose source and destination overlap is undefined (as for
// cudaMemcpy): the source would change before the request completes.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/portability.h"
#include "transport/device_region_ops.h"
#include "transport/reorder.h"
#include "transport/tcp_transport.h"
#include "transport/transport.h"

#if !defined(UCCL_EP_GPU_RUNTIME)
#error "cuda_copy_transport.h needs the GPU runtime: include it only in GPU builds (UCCL_EP_WITH_GPU)"
#endif

namespace uccl_ep {

class PeerMemory;

struct CudaCopyTransportOptions {
  int64_t reorder_seed = -1;  // >= 0: reorder with this seed; -1: UCCL_EP_TRANSPORT_REORDER
  double timeout_s = 30.0;    // connect(), each of quiet()'s two waits, and close()'s flush
};

class CudaCopyTransport final : public Transport {
 public:
  // `memory` must have mapped every rank's buffer (open_peers with this rank) and must stay
  // mapped until close(). Throws std::invalid_argument naming a bad argument, TransportError
  // if a stream cannot be created or the control transport cannot listen.
  CudaCopyTransport(int rank, int num_ranks, const PeerMemory& memory, const CudaCopyTransportOptions& options = {});
  ~CudaCopyTransport() override;

  CudaCopyTransport(const CudaCopyTransport&) = delete;
  CudaCopyTransport& operator=(const CudaCopyTransport&) = delete;

  // "ip:port/region_bytes": what the peers pass to connect().
  std::string listen_address() const;

  // Connects the control transport from every rank's listen_address() (addresses[rank] is
  // ours) and learns the peers' region sizes. Throws std::invalid_argument for a malformed
  // address, TransportError as TcpTransport::connect does.
  void connect(const std::vector<std::string>& addresses);

  const char* name() const override { return "cuda-copy"; }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  MemoryRegion region() const override { return MemoryRegion{local_base_, peers_[rank_].bytes}; }
  bool region_is_host_memory() const override { return false; }
  // Counter adds and flag stores are one-thread kernels on the stream of this rank's copies to
  // itself, so they follow what was posted before them; they throw TransportError if a launch fails.
  RegionWriter& region_writer() override { return *writer_; }
  void bind_thread() noexcept override { bind_thread_to_device(device_); }
  const ReorderConfig& reorder_config() const { return reorder_; }

  void post_write(int peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                  std::optional<uint32_t> imm, uint64_t request_id) override;
  void post_atomic_add(int peer, uint64_t remote_offset, int64_t value, uint64_t request_id) override;
  size_t poll_completions(uint64_t* out, size_t max) override;
  size_t poll_immediates(ImmediateEvent* out, size_t max) override;
  // Issues what the windows hold and waits (timeout_s) for the copy engines, forwarding the
  // immediates; then waits (timeout_s) in the control transport's quiet() for their
  // acknowledgements.
  void quiet() override;
  // An event recorded on every peer's stream written since the last fence; a later copy's stream
  // waits for the other streams' fence events before it (the copies of one stream run in order).
  bool fence() override;
  void close() override;
  uint64_t outstanding() const override;
  // "write of N bytes to peer P (request I, local offset L -> remote offset R), on the copy engine for
  // S s" (or "in the reorder window"): the front request of the peer whose front waited longest.
  std::string oldest_outstanding() const override;

 private:
  enum class Op : uint8_t { kWrite, kAtomicAdd };

  struct Request {
    Op op = Op::kWrite;
    uint64_t id = 0;
    uint64_t local_offset = 0;   // kWrite
    uint64_t remote_offset = 0;
    uint64_t length = 0;         // kWrite
    std::optional<uint32_t> imm; // kWrite
    int64_t value = 0;           // kAtomicAdd
  };

  // A request handed to the copy engine; `done` completes after it.
  struct Issued {
    Request request;
    gpuEvent_t done = nullptr;
    std::chrono::steady_clock::time_point issued_at;
  };

  struct Peer {
    uint8_t* base = nullptr;       // its region, as mapped into this process
    uint64_t bytes = 0;            // its region's size (ours from the constructor, theirs from connect)
    gpuStream_t stream = nullptr;  // on our device
    ReorderWindow<Request> window;
    std::deque<Issued> issued;     // in stream order, so they complete front first
    // fence(): this stream's latest fence event and its number (0: none yet), whether a copy was
    // issued on it since, and per other peer the number of the fence this stream already waits for.
    gpuEvent_t fence_event = nullptr;
    uint64_t fence_number = 0;
    bool written_since_fence = false;
    std::vector<uint64_t> fences_waited;
  };

  void create_streams();
  void check_usable(int peer, const char* op) const;
  void post(int peer, Request&& request);

  // All with mu_ held.
  void issue(int peer, const Request& request);
  gpuError_t enqueue(const Peer& p, const Request& request);
  gpuError_t wait_for_fences(int peer);
  gpuEvent_t acquire_event(int peer, uint64_t request_id);
  void flush_windows();
  void progress();
  void release_expired_window(int peer);
  void retire_finished(int peer);
  void retire(int peer, const Request& request);
  void throw_first_error();
  uint64_t data_outstanding() const;
  // Makes progress until no request waits in a window or on a copy engine, or until `deadline`
  // (then false); `lock` (of mu_) is released while it sleeps.
  bool drain_copies(std::unique_lock<std::mutex>& lock, std::chrono::steady_clock::time_point deadline);
  std::string copy_timeout_message() const;
  std::string describe_oldest() const;  // oldest_outstanding() with mu_ held
  void release_gpu_resources();

  std::string who() const;  // "cuda-copy transport rank R"
  std::string failure(int peer, uint64_t request_id, const std::string& what, gpuError_t status) const;

  const int rank_;
  const int num_ranks_;
  const int device_;
  void* const local_base_;
  const double timeout_s_;
  const ReorderConfig reorder_;
  TcpTransport control_;  // empty region: immediates and acknowledgements only
  bool connected_ = false;
  bool closed_ = false;

  mutable std::mutex mu_;
  std::vector<Peer> peers_;  // [num_ranks]
  std::unique_ptr<DeviceRegionWriter> writer_;  // on the stream of our copies to ourselves
  std::vector<gpuEvent_t> spare_events_;
  uint64_t fences_ = 0;
  uint64_t unordered_requests_ = 0;  // posted with an immediate or as an atomic add, not yet off the stream
  std::deque<uint64_t> completions_;  // requests without an immediate
  std::deque<std::string> errors_;    // failures found while making progress, thrown once each
};

}  // namespace uccl_ep
