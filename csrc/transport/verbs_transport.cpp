#if defined(UCCL_EP_WITH_VERBS)
#include "transport/verbs_transport.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "common/portability.h"
#include "common/settings.h"
#include "transport/request_checks.h"
#include "transport/verbs_devices.h"
#include "transport/verbs_registration.h"
#if defined(UCCL_EP_GPU_RUNTIME)
#include "transport/device_region_ops.h"
#endif

namespace uccl_ep {

namespace {

constexpr const char* kRecordVersion = "verbs2";
constexpr uint32_t kStartPsn = 0;
constexpr int kSendQueueDepth = 512;  // per queue pair, capped by the device
constexpr int kRecvQueueDepth = 256;  // receives posted per queue pair for immediates
constexpr int kPollBatch = 64;

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::string(value) : std::string();
}

// An int setting: the option when it is not `unset`, else the environment, else `fallback`.
int int_setting(int option, int unset, const char* env, int fallback, int minimum) {
  if (option != unset) return option;
  const std::string text = env_or_empty(env);
  if (text.empty()) return fallback;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || value < minimum) {
    throw std::invalid_argument(std::string(env) + "=" + text + ": expected an integer >= " + std::to_string(minimum));
  }
  return static_cast<int>(value);
}

std::string gid_hex(const ibv_gid& gid) {
  static const char* digits = "0123456789abcdef";
  std::string text;
  for (uint8_t byte : gid.raw) {
    text += digits[byte >> 4];
    text += digits[byte & 15];
  }
  return text;
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream stream(text);
  while (std::getline(stream, part, separator)) parts.push_back(part);
  return parts;
}

// What an error completion usually means, beyond its name.
std::string advice(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_RETRY_EXC_ERR:
      return "; the peer stopped answering or the network drops packets (on Broadcom Thor-2, lower "
             "UCCL_IB_MAX_INFLIGHT_BYTES)";
    case IBV_WC_REM_ACCESS_ERR:
      return "; the peer's region does not allow this access or the range is outside it";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "; the peer posted no receive for an immediate in time";
    case IBV_WC_WR_FLUSH_ERR:
      return "; its queue pair had failed before (no other error completion here named why: the peer's own "
             "error, or the device's, says it)";
    default:
      return "";
  }
}

#if defined(UCCL_EP_GPU_RUNTIME)
// The RegionWriter of a GPU region the NIC writes into: DeviceRegionWriter's kernels on a stream of its
// own, each after a flush of the NIC's completed writes where the GPU may see them out of order.
class NicGpuRegionWriter final : public RegionWriter {
 public:
  NicGpuRegionWriter(MemoryRegion region, int gpu, int rank) : gpu_(gpu), rank_(rank) {
    ScopedDevice current(gpu, "verbs", rank);
    load_region_ops_kernels();
    const gpuError_t status = gpu_stream_create_nonblocking(&stream_);
    if (status != kGpuSuccess) {
      throw TransportError(transport_label("verbs", rank) + ": a stream for its own region's flags could not be "
                           "created: " + gpu_error_text(status));
    }
    flush_ = !gpu_nic_writes_ordered(gpu);
    inner_ = std::make_unique<DeviceRegionWriter>(region, gpu, stream_, "verbs", rank);
  }
  ~NicGpuRegionWriter() override {
    inner_.reset();
    ScopedDevice current(gpu_);
    (void)gpu_stream_destroy(stream_);
  }
  void add(uint64_t offset, int64_t amount) override {
    flush();
    inner_->add(offset, amount);
  }
  void store_release(uint64_t offset, int64_t value) override {
    flush();
    inner_->store_release(offset, value);
  }

 private:
  void flush() const {
    if (!flush_) return;
    ScopedDevice current(gpu_, "verbs", rank_);
    const gpuError_t status = gpu_flush_nic_writes();
    if (status != kGpuSuccess) {
      throw TransportError(transport_label("verbs", rank_) + ": flushing the NIC's writes before a flag failed: " +
                           gpu_error_text(status));
    }
  }

  const int gpu_;
  const int rank_;
  gpuStream_t stream_ = nullptr;
  bool flush_ = false;
  std::unique_ptr<DeviceRegionWriter> inner_;
};
#endif

std::unique_ptr<RegionWriter> region_writer_for(MemoryRegion region, int gpu, int rank) {
  if (gpu < 0) return std::make_unique<HostRegionWriter>(region);
#if defined(UCCL_EP_GPU_RUNTIME)
  require_device_region("verbs", rank, gpu, region);
  return std::make_unique<NicGpuRegionWriter>(region, gpu, rank);
#else
  (void)rank;
  throw std::invalid_argument("gpu=" + std::to_string(gpu) + ": this build has no GPU support (give gpu -1 for a "
                              "host region)");
#endif
}

}  // namespace

VerbsTransport::VerbsTransport(int rank, int num_ranks, MemoryRegion region, const VerbsTransportOptions& options)
    : ibv_(VerbsLibrary::get()),
      rank_(rank),
      num_ranks_(num_ranks),
      region_(region),
      gpu_(options.gpu),
      reorder_(ReorderConfig::resolve(options.reorder_seed)),
      timeout_s_(options.timeout_s) {
  if (num_ranks < 1) throw std::invalid_argument("num_ranks must be >= 1 (got " + std::to_string(num_ranks) + ")");
  if (rank < 0 || rank >= num_ranks) {
    throw std::invalid_argument("rank must be in [0, num_ranks=" + std::to_string(num_ranks) + ") (got " +
                                std::to_string(rank) + ")");
  }
  if (region.base == nullptr || region.bytes == 0) throw std::invalid_argument("region must be non-empty");
  if (!(options.timeout_s > 0)) throw std::invalid_argument("timeout_s must be > 0");
  if (options.gpu < -1) throw std::invalid_argument("gpu must be >= 0, or -1 for host memory");
  writer_ = region_writer_for(region, options.gpu, rank);
  service_level_ = int_setting(options.service_level, -1, "UCCL_IB_SL", 0, 0);
  traffic_class_ = int_setting(options.traffic_class, -1, "UCCL_IB_TC", 0, 0);
  if (options.qps_per_peer < 0) throw std::invalid_argument("qps_per_peer must be >= 0 (0: UCCL_IB_QPS_PER_PEER)");
  qps_per_peer_ = int_setting(options.qps_per_peer, 0, "UCCL_IB_QPS_PER_PEER", 1, 1);
  if (options.max_inflight_bytes < -1) throw std::invalid_argument("max_inflight_bytes must be >= -1");
  if (options.max_inflight_requests < 0) throw std::invalid_argument("max_inflight_requests must be >= 0");
  max_inflight_bytes_ = static_cast<uint64_t>(
      options.max_inflight_bytes >= 0
          ? options.max_inflight_bytes
          : (env_or_empty("UCCL_IB_MAX_INFLIGHT_BYTES").empty()
                 ? 0
                 : parse_setting_unsigned("UCCL_IB_MAX_INFLIGHT_BYTES", env_or_empty("UCCL_IB_MAX_INFLIGHT_BYTES"), 1)));
  max_inflight_requests_ = static_cast<uint64_t>(options.max_inflight_requests);
  try {
    open_device(options);
    pick_gid(int_setting(options.gid_index, -2, "UCCL_IB_GID_INDEX", -1, -1));
    create_queue_pairs();
  } catch (...) {
    release_resources();
    throw;
  }
}

VerbsTransport::~VerbsTransport() { close(); }

std::string VerbsTransport::who() const {
  return "verbs transport rank " + std::to_string(rank_) + " (" + device_name_ + " port " + std::to_string(port_) +
         ")";
}

void VerbsTransport::open_device(const VerbsTransportOptions& options) {
  std::string wanted = options.device.empty() ? env_or_empty("UCCL_IB_HCA") : options.device;
  const size_t colon = wanted.find(':');
  if (colon != std::string::npos) {
    port_ = std::atoi(wanted.c_str() + colon + 1);
    if (port_ < 1) throw std::invalid_argument("device " + wanted + ": the port after ':' must be >= 1");
    wanted.resize(colon);
  }
  int count = 0;
  ibv_device** devices = ibv_.get_device_list(&count);
  if (devices == nullptr || count == 0) {
    if (devices != nullptr) ibv_.free_device_list(devices);
    throw TransportError("verbs transport rank " + std::to_string(rank_) +
                         ": no RDMA device found (none in /sys/class/infiniband); choose UCCL_EP_PROXY_TRANSPORT=tcp "
                         "on hosts without RDMA NICs");
  }
  ibv_device* chosen = nullptr;
  std::string names;
  for (int i = 0; i < count; ++i) {
    const std::string name = ibv_.get_device_name(devices[i]);
    names += (names.empty() ? "" : ", ") + name;
    if (chosen == nullptr && (wanted.empty() || name == wanted)) chosen = devices[i];
  }
  if (chosen == nullptr) {
    ibv_.free_device_list(devices);
    throw TransportError("verbs transport rank " + std::to_string(rank_) + ": no RDMA device named '" + wanted +
                         "' (UCCL_IB_HCA); this host has " + names);
  }
  device_name_ = ibv_.get_device_name(chosen);
  context_ = ibv_.open_device(chosen);
  ibv_.free_device_list(devices);
  if (context_ == nullptr) throw TransportError(who() + ": ibv_open_device failed: " + std::strerror(errno));
  ibv_device_attr device{};
  if (ibv_.query_device(context_, &device) != 0) throw TransportError(who() + ": ibv_query_device failed");
  if (port_ > device.phys_port_cnt) {
    throw TransportError(who() + ": the device has " + std::to_string(device.phys_port_cnt) + " port(s)");
  }
  if (verbs_query_port(ibv_, context_, port_, &port_attr_) != 0) {
    throw TransportError(who() + ": ibv_query_port failed");
  }
  if (port_attr_.state != IBV_PORT_ACTIVE) {
    throw TransportError(who() + ": the port is not active (state " + std::to_string(port_attr_.state) + ")");
  }
  efa_ = query_efa_device(ibv_, context_);
  native_atomics_ = device.atomic_cap != IBV_ATOMIC_NONE && !efa_.efa;
  max_send_wr_ = std::min(kSendQueueDepth, device.max_qp_wr);
  max_recv_wr_ = std::min(kRecvQueueDepth, device.max_qp_wr);
  max_rd_atomic_ = std::max(1, std::min(device.max_qp_rd_atom, device.max_qp_init_rd_atom));
  pd_ = ibv_.alloc_pd(context_);
  if (pd_ == nullptr) throw TransportError(who() + ": ibv_alloc_pd failed");
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                     (native_atomics_ ? IBV_ACCESS_REMOTE_ATOMIC : 0);
  const RegisteredRegion registered = register_region(ibv_, pd_, region_, access, gpu_, who());
  mr_ = registered.mr;
  registration_ = registered.method;
  scratch_mr_ = ibv_.reg_mr(pd_, &scratch_word_, sizeof(scratch_word_), IBV_ACCESS_LOCAL_WRITE);
  if (scratch_mr_ == nullptr) throw TransportError(who() + ": registering the atomics' scratch word failed");
}

void VerbsTransport::pick_gid(int requested) {
  if (port_attr_.link_layer == IBV_LINK_LAYER_INFINIBAND && requested < 0) return;  // LID routing, no GRH
  if (efa_.efa && requested < 0) requested = 0;  // EFA's port has one GID
  if (requested >= 0) {
    if (requested >= port_attr_.gid_tbl_len || ibv_.query_gid(context_, port_, requested, &gid_) != 0) {
      throw TransportError(who() + ": GID index " + std::to_string(requested) + " (UCCL_IB_GID_INDEX) is not in the "
                           "port's table of " + std::to_string(port_attr_.gid_tbl_len) + " entries");
    }
    static const ibv_gid zero{};
    if (std::memcmp(gid_.raw, zero.raw, sizeof(zero.raw)) == 0) {
      throw TransportError(who() + ": GID index " + std::to_string(requested) + " (UCCL_IB_GID_INDEX) is empty");
    }
    gid_index_ = requested;
    return;
  }
  // The first RoCE v2 entry with an IPv4-mapped address (the one routable over IPv4 networks).
  const std::vector<VerbsGid> table = verbs_gid_table(ibv_, context_, port_, port_attr_.gid_tbl_len);
  gid_index_ = verbs_roce_v2_ipv4_gid(table);
  for (const VerbsGid& entry : table) {
    if (entry.index == gid_index_) gid_ = entry.gid;
  }
  if (gid_index_ < 0) {
    throw TransportError(who() + ": no RoCE v2 GID with an IPv4 address on this port (give the netdev an IPv4 "
                         "address, or set UCCL_IB_GID_INDEX)");
  }
}

void VerbsTransport::create_queue_pairs() {
  // Queue pairs to every rank, this one included: its atomic adds to itself go through the NIC too.
  const int queue_pairs = num_ranks_ * qps_per_peer_;
  send_cq_ = ibv_.create_cq(context_, queue_pairs * max_send_wr_, nullptr, nullptr, 0);
  recv_cq_ = ibv_.create_cq(context_, queue_pairs * max_recv_wr_, nullptr, nullptr, 0);
  if (send_cq_ == nullptr || recv_cq_ == nullptr) throw TransportError(who() + ": ibv_create_cq failed");
  peers_.resize(static_cast<size_t>(num_ranks_));
  for (int p = 0; p < num_ranks_; ++p) {
    Peer& peer = peers_[static_cast<size_t>(p)];
    peer.reorder = ReorderWindow<Request>(reorder_, static_cast<uint32_t>(rank_), static_cast<uint32_t>(p));
    peer.posted.assign(static_cast<size_t>(qps_per_peer_), 0);
    for (int index = 0; index < qps_per_peer_; ++index) create_queue_pair(p, index);
  }
}

void VerbsTransport::create_queue_pair(int p, int index) {
  Peer& peer = peers_[static_cast<size_t>(p)];
  if (efa_.efa) {
    ibv_qp* qp = create_srd_queue_pair(ibv_, context_, pd_, send_cq_, recv_cq_, max_send_wr_, max_recv_wr_, port_,
                                       efa_, who());
    peer.qps.push_back(qp);
    owner_of_qp_[qp->qp_num] = QueuePairOwner{p, index};
    post_recvs(qp, max_recv_wr_);
    return;
  }
  ibv_qp_init_attr init{};
  init.send_cq = send_cq_;
  init.recv_cq = recv_cq_;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = static_cast<uint32_t>(max_send_wr_);
  init.cap.max_recv_wr = static_cast<uint32_t>(max_recv_wr_);
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_.create_qp(pd_, &init);
  if (qp == nullptr) throw TransportError(who() + ": ibv_create_qp for rank " + std::to_string(p) + " failed");
  peer.qps.push_back(qp);
  owner_of_qp_[qp->qp_num] = QueuePairOwner{p, index};
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = static_cast<uint8_t>(port_);
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                         (native_atomics_ ? IBV_ACCESS_REMOTE_ATOMIC : 0);
  if (ibv_.modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
    throw TransportError(who() + ": moving the queue pair for rank " + std::to_string(p) + " to INIT failed");
  }
  post_recvs(qp, max_recv_wr_);
}

void VerbsTransport::post_recvs(ibv_qp* qp, int count) {
  for (int i = 0; i < count; ++i) {
    ibv_recv_wr wr{};  // no scatter entries: a write's immediate carries everything
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_recv(qp, &wr, &bad) != 0) throw TransportError(who() + ": ibv_post_recv failed");
  }
}

std::string VerbsTransport::listen_address() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw TransportError(who() + ": listen_address() after close()");
  std::ostringstream record;
  record << kRecordVersion << '/' << port_attr_.lid << '/' << gid_hex(gid_) << '/'
         << reinterpret_cast<uintptr_t>(region_.base) << '/' << region_.bytes << '/' << mr_->rkey << '/';
  // Each peer's queue pairs in turn: [peer * qps_per_peer + index].
  for (int p = 0; p < num_ranks_; ++p) {
    for (int index = 0; index < qps_per_peer_; ++index) {
      record << (p || index ? "," : "") << peers_[static_cast<size_t>(p)].qps[static_cast<size_t>(index)]->qp_num;
    }
  }
  return record.str();
}

void VerbsTransport::connect(const std::vector<std::string>& addresses) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw TransportError(who() + ": connect() after close()");
  if (connected_) throw TransportError(who() + ": connect() twice");
  if (static_cast<int>(addresses.size()) != num_ranks_) {
    throw std::invalid_argument("addresses must have num_ranks=" + std::to_string(num_ranks_) + " entries (got " +
                                std::to_string(addresses.size()) + ")");
  }
  for (int p = 0; p < num_ranks_; ++p) {  // this rank's own record connects its queue pair to itself
    const std::vector<std::string> fields = split(addresses[static_cast<size_t>(p)], '/');
    const std::vector<std::string> qpns = fields.size() == 7 ? split(fields[6], ',') : std::vector<std::string>{};
    if (fields.size() != 7 || fields[0] != kRecordVersion || fields[2].size() != 32 || qpns.empty() ||
        qpns.size() % static_cast<size_t>(num_ranks_) != 0) {
      throw std::invalid_argument("addresses[" + std::to_string(p) + "] is not a verbs connection record of " +
                                  std::to_string(num_ranks_) + " ranks: '" + addresses[static_cast<size_t>(p)] + "'");
    }
    const size_t peer_qps = qpns.size() / static_cast<size_t>(num_ranks_);
    if (peer_qps != static_cast<size_t>(qps_per_peer_)) {
      throw std::invalid_argument(who() + ": rank " + std::to_string(p) + " has " + std::to_string(peer_qps) +
                                  " queue pairs per peer, this rank " + std::to_string(qps_per_peer_) +
                                  "; every rank must use the same UCCL_IB_QPS_PER_PEER");
    }
    Peer& peer = peers_[static_cast<size_t>(p)];
    ibv_gid remote_gid{};
    for (int i = 0; i < 16; ++i) {
      remote_gid.raw[i] = static_cast<uint8_t>(std::stoul(fields[2].substr(static_cast<size_t>(2 * i), 2), nullptr, 16));
    }
    peer.remote_base = std::stoull(fields[3]);
    peer.remote_bytes = std::stoull(fields[4]);
    peer.rkey = static_cast<uint32_t>(std::stoul(fields[5]));
    const auto lid = static_cast<uint16_t>(std::stoul(fields[1]));
    if (efa_.efa) peer.ah = create_srd_address(ibv_, pd_, port_, remote_gid, who());
    for (int index = 0; index < qps_per_peer_; ++index) {
      // Our queue pair `index` for rank p meets its queue pair `index` for us.
      const auto remote_qpn =
          static_cast<uint32_t>(std::stoul(qpns[static_cast<size_t>(rank_ * qps_per_peer_ + index)]));
      if (efa_.efa) {
        peer.remote_qpns.push_back(remote_qpn);
      } else {
        connect_queue_pair(p, peer.qps[static_cast<size_t>(index)], remote_qpn, lid, remote_gid);
      }
    }
  }
  connected_ = true;
}

void VerbsTransport::connect_queue_pair(int p, ibv_qp* qp, uint32_t remote_qpn, uint16_t lid,
                                        const ibv_gid& remote_gid) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = port_attr_.active_mtu;
  attr.dest_qp_num = remote_qpn;
  attr.rq_psn = kStartPsn;
  attr.max_dest_rd_atomic = static_cast<uint8_t>(max_rd_atomic_);
  attr.min_rnr_timer = 12;
  attr.ah_attr.dlid = lid;
  attr.ah_attr.sl = static_cast<uint8_t>(service_level_);
  attr.ah_attr.port_num = static_cast<uint8_t>(port_);
  if (gid_index_ >= 0) {
    attr.ah_attr.is_global = 1;
    attr.ah_attr.grh.dgid = remote_gid;
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index_);
    attr.ah_attr.grh.hop_limit = 64;
    attr.ah_attr.grh.traffic_class = static_cast<uint8_t>(traffic_class_);
  }
  if (ibv_.modify_qp(qp, &attr,
                     IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                         IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
    throw TransportError(who() + ": moving the queue pair for rank " + std::to_string(p) + " to RTR failed (" +
                         std::strerror(errno) + "; a wrong UCCL_IB_GID_INDEX, or no route to the peer's GID)");
  }
  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = 14;
  attr.retry_cnt = 7;
  attr.rnr_retry = 7;  // wait for receives as long as it takes
  attr.sq_psn = kStartPsn;
  attr.max_rd_atomic = static_cast<uint8_t>(max_rd_atomic_);
  if (ibv_.modify_qp(qp, &attr,
                     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                         IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
    throw TransportError(who() + ": moving the queue pair for rank " + std::to_string(p) + " to RTS failed (" +
                         std::strerror(errno) + ")");
  }
}

void VerbsTransport::post_write(int peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                                std::optional<uint32_t> imm, uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable(who(), closed_, connected_, peer, num_ranks_, "post_write");
  throw_failure();
  check_range("local_offset", local_offset, length, region_.bytes, "this rank's region");
  const uint64_t remote_bytes = peer == rank_ ? region_.bytes : peers_[static_cast<size_t>(peer)].remote_bytes;
  check_range("remote_offset", remote_offset, length, remote_bytes, "rank " + std::to_string(peer) + "'s region");
  submit(Request{request_id, 0, peer, false, local_offset, remote_offset, length, imm});
}

void VerbsTransport::post_atomic_add(int peer, uint64_t remote_offset, int64_t value, uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable(who(), closed_, connected_, peer, num_ranks_, "post_atomic_add");
  throw_failure();
  if (remote_offset % 8 != 0) {
    throw std::invalid_argument("remote_offset must be a multiple of 8 for an atomic add (got " +
                                std::to_string(remote_offset) + ")");
  }
  const uint64_t remote_bytes = peer == rank_ ? region_.bytes : peers_[static_cast<size_t>(peer)].remote_bytes;
  check_range("remote_offset", remote_offset, 8, remote_bytes, "rank " + std::to_string(peer) + "'s region");
  if (!native_atomics_ && peer != rank_) {
    throw TransportError(who() + ": the device does not do RDMA atomics (atomic_cap NONE); the ordering layer's "
                         "immediate-encoded adds serve such devices");
  }
  submit(Request{request_id, 0, peer, true, 0, remote_offset, static_cast<uint64_t>(value), std::nullopt});
}

void VerbsTransport::submit(Request request) {
  ++outstanding_;
  request.serial = next_serial_++;
  in_flight_[request.serial] =
      InFlight{request.id, request.peer, bytes_of(request), std::chrono::steady_clock::now()};
  peers_[static_cast<size_t>(request.peer)].reorder.push(std::move(request), std::chrono::steady_clock::now(),
                                                          [this](Request r) { post_or_wait(std::move(r)); });
}

void VerbsTransport::apply_locally(const Request& r) {
  if (r.atomic) {
    writer_->add(r.remote_offset, static_cast<int64_t>(r.length));
  } else {
    auto* base = static_cast<uint8_t*>(region_.base);
    std::memmove(base + r.remote_offset, base + r.local_offset, r.length);
    if (r.imm) immediates_.push_back(ImmediateEvent{static_cast<uint32_t>(rank_), *r.imm});
  }
  in_flight_.erase(r.serial);
  --outstanding_;
  completed_.push_back(r.id);
}

void VerbsTransport::post_or_wait(Request r) {
  // A write to itself is a copy where the CPU can make it (host memory), else the NIC's. An atomic add to
  // itself goes through the NIC when the peers' adds do: the NIC's atomics are atomic among themselves only.
  if (r.peer == rank_ && (r.atomic ? !native_atomics_ : gpu_ < 0)) {
    apply_locally(r);
    return;
  }
  Peer& peer = peers_[static_cast<size_t>(r.peer)];
  const int index = peer.waiting.empty() ? queue_pair_for(peer, r) : -1;
  if (index < 0) {
    peer.waiting.push_back(std::move(r));
    return;
  }
  post_now(peer, r, index);
}

int VerbsTransport::queue_pair_for(const Peer& peer, const Request& r) const {
  if (max_inflight_requests_ != 0 && nic_requests_ >= max_inflight_requests_) return -1;
  if (max_inflight_bytes_ != 0 && nic_bytes_ != 0 && nic_bytes_ + bytes_of(r) > max_inflight_bytes_) return -1;
  // The queue pairs in turn, from the one after the last used, skipping full send queues.
  for (size_t step = 0; step < peer.qps.size(); ++step) {
    const size_t index = (peer.next_qp + step) % peer.qps.size();
    if (peer.posted[index] < static_cast<uint32_t>(max_send_wr_)) return static_cast<int>(index);
  }
  return -1;
}

void VerbsTransport::post_now(Peer& peer, const Request& r, int index) {
  if (efa_.efa) {
    if (r.length > efa_.max_rdma_bytes) {
      fail(who() + ": request " + std::to_string(r.id) + " writes " + std::to_string(r.length) + " bytes, more than " +
           "the EFA device's largest RDMA (" + std::to_string(efa_.max_rdma_bytes) + ")");
      return;
    }
    const auto slot = static_cast<size_t>(index);
    const int rc = post_srd_write(ibv_, peer.qps[slot], peer.ah, peer.remote_qpns[slot], r.serial,
                                  reinterpret_cast<uintptr_t>(region_.base) + r.local_offset, mr_->lkey,
                                  static_cast<uint32_t>(r.length), peer.remote_base + r.remote_offset, peer.rkey,
                                  r.imm);
    if (rc != 0) {
      fail(who() + ": posting request " + std::to_string(r.id) + " to rank " + std::to_string(r.peer) +
           " on its SRD queue pair failed: " + std::strerror(rc));
      return;
    }
    posted(peer, r, index);
    return;
  }
  ibv_sge sge{};
  ibv_send_wr wr{};
  wr.wr_id = r.serial;  // the caller's ids need not be unique
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  if (r.atomic) {
    sge.addr = reinterpret_cast<uintptr_t>(&scratch_word_);
    sge.length = 8;
    sge.lkey = scratch_mr_->lkey;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr.wr.atomic.remote_addr = peer.remote_base + r.remote_offset;
    wr.wr.atomic.compare_add = r.length;
    wr.wr.atomic.rkey = peer.rkey;
  } else {
    sge.addr = reinterpret_cast<uintptr_t>(region_.base) + r.local_offset;
    sge.length = static_cast<uint32_t>(r.length);
    sge.lkey = mr_->lkey;
    wr.num_sge = r.length > 0 ? 1 : 0;
    wr.opcode = r.imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    if (r.imm) wr.imm_data = htonl(*r.imm);
    wr.wr.rdma.remote_addr = peer.remote_base + r.remote_offset;
    wr.wr.rdma.rkey = peer.rkey;
  }
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(peer.qps[static_cast<size_t>(index)], &wr, &bad);
  if (rc != 0) {
    fail(who() + ": ibv_post_send of request " + std::to_string(r.id) + " to rank " + std::to_string(r.peer) +
         " failed: " + std::strerror(rc));
    return;
  }
  posted(peer, r, index);
}

void VerbsTransport::posted(Peer& peer, const Request& r, int index) {
  ++peer.posted[static_cast<size_t>(index)];
  peer.next_qp = (static_cast<size_t>(index) + 1) % peer.qps.size();
  nic_bytes_ += bytes_of(r);
  ++nic_requests_;
  peak_bytes_ = std::max(peak_bytes_, nic_bytes_);
  peak_requests_ = std::max(peak_requests_, nic_requests_);
}

void VerbsTransport::progress() {
  ibv_wc wcs[kPollBatch];
  for (;;) {
    const int n = ibv_poll_cq(send_cq_, kPollBatch, wcs);
    if (n < 0) {
      fail(who() + ": polling the send completion queue failed");
      break;
    }
    for (int i = 0; i < n; ++i) {
      const ibv_wc& wc = wcs[i];
      const auto found = owner_of_qp_.find(wc.qp_num);
      const int peer = found == owner_of_qp_.end() ? -1 : found->second.peer;
      if (peer >= 0) --peers_[static_cast<size_t>(peer)].posted[static_cast<size_t>(found->second.index)];
      const auto request = in_flight_.find(wc.wr_id);
      if (request == in_flight_.end()) {
        fail(who() + ": a completion for work request " + std::to_string(wc.wr_id) + " that was never posted");
        continue;
      }
      const uint64_t id = request->second.id;
      nic_bytes_ -= request->second.bytes;
      in_flight_.erase(request);
      --nic_requests_;
      --outstanding_;
      if (wc.status != IBV_WC_SUCCESS) {
        fail(who() + ": request " + std::to_string(id) + " to rank " + std::to_string(peer) + " failed: " +
                 ibv_.wc_status_str(wc.status) + " (" + std::to_string(wc.status) + ")" + advice(wc.status),
             wc.status == IBV_WC_WR_FLUSH_ERR);
        continue;
      }
      completed_.push_back(id);
    }
    if (n < kPollBatch) break;
  }
  for (;;) {
    const int n = ibv_poll_cq(recv_cq_, kPollBatch, wcs);
    if (n < 0) {
      fail(who() + ": polling the receive completion queue failed");
      break;
    }
    for (int i = 0; i < n; ++i) {
      const ibv_wc& wc = wcs[i];
      const auto found = owner_of_qp_.find(wc.qp_num);
      if (found == owner_of_qp_.end()) continue;
      const QueuePairOwner owner = found->second;
      if (wc.status != IBV_WC_SUCCESS) {
        if (wc.status != IBV_WC_WR_FLUSH_ERR) {
          fail(who() + ": a receive from rank " + std::to_string(owner.peer) + " failed: " +
               ibv_.wc_status_str(wc.status) + " (" + std::to_string(wc.status) + ")");
        }
        continue;
      }
      if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        immediates_.push_back(ImmediateEvent{static_cast<uint32_t>(owner.peer), ntohl(wc.imm_data)});
      }
      if (failure_.empty()) {
        post_recvs(peers_[static_cast<size_t>(owner.peer)].qps[static_cast<size_t>(owner.index)], 1);
      }
    }
    if (n < kPollBatch) break;
  }
  const auto now = std::chrono::steady_clock::now();
  for (Peer& peer : peers_) {
    if (peer.reorder.expired(now)) peer.reorder.flush([this](Request r) { post_or_wait(std::move(r)); });
    while (!peer.waiting.empty() && failure_.empty()) {
      const int index = queue_pair_for(peer, peer.waiting.front());
      if (index < 0) break;
      post_now(peer, peer.waiting.front(), index);
      peer.waiting.pop_front();
    }
  }
}

void VerbsTransport::fail(const std::string& message, bool flushed) {
  if (failure_.empty() || (failure_flushed_ && !flushed && !failure_reported_)) {
    failure_ = message;
    failure_flushed_ = flushed;
  }
}

void VerbsTransport::throw_failure() {
  if (failure_.empty()) return;
  if (!failure_reported_) {
    failure_reported_ = true;
    throw TransportError(failure_);
  }
  throw TransportError(who() + ": unusable after an earlier failure: " + failure_);
}

size_t VerbsTransport::poll_completions(uint64_t* out, size_t max) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_ || !connected_) return 0;
  progress();
  if (!failure_.empty() && !failure_reported_) throw_failure();
  size_t n = 0;
  while (n < max && !completed_.empty()) {
    out[n++] = completed_.front();
    completed_.pop_front();
  }
  return n;
}

size_t VerbsTransport::poll_immediates(ImmediateEvent* out, size_t max) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_ || !connected_) return 0;
  progress();
  size_t n = 0;
  while (n < max && !immediates_.empty()) {
    out[n++] = immediates_.front();
    immediates_.pop_front();
  }
  return n;
}

void VerbsTransport::quiet() {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                             std::chrono::duration<double>(timeout_s_));
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) throw TransportError(who() + ": quiet() after close()");
      for (Peer& peer : peers_) peer.reorder.flush([this](Request r) { post_or_wait(std::move(r)); });
      progress();
      if (!failure_.empty()) throw_failure();
      if (outstanding_ == 0) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        throw TransportError(who() + ": quiet() timed out after " + std::to_string(timeout_s_) + " s with " +
                             std::to_string(outstanding_) + " request(s) outstanding; " + oldest_outstanding_locked());
      }
    }
    std::this_thread::yield();
  }
}

uint64_t VerbsTransport::outstanding() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return outstanding_;
}

std::string VerbsTransport::oldest_outstanding() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return oldest_outstanding_locked();
}

std::string VerbsTransport::oldest_outstanding_locked() const {
  const std::pair<const uint64_t, InFlight>* oldest = nullptr;
  for (const auto& entry : in_flight_) {
    if (oldest == nullptr || entry.second.since < oldest->second.since) oldest = &entry;
  }
  if (oldest == nullptr) return {};
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - oldest->second.since).count();
  return "request " + std::to_string(oldest->second.id) + " to rank " + std::to_string(oldest->second.peer) +
         " unacknowledged for " + std::to_string(waited) + " s";
}

uint64_t VerbsTransport::peak_inflight_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_bytes_;
}

uint64_t VerbsTransport::peak_inflight_requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_requests_;
}

void VerbsTransport::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  release_resources();
}

void VerbsTransport::release_resources() {
  for (Peer& peer : peers_) {
    for (ibv_qp* qp : peer.qps) (void)ibv_.destroy_qp(qp);
    peer.qps.clear();
    if (peer.ah != nullptr) (void)ibv_.destroy_ah(peer.ah);
    peer.ah = nullptr;
  }
  if (send_cq_ != nullptr) (void)ibv_.destroy_cq(send_cq_);
  if (recv_cq_ != nullptr) (void)ibv_.destroy_cq(recv_cq_);
  send_cq_ = recv_cq_ = nullptr;
  if (scratch_mr_ != nullptr) (void)ibv_.dereg_mr(scratch_mr_);
  if (mr_ != nullptr) (void)ibv_.dereg_mr(mr_);
  scratch_mr_ = mr_ = nullptr;
  if (pd_ != nullptr) (void)ibv_.dealloc_pd(pd_);
  pd_ = nullptr;
  if (context_ != nullptr) (void)ibv_.close_device(context_);
  context_ = nullptr;
}

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
