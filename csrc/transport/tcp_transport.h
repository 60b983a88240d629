// The `tcp` transport: a full mesh of TCP connections between num_ranks ranks,
// for any host and for CI. The region is host memory, or (TcpTransportOptions::device, GPU
// builds) memory of a GPU, staged through pinned host memory (below).
//
// Bootstrapping is the caller's: each rank constructs its transport, which listens on the
// IPv4 address of the interface named by UCCL_SOCKET_IFNAME (or on 127.0.0.1) on a port the
// OS picks (or `listen_port`), publishes listen_address() ("ip:port") to the others, and
// calls connect() with every rank's address. Rank r dials every higher rank and accepts
// every lower one; both sides exchange a hello (protocol version, ranks, region size).
//
// After connect() one I/O thread serves every connection through epoll: it sends queued
// frames (writes go straight from a host region, no copy), receives frames, applies writes
// (received straight into a host region), atomics and immediates, and acknowledges each request
// once applied. Posting never blocks on the network.
//
// A device region is staged (tcp_staging.h) by the I/O thread, so posting never blocks on the GPU
// either:
//   sending    a queued write's payload is copied device -> pinned staging on a stream of the
//              transport, the I/O thread waits (timeout_s) for the copies, and sends from staging.
//              The send staging is a pool of chunks that the connections borrow in queue order and
//              give back as their bytes leave, so a write larger than the pool streams through it;
//              one connection holds at most 8 MiB of it, and with several peers at most half.
//   receiving  a payload is received into a staging arena and copied into the region a recv() at a
//              time; a peer's atomic add is a one-thread system-scope kernel. Their immediates and
//              acknowledgements are given after the I/O thread has waited (timeout_s) for those
//              copies and kernels, once per batch of frames read from a connection, and before the
//              arena is reused.
//   locally    a write to itself is a device -> device copy and an atomic add a kernel, each waited
//              for by the posting thread; region_writer() launches one-thread kernels.
// A quarter of the staging (staging_bytes, else UCCL_EP_TCP_STAGING_BYTES, else 64 MiB) is the
// receive arena, the rest the send pool. A GPU failure while applying a peer's request rejects it
// (the peer's poll_completions()/quiet() throws) and is thrown by this rank's next
// poll_completions()/quiet() as well; one while staging a write fails that peer's connection.
//
// Wire format (host byte order: every rank of a job runs on the same architecture): a 32-byte
// FrameHeader, followed by `length` payload bytes for kWrite and kNack.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/reorder.h"
#include "transport/tcp_staging.h"
#include "transport/transport.h"

namespace uccl_ep {

namespace tcp_wire {

constexpr uint16_t kMagic = 0xEC75;
constexpr uint32_t kProtocolVersion = 1;

enum FrameType : uint8_t {
  kHello = 1,     // request_id: rank, offset: region bytes, length: num_ranks, imm: version
  kWrite = 2,     // offset: remote offset, length: payload bytes, imm if flags & kHasImm
  kAtomicAdd = 3, // offset: remote offset, length: the int64 value
  kAck = 4,       // request_id: the request applied
  kNack = 5,      // request_id: the request rejected; payload: the reason (length bytes)
  kBye = 6,       // the sender is closing: it will apply nothing more
};

constexpr uint8_t kHasImm = 1;

struct FrameHeader {
  uint16_t magic;
  uint8_t type;
  uint8_t flags;
  uint32_t imm;
  uint64_t request_id;
  uint64_t offset;
  uint64_t length;  // payload bytes, or the atomic's value as two's complement
};
static_assert(sizeof(FrameHeader) == 32, "FrameHeader is 32 bytes on the wire");

}  // namespace tcp_wire

struct TcpTransportOptions {
  int64_t reorder_seed = -1;   // >= 0: reorder with this seed; -1: UCCL_EP_TRANSPORT_REORDER
  double timeout_s = 30.0;     // connect(), quiet(), close()'s flush, and each wait for the GPU
  int listen_port = 0;         // 0: the OS picks
  int device = -1;             // >= 0: the region is memory of this GPU (GPU builds); -1: host memory
  uint64_t staging_bytes = 0;  // a device region's pinned staging; 0: UCCL_EP_TCP_STAGING_BYTES, else 64 MiB
  bool stage_host_region_for_test = false;  // stage a host region as a device one is (tests without a GPU)
};

class TcpTransport final : public Transport {
 public:
  // Validates the arguments (std::invalid_argument naming the bad one, e.g. a device in a build
  // without GPU support, or a region that is not that device's memory), allocates a device
  // region's staging, resolves the listen address and starts listening. Throws TransportError if
  // the staging cannot be had, the interface is unknown or the port cannot be bound.
  TcpTransport(int rank, int num_ranks, MemoryRegion region, const TcpTransportOptions& options = {});
  ~TcpTransport() override;

  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  // "ip:port" that peers dial.
  std::string listen_address() const { return listen_address_; }

  // Builds the mesh from every rank's listen_address() (addresses[rank] is ours) and starts
  // the I/O thread. Throws TransportError naming the peer that could not be reached or
  // that sent a bad hello, or on timeout.
  void connect(const std::vector<std::string>& addresses);
  bool connected() const { return connected_; }

  const char* name() const override { return "tcp"; }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  MemoryRegion region() const override { return region_; }
  bool region_is_host_memory() const override { return device_ < 0; }
  RegionWriter& region_writer() override { return staged_ ? staged_->writer() : region_writer_; }
  void bind_thread() noexcept override {
    if (staged_) staged_->bind_thread();
  }
  const ReorderConfig& reorder_config() const { return reorder_; }
  // Bytes of staging (0: the region is not staged).
  uint64_t staging_bytes() const { return staging_bytes_; }

  void post_write(int peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                  std::optional<uint32_t> imm, uint64_t request_id) override;
  void post_atomic_add(int peer, uint64_t remote_offset, int64_t value, uint64_t request_id) override;
  size_t poll_completions(uint64_t* out, size_t max) override;
  size_t poll_immediates(ImmediateEvent* out, size_t max) override;
  void quiet() override;
  void close() override;
  uint64_t outstanding() const override;
  // Per peer with unfinished requests: how many, and how many frames still wait to be sent (held in
  // the reorder window, queued, of those staged out of device memory) - where a stall is.
  std::string oldest_outstanding() const override;

  // Requests from peers that this rank rejected (each was reported back to its poster).
  uint64_t rejected_requests() const { return rejected_.load(); }

  // Test hook: posts a write without the sender-side bounds check on the remote range, so
  // tests can exercise the receiver's check. Not for production use.
  void post_write_unchecked_for_test(int peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                                     std::optional<uint32_t> imm, uint64_t request_id);

 private:
  struct OutFrame {
    tcp_wire::FrameHeader header{};
    const uint8_t* payload = nullptr;  // into the region, or into `owned`
    std::string owned;                 // a nack's reason
    bool staged = false;               // a write from a staged region: its payload is sent from staging
    uint64_t stage_at = 0;             // where its payload starts in the peer's StagingFifo
    uint64_t staged_bytes = 0;         // how much of its payload is staged
  };


  struct Peer {
    int rank = -1;
    int fd = -1;
    uint64_t region_bytes = 0;  // from its hello

    // Guarded by mu: the send side.
    std::mutex mu;
    ReorderWindow<OutFrame> window;
    std::deque<OutFrame> queue;
    size_t front_sent = 0;      // bytes of queue.front() (header + payload) already sent
    bool want_out = false;      // EPOLLOUT armed
    bool send_closed = false;   // nothing more may be sent (bye sent, or the connection is gone)
    StagingFifo staging;        // staged payload bytes of the queue (a staged region; the I/O thread's)
    size_t staged_frames = 0;   // the queue's leading frames whose payload needs no more staging

    // Owned by the I/O thread: the receive side.
    tcp_wire::FrameHeader in_header{};
    size_t in_header_got = 0;
    bool in_payload = false;
    uint8_t* in_dest = nullptr;  // where payload bytes go; nullptr: a nack's reason or discarded
    uint64_t in_remaining = 0;
    std::string in_reason;       // a nack's reason as it arrives
    std::string in_reject;       // why this request is rejected (empty: accepted)
    bool in_ignore = false;      // closing: the request is neither applied nor acknowledged
    bool registered = false;     // in the epoll set
    bool got_bye = false;

    // Guarded by the transport's state_mu_.
    uint64_t posted = 0;
    uint64_t finished = 0;  // acknowledged, rejected or abandoned
    bool failed = false;    // no more requests may be posted
    std::string failure;
    bool out_done = false;  // we will send nothing more (bye sent, or the connection is gone)
    bool in_done = false;   // the peer will send nothing more (end of stream, or an error)
  };

  // A request of a peer applied to a staged region on the GPU: its acknowledgement (and immediate)
  // wait until the I/O thread has waited for the GPU.
  struct Landed {
    Peer* peer;
    uint64_t request_id;
    bool has_imm;
    uint32_t imm;
  };

  void stage_region(const TcpTransportOptions& options);
  void check_usable(int peer, const char* op) const;
  void post(int peer, OutFrame&& frame);
  void release_locked(Peer& p, OutFrame&& frame);  // p.mu held
  void apply_local(const OutFrame& frame);
  void flush_windows();
  void wake();

  // The I/O thread's ("p.mu held": its caller holds it).
  void io_loop();
  void io_send(Peer& p);
  std::string stage_queue(Peer& p);                            // p.mu held
  size_t gather_sendable(Peer& p, iovec* iov, size_t max);     // p.mu held
  bool consume_sent(Peer& p, size_t sent);                     // p.mu held; true once the bye went
  void clear_queue(Peer& p);                                   // p.mu held
  void io_receive(Peer& p);
  void receive_frames(Peer& p);
  ssize_t receive_staged(Peer& p, size_t want);
  void io_frame_done(Peer& p);
  void apply_add(Peer& p, const tcp_wire::FrameHeader& h);
  void applied(Peer& p, const tcp_wire::FrameHeader& h);
  void settle_landed();
  void refuse_on_device(Peer& p, uint64_t request_id, const std::string& error);
  std::string device_rejection(const std::string& error) const;
  void note_device_failure(Peer& p, uint64_t request_id, const std::string& error);
  void io_end_of_input(Peer& p);
  void io_reply(Peer& p, uint8_t type, uint64_t request_id, std::string reason);
  void fail_peer(Peer& p, const std::string& why);
  void finish_request(Peer& p, uint64_t id, bool ok, const std::string& error);
  void set_epoll(Peer& p);

  std::string who() const;  // "tcp transport rank R"
  std::string peer_label(const Peer& p) const;

  const int rank_;
  const int num_ranks_;
  const MemoryRegion region_;
  HostRegionWriter region_writer_{region_};
  const int device_;
  const double timeout_s_;
  const ReorderConfig reorder_;
  std::string listen_address_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::vector<std::unique_ptr<Peer>> peers_;  // [num_ranks]; ours has fd -1 (local copies)
  std::thread io_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> poll_soon_{false};  // a queue waits on a connection outside the epoll set, or on staging
  std::atomic<bool> closing_{false};  // close() started: incoming requests are ignored
  bool connected_ = false;
  bool closed_ = false;
  std::atomic<uint64_t> rejected_{0};

  // Staging of a device region (null: the region is host memory, read and written directly).
  std::unique_ptr<StagedRegion> staged_;
  uint64_t staging_bytes_ = 0;
  // The I/O thread's: the receive arena (the start of the staging) and the send pool (the rest).
  uint64_t arena_bytes_ = 0;
  uint64_t arena_used_ = 0;  // received since the last settle_landed()
  bool landing_ = false;     // copies or adds queued since the last settle_landed()
  std::vector<Landed> landed_;
  ChunkPool pool_;
  size_t peer_chunks_ = 0;   // chunks one connection may hold

  mutable std::mutex state_mu_;
  std::condition_variable state_cv_;
  std::deque<uint64_t> completions_;
  std::deque<ImmediateEvent> immediates_;
  std::deque<std::string> errors_;
};

}  // namespace uccl_ep
