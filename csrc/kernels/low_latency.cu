// Low-latency dispatch and combine over mapped peer memory (see low_latency.h).
//
// A block is kGroupsPerBlock independent warp groups; each group takes whole units of work
// in turn (unit u goes to block u mod the grid, the block's first group first) and syncs only
// its own warps:
//   dispatch send: one unit per token. The group casts the row once into shared memory (fp8
//     with its scales; bf16 rows are sent from x as they are), counts for each of the token's
//     experts the entries before it that chose the same expert (its slot: rows of one expert
//     are numbered in (token, top-k slot) order) and the expert's total, then stores the
//     message once into each destination rank's slot for (this rank, token), and per top-k slot
//     an index entry (expert, slot) -> token. The last sender of an expert (a per-expert
//     counter in this rank's signal area) publishes the count with the epoch; experts nobody
//     chose get a zero count from the group that owns them.
//   dispatch recv: warps, not groups: each local expert's rows are dealt to several warps of
//     the grid. A warp waits for every source's flag, lays the sources out in rank order, and
//     copies its rows' messages (found through the index) into the packed outputs.
//   combine send: one unit per local expert: each received row goes back to its source
//     rank's block for this rank, after the rows of this rank's smaller experts, then one flag
//     per source.
//   combine recv: one unit per token (or per slice of its channels when there are more groups
//     than tokens): wait for the flags of its experts, then sum the weighted rows (found at the
//     positions the dispatch recorded) in float32.
//   pre-reduced combine (bf16, every peer mapped; low_latency.h): one group sends this rank's routing
//     records to every rank; then one unit per (source rank, token) sums the token's rows over this
//     rank's experts into its slot at the source, and the receive adds one slot per rank.
// Peers reached through the CPU proxy (LowLatencyRegion::via_proxy) get the same stores in an outbox
// of this rank's buffer; the unit that completes a phase for such a peer pushes its writes (data,
// quiet, flags) into the proxy's FIFOs, and a send launch pushes the release count.
// Sending and receiving are one launch unless the caller asked for a hook; a group only
// starts receiving after all its sends, so a grid no larger than the SM count cannot
// deadlock on itself.
#include "kernels/low_latency.h"
#include "kernels/lanes.h"

#include "channel/fifo_device.cuh"


#include <algorithm>
#include <array>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace uccl_ep {
namespace kernels {

constexpr int kWarpsPerGroup = 8;
// HIP has no named barriers (group_barrier is the block's barrier there), so a block is one group.
#if defined(UCCL_EP_HIP)
constexpr int kGroupsPerBlock = 1;
#else
constexpr int kGroupsPerBlock = 2;
#endif
constexpr int kGroupThreads = kWarpsPerGroup * kWarpSize;
constexpr int kBlockThreads = kGroupsPerBlock * kGroupThreads;
constexpr int kChannels = kLowLatencyChannelsPerScale;
constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;        // keeps all-zero groups finite (as the reference)
constexpr int kLogfmtMaxLevel = 511;       // 9 magnitude bits
constexpr float kLogfmtClipLog2 = 32.0f;   // smallest magnitude kept: max * 2^-32
constexpr int kLogfmtGroupBytes = 2 * kChannels;   // a group's payload slot (a raw bf16 group)
constexpr int kLogfmtLaneBytes = 10;       // 8 channels x 10 bits
constexpr int64_t kMaxSharedBytes = 227 * 1024;  // per block on sm_90

static_assert(kGroupThreads >= kLowLatencyMaxTopk, "a group waits for all of a token's experts at once");

struct GroupShared {
  int32_t counts[kLowLatencyMaxRanks];     // rows per source rank
  int32_t begins[kLowLatencyMaxRanks];
  int32_t experts[kLowLatencyMaxTopk];     // a token's experts (-1: skip)
  int32_t before[kLowLatencyMaxTopk];      // entries before this one with the same expert
  int32_t chosen[kLowLatencyMaxTopk];      // entries with the same expert in all
  int32_t smaller[kLowLatencyMaxTopk];     // entries choosing a smaller expert of the same rank
  int32_t starts[kLowLatencyMaxRanks];     // combine send: this expert's first row in each source's block
  float weights[kLowLatencyMaxTopk];
  int64_t messages[kLowLatencyMaxTopk];    // combine receive: each entry's row in this rank's area
  int32_t found;
};

// Bytes of shared memory a group stages one fp8 message in (header, row, scales).
__host__ __device__ __forceinline__ int64_t fp8_message_bytes(int hidden) {
  return 16 + hidden + 4 * (hidden / kLowLatencyChannelsPerScale);
}
__host__ __device__ __forceinline__ int64_t staging_bytes(int hidden) { return (fp8_message_bytes(hidden) + 15) / 16 * 16; }

__device__ __forceinline__ GroupPosition group_position() {
  return group_position_of(threadIdx.x, blockIdx.x, gridDim.x, kWarpSize, kGroupThreads, kGroupsPerBlock);
}

__device__ __forceinline__ void group_sync(const GroupPosition& g) { group_barrier(1 + g.index, kGroupThreads); }

__device__ __forceinline__ uint8_t* rank_base(const LowLatencyRegion& r, int rank) {
  return reinterpret_cast<uint8_t*>(r.peer_bases[rank]);
}

__device__ __forceinline__ bool via_proxy(const LowLatencyRegion& r, int rank) {
  return r.via_proxy != nullptr && rank != r.rank && r.via_proxy[rank] != 0;
}

// Offset in this rank's buffer of its outbox for `peer`, in the half whose outboxes start at
// `half_outboxes` (this half's by default).
__device__ __forceinline__ int64_t outbox_offset(const LowLatencyRegion& r, int peer, int64_t half_outboxes) {
  return half_outboxes + peer * r.outbox_peer_bytes;
}
__device__ __forceinline__ int64_t outbox_offset(const LowLatencyRegion& r, int peer) {
  return outbox_offset(r, peer, r.outbox_offset);
}

__device__ __forceinline__ uint8_t* outbox(const LowLatencyRegion& r, int peer) {
  return rank_base(r, r.rank) + outbox_offset(r, peer);
}

// The count flag of (source `src`, local expert `local`) in `rank`'s signal area (dispatch and
// combine alike); staged in the outbox when `rank` is reached through the proxy.
__device__ __forceinline__ uint64_t* count_flag_at(const LowLatencyRegion& r, int rank, int src, int local,
                                                   int local_experts) {
  if (via_proxy(r, rank)) return reinterpret_cast<uint64_t*>(outbox(r, rank) + r.outbox_flags_pos) + local;
  return reinterpret_cast<uint64_t*>(rank_base(r, rank) + r.signal_offset) +
         src * low_latency_flags_per_source(local_experts) + local;
}

// This rank's own counters: rows sent per expert, then per peer the units (and rows) staged for it.
__device__ __forceinline__ int32_t* sent_counters(const LowLatencyRegion& r) {
  return reinterpret_cast<int32_t*>(rank_base(r, r.rank) + r.counters_offset);
}
__device__ __forceinline__ int32_t* staged_units(const LowLatencyRegion& r, int num_experts, int peer) {
  return sent_counters(r) + num_experts + peer;
}
__device__ __forceinline__ int32_t* staged_rows(const LowLatencyRegion& r, int num_experts, int peer) {
  return sent_counters(r) + num_experts + r.num_ranks + peer;
}

// A rank that finds itself masked takes part in nothing: it neither sends nor waits, so it
// receives no rows and combines to zeros (the peers skip it too).
__device__ __forceinline__ bool is_masked(const LowLatencyRegion& r, int rank) {
  return r.masked != nullptr &&
         (load_volatile_u8(r.masked + rank) != 0 || load_volatile_u8(r.masked + r.rank) != 0);
}

__device__ __forceinline__ bool aborted(const LowLatencyRegion& r) {
  return *reinterpret_cast<const volatile uint64_t*>(r.control + 2) != 0;
}

__device__ void report(const LowLatencyRegion& r, int32_t code, int32_t phase, int32_t peer, int32_t detail) {
  *reinterpret_cast<volatile uint64_t*>(r.control + 2) = 1;  // the other waits stop early
  if (compare_and_swap_system(&r.status->code, 0, code) == 0) {
    r.status->phase = phase;
    r.status->peer = peer;
    r.status->detail = detail;
    __threadfence_system();
  }
}

// Waits until `ready(word)` holds for the word at `addr`, which `peer` writes. Returns false if
// `peer` is masked or went silent (then it is masked with enable_shrink, else reported).
template <typename Ready>
__device__ bool wait_for(const LowLatencyRegion& r, const uint64_t* addr, Ready ready, int peer, int32_t phase,
                         int32_t detail, int64_t* wait_cost_stats, uint64_t& value) {
  if (is_masked(r, peer)) return false;
  uint64_t start = wait_cost_stats != nullptr ? device_time_ns() : 0;  // else the clock only once the flag is late
  value = poll_flag(addr, r.aggressive_atomics);
  while (!ready(value)) {
    if (start == 0) start = device_time_ns();
    if (is_masked(r, peer) || aborted(r)) return false;
    if (device_time_ns() - start > static_cast<uint64_t>(r.timeout_ns)) {
      if (r.masked != nullptr) {
        *reinterpret_cast<volatile uint8_t*>(r.masked + peer) = 1;
      } else {
        report(r, kLowLatencyTimeout, phase, peer, detail);
      }
      return false;
    }
    value = poll_flag(addr, r.aggressive_atomics);
  }
  acquire_polled_flag(r.aggressive_atomics);
  if (wait_cost_stats != nullptr) {
    atomicAdd(reinterpret_cast<unsigned long long*>(wait_cost_stats + peer),
              static_cast<unsigned long long>(device_time_ns() - start));
  }
  return true;
}

// The row count of a flag once it carries `epoch`, or -1 (masked or silent peer).
__device__ int wait_flag(const LowLatencyRegion& r, const uint64_t* flag, uint64_t epoch, int peer, int32_t phase,
                         int32_t detail, int64_t* wait_cost_stats) {
  uint64_t value;
  const bool arrived = wait_for(r, flag, [epoch](uint64_t word) { return (word >> 32) == epoch; }, peer, phase,
                                detail, wait_cost_stats, value);
  return arrived ? static_cast<int>(value & 0xFFFFFFFFu) : -1;
}

// Where a rank's buffer holds the count of uses of a half (its release counts at `release_offset`)
// that `reader` has finished reading.
__device__ __forceinline__ int64_t release_slot(int64_t release_offset, int reader) {
  return release_offset + reader * kLowLatencyReleaseStride;
}

// ------------------------------------------------------------------------------ proxy path
// A write of `bytes` from this rank's buffer (offset `local`) to `peer`'s (offset `remote`):
// offsets and lengths are multiples of 16 by the layout.
__device__ __forceinline__ Command proxy_write(int peer, int64_t local, int64_t remote, int64_t bytes) {
  return encode_command(CommandKind::kWrite, static_cast<uint32_t>(peer), 0, static_cast<uint64_t>(bytes) / 16, 0,
                        static_cast<uint64_t>(local) / 16, static_cast<uint64_t>(remote) / 16);
}

__device__ __forceinline__ Command proxy_quiet() { return encode_command(CommandKind::kQuiet, 0, 0, 0, 0, 0, 0); }

// One thread pushes `count` commands, in order, into `peer`'s FIFO. A FIFO that stays full for the
// timeout is reported (the proxy is gone or stuck) and the rest is dropped.
__device__ void push_commands(const LowLatencyRegion& r, int peer, const Command* commands, int count,
                              int32_t phase) {
  const FifoView fifo = r.fifos[peer % r.num_fifos];
  DeviceFifoOps ops{device_time_ns() + static_cast<uint64_t>(r.timeout_ns)};
  for (int i = 0; i < count; ++i) {
    if (fifo_push(fifo, commands[i], ops) != PushResult::kPushed) {
      report(r, kLowLatencyProxyStalled, phase, peer, i);
      return;
    }
  }
}

// Called by one thread of each unit of a phase, after the unit's stores for proxy peer `peer`
// (and a group barrier): counts the unit in, and returns true to the unit that completes the phase
// for that peer, with the rows staged by all units in `total_rows`. The counters are then reset
// for the next use, and the staged bytes made visible to the copy engines and the CPU.
__device__ bool last_staged_unit(const LowLatencyRegion& r, int num_experts, int peer, int units, int rows,
                                 int& total_rows) {
  int32_t* unit_count = staged_units(r, num_experts, peer);
  int32_t* row_count = staged_rows(r, num_experts, peer);
  if (rows != 0) atomicAdd(row_count, rows);
  __threadfence();
  if (atomicAdd(unit_count, 1) + 1 != units) return false;
  __threadfence();
  total_rows = atomicAdd(row_count, 0);
  *unit_count = 0;
  *row_count = 0;
  __threadfence_system();
  return true;
}

// A use of a half counts as kUseShares: each block of the receiving launch adds its share when its
// reads are done, and the count of uses is the count of shares divided down. One counter serves
// both (nothing to reset between launches), for any grid up to kUseShares blocks; a block reads the
// count before its own share is in, so the quotient is the same for every block of one launch.
constexpr uint64_t kUseShares = 1ull << 16;

__device__ __forceinline__ uint64_t completed_uses(const LowLatencyRegion& r) { return r.control[0] / kUseShares; }

// A send launch for use `epoch` first tells every peer how many uses of each half this rank has
// finished reading: stream order puts every earlier receive of this rank before it, so the receive
// itself ends without fences or remote stores. A peer needs a count only before its next write into
// that half, in a later call whose send every rank launches too; the other half's count goes out a
// call before that half's own next send. Masked peers get them as well, so a peer unmasked later
// finds them current (an IPC mapping keeps a dead peer's memory valid); a proxy peer's counts are
// staged and written by the proxy.
__device__ void publish_release(const LowLatencyRegion& r, uint64_t epoch) {
  if (blockIdx.x != 0) return;
  const int64_t release_offsets[2] = {r.release_offset, r.other_half_release_offset};
  const int64_t outbox_offsets[2] = {r.outbox_offset, r.other_half_outbox_offset};
  // No launch on the other half runs meanwhile (stream order), so its count is whole uses.
  const uint64_t shares[2] = {(epoch - 1) * kUseShares, *r.other_half_control / kUseShares * kUseShares};
  for (int peer = threadIdx.x; peer < r.num_ranks; peer += blockDim.x) {
    const bool proxy = via_proxy(r, peer);
    Command writes[2];
    for (int half = 0; half < 2; ++half) {
      const int64_t slot = release_slot(release_offsets[half], r.rank);
      if (!proxy) {
        store_relaxed_system(reinterpret_cast<uint64_t*>(rank_base(r, peer) + slot), shares[half]);
        continue;
      }
      const int64_t staged = outbox_offset(r, peer, outbox_offsets[half]) + r.outbox_release_pos;
      *reinterpret_cast<uint64_t*>(rank_base(r, r.rank) + staged) = shares[half];
      writes[half] = proxy_write(peer, staged, slot, kLowLatencyReleaseStride);
    }
    if (proxy) {
      __threadfence_system();
      push_commands(r, peer, writes, 2, kLowLatencyRelease);
    }
  }
}

// Before a group stores into its peers' halves for use `epoch`, each peer must have finished reading
// the previous use of this half (a graph replaying one call uses the same half back to back). This
// rank's own count goes out first, so two ranks never wait on each other.
__device__ void exchange_releases(const LowLatencyRegion& r, const GroupPosition& g, uint64_t epoch, int32_t phase) {
  publish_release(r, epoch);
  for (int peer = g.thread; peer < r.num_ranks; peer += kGroupThreads) {
    uint64_t value;
    wait_for(r, reinterpret_cast<const uint64_t*>(rank_base(r, r.rank) + release_slot(r.release_offset, peer)),
             [epoch](uint64_t shares) { return shares / kUseShares + 1 >= epoch; }, peer, phase, -1, nullptr, value);
  }
  group_sync(g);
}

// A block of a receiving launch ends its use of the half by adding its share to this rank's count,
// which only later launches read (the next send publishes it).
__device__ __forceinline__ void finish_use(const LowLatencyRegion& r) {
  if (threadIdx.x != 0) return;
  const uint64_t share = kUseShares / gridDim.x + (blockIdx.x < kUseShares % gridDim.x ? 1 : 0);
  fetch_add_device_relaxed(r.control, share);
}

// A warp copies `bytes` (a multiple of 16): kCopyBatch loads in flight per lane before their stores.
constexpr int kCopyBatch = 8;
template <bool kFromL2>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t bytes, int lane) {
  auto* out = reinterpret_cast<int4*>(dst);
  const auto* in = reinterpret_cast<const int4*>(src);
  const int64_t n = bytes / 16;
  for (int64_t base = lane; base < n; base += kWarpSize * kCopyBatch) {
    int4 values[kCopyBatch];
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u) {
      const int64_t i = base + u * kWarpSize;
      if (i < n) values[u] = kFromL2 ? load_l2_16(in + i) : in[i];
    }
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u) {
      const int64_t i = base + u * kWarpSize;
      if (i < n) out[i] = values[u];
    }
  }
}

// Eight floats rounded to bf16, packed as one 16-byte store.
__device__ __forceinline__ int4 float_to_bf16x8(const float* values) {
  int4 packed;
  auto* pairs = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = float2_to_bf16x2(values[2 * i], values[2 * i + 1]);
  return packed;
}

__device__ __forceinline__ void bf16x8_to_float(const int4& packed, float* out) {
  const auto* pairs = reinterpret_cast<const uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = bf16x2_to_float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// ------------------------------------------------------------------------------ dispatch
// Scale for one 128-channel group, as the reference quantizer computes it: x * scale is cast,
// and scale_inv travels (x ~= fp8 * scale_inv).
__device__ __forceinline__ void fp8_scales(float amax, bool round_scale, float& scale, float& scale_inv) {
  amax = fmaxf(amax, kAmaxFloor);
  if (round_scale) {
    int exponent;
    const float mantissa = frexpf(__fmul_rn(amax, static_cast<float>(1.0 / 448.0)), &exponent);
    if (mantissa == 0.5f) exponent -= 1;  // already a power of two: ceil(log2) is exact
    scale_inv = ldexpf(1.0f, exponent);
    scale = ldexpf(1.0f, -exponent);
  } else {
    scale_inv = __fmul_rn(amax, static_cast<float>(1.0 / 448.0));
    scale = __fmul_rn(__frcp_rn(amax), kFp8Max);  // torch computes 448 / amax as reciprocal(amax) * 448
  }
}

// Dispatch receive area of one rank: a message slot per (source rank, token), then an index per
// (source rank, local expert, row) naming the token of each row. What one source sends a rank (its
// messages, its index entries, its count flags) is contiguous there: one write each through a proxy.
__device__ __forceinline__ uint8_t* dispatch_message_at(const LowLatencyDispatchArgs& a, int rank, int src, int token) {
  const int64_t msg_bytes = low_latency_dispatch_msg_bytes(a.hidden);
  if (via_proxy(a.region, rank)) return outbox(a.region, rank) + token * msg_bytes;
  return rank_base(a.region, rank) + a.region.recv_offset +
         (static_cast<int64_t>(src) * a.num_max_tokens + token) * msg_bytes;
}

__device__ __forceinline__ int32_t* dispatch_index_at(const LowLatencyDispatchArgs& a, int rank, int local, int src,
                                                      int row) {
  const int64_t entry = static_cast<int64_t>(local) * a.num_max_tokens + row;
  if (via_proxy(a.region, rank)) return reinterpret_cast<int32_t*>(outbox(a.region, rank) + a.region.outbox_index_pos) + entry;
  const int64_t messages = low_latency_dispatch_messages_bytes(a.region.num_ranks, a.num_max_tokens, a.hidden);
  auto* index = reinterpret_cast<int32_t*>(rank_base(a.region, rank) + a.region.recv_offset + messages);
  const int local_experts = a.num_experts / a.region.num_ranks;
  return index + src * low_latency_index_per_source(local_experts, a.num_max_tokens) + entry;
}

__device__ __forceinline__ uint64_t* dispatch_flag_at(const LowLatencyDispatchArgs& a, int rank, int src, int local) {
  return count_flag_at(a.region, rank, src, local, a.num_experts / a.region.num_ranks);
}

// Once every unit of the dispatch send staged its part for proxy peer `peer` (each token, and each
// of the peer's experts): its messages, its index entries, then (after they landed) its flags.
__device__ void dispatch_staged(const LowLatencyDispatchArgs& a, int peer) {
  const LowLatencyRegion& r = a.region;
  const int local_experts = a.num_experts / r.num_ranks;
  int rows = 0;
  if (!last_staged_unit(r, a.num_experts, peer, a.num_tokens + local_experts, 0, rows)) return;
  const int64_t msg_bytes = low_latency_dispatch_msg_bytes(a.hidden);
  const int64_t box = outbox_offset(r, peer);
  const int64_t index_bytes = 4 * low_latency_index_per_source(local_experts, a.num_max_tokens);
  const int64_t flags_bytes = 8 * low_latency_flags_per_source(local_experts);
  const int64_t index_area = r.recv_offset + low_latency_dispatch_messages_bytes(r.num_ranks, a.num_max_tokens, a.hidden);
  const Command commands[4] = {
      proxy_write(peer, box, r.recv_offset + r.rank * a.num_max_tokens * msg_bytes, a.num_tokens * msg_bytes),
      proxy_write(peer, box + r.outbox_index_pos, index_area + r.rank * index_bytes, index_bytes),
      proxy_quiet(),  // the flags land after what they announce
      proxy_write(peer, box + r.outbox_flags_pos, r.signal_offset + r.rank * flags_bytes, flags_bytes)};
  push_commands(r, peer, commands, 4, kLowLatencyDispatchSend);
}

// One thread of a dispatch send unit, after the unit's stores: counts it in for every proxy peer.
__device__ void dispatch_unit_staged(const LowLatencyDispatchArgs& a, const GroupPosition& g) {
  if (a.region.via_proxy == nullptr || g.thread != 0) return;
  for (int peer = 0; peer < a.region.num_ranks; ++peer) {
    if (via_proxy(a.region, peer) && !is_masked(a.region, peer)) dispatch_staged(a, peer);
  }
}

// The group casts token `token`'s row into `message` (shared): header, fp8 row, scales.
// 16 channels per thread, 8 threads per scale group.
__device__ void stage_fp8_message(const LowLatencyDispatchArgs& a, int token, uint8_t* message,
                                  const GroupPosition& g) {
  if (g.thread == 0) *reinterpret_cast<int4*>(message) = make_int4(token, 0, 0, 0);
  const auto* row = reinterpret_cast<const uint8_t*>(a.x) + static_cast<int64_t>(token) * a.hidden * 2;
  auto* scales = reinterpret_cast<float*>(message + 16 + a.hidden);
  for (int base = 0; base < a.hidden; base += kGroupThreads * 16) {
    const int channel = base + g.thread * 16;
    const bool active = channel < a.hidden;
    float values[16];
    float amax = 0.0f;
    if (active) {
      const auto* src = reinterpret_cast<const int4*>(row + 2LL * channel);
      const int4 first = __ldg(src), second = __ldg(src + 1);
      bf16x8_to_float(first, values);
      bf16x8_to_float(second, values + 8);
#pragma unroll
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(values[i]));
    }
#pragma unroll
    for (int mask = 1; mask < 8; mask <<= 1) amax = fmaxf(amax, warp_shuffle_xor(amax, mask));
    if (!active) continue;
    float scale, scale_inv;
    fp8_scales(amax, a.round_scale, scale, scale_inv);
    int4 packed;
    auto* pairs = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float lo = fminf(fmaxf(__fmul_rn(values[2 * i], scale), -kFp8Max), kFp8Max);
      const float hi = fminf(fmaxf(__fmul_rn(values[2 * i + 1], scale), -kFp8Max), kFp8Max);
      pairs[i] = float2_to_fp8x2_e4m3(lo, hi);
    }
    *reinterpret_cast<int4*>(message + 16 + channel) = packed;
    if (g.thread % 8 == 0) scales[channel / kChannels] = scale_inv;
  }
}

// Expert of entry `entry`, or -1 for none, out of range, or on a masked rank.
__device__ __forceinline__ int routed_expert(const LowLatencyDispatchArgs& a, int64_t entry, int local_experts) {
  const int64_t expert = a.topk_idx[entry];
  if (expert < 0 || expert >= a.num_experts) return -1;
  return is_masked(a.region, static_cast<int>(expert / local_experts)) ? -1 : static_cast<int>(expert);
}

__device__ void dispatch_send_token(const LowLatencyDispatchArgs& a, GroupShared& sh, uint8_t* message,
                                    const GroupPosition& g, int token, uint64_t epoch, int32_t* sent_counters) {
  const LowLatencyRegion& r = a.region;
  const int local_experts = a.num_experts / r.num_ranks;
  const int64_t first_entry = static_cast<int64_t>(token) * a.num_topk;
  if (g.thread < a.num_topk) sh.experts[g.thread] = routed_expert(a, first_entry + g.thread, local_experts);
  group_sync(g);
  if (a.use_fp8) stage_fp8_message(a, token, message, g);
  // A warp per top-k slot counts over all entries: those of the same expert (earlier ones give the
  // slot: rows of one expert are numbered in (token, slot) order), and, for the combine position,
  // those choosing a smaller expert of the same rank.
  const int64_t entries = static_cast<int64_t>(a.num_tokens) * a.num_topk;
  for (int k = g.warp; k < a.num_topk; k += kWarpsPerGroup) {
    const int chosen = sh.experts[k];
    if (chosen < 0) continue;
    const int rank_first = chosen - chosen % local_experts;
    const int64_t mine = first_entry + k;
    int same = 0, earlier = 0, smaller = 0;
    for (int64_t entry = g.lane; entry < entries; entry += kWarpSize) {
      const int64_t expert = a.topk_idx[entry];
      same += expert == chosen;
      earlier += expert == chosen && entry < mine;
      smaller += expert >= rank_first && expert < chosen;
    }
    same = warp_total(DeviceWarp{}, same);
    earlier = warp_total(DeviceWarp{}, earlier);
    smaller = warp_total(DeviceWarp{}, smaller);
    if (g.lane == 0) {
      sh.chosen[k] = same;
      sh.before[k] = earlier;
      sh.smaller[k] = smaller;
    }
  }
  group_sync(g);
  // One message per destination rank (written by the warp of the first top-k slot naming it): the
  // rank's experts all read the row from its token slot, so it crosses NVLink once, not per expert.
  for (int k = g.warp; k < a.num_topk; k += kWarpsPerGroup) {
    const int expert = sh.experts[k];
    if (expert < 0) continue;
    const int dst = expert / local_experts;
    bool first = true;
    for (int earlier = 0; earlier < k; ++earlier) {
      first &= sh.experts[earlier] < 0 || sh.experts[earlier] / local_experts != dst;
    }
    if (!first) continue;
    uint8_t* out = dispatch_message_at(a, dst, r.rank, token);
    if (a.use_fp8) {
      warp_copy<false>(out, message, staging_bytes(a.hidden), g.lane);
    } else {
      if (g.lane == 0) *reinterpret_cast<int4*>(out) = make_int4(token, 0, 0, 0);
      warp_copy<false>(out + 16, reinterpret_cast<const uint8_t*>(a.x) + static_cast<int64_t>(token) * a.hidden * 2,
                       2LL * a.hidden, g.lane);
    }
  }
  group_sync(g);  // every message is stored before an index entry announces it
  // One thread per top-k slot: the index entry (slot -> token) in the expert's rank, then the count.
  if (g.thread < a.num_topk) {
    const int k = g.thread;
    const int expert = sh.experts[k];
    int32_t* slots = a.positions + entries;
    if (expert < 0) a.positions[first_entry + k] = slots[first_entry + k] = -1;
    if (expert >= 0) {
      const int dst = expert / local_experts, local = expert % local_experts;
      const int slot = sh.before[k];
      const int position = sh.smaller[k] + slot;
      a.positions[first_entry + k] = position;
      slots[first_entry + k] = slot;
      if (slot < a.num_max_tokens &&
          position < low_latency_combine_rows_per_source(a.num_max_tokens, a.num_topk, local_experts)) {
        *dispatch_index_at(a, dst, local, r.rank, slot) = token;
      } else {
        report(r, kLowLatencyTooManyRows, kLowLatencyDispatchSend, dst, expert);
      }
      // Release this thread's view (the group's messages, its entry); the expert's last sender
      // acquires every sender's and publishes the count.
      __threadfence();
      const int done = atomicAdd(sent_counters + expert, 1) + 1;
      if (done == sh.chosen[k]) {
        __threadfence();
        sent_counters[expert] = 0;
        publish_flag(dispatch_flag_at(a, dst, r.rank, local),
                     (epoch << 32) | static_cast<uint32_t>(min(sh.chosen[k], a.num_max_tokens)), r.aggressive_atomics);
      }
    }
  }
  group_sync(g);  // shared memory is reused by the group's next token
}

// Experts no token of this rank chose still get their (zero) count.
__device__ void dispatch_send_empty_expert(const LowLatencyDispatchArgs& a, GroupShared& sh, const GroupPosition& g,
                                           int expert, uint64_t epoch) {
  const LowLatencyRegion& r = a.region;
  const int local_experts = a.num_experts / r.num_ranks;
  const int dst = expert / local_experts, local = expert % local_experts;
  if (is_masked(r, dst)) return;
  if (g.thread == 0) sh.found = 0;
  group_sync(g);
  const int64_t entries = static_cast<int64_t>(a.num_tokens) * a.num_topk;
  bool found = false;
  for (int64_t entry = g.thread; entry < entries && !found; entry += kGroupThreads) found = a.topk_idx[entry] == expert;
  if (found) sh.found = 1;
  group_sync(g);
  if (g.thread == 0 && sh.found == 0) {
    publish_flag(dispatch_flag_at(a, dst, r.rank, local), epoch << 32, r.aggressive_atomics);
  }
  group_sync(g);
  if (g.thread == 0 && via_proxy(r, dst)) dispatch_staged(a, dst);
}

__device__ __forceinline__ int source_of_row(const GroupShared& sh, int row, int num_ranks) {
  int src = 0;
  while (src + 1 < num_ranks && row >= sh.begins[src + 1]) ++src;
  return src;
}

// Copies received row `row` of local expert `local` (the `index`-th row `src` sent it) into the
// packed outputs: one warp.
__device__ void dispatch_recv_row(const LowLatencyDispatchArgs& a, int local, int src, int index, int row, int lane) {
  const LowLatencyRegion& r = a.region;
  const int64_t slots_per_expert = static_cast<int64_t>(r.num_ranks) * a.num_max_tokens;
  const int64_t row_bytes = a.use_fp8 ? a.hidden : 2LL * a.hidden;
  const int num_scales = a.hidden / kChannels;
  const int token = load_l2(dispatch_index_at(a, r.rank, local, src, index));
  const uint8_t* msg = dispatch_message_at(a, r.rank, src, token);
  const int64_t out_row = local * slots_per_expert + row;
  if (lane == 0) a.src_info[out_row] = token;
  warp_copy<true>(reinterpret_cast<uint8_t*>(a.recv_x) + out_row * row_bytes, msg + 16, row_bytes, lane);
  if (!a.use_fp8) return;
  // Scales four at a time (the message slot has room past the last one): either packed as four
  // exponent bytes per int32, lowest channel group first, or stored one float per column.
  const auto* scales = reinterpret_cast<const float*>(msg + 16 + a.hidden);
  const int num_words = (num_scales + 3) / 4;
  for (int w = lane; w < num_words; w += kWarpSize) {
    const int4 four = load_l2_16(scales + 4 * w);
    if (a.use_ue8m0) {
      const uint32_t word = ((static_cast<uint32_t>(four.x) >> 23) & 0xFF) |
                            (((static_cast<uint32_t>(four.y) >> 23) & 0xFF) << 8) |
                            (((static_cast<uint32_t>(four.z) >> 23) & 0xFF) << 16) |
                            (((static_cast<uint32_t>(four.w) >> 23) & 0xFF) << 24);
      reinterpret_cast<int32_t*>(a.recv_scales)[(local * num_words + w) * slots_per_expert + row] = static_cast<int32_t>(word);
      continue;
    }
    const int values[4] = {four.x, four.y, four.z, four.w};
    auto* out = reinterpret_cast<int32_t*>(a.recv_scales) + (local * num_scales + 4 * w) * slots_per_expert + row;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (4 * w + i < num_scales) out[i * slots_per_expert] = values[i];
    }
  }
}

// One warp's share of local expert `local`: it waits for every source's count (a lane per source),
// lays the sources out in rank order, and copies the rows whose position is `slice` modulo
// `slices`. The first slice also writes the expert's layout, count and stats.
__device__ void dispatch_recv_slice(const LowLatencyDispatchArgs& a, int local, int slice, int slices, int lane,
                                    uint64_t epoch) {
  const LowLatencyRegion& r = a.region;
  int begin = 0;  // rows of the sources before this chunk of 32
  for (int chunk = 0; chunk < r.num_ranks; chunk += kWarpSize) {
    const int src = chunk + lane;
    int count = 0;
    if (src < r.num_ranks) {
      count = max(wait_flag(r, dispatch_flag_at(a, r.rank, src, local), epoch, src, kLowLatencyDispatchRecv, local,
                            slice == 0 ? a.wait_cost_stats : nullptr), 0);
    }
    warp_sync();  // orders each lane's acquire before the other lanes' reads of that source's rows
    const int inclusive = warp_inclusive_sum(DeviceWarp{}, count);
    const int first_row = begin + inclusive - count;
    if (slice == 0 && src < r.num_ranks) {
      a.layout_range[static_cast<int64_t>(local) * r.num_ranks + src] = (static_cast<int64_t>(first_row) << 32) | count;
    }
#pragma unroll 1
    for (int s = 0; s < kWarpSize && chunk + s < r.num_ranks; ++s) {
      const int rows = warp_shuffle(count, s);
      const int first = warp_shuffle(first_row, s);
      for (int row = first + (slice - first % slices + slices) % slices; row < first + rows; row += slices) {
        dispatch_recv_row(a, local, chunk + s, row - first, row, lane);
      }
    }
    begin += warp_shuffle(inclusive, kWarpSize - 1);
  }
  if (slice == 0 && lane == 0) {
    a.recv_count[local] = begin;
    if (a.cumulative_recv_stats != nullptr) a.cumulative_recv_stats[local] += begin;
  }
}

// The receive spreads every local expert's rows over warps of the whole grid (a few busy experts
// would otherwise leave most SMs idle); warp w of a block is the grid's w * gridDim.x + blockIdx.x.
__device__ void dispatch_recv(const LowLatencyDispatchArgs& a, const GroupPosition& g, uint64_t epoch) {
  const int local_experts = a.num_experts / a.region.num_ranks;
  const int warps = gridDim.x * kGroupsPerBlock * kWarpsPerGroup;
  const int warp = (g.index * kWarpsPerGroup + g.warp) * gridDim.x + blockIdx.x;
  const int slices = max(1, warps / local_experts);
  for (int unit = warp; unit < local_experts * slices; unit += warps) {
    dispatch_recv_slice(a, unit % local_experts, unit / local_experts, slices, g.lane, epoch);
  }
}

template <int kPhases>
__device__ __forceinline__ void low_latency_dispatch_body(const LowLatencyDispatchArgs& a, GroupShared* shared) {
  extern __shared__ int4 staging[];  // kGroupsPerBlock fp8 messages (fp8 only)
  const GroupPosition g = group_position();
  GroupShared& sh = shared[g.index];
  uint8_t* message = reinterpret_cast<uint8_t*>(staging) + (a.use_fp8 ? g.index * staging_bytes(a.hidden) : 0);
  const uint64_t epoch = completed_uses(a.region) + 1;
  if (kPhases & kLowLatencySend) {
    exchange_releases(a.region, g, epoch, kLowLatencyDispatchSend);
    for (int token = g.first; token < a.num_tokens; token += g.stride) {
      dispatch_send_token(a, sh, message, g, token, epoch, sent_counters(a.region));
      dispatch_unit_staged(a, g);
    }
    for (int expert = g.first; expert < a.num_experts; expert += g.stride) {
      dispatch_send_empty_expert(a, sh, g, expert, epoch);
    }
  }
  if (kPhases & kLowLatencyRecv) {
    dispatch_recv(a, g, epoch);
    finish_use(a.region);
  }
}

// One kernel per operation, whatever its phases: profilers and DeepEP's bench_kineto find the
// send and the receive of a hooked call under one name ("::dispatch", "::combine").
namespace low_latency {
__global__ void __launch_bounds__(kBlockThreads, 1) dispatch(const LowLatencyDispatchArgs a) {
  __shared__ GroupShared shared[kGroupsPerBlock];
  if (a.phases == kLowLatencySend) {
    low_latency_dispatch_body<kLowLatencySend>(a, shared);
  } else if (a.phases == kLowLatencyRecv) {
    low_latency_dispatch_body<kLowLatencyRecv>(a, shared);
  } else {
    low_latency_dispatch_body<kLowLatencySend | kLowLatencyRecv>(a, shared);
  }
}
}  // namespace low_latency

// ------------------------------------------------------------------------------ combine
// LogFMT: per 128 channels, 16 lanes of 8 channels. A group that is cast stores 10-bit codes
// (sign, 9-bit level on a log scale between log_min and log_max) and a (log_min, step) header;
// others travel as bf16 with step 0. The float operations are those of the reference's
// emulation, each rounded separately.
__device__ void send_logfmt_row(const uint8_t* row, uint8_t* msg, int hidden, int lane) {
  const int groups = hidden / kChannels;
  auto* headers = reinterpret_cast<float2*>(msg + 2LL * hidden);
  for (int base = 0; base < groups; base += 2) {
    const int group = base + lane / 16;
    const int quarter = lane % 16;  // which 8 channels of the group
    const bool active = group < groups;
    float values[8];
    int4 raw = make_int4(0, 0, 0, 0);
    if (active) raw = __ldg(reinterpret_cast<const int4*>(row + 2LL * (group * kChannels + quarter * 8)));
    bf16x8_to_float(raw, values);
    float mag_max = 0.0f, mag_min = INFINITY;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      mag_max = fmaxf(mag_max, fabsf(values[i]));
      mag_min = fminf(mag_min, fabsf(values[i]));
    }
#pragma unroll
    for (int mask = 1; mask < 16; mask <<= 1) {
      mag_max = fmaxf(mag_max, warp_shuffle_xor(mag_max, mask));
      mag_min = fminf(mag_min, warp_shuffle_xor(mag_min, mask));
    }
    if (!active) continue;
    uint8_t* payload = msg + static_cast<int64_t>(group) * kLogfmtGroupBytes;
    const float log_max = log2f(mag_max);
    const float log_min = fmaxf(log2f(mag_min), __fsub_rn(log_max, kLogfmtClipLog2));
    if (!(log_max < 0.0f && log_min < log_max)) {
      *reinterpret_cast<int4*>(payload + quarter * 16) = raw;
      if (quarter == 0) headers[group] = make_float2(0.0f, 0.0f);
      continue;
    }
    const float step = __fdiv_rn(__fsub_rn(log_max, log_min), static_cast<float>(kLogfmtMaxLevel - 1));
    const float rounding =
        __fsub_rn(2.0f, __fdiv_rn(log2f(__fmul_rn(__fadd_rn(1.0f, exp2f(step)), 0.5f)), step));
    const float offset = __fsub_rn(rounding, __fdiv_rn(log_min, step));
    uint64_t bits_lo = 0;  // codes 0..5 (60 bits), then 6..7 in bits_hi
    uint32_t bits_hi = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float level = floorf(fmaxf(__fadd_rn(__fdiv_rn(log2f(fabsf(values[i])), step), offset), 0.0f));
      level = fminf(level, static_cast<float>(kLogfmtMaxLevel));
      const uint32_t code = (signbit(values[i]) ? 1u << 9 : 0u) | static_cast<uint32_t>(level);
      if (i < 6) {
        bits_lo |= static_cast<uint64_t>(code) << (10 * i);
      } else {
        bits_hi |= code << (10 * (i - 6));
      }
    }
    // 80 bits as five 16-bit words (the lane's 10 bytes are 2-byte aligned).
    auto* words = reinterpret_cast<uint16_t*>(payload + quarter * kLogfmtLaneBytes);
    const uint64_t low64 = bits_lo | (static_cast<uint64_t>(bits_hi) << 60);
    words[0] = static_cast<uint16_t>(low64);
    words[1] = static_cast<uint16_t>(low64 >> 16);
    words[2] = static_cast<uint16_t>(low64 >> 32);
    words[3] = static_cast<uint16_t>(low64 >> 48);
    words[4] = static_cast<uint16_t>(bits_hi >> 4);
    if (quarter == 0) headers[group] = make_float2(log_min, step);
  }
}

// Decodes channels [8 * chunk, 8 * chunk + 8) of a LogFMT message.
__device__ __forceinline__ void read_logfmt_chunk(const uint8_t* msg, int hidden, int chunk, float* out) {
  const int group = chunk / 16;
  const int quarter = chunk % 16;
  const uint8_t* payload = msg + static_cast<int64_t>(group) * kLogfmtGroupBytes;
  const float2 header = load_l2(reinterpret_cast<const float2*>(msg + 2LL * hidden) + group);
  if (header.y == 0.0f) {
    bf16x8_to_float(load_l2_16(payload + quarter * 16), out);
    return;
  }
  const auto* words = reinterpret_cast<const uint16_t*>(payload + quarter * kLogfmtLaneBytes);
  uint64_t low64 = 0;
#pragma unroll
  for (int w = 0; w < 4; ++w) low64 |= static_cast<uint64_t>(load_l2(words + w)) << (16 * w);
  const uint32_t top = load_l2(words + 4);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t code;
    if (i < 6) {
      code = static_cast<uint32_t>(low64 >> (10 * i)) & 0x3FF;
    } else if (i == 6) {
      code = static_cast<uint32_t>((low64 >> 60) | (static_cast<uint64_t>(top) << 4)) & 0x3FF;
    } else {
      code = (top >> 6) & 0x3FF;
    }
    const uint32_t level = code & 0x1FF;
    const float magnitude =
        level == 0 ? 0.0f : exp2f(__fadd_rn(__fmul_rn(static_cast<float>(level) - 1.0f, header.y), header.x));
    out[i] = (code >> 9) ? -magnitude : magnitude;
  }
}

// Row `position` of source `src`'s block in `rank`'s combine receive area.
__device__ __forceinline__ uint8_t* combine_message_at(const LowLatencyCombineArgs& a, int rank, int src,
                                                       int64_t position) {
  const int64_t msg_bytes = low_latency_combine_msg_bytes(a.hidden);
  if (via_proxy(a.region, rank)) return outbox(a.region, rank) + position * msg_bytes;
  const int64_t rows = low_latency_combine_rows_per_source(a.num_max_tokens, a.num_topk,
                                                           a.num_experts / a.region.num_ranks);
  return rank_base(a.region, rank) + a.region.recv_offset + (src * rows + position) * msg_bytes;
}

// Once every local expert staged its rows and flag for proxy peer `peer`: the rows, then (after
// they landed) the flags.
__device__ void combine_staged(const LowLatencyCombineArgs& a, int peer, int rows) {
  const LowLatencyRegion& r = a.region;
  const int local_experts = a.num_experts / r.num_ranks;
  int total_rows = 0;
  if (!last_staged_unit(r, a.num_experts, peer, local_experts, rows, total_rows)) return;
  const int64_t msg_bytes = low_latency_combine_msg_bytes(a.hidden);
  const int64_t block_rows = low_latency_combine_rows_per_source(a.num_max_tokens, a.num_topk, local_experts);
  const int64_t flags_bytes = 8 * low_latency_flags_per_source(local_experts);
  const int64_t box = outbox_offset(r, peer);
  const Command commands[3] = {
      proxy_write(peer, box, r.recv_offset + r.rank * block_rows * msg_bytes, total_rows * msg_bytes),
      proxy_quiet(),  // the flags land after the rows
      proxy_write(peer, box + r.outbox_flags_pos, r.signal_offset + r.rank * flags_bytes, flags_bytes)};
  push_commands(r, peer, commands, 3, kLowLatencyCombineSend);
}

__device__ void combine_send_expert(const LowLatencyCombineArgs& a, GroupShared& sh, const GroupPosition& g, int local,
                                    uint64_t epoch) {
  const LowLatencyRegion& r = a.region;
  const int local_experts = a.num_experts / r.num_ranks;
  const int64_t slots_per_expert = static_cast<int64_t>(r.num_ranks) * a.num_max_tokens;
  for (int src = g.thread; src < r.num_ranks; src += kGroupThreads) {
    const int64_t range = a.layout_range[static_cast<int64_t>(local) * r.num_ranks + src];
    sh.begins[src] = static_cast<int32_t>(range >> 32);
    sh.counts[src] = static_cast<int32_t>(range & 0xFFFFFFFF);
    sh.starts[src] = 0;
  }
  group_sync(g);
  // In each source's block, this expert's rows follow those of the smaller local experts.
  for (int64_t i = g.thread; i < static_cast<int64_t>(local) * r.num_ranks; i += kGroupThreads) {
    atomic_add_block_relaxed(&sh.starts[i % r.num_ranks], static_cast<int32_t>(a.layout_range[i] & 0xFFFFFFFF));
  }
  group_sync(g);
  int total = 0;
  for (int src = 0; src < r.num_ranks; ++src) total += sh.counts[src];
  for (int row = g.warp; row < total; row += kWarpsPerGroup) {
    const int src = source_of_row(sh, row, r.num_ranks);
    if (is_masked(r, src)) continue;
    uint8_t* msg = combine_message_at(a, src, r.rank, sh.starts[src] + row - sh.begins[src]);
    const auto* in = reinterpret_cast<const uint8_t*>(a.x) + (local * slots_per_expert + row) * 2LL * a.hidden;
    if (a.use_logfmt) {
      send_logfmt_row(in, msg, a.hidden, g.lane);
    } else {
      warp_copy<false>(msg, in, 2LL * a.hidden, g.lane);
    }
  }
  group_sync(g);
  for (int src = g.thread; src < r.num_ranks; src += kGroupThreads) {
    if (!is_masked(r, src)) {
      publish_flag(count_flag_at(r, src, r.rank, local, local_experts),
                   (epoch << 32) | static_cast<uint32_t>(sh.counts[src]), r.aggressive_atomics);
    }
  }
  group_sync(g);
  if (r.via_proxy != nullptr && g.thread == 0) {
    for (int src = 0; src < r.num_ranks; ++src) {
      if (via_proxy(r, src) && !is_masked(r, src)) combine_staged(a, src, sh.counts[src]);
    }
  }
  group_sync(g);  // shared counts are reused by the group's next unit
}

// Rows a thread of the combine receive has in flight at once: with 8 the receive kernel (64
// registers) spills.
constexpr int kSumBatch = 4;

// ------------------------------------------------------------------ pre-reduced combine (low_latency.h)
constexpr int kPartialChunks = 2;
__host__ __device__ inline bool prereduces(const LowLatencyCombineArgs& a) {
  return a.prereduce && !a.use_logfmt && a.region.via_proxy == nullptr &&
         low_latency_combine_prereduces(a.num_max_tokens, a.hidden, a.num_topk, a.num_experts / a.region.num_ranks);
}

// What `src` returns to `rank` for token `token`: a two-row slot, its flag in the last 8 bytes.
__device__ __forceinline__ uint8_t* partial_slot_at(const LowLatencyCombineArgs& a, int rank, int src, int token) {
  return combine_message_at(a, rank, src, 2LL * token);
}
__device__ __forceinline__ uint64_t* partial_flag_at(const LowLatencyCombineArgs& a, int rank, int src, int token) {
  return reinterpret_cast<uint64_t*>(partial_slot_at(a, rank, src, token + 1)) - 1;
}

// `src`'s routing records in `rank`'s block for it: [T, K] (local expert, slot), [T, K] weights, a flag.
struct CombineRecords {
  int2* rows;
  float* weights;
  uint64_t* flag;
};
__device__ __forceinline__ CombineRecords combine_records_at(const LowLatencyCombineArgs& a, int rank, int src) {
  uint8_t* base = combine_message_at(a, rank, src, 2LL * a.num_max_tokens);
  const int64_t entries = static_cast<int64_t>(a.num_max_tokens) * a.num_topk;
  const int64_t flag_at = low_latency_combine_records_bytes(a.num_max_tokens, a.num_topk) - 16;
  return {reinterpret_cast<int2*>(base), reinterpret_cast<float*>(base + 8 * entries),
          reinterpret_cast<uint64_t*>(base + flag_at)};
}

// A group tells rank `dst` which of this rank's top-k entries its experts hold (local expert and slot,
// -1 for the others) with their weights, then raises the records flag with this rank's token count.
constexpr int kRecordBatch = 4;   // entries a thread loads before it stores any (the loads overlap)
__device__ void send_combine_records(const LowLatencyCombineArgs& a, const GroupPosition& g, int dst, uint64_t epoch) {
  const LowLatencyRegion& r = a.region;
  if (is_masked(r, dst)) return;
  const int local_experts = a.num_experts / r.num_ranks;
  const int64_t entries = static_cast<int64_t>(a.num_tokens) * a.num_topk;
  const int32_t* slots = a.positions + entries;
  const CombineRecords records = combine_records_at(a, dst, r.rank);
  for (int64_t base = g.thread; base < entries; base += kGroupThreads * kRecordBatch) {
    int2 held[kRecordBatch];
    float weight[kRecordBatch];
#pragma unroll
    for (int u = 0; u < kRecordBatch; ++u) {
      const int64_t entry = base + u * kGroupThreads;
      held[u] = make_int2(-1, -1);
      if (entry >= entries) continue;
      const int64_t chosen = a.topk_idx[entry];
      if (chosen >= 0 && chosen < a.num_experts && a.positions[entry] >= 0 && chosen / local_experts == dst) {
        held[u] = make_int2(static_cast<int>(chosen % local_experts), slots[entry]);
      }
      weight[u] = a.topk_weights[entry];
    }
#pragma unroll
    for (int u = 0; u < kRecordBatch; ++u) {
      const int64_t entry = base + u * kGroupThreads;
      if (entry >= entries) continue;
      records.rows[entry] = held[u];
      if (held[u].x >= 0) records.weights[entry] = weight[u];
    }
  }
  group_sync(g);
  if (g.thread == 0) {
    publish_flag(records.flag, (epoch << 32) | static_cast<uint32_t>(a.num_tokens), r.aggressive_atomics);
  }
}

// The sum of source `src`'s token `token` over this rank's experts, into the token's slot at `src`:
// float32 weighted in top-k order, or the one row as it is.
__device__ void send_partial(const LowLatencyCombineArgs& a, GroupShared& sh, const GroupPosition& g, int src,
                             int token, uint64_t epoch) {
  const LowLatencyRegion& r = a.region;
  const int local_experts = a.num_experts / r.num_ranks;
  if (g.thread == 0) {
    sh.found = wait_flag(r, combine_records_at(a, r.rank, src).flag, epoch, src, kLowLatencyCombineRecords, token,
                         nullptr);
  }
  group_sync(g);
  if (token >= sh.found) {   // a masked source (-1) or past its tokens
    group_sync(g);
    return;
  }
  if (g.thread < a.num_topk) {
    const CombineRecords records = combine_records_at(a, r.rank, src);
    const int64_t entry = static_cast<int64_t>(token) * a.num_topk + g.thread;
    const int2 held = load_l2(records.rows + entry);   // a peer wrote them (not through this SM's L1)
    int64_t offset = -1;
    if (held.x >= 0 && held.x < local_experts) {
      const int64_t range = a.layout_range[static_cast<int64_t>(held.x) * r.num_ranks + src];
      if (held.y >= 0 && held.y < static_cast<int32_t>(range & 0xFFFFFFFF)) {
        const int64_t row = static_cast<int64_t>(held.x) * r.num_ranks * a.num_max_tokens + (range >> 32) + held.y;
        offset = row * 2LL * a.hidden;
      }
    }
    sh.messages[g.thread] = offset;
    sh.weights[g.thread] = held.x >= 0 ? load_l2(records.weights + entry) : 0.0f;
  }
  group_sync(g);
  if (g.thread == 0) {   // the entries this rank holds, in top-k order (every thread has read sh.found)
    int held = 0;
    for (int k = 0; k < a.num_topk; ++k) {
      if (sh.messages[k] >= 0) sh.smaller[held++] = k;
    }
    sh.found = held;
  }
  group_sync(g);
  const int held = sh.found;
  const auto* x = reinterpret_cast<const uint8_t*>(a.x);
  uint8_t* slot = partial_slot_at(a, src, r.rank, token);
  const int chunks = a.hidden / 8;   // of 8 channels (16 bytes of bf16)
  if (held == 1) {
    const int per_warp = (chunks + kWarpsPerGroup - 1) / kWarpsPerGroup;
    const int first = g.warp * per_warp, count = max(0, min(chunks - first, per_warp));
    warp_copy<false>(slot + 16LL * first, x + sh.messages[sh.smaller[0]] + 16LL * first, 16LL * count, g.lane);
  } else if (held > 1) {
    // kPartialChunks chunks per thread at once, kSumBatch rows each: their loads overlap.
    auto* partial = reinterpret_cast<int4*>(slot);
    for (int chunk0 = g.thread; chunk0 < chunks; chunk0 += kPartialChunks * kGroupThreads) {
      float sum[kPartialChunks][8];
#pragma unroll
      for (int c = 0; c < kPartialChunks; ++c) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[c][i] = 0.0f;
      }
      for (int i0 = 0; i0 < held; i0 += kSumBatch) {
        int4 rows[kPartialChunks][kSumBatch];
#pragma unroll
        for (int c = 0; c < kPartialChunks; ++c) {
#pragma unroll
          for (int u = 0; u < kSumBatch; ++u) {
            const int chunk = chunk0 + c * kGroupThreads;
            if (i0 + u < held && chunk < chunks) {
              rows[c][u] = reinterpret_cast<const int4*>(x + sh.messages[sh.smaller[i0 + u]])[chunk];
            }
          }
        }
#pragma unroll
        for (int c = 0; c < kPartialChunks; ++c) {
#pragma unroll
          for (int u = 0; u < kSumBatch; ++u) {
            if (i0 + u >= held) continue;
            const float weight = sh.weights[sh.smaller[i0 + u]];
            float values[8];
            bf16x8_to_float(rows[c][u], values);
#pragma unroll
            for (int i = 0; i < 8; ++i) sum[c][i] = __fadd_rn(sum[c][i], __fmul_rn(values[i], weight));
          }
        }
      }
#pragma unroll
      for (int c = 0; c < kPartialChunks; ++c) {
        const int chunk = chunk0 + c * kGroupThreads;
        if (chunk >= chunks) continue;
        partial[2 * chunk] = make_int4(__float_as_int(sum[c][0]), __float_as_int(sum[c][1]),
                                       __float_as_int(sum[c][2]), __float_as_int(sum[c][3]));
        partial[2 * chunk + 1] = make_int4(__float_as_int(sum[c][4]), __float_as_int(sum[c][5]),
                                           __float_as_int(sum[c][6]), __float_as_int(sum[c][7]));
      }
    }
  }
  group_sync(g);
  if (held > 0 && g.thread == 0) {
    publish_flag(partial_flag_at(a, src, r.rank, token), (epoch << 32) | static_cast<uint32_t>(held),
                 r.aggressive_atomics);
  }
}

// Sums one token's rows; with several slices per token, this group does every slices-th chunk
// of 8 channels starting at `slice` (the first slice alone counts the wait in the stats).
// kLogfmt: the rows came as LogFMT (a compile-time choice: the bf16 path carries none of the decoding).
template <bool kLogfmt>
__device__ void combine_recv_token(const LowLatencyCombineArgs& a, GroupShared& sh, const GroupPosition& g, int token,
                                   int slice, int slices, uint64_t epoch) {
  const LowLatencyRegion& r = a.region;
  const int local_experts = a.num_experts / r.num_ranks;
  if (g.thread < a.num_topk) {
    // The entry's fields are loaded together, before the wait (whose acquire would hold later loads back).
    const int64_t entry = static_cast<int64_t>(token) * a.num_topk + g.thread;
    const int64_t chosen = a.topk_idx[entry];
    const int position = a.positions[entry];
    sh.weights[g.thread] = a.topk_weights[entry];
    int expert = chosen >= 0 && chosen < a.num_experts ? static_cast<int>(chosen) : -1;  // others: no expert
    if (expert >= 0) {
      const int owner = expert / local_experts;
      if (wait_flag(r, count_flag_at(r, r.rank, owner, expert % local_experts, local_experts), epoch, owner,
                    kLowLatencyCombineRecv, expert,
                    slice == 0 ? a.wait_cost_stats : nullptr) < 0) {
        expert = -1;
      }
      // An entry the dispatch did not send (its rank was masked then) has no row.
      if (position < 0) expert = -1;
      sh.messages[g.thread] = combine_message_at(a, r.rank, owner, max(position, 0)) - rank_base(r, r.rank);
    }
    sh.experts[g.thread] = expert;
  }
  group_sync(g);
  const uint8_t* area = rank_base(r, r.rank);
  auto* out = reinterpret_cast<uint16_t*>(a.out) + static_cast<int64_t>(token) * a.hidden;
  for (int chunk = slice * kGroupThreads + g.thread; chunk < a.hidden / 8; chunk += slices * kGroupThreads) {
    float sum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    // kSumBatch experts' rows in flight at once; the sum keeps top-k order.
    for (int k0 = 0; k0 < a.num_topk; k0 += kSumBatch) {
      int4 rows[kSumBatch];
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u) {
        const int k = k0 + u;
        const int expert = k < a.num_topk ? sh.experts[k] : -1;
        if (expert < 0 || kLogfmt) continue;
        rows[u] = load_l2_16(area + sh.messages[k] + chunk * 16);
      }
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u) {
        const int k = k0 + u;
        const int expert = k < a.num_topk ? sh.experts[k] : -1;
        if (expert < 0) continue;
        float values[8];
        if (kLogfmt) {
          read_logfmt_chunk(area + sh.messages[k], a.hidden, chunk, values);
        } else {
          bf16x8_to_float(rows[u], values);
        }
        const float weight = sh.weights[k];
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[i] = __fadd_rn(sum[i], __fmul_rn(values[i], weight));
      }
    }
    reinterpret_cast<int4*>(out)[chunk] = float_to_bf16x8(sum);
  }
  group_sync(g);
}

// Sums one token from the slots its experts' ranks returned (see combine_recv_token for slices): a rank's
// float32 partial, or its one row times the entry's weight, in the order the ranks first appear in top-k.
__device__ void combine_recv_partials(const LowLatencyCombineArgs& a, GroupShared& sh, const GroupPosition& g,
                                      int token, int slice, int slices, uint64_t epoch) {
  const LowLatencyRegion& r = a.region;
  const int local_experts = a.num_experts / r.num_ranks;
  const int64_t first_entry = static_cast<int64_t>(token) * a.num_topk;
  if (g.thread < a.num_topk) {
    const int64_t chosen = a.topk_idx[first_entry + g.thread];
    const bool sent = chosen >= 0 && chosen < a.num_experts && a.positions[first_entry + g.thread] >= 0;
    sh.experts[g.thread] = sent ? static_cast<int>(chosen / local_experts) : -1;
    sh.weights[g.thread] = a.topk_weights[first_entry + g.thread];
  }
  group_sync(g);
  if (g.thread < a.num_topk) {
    const int owner = sh.experts[g.thread];
    int held = 0;
    bool first = owner >= 0;
    for (int k = 0; k < a.num_topk; ++k) {
      if (sh.experts[k] != owner) continue;
      ++held;
      first &= k >= g.thread;
    }
    const int expert = static_cast<int>(a.topk_idx[first_entry + g.thread]);   // names the wait in a timeout
    if (first && wait_flag(r, partial_flag_at(a, r.rank, owner, token), epoch, owner, kLowLatencyCombineRecv,
                           expert, slice == 0 ? a.wait_cost_stats : nullptr) < 0) {
      held = 0;
    }
    sh.before[g.thread] = first ? held : 0;
    sh.messages[g.thread] = first ? partial_slot_at(a, r.rank, owner, token) - rank_base(r, r.rank) : 0;
  }
  group_sync(g);
  const uint8_t* area = rank_base(r, r.rank);
  auto* out = reinterpret_cast<uint16_t*>(a.out) + static_cast<int64_t>(token) * a.hidden;
  for (int chunk = slice * kGroupThreads + g.thread; chunk < a.hidden / 8; chunk += slices * kGroupThreads) {
    float sum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int k = 0; k < a.num_topk; ++k) {
      const int held = sh.before[k];
      if (held == 0) continue;
      const auto* slot = reinterpret_cast<const int4*>(area + sh.messages[k]);
      float values[8];
      if (held == 1) {
        bf16x8_to_float(load_l2_16(slot + chunk), values);
        const float weight = sh.weights[k];
#pragma unroll
        for (int i = 0; i < 8; ++i) values[i] = __fmul_rn(values[i], weight);
      } else {
        const int4 lo = load_l2_16(slot + 2 * chunk), hi = load_l2_16(slot + 2 * chunk + 1);
        const int words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) values[i] = __int_as_float(words[i]);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[i] = __fadd_rn(sum[i], values[i]);
    }
    reinterpret_cast<int4*>(out)[chunk] = float_to_bf16x8(sum);
  }
  group_sync(g);
}

template <int kPhases, bool kLogfmt>
__device__ __forceinline__ void low_latency_combine_body(const LowLatencyCombineArgs& a, GroupShared* shared) {
  const GroupPosition g = group_position();
  GroupShared& sh = shared[g.index];
  const uint64_t epoch = completed_uses(a.region) + 1;
  const bool prereduced = !kLogfmt && prereduces(a);
  if (kPhases & kLowLatencySend) {
    exchange_releases(a.region, g, epoch, kLowLatencyCombineSend);
    if (prereduced) {
      for (int dst = g.first; dst < a.region.num_ranks; dst += g.stride) send_combine_records(a, g, dst, epoch);
      const int units = a.region.num_ranks * a.num_max_tokens;
      for (int unit = g.first; unit < units; unit += g.stride) {
        send_partial(a, sh, g, unit / a.num_max_tokens, unit % a.num_max_tokens, epoch);
      }
    } else {
      const int local_experts = a.num_experts / a.region.num_ranks;
      for (int local = g.first; local < local_experts; local += g.stride) combine_send_expert(a, sh, g, local, epoch);
    }
  }
  if (kPhases & kLowLatencyRecv) {
    // Few tokens: split each token's channels over several groups, so every SM has work.
    const int chunk_rounds = (a.hidden / 8 + kGroupThreads - 1) / kGroupThreads;
    const int slices = max(1, min(g.stride / max(a.num_tokens, 1), chunk_rounds));
    for (int unit = g.first; unit < a.num_tokens * slices; unit += g.stride) {
      if (prereduced) {
        combine_recv_partials(a, sh, g, unit / slices, unit % slices, slices, epoch);
      } else {
        combine_recv_token<kLogfmt>(a, sh, g, unit / slices, unit % slices, slices, epoch);
      }
    }
    finish_use(a.region);
  }
}

// The receive alone waits only on other launches, so its grid may hold several blocks per SM: as many as are
// resident at once (a second wave would wait for the first), at most this many.
constexpr int kCombineRecvMaxBlocksPerSm = 4;

namespace low_latency {
template <bool kLogfmt>
__global__ void __launch_bounds__(kBlockThreads, 1) combine(const LowLatencyCombineArgs a) {
  __shared__ GroupShared shared[kGroupsPerBlock];
  if (a.phases == kLowLatencySend) {
    low_latency_combine_body<kLowLatencySend, kLogfmt>(a, shared);
  } else if (a.phases == kLowLatencyRecv) {
    low_latency_combine_body<kLowLatencyRecv, kLogfmt>(a, shared);
  } else {
    low_latency_combine_body<kLowLatencySend | kLowLatencyRecv, kLogfmt>(a, shared);
  }
}
}  // namespace low_latency

// ------------------------------------------------------------------------------ launchers
void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument("low-latency kernel: " + message);
}

void check_common(const LowLatencyRegion& r, int num_tokens, int num_max_tokens, int hidden, int num_topk,
                  int num_experts, int phases, int num_sms) {
  // Messages are built only on failure: these checks run on every launch.
  if (r.num_ranks < 1 || r.num_ranks > kLowLatencyMaxRanks) {
    require(false, "num_ranks must be in [1, " + std::to_string(kLowLatencyMaxRanks) + "], got " +
                       std::to_string(r.num_ranks));
  }
  require(r.rank >= 0 && r.rank < r.num_ranks, "rank out of range");
  require(r.peer_bases != nullptr && r.control != nullptr && r.status != nullptr, "region pointers must be set");
  require(r.timeout_ns > 0, "timeout_ns must be positive");
  require(num_max_tokens >= 1, "num_max_tokens must be positive");
  require(num_tokens >= 0 && num_tokens <= num_max_tokens, "num_tokens must be in [0, num_max_tokens]");
  require(hidden > 0 && hidden % 8 == 0, "hidden must be a positive multiple of 8");
  if (num_topk < 1 || num_topk > kLowLatencyMaxTopk) {
    require(false, "num_topk must be in [1, " + std::to_string(kLowLatencyMaxTopk) + "]");
  }
  require(num_experts > 0 && num_experts % r.num_ranks == 0, "num_experts must be a positive multiple of num_ranks");
  require(phases >= 1 && phases <= (kLowLatencySend | kLowLatencyRecv), "phases must be send, recv or both");
  // A receiving launch splits a use into kUseShares shares, at least one per block.
  if (num_sms < 1 || static_cast<uint64_t>(num_sms) * kCombineRecvMaxBlocksPerSm > kUseShares) {
    require(false, "num_sms must be in [1, " + std::to_string(kUseShares / kCombineRecvMaxBlocksPerSm) + "], got " +
                       std::to_string(num_sms));
  }
}

// One block per unit up to the SM count: units spread over every SM before any SM takes two.
int grid_size(int units, int num_sms) { return std::min(std::max(units, 1), num_sms); }

// Blocks of the combine kernel (LogFMT or not) one SM of the current device holds at once, in
// [1, kCombineRecvMaxBlocksPerSm]: its registers decide. Asked once per device and kernel, when the
// kernels load (before any launch a CUDA graph might capture), for every thread.
int combine_resident_blocks_per_sm(bool logfmt) {
  static std::mutex mutex;
  static std::vector<std::array<int, 2>> known;  // per device; 0: not asked yet
  int device = 0;
  UCCL_EP_GPU_CHECK(gpu_get_device(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(known.size()) <= device) known.resize(device + 1, {0, 0});
  int& blocks = known[device][logfmt ? 1 : 0];
  if (blocks == 0) {
    UCCL_EP_GPU_CHECK(gpu_resident_blocks_per_sm(
        &blocks, logfmt ? low_latency::combine<true> : low_latency::combine<false>, kBlockThreads, 0));
    blocks = std::min(std::max(blocks, 1), kCombineRecvMaxBlocksPerSm);
  }
  return blocks;
}

}  // namespace kernels

void load_low_latency_kernels() {
  using namespace kernels;
  gpu_load_kernels(low_latency::dispatch, low_latency::combine<false>, low_latency::combine<true>);
  combine_resident_blocks_per_sm(false);
  combine_resident_blocks_per_sm(true);
}

void launch_low_latency_dispatch(const LowLatencyDispatchArgs& a, gpuStream_t stream) {
  using namespace kernels;
  check_common(a.region, a.num_tokens, a.num_max_tokens, a.hidden, a.num_topk, a.num_experts, a.phases, a.num_sms);
  require(!a.use_fp8 || a.hidden % kChannels == 0, "fp8 needs hidden % 128 == 0");
  require(!a.use_ue8m0 || (a.use_fp8 && a.round_scale && a.hidden % (4 * kChannels) == 0),
          "use_ue8m0 needs use_fp8, round_scale and hidden % 512 == 0");
  require(a.num_tokens == 0 || (a.x != nullptr && a.topk_idx != nullptr), "x and topk_idx must be set");
  if (a.phases & kLowLatencyRecv) {
    require(a.recv_x != nullptr && a.recv_count != nullptr && a.src_info != nullptr && a.layout_range != nullptr,
            "receive outputs must be set");
    require(!a.use_fp8 || a.recv_scales != nullptr, "recv_scales must be set for fp8");
  }
  // A receive alone deals its rows over every SM.
  const int units = (a.phases & kLowLatencySend) ? std::max(a.num_tokens, a.num_experts) : a.num_sms;
  // Only the send casts into shared memory: a receive alone asks for none (no carveout to set up).
  const int64_t staging = a.use_fp8 && (a.phases & kLowLatencySend) ? kGroupsPerBlock * staging_bytes(a.hidden) : 0;
  if (staging + static_cast<int64_t>(sizeof(GroupShared)) * kGroupsPerBlock > kMaxSharedBytes) {
    require(false, "hidden " + std::to_string(a.hidden) + " is too large for the fp8 staging in shared memory");
  }
  const auto kernel = low_latency::dispatch;
  // The largest staging any launch asked for, per device (the attribute holds for every later launch).
  static thread_local std::vector<int64_t> staging_allowed;
  int device = 0;
  UCCL_EP_GPU_CHECK(gpu_get_device(&device));
  if (static_cast<int>(staging_allowed.size()) <= device) staging_allowed.resize(device + 1, 0);
  if (staging > staging_allowed[device]) {
    UCCL_EP_GPU_CHECK(gpu_set_max_dynamic_shared(kernel, static_cast<int>(staging)));
    staging_allowed[device] = staging;
  }
  kernel<<<grid_size(units, a.num_sms), kBlockThreads, staging, stream>>>(a);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

void launch_low_latency_combine(const LowLatencyCombineArgs& a, gpuStream_t stream) {
  using namespace kernels;
  check_common(a.region, a.num_tokens, a.num_max_tokens, a.hidden, a.num_topk, a.num_experts, a.phases, a.num_sms);
  require(!a.use_logfmt || a.hidden % kChannels == 0, "use_logfmt needs hidden % 128 == 0");
  const int local_experts = a.num_experts / a.region.num_ranks;
  const bool prereduced = prereduces(a);
  if (a.phases & kLowLatencySend) {
    require(a.x != nullptr && a.src_info != nullptr && a.layout_range != nullptr, "x and the handle must be set");
  }
  // The pre-reduced send reads the routing too (it tells the experts' ranks the weights).
  if ((a.phases & kLowLatencyRecv) || prereduced) {
    require(a.num_tokens == 0 || (a.topk_idx != nullptr && a.topk_weights != nullptr && a.positions != nullptr),
            "topk_idx, topk_weights and the dispatch's positions must be set");
  }
  if (a.phases & kLowLatencyRecv) require(a.num_tokens == 0 || a.out != nullptr, "out must be set");
  const int send_units = prereduced ? a.region.num_ranks * a.num_max_tokens : local_experts;
  int units = std::max((a.phases & kLowLatencySend) ? send_units : 0, (a.phases & kLowLatencyRecv) ? a.num_tokens : 0);
  const auto kernel = a.use_logfmt ? low_latency::combine<true> : low_latency::combine<false>;
  int max_blocks = a.num_sms;
  if (a.phases == kLowLatencyRecv) {
    // A block per kGroupsPerBlock slices of a token's channels (one round of chunks per group).
    const int chunk_rounds = (a.hidden / 8 + kGroupThreads - 1) / kGroupThreads;
    units = (a.num_tokens * chunk_rounds + kGroupsPerBlock - 1) / kGroupsPerBlock;
    max_blocks = a.num_sms * combine_resident_blocks_per_sm(a.use_logfmt);
  }
  kernel<<<grid_size(units, max_blocks), kBlockThreads, 0, stream>>>(a);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

}  // namespace uccl_ep
