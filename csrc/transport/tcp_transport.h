// The `tcp` transport (DESIGN §6): a full mesh of TCP connections between num_ranks ranks,
// for any host and for CI. Host memory only (device memory is staged through pinned host
// memory by the proxy).
//
// Bootstrapping is the caller's: each rank constructs its transport, which listens on the
// IPv4 address of the interface named by UCCL_SOCKET_IFNAME (or on 127.0.0.1) on a port the
// OS picks (or `listen_port`), publishes listen_address() ("ip:port") to the others, and
// calls connect() with every rank's address. Rank r dials every higher rank and accepts
// every lower one; both sides exchange a hello (protocol version, ranks, region size).
//
// After connect() one I/O thread serves every connection through epoll: it sends queued
// frames (writes go straight from the region, no copy), receives frames, applies writes
// (received straight into the region), atomics and immediates, and acknowledges each request
// once applied. Posting never blocks on the network.
//
// Wire format (host byte order: every rank of a job runs on the same architecture): a 32-byte
// FrameHeader, followed by `length` payload bytes for kWrite and kNack.
#pragma once

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
  int64_t reorder_seed = -1;  // >= 0: reorder with this seed; -1: UCCL_EP_TRANSPORT_REORDER
  double timeout_s = 30.0;    // connect(), quiet() and close()'s flush
  int listen_port = 0;        // 0: the OS picks
};

class TcpTransport final : public Transport {
 public:
  // Validates the arguments (std::invalid_argument naming the bad one), resolves the listen
  // address and starts listening. Throws TransportError if the interface is unknown or the
  // port cannot be bound.
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
  bool region_is_host_memory() const override { return true; }
  RegionWriter& region_writer() override { return region_writer_; }
  const ReorderConfig& reorder_config() const { return reorder_; }

  void post_write(int peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                  std::optional<uint32_t> imm, uint64_t request_id) override;
  void post_atomic_add(int peer, uint64_t remote_offset, int64_t value, uint64_t request_id) override;
  size_t poll_completions(uint64_t* out, size_t max) override;
  size_t poll_immediates(ImmediateEvent* out, size_t max) override;
  void quiet() override;
  void close() override;
  uint64_t outstanding() const override;

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

  void check_usable(int peer, const char* op) const;
  void post(int peer, OutFrame&& frame);
  void release_locked(Peer& p, OutFrame&& frame);  // p.mu held
  void apply_local(const OutFrame& frame);
  void flush_windows();
  void wake();

  void io_loop();
  void io_send(Peer& p);        // called by the I/O thread
  bool io_receive(Peer& p);     // false once the connection is over
  void io_frame_done(Peer& p);
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
  const double timeout_s_;
  const ReorderConfig reorder_;
  std::string listen_address_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::vector<std::unique_ptr<Peer>> peers_;  // [num_ranks]; ours has fd -1 (local copies)
  std::thread io_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> poll_soon_{false};  // a queue waits on a connection outside the epoll set
  std::atomic<bool> closing_{false};  // close() started: incoming requests are ignored
  bool connected_ = false;
  bool closed_ = false;
  std::atomic<uint64_t> rejected_{0};

  mutable std::mutex state_mu_;
  std::condition_variable state_cv_;
  std::deque<uint64_t> completions_;
  std::deque<ImmediateEvent> immediates_;
  std::deque<std::string> errors_;
};

}  // namespace uccl_ep
