// The GPU-driven rail hop (rail.h has the region and the protocol).
#include "kernels/rail.h"

#include <algorithm>
#include <string>

#include "channel/command.h"
#include "channel/fifo_device.cuh"
#include "common/require.h"

namespace uccl_ep {
namespace {

constexpr int kRailThreads = 512;
constexpr int kRailBlocksPerRole = 32;  // blocks that send (and as many that receive), split between the hosts
constexpr int kRailCopyUnroll = 4;      // 16-byte loads a thread has in flight before its stores
constexpr int kRoleSend = 0, kRoleReceive = 1;

struct RailArgs {
  uint8_t* region;
  const uint8_t* rows;  // this rank's rows, by destination host
  uint8_t* out;         // the rows received, by source host
  int64_t width, slot_bytes, control_bytes;
  int64_t cap;  // rows per piece
  int32_t host, num_hosts, blocks_per_host, num_fifos;
  const FifoView* fifos;
  int64_t timeout_ns, exchange;
  RailFailure* failure;
  uint32_t* scratch;  // [0] abort, then a counter of finished blocks per (role, host)
  int32_t send_first[kRailMaxHosts], send_rows[kRailMaxHosts];  // in rows of `rows`
  int32_t recv_first[kRailMaxHosts], recv_rows[kRailMaxHosts];  // in rows of `out`
  uint32_t sent[kRailMaxHosts], received[kRailMaxHosts];          // pieces before this exchange, per peer host
};

__device__ __forceinline__ int64_t word_offset(const RailArgs& a, int kind, int host) {
  return (static_cast<int64_t>(kind) * a.num_hosts + host) * kRailWordBytes;
}
__device__ __forceinline__ uint64_t* word(const RailArgs& a, int kind, int host) {
  return reinterpret_cast<uint64_t*>(a.region + word_offset(a, kind, host));
}
__device__ __forceinline__ int64_t send_slot(const RailArgs& a, int host) {
  return a.control_bytes + host * a.slot_bytes;
}
__device__ __forceinline__ int64_t receive_slot(const RailArgs& a, int host) {
  return a.control_bytes + (a.num_hosts + host) * a.slot_bytes;
}
// An empty block is one empty piece: its count still tells the receiver that nothing more comes.
__host__ __device__ __forceinline__ int64_t rail_pieces(int64_t rows, int64_t cap) {
  return rows == 0 ? 1 : (rows + cap - 1) / cap;
}

__device__ __forceinline__ int64_t smaller(int64_t x, int64_t y) { return x < y ? x : y; }

__device__ __forceinline__ bool aborted(const RailArgs& a) {
  return *reinterpret_cast<volatile uint32_t*>(a.scratch) != 0;
}

// The first failure of the rail's life is kept; every later wait and exchange ends at once.
__device__ void record_failure(const RailArgs& a, int32_t phase, int peer, int64_t expected, int64_t seen) {
  if (atomicCAS(a.scratch, 0u, 1u) != 0u) return;
  volatile RailFailure* f = a.failure;
  f->phase = phase;
  f->peer = peer;
  f->exchange = a.exchange;
  f->expected = expected;
  f->seen = seen;
  __threadfence_system();
  f->failed = 1;
}

// Thread 0 waits until `ready` holds for the word a peer's proxy writes; false after a failure.
template <typename Ready>
__device__ bool wait_word(const RailArgs& a, const uint64_t* addr, Ready ready, int32_t phase, int peer,
                          int64_t expected, uint64_t& value) {
  const uint64_t start = device_time_ns();
  for (;;) {
    value = load_acquire_system(addr);
    if (ready(value)) return true;
    if (aborted(a)) return false;
    if (device_time_ns() - start > static_cast<uint64_t>(a.timeout_ns)) {
      record_failure(a, phase, peer, expected, static_cast<int64_t>(value));
      return false;
    }
  }
}

// A block's share (`part` of a.blocks_per_host) of `bytes` (a multiple of 16) from src to dst. `landed`: src was
// written by a transport, so the loads skip L1 (it may hold an earlier piece of the slot).
__device__ void copy_share(const uint8_t* src, uint8_t* dst, int64_t bytes, int part, int parts, bool landed) {
  const int64_t units = bytes / 16, per_part = (units + parts - 1) / parts;
  const int64_t begin = per_part * part, end = smaller(units, begin + per_part);
  const int4* from = reinterpret_cast<const int4*>(src);
  int4* to = reinterpret_cast<int4*>(dst);
  constexpr int64_t kStride = static_cast<int64_t>(kRailThreads) * kRailCopyUnroll;
  int64_t i = begin + threadIdx.x;
  for (; i + (kRailCopyUnroll - 1) * kRailThreads < end; i += kStride) {
    int4 values[kRailCopyUnroll];
#pragma unroll
    for (int u = 0; u < kRailCopyUnroll; ++u) values[u] = landed ? load_l2_16(from + i + u * kRailThreads) : from[i + u * kRailThreads];
#pragma unroll
    for (int u = 0; u < kRailCopyUnroll; ++u) to[i + u * kRailThreads] = values[u];
  }
  for (; i < end; i += kRailThreads) to[i] = landed ? load_l2_16(from + i) : from[i];
}

// Thread 0 of each block counts its block's share of piece `piece` of (role, host) in; true for the block that
// completes the piece, which also resets the counter after the last piece (every block is done with it then).
__device__ bool completes_piece(const RailArgs& a, int role, int host, int64_t piece, bool last) {
  uint32_t* counter = a.scratch + 1 + role * kRailMaxHosts + host;
  const uint32_t done = atomicAdd(counter, 1u) + 1;
  if (done != static_cast<uint32_t>(a.blocks_per_host * (piece + 1))) return false;
  __threadfence_system();  // every block's copies before what the caller does next
  if (last) *counter = 0;
  return true;
}

__device__ __forceinline__ Command write_command(CommandKind kind, int peer, uint32_t flags, int64_t local,
                                                 int64_t remote, int64_t bytes) {
  return encode_command(kind, static_cast<uint32_t>(peer), flags, static_cast<uint64_t>(bytes) / 16, kRailCounter,
                        static_cast<uint64_t>(local) / 16, static_cast<uint64_t>(remote) / 16);
}

// The int64 count flag the receiving proxy stores once the `writes` it announces have landed: -(writes + 1).
__device__ __forceinline__ int64_t announced_writes(int64_t flag) { return -flag - 1; }

// All commands to one host go through one FIFO.
__device__ void push_commands(const RailArgs& a, int peer, const Command* commands, int count) {
  const FifoView fifo = a.fifos[peer % a.num_fifos];
  DeviceFifoOps ops{device_time_ns() + static_cast<uint64_t>(a.timeout_ns)};
  for (int i = 0; i < count; ++i) {
    if (fifo_push(fifo, commands[i], ops) != PushResult::kPushed) {
      record_failure(a, kRailFifoFull, peer, count, i);
      return;
    }
  }
}

// This rank's rows for host `to`, piece by piece: each once `to` freed our slot there.
__device__ void send_block(const RailArgs& a, int to, int part) {
  __shared__ int ok;
  const int64_t rows = a.send_rows[to], pieces = rail_pieces(rows, a.cap);
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const uint64_t seq = a.sent[to] + piece + 1;
    if (threadIdx.x == 0) {
      uint64_t value;
      ok = wait_word(a, word(a, kRailFreed, to), [seq](uint64_t freed) { return freed + 1 >= seq; },
                     kRailWaitFreed, to, static_cast<int64_t>(seq - 1), value);
    }
    __syncthreads();
    if (!ok) return;
    const int64_t count = smaller(a.cap, rows - piece * a.cap), bytes = count * a.width;
    copy_share(a.rows + (a.send_first[to] + piece * a.cap) * a.width, a.region + send_slot(a, to), bytes, part,
               a.blocks_per_host, false);
    __threadfence_system();  // every thread's stores, for the transport's read (not only thread 0's)
    __syncthreads();
    if (threadIdx.x == 0 && completes_piece(a, kRoleSend, to, piece, piece + 1 == pieces)) {
      // The rows' write lands with an immediate; the count flag (a signed value in the length field) announces
      // it, and the receiving proxy holds the flag until it has landed: no quiet, and any delivery order.
      const uint32_t buffer = static_cast<uint32_t>(seq % 2);
      const int64_t writes = bytes > 0 ? 1 : 0;
      Command commands[2];
      int n = 0;
      if (bytes > 0) {
        commands[n++] = write_command(CommandKind::kWriteWithCount, to, buffer, send_slot(a, to),
                                      receive_slot(a, a.host), bytes);
      }
      commands[n++] = encode_command(CommandKind::kAtomicAdd, static_cast<uint32_t>(to),
                                     buffer | kCommandFlagCountFlag, static_cast<uint64_t>(writes), kRailCounter, 0, 0);
      push_commands(a, to, commands, n);
    }
  }
}

// Host `from`'s rows for this rank, piece by piece as they land, each slot freed once copied out.
__device__ void receive_block(const RailArgs& a, int from, int part) {
  __shared__ int ok;
  const int64_t rows = a.recv_rows[from], pieces = rail_pieces(rows, a.cap);
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const uint64_t seq = a.received[from] + piece + 1;
    const int64_t count = smaller(a.cap, rows - piece * a.cap), writes = count > 0 ? 1 : 0;
    uint64_t* flag = reinterpret_cast<uint64_t*>(a.region + rail_flag_offset(a.num_hosts, seq, from));
    if (threadIdx.x == 0) {
      // The flag of this piece's parity was reset after the piece two before; the sender sends this one only
      // after this rank freed the one before, so a nonzero flag is this piece's.
      uint64_t value;
      ok = wait_word(a, flag, [](uint64_t v) { return v != 0; }, kRailWaitArrived, from, static_cast<int64_t>(seq),
                     value);
      const int64_t announced = announced_writes(static_cast<int64_t>(value));
      if (ok && announced != writes) {
        record_failure(a, kRailBadCount, from, writes, announced);
        ok = 0;
      }
    }
    __syncthreads();
    if (!ok) return;
    copy_share(a.region + receive_slot(a, from), a.out + (a.recv_first[from] + piece * a.cap) * a.width,
               count * a.width, part, a.blocks_per_host, true);
    __syncthreads();  // every load of the slot returned before it is freed
    if (threadIdx.x == 0 && completes_piece(a, kRoleReceive, from, piece, piece + 1 == pieces)) {
      store_release_system(flag, 0);  // every block has read it: the piece two later may reuse it once freed
      store_release_system(word(a, kRailFreedStaged, from), seq);
      const Command command = write_command(CommandKind::kWrite, from, 0, word_offset(a, kRailFreedStaged, from),
                                            word_offset(a, kRailFreed, a.host), kRailWordBytes);
      push_commands(a, from, &command, 1);
    }
  }
}

__global__ void __launch_bounds__(kRailThreads, 1) rail_exchange(RailArgs a) {
  if (aborted(a)) return;
  const int per_role = a.num_hosts * a.blocks_per_host;
  const int role = blockIdx.x / per_role, host = blockIdx.x % per_role / a.blocks_per_host;
  const int part = blockIdx.x % a.blocks_per_host;
  if (role == kRoleSend) {
    if (host != a.host) send_block(a, host, part);
  } else if (host != a.host) {
    receive_block(a, host, part);
  } else {  // this host's own rows stay here
    copy_share(a.rows + a.send_first[host] * a.width, a.out + a.recv_first[host] * a.width,
               a.send_rows[host] * a.width, part, a.blocks_per_host, false);
  }
}

}  // namespace

DeviceRail::DeviceRail(uint8_t* region, int64_t region_bytes, int host, int num_hosts, const FifoView* fifos,
                       int num_fifos, double timeout_s, int device)
    : region_(region), region_bytes_(region_bytes), host_(host), num_hosts_(num_hosts), num_fifos_(num_fifos),
      device_(device), fifos_(fifos), timeout_ns_(static_cast<int64_t>(timeout_s * 1e9)),
      sent_(std::max(num_hosts, 0), 0), received_(std::max(num_hosts, 0), 0) {
  require(num_hosts >= 1 && num_hosts <= kRailMaxHosts,
          "num_hosts must be in [1, " + std::to_string(kRailMaxHosts) + "], got " + std::to_string(num_hosts));
  require(host >= 0 && host < num_hosts, "host " + std::to_string(host) + " is outside the rail's " +
                                             std::to_string(num_hosts) + " hosts");
  require(region != nullptr && reinterpret_cast<uintptr_t>(region) % 16 == 0, "the region must be 16-byte aligned");
  require(fifos != nullptr && num_fifos >= 1, "the rail needs the proxy's FIFOs");
  require(timeout_s > 0, "timeout_s must be positive");
  const int64_t control = rail_control_bytes(num_hosts);
  slot_bytes_ = region_bytes > control ? (region_bytes - control) / (2 * num_hosts) / 16 * 16 : 0;
  require(slot_bytes_ >= 16, "num_rdma_bytes=" + std::to_string(region_bytes) + " leaves no room for rows across " +
                                 std::to_string(num_hosts) + " hosts (the rail needs " + std::to_string(control) +
                                 " bytes of control words and a slot per host each way)");
  CurrentDevice on(device);
  void* host_record = nullptr;
  void* device_record = nullptr;
  UCCL_EP_GPU_CHECK(gpu_host_alloc_mapped(&host_record, &device_record, sizeof(RailFailure)));
  failure_host_ = static_cast<RailFailure*>(host_record);
  failure_device_ = static_cast<RailFailure*>(device_record);
  *failure_host_ = RailFailure{};
  const size_t scratch_bytes = (1 + 2 * kRailMaxHosts) * sizeof(uint32_t);
  UCCL_EP_GPU_CHECK(gpu_device_alloc(reinterpret_cast<void**>(&scratch_), scratch_bytes));
  UCCL_EP_GPU_CHECK(gpu_memset(scratch_, 0, scratch_bytes));
  gpu_load_kernels(rail_exchange);  // loaded now, not at a first launch behind a waiting kernel
}

DeviceRail::~DeviceRail() {
  try {
    release();
  } catch (...) {  // a destructor must not throw; release() reports where it is called directly
  }
}

int64_t DeviceRail::exchange(const uint8_t* rows, uint8_t* out, int64_t width, const std::vector<int64_t>& send_counts,
                             const std::vector<int64_t>& recv_counts, gpuStream_t stream) {
  require(!released_, "the rail was released");
  require(static_cast<int>(send_counts.size()) == num_hosts_ && static_cast<int>(recv_counts.size()) == num_hosts_,
          "send_counts and recv_counts need one count per host (" + std::to_string(num_hosts_) + ")");
  require(width > 0 && width % 16 == 0, "the rows' width must be a positive multiple of 16 bytes, got " +
                                            std::to_string(width));
  require(width <= slot_bytes_, "a row of " + std::to_string(width) + " bytes does not fit the rail's slots of " +
                                    std::to_string(slot_bytes_) + " bytes");
  require(send_counts[host_] == recv_counts[host_], "the rows this host keeps must be counted alike both ways");
  bool capturing = false;
  UCCL_EP_GPU_CHECK(gpu_stream_capturing(stream, &capturing));
  require(!capturing, "the rail between hosts numbers its pieces on the host, so a CUDA graph could not replay it; "
                      "capture normal mode across hosts over the collective rail (UCCL_EP_PROXY_TRANSPORT unset)");
  RailArgs a{};
  a.region = region_;
  a.rows = rows;
  a.out = out;
  a.width = width;
  a.slot_bytes = slot_bytes_;
  a.control_bytes = rail_control_bytes(num_hosts_);
  a.cap = slot_bytes_ / width;
  a.host = host_;
  a.num_hosts = num_hosts_;
  a.blocks_per_host = std::max(1, kRailBlocksPerRole / num_hosts_);
  a.num_fifos = num_fifos_;
  a.fifos = fifos_;
  a.timeout_ns = timeout_ns_;
  a.exchange = exchanges_ + 1;
  a.failure = failure_device_;
  a.scratch = scratch_;
  int64_t sent_rows = 0, received_rows = 0, writes = 0;
  for (int h = 0; h < num_hosts_; ++h) {
    require(send_counts[h] >= 0 && recv_counts[h] >= 0, "row counts must not be negative");
    a.send_first[h] = static_cast<int32_t>(sent_rows);
    a.send_rows[h] = static_cast<int32_t>(send_counts[h]);
    a.recv_first[h] = static_cast<int32_t>(received_rows);
    a.recv_rows[h] = static_cast<int32_t>(recv_counts[h]);
    a.sent[h] = sent_[h];
    a.received[h] = received_[h];
    sent_rows += send_counts[h];
    received_rows += recv_counts[h];
    require(sent_rows < (int64_t{1} << 31) && received_rows < (int64_t{1} << 31), "too many rows for one exchange");
  }
  require((sent_rows == 0 || rows != nullptr) && (received_rows == 0 || out != nullptr),
          "rows and out must not be null when rows move");
  for (int h = 0; h < num_hosts_; ++h) {
    if (h == host_) continue;
    const int64_t out_pieces = rail_pieces(send_counts[h], a.cap), in_pieces = rail_pieces(recv_counts[h], a.cap);
    writes += (send_counts[h] > 0 ? 2 : 1) * out_pieces + in_pieces;  // rows and their count flag; freed slots
    sent_[h] += static_cast<uint32_t>(out_pieces);
    received_[h] += static_cast<uint32_t>(in_pieces);
  }
  ++exchanges_;
  CurrentDevice on(device_);
  rail_exchange<<<2 * num_hosts_ * a.blocks_per_host, kRailThreads, 0, stream>>>(a);
  UCCL_EP_GPU_CHECK(gpu_last_error());
  return writes;
}

RailFailure DeviceRail::failure() const {
  if (failure_host_ == nullptr) return RailFailure{};
  RailFailure copy{};
  copy.failed = __atomic_load_n(&failure_host_->failed, __ATOMIC_ACQUIRE);  // written last
  if (copy.failed == 0) return copy;
  const volatile RailFailure* f = failure_host_;
  copy.phase = f->phase;
  copy.peer = f->peer;
  copy.exchange = f->exchange;
  copy.expected = f->expected;
  copy.seen = f->seen;
  return copy;
}

void DeviceRail::release() {
  if (released_) return;
  released_ = true;
  CurrentDevice on(device_);
  const gpuError_t synced = gpu_device_synchronize();  // no kernel still reads the scratch or the record
  if (scratch_ != nullptr) (void)gpu_device_free(scratch_);  // the synchronize reports a failure first
  if (failure_host_ != nullptr) (void)gpu_host_free(failure_host_);
  scratch_ = nullptr;
  failure_host_ = failure_device_ = nullptr;
  UCCL_EP_GPU_CHECK(synced);
}

}  // namespace uccl_ep
