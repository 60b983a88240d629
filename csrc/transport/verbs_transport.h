// The `verbs` transport: RDMA over libibverbs (loaded at run time, verbs_library.h), reliable-connected
// (RC) queue pairs to each peer, for ConnectX (mlx5), Broadcom (bnxt_re), Pollara (ionic) and soft-RoCE
// (rxe); on AWS EFA, scalable reliable datagram (SRD) queue pairs instead (verbs_srd.h: unordered,
// addressed per request, no atomics). The region is host memory or a GPU's memory, registered once
// (verbs_registration.h: DMA-BUF or peer memory for a GPU's). With several queue pairs per peer,
// requests to a peer take them in turn (more paths through the network, more requests in flight);
// requests on different queue pairs may land in any order, as the Transport contract allows.
//
//   post_write        RDMA WRITE, or WRITE_WITH_IMM: the peer's poll_immediates() reports the immediate
//                     once the bytes are in its region (its receive completion follows the data).
//   post_atomic_add   ATOMIC_FETCH_AND_ADD where the device reports atomics (its old value lands in a
//                     scratch word and is dropped); a device without them refuses atomic adds to peers.
//   completion        the RC acknowledgement: the peer's NIC has placed the data (or done the atomic).
//   to itself         a write is a memcpy (host memory) or goes through a queue pair connected to itself
//                     (GPU memory); an atomic add goes through that queue pair (a NIC's atomics are atomic
//                     with each other, not with the CPU's), or is the RegionWriter's add on a device
//                     without atomics. Either completes like any other request.
//   region_writer     host atomics on host memory; on GPU memory one-thread kernels on a stream of the
//                     transport's, after a flush of the NIC's completed writes where the GPU may see them
//                     out of order (gpu_nic_writes_ordered), so a flag never overtakes the data it announces.
//
// Bootstrapping is the caller's, as for tcp: listen_address() is this rank's connection record (its
// GID, LID, the QP numbers for each peer, the region's address, size and key, as text), every rank
// all-gathers them over its own process group and calls connect(); after connect() every rank must
// pass a barrier before it posts, so that no request reaches a queue pair not yet ready to receive.
//
// Settings (the constructor's options, else the environment): UCCL_IB_HCA (device name, optionally
// ":port"; default the first device), UCCL_IB_GID_INDEX (-1 or unset: the first RoCE v2 IPv4 GID, or
// none on InfiniBand), UCCL_IB_SL, UCCL_IB_TC, UCCL_IB_QPS_PER_PEER (1; every rank must use the same).
// Every error completion is a TransportError naming this
// rank, the peer, the request and the status in words; the transport then refuses new requests.
#pragma once

#if defined(UCCL_EP_WITH_VERBS)
#include <infiniband/verbs.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/reorder.h"
#include "transport/transport.h"
#include "transport/verbs_library.h"
#include "transport/verbs_srd.h"

namespace uccl_ep {

struct VerbsTransportOptions {
  std::string device;        // "" : UCCL_IB_HCA, else the first device; "name" or "name:port"
  int gid_index = -2;        // -2: UCCL_IB_GID_INDEX, else auto; -1: auto; >= 0: that entry
  int service_level = -1;    // -1: UCCL_IB_SL, else 0
  int traffic_class = -1;    // -1: UCCL_IB_TC, else 0
  int64_t reorder_seed = -1;  // >= 0: reorder with this seed; -1: UCCL_EP_TRANSPORT_REORDER
  double timeout_s = 30.0;   // quiet()
  // Caps on what this NIC has in flight, over all peers (requests wait in order until they fit; one
  // larger than the byte cap goes alone): bytes (-1: UCCL_IB_MAX_INFLIGHT_BYTES, else none; 0: none)
  // and requests (0: none beyond the queue pairs' depth; the caller picks the platform config's
  // UCCL_IB_MAX_INFLIGHT_NORMAL or _LOW_LATENCY).
  int64_t max_inflight_bytes = -1;
  int64_t max_inflight_requests = 0;
  int qps_per_peer = 0;      // 0: UCCL_IB_QPS_PER_PEER, else 1
  int gpu = -1;              // >= 0: the region is memory of this GPU (GPU builds); -1: host memory
};

class VerbsTransport final : public Transport {
 public:
  // Opens the device, picks the GID, registers the region and creates the queue pairs. Throws
  // TransportError naming what is missing (libibverbs, the device, the port, a GID, the region's
  // registration) and std::invalid_argument for a bad option (a gpu the region is not memory of).
  VerbsTransport(int rank, int num_ranks, MemoryRegion region, const VerbsTransportOptions& options = {});
  ~VerbsTransport() override;

  VerbsTransport(const VerbsTransport&) = delete;
  VerbsTransport& operator=(const VerbsTransport&) = delete;

  // This rank's connection record (text), for the peers' connect().
  std::string listen_address() const;
  // Brings every queue pair to ready-to-send with the peers' records (addresses[rank] is ours).
  void connect(const std::vector<std::string>& addresses);
  bool connected() const { return connected_; }

  const char* name() const override { return "verbs"; }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  MemoryRegion region() const override { return region_; }
  bool region_is_host_memory() const override { return gpu_ < 0; }
  RegionWriter& region_writer() override { return *writer_; }

  void post_write(int peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                  std::optional<uint32_t> imm, uint64_t request_id) override;
  void post_atomic_add(int peer, uint64_t remote_offset, int64_t value, uint64_t request_id) override;
  size_t poll_completions(uint64_t* out, size_t max) override;
  size_t poll_immediates(ImmediateEvent* out, size_t max) override;
  void quiet() override;
  void close() override;
  uint64_t outstanding() const override;
  std::string oldest_outstanding() const override;

  const ReorderConfig& reorder_config() const { return reorder_; }
  // What was chosen: the device's name, its port, the GID index (-1: none, InfiniBand) and whether
  // the device does atomics, and the queue pairs to each peer.
  const std::string& device_name() const { return device_name_; }
  int port() const { return port_; }
  int gid_index() const { return gid_index_; }
  bool native_atomics() const { return native_atomics_; }
  int qps_per_peer() const { return qps_per_peer_; }
  // How the region was registered: "host memory", "DMA-BUF" or "peer memory".
  const char* registration() const { return registration_; }
  // Whether the device is EFA (SRD queue pairs).
  bool srd() const { return efa_.efa; }
  // The most bytes and requests this NIC had in flight at once so far (the caps' effect).
  uint64_t peak_inflight_bytes() const;
  uint64_t peak_inflight_requests() const;

 private:
  struct Request {
    uint64_t id;       // the caller's (several requests may share one)
    uint64_t serial;   // ours, unique: the work request's id
    int peer;
    bool atomic;
    uint64_t local_offset;
    uint64_t remote_offset;
    uint64_t length;  // or the atomic's value
    std::optional<uint32_t> imm;
  };
  struct Peer {
    std::vector<ibv_qp*> qps;          // qps_per_peer_ of them
    std::vector<uint32_t> posted;      // work requests on each one's send queue
    size_t next_qp = 0;                // where the search for a queue pair with room starts
    uint64_t remote_base = 0;
    uint64_t remote_bytes = 0;
    uint32_t rkey = 0;
    ibv_ah* ah = nullptr;                // SRD: where requests to this peer go
    std::vector<uint32_t> remote_qpns;   // SRD: the peer's queue pair for this rank, per index
    std::deque<Request> waiting;      // not posted yet: every send queue was full
    ReorderWindow<Request> reorder;
  };

  std::string who() const;
  void open_device(const VerbsTransportOptions& options);
  void pick_gid(int requested);
  void create_queue_pairs();
  void create_queue_pair(int peer, int index);
  // To ready-to-send, towards the peer's queue pair remote_qpn.
  void connect_queue_pair(int peer, ibv_qp* qp, uint32_t remote_qpn, uint16_t lid, const ibv_gid& remote_gid);
  void post_recvs(ibv_qp* qp, int count);
  void submit(Request request);           // through the reorder window
  void post_or_wait(Request request);      // onto the send queue, or into `waiting`
  void post_now(Peer& peer, const Request& request, int queue_pair);
  void posted(Peer& peer, const Request& request, int queue_pair);  // the NIC's counts, once it took it
  // The queue pair `request` goes on now, or -1 while it must wait (the NIC's in-flight caps, or every send
  // queue to the peer full).
  int queue_pair_for(const Peer& peer, const Request& request) const;
  static uint64_t bytes_of(const Request& request) { return request.atomic ? 8 : request.length; }
  void apply_locally(const Request& request);
  void progress();                         // polls both CQs, posts what waited; lock held
  // The first failure: reported once, later posts refused. A flushed request only follows a queue pair's
  // failure, so a cause found later (before the report) takes its place.
  void fail(const std::string& message, bool flushed = false);
  void throw_failure();
  std::string oldest_outstanding_locked() const;
  void release_resources();

  const VerbsLibrary& ibv_;
  int rank_;
  int num_ranks_;
  MemoryRegion region_;
  int gpu_ = -1;
  std::unique_ptr<RegionWriter> writer_;
  ReorderConfig reorder_;
  double timeout_s_;
  int service_level_ = 0;
  int traffic_class_ = 0;

  std::string device_name_;
  int port_ = 1;
  int gid_index_ = -1;
  bool native_atomics_ = false;
  EfaDevice efa_;
  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_mr* mr_ = nullptr;
  const char* registration_ = "";
  ibv_mr* scratch_mr_ = nullptr;          // the atomics' old values
  uint64_t scratch_word_ = 0;
  ibv_cq* send_cq_ = nullptr;
  ibv_cq* recv_cq_ = nullptr;
  ibv_port_attr port_attr_{};
  ibv_gid gid_{};
  int max_send_wr_ = 0;
  int max_recv_wr_ = 0;
  int max_rd_atomic_ = 1;
  std::vector<Peer> peers_;
  int qps_per_peer_ = 1;
  struct QueuePairOwner {
    int peer;
    int index;  // in the peer's qps
  };
  std::unordered_map<uint32_t, QueuePairOwner> owner_of_qp_;

  mutable std::mutex mutex_;
  bool connected_ = false;
  bool closed_ = false;
  std::string failure_;            // the first failure
  bool failure_reported_ = false;
  bool failure_flushed_ = false;   // failure_ is a flushed request, not a cause
  std::deque<uint64_t> completed_;
  std::deque<ImmediateEvent> immediates_;
  struct InFlight {
    uint64_t id;  // the caller's
    int peer;
    uint64_t bytes;
    std::chrono::steady_clock::time_point since;  // posted by the caller
  };
  std::unordered_map<uint64_t, InFlight> in_flight_;  // by serial
  uint64_t next_serial_ = 0;
  uint64_t outstanding_ = 0;       // posted by the caller, not completed
  uint64_t max_inflight_bytes_ = 0;     // 0: no cap
  uint64_t max_inflight_requests_ = 0;  // 0: no cap
  uint64_t nic_bytes_ = 0;              // on the NIC's send queues now
  uint64_t nic_requests_ = 0;
  uint64_t peak_bytes_ = 0;
  uint64_t peak_requests_ = 0;
};

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
