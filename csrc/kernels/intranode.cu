// Normal-mode dispatch and combine over mapped peer memory (protocol in intranode.h).
//
// Work split: a warp per token (dispatch send, combine receive) or per received row (dispatch
// receive, combine send); warps of all blocks take units in turn. Every block of a send or
// receive kernel waits for the same flags itself, so no block depends on another.
#include "kernels/intranode.h"

#include <cuda_bf16.h>

#include <string>

namespace uccl_ep {
namespace normal_kernels {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kBf16PerVector = 8;  // bf16 values in one 16-byte vector

static_assert(kNormalMaxTopk <= kWarpSize, "one lane per top-k entry");

__device__ __forceinline__ uint8_t* rank_base(const NormalRegion& r, int rank) {
  return reinterpret_cast<uint8_t*>(r.peer_bases[rank]);
}
__device__ __forceinline__ uint8_t* data_area(const NormalRegion& r, int rank) {
  return rank_base(r, rank) + kNormalControlBytes;
}
// In `rank`'s control area: the epoch `src` last announced to it.
__device__ __forceinline__ uint64_t* arrived_word(const NormalRegion& r, int rank, int src) {
  return reinterpret_cast<uint64_t*>(rank_base(r, rank)) + src;
}
// In `rank`'s control area: the last exchange `reader` finished reading.
__device__ __forceinline__ uint64_t* freed_word(const NormalRegion& r, int rank, int reader) {
  return reinterpret_cast<uint64_t*>(rank_base(r, rank)) + kNormalMaxRanks + reader;
}

__device__ __forceinline__ uint64_t exchanges_done(const NormalRegion& r) {
  return *reinterpret_cast<const volatile uint64_t*>(r.control + kNormalExchangesWord);
}
__device__ __forceinline__ bool aborted(const NormalRegion& r) {
  return *reinterpret_cast<const volatile uint64_t*>(r.control + kNormalAbortedWord) != 0;
}

__device__ void record_failure(const NormalRegion& r, int32_t code, int32_t phase, int32_t peer, int32_t detail) {
  *reinterpret_cast<volatile uint64_t*>(r.control + kNormalAbortedWord) = 1;
  if (compare_and_swap_system(&r.status->code, 0, code) == 0) {
    r.status->phase = phase;
    r.status->peer = peer;
    r.status->detail = detail;
    __threadfence_system();
  }
}

// One thread waits until the word `peer` writes reaches `target`; false on abort or timeout.
__device__ bool wait_at_least(const NormalRegion& r, const uint64_t* word, uint64_t target, int32_t phase,
                              int32_t peer) {
  const uint64_t start = device_time_ns();
  while (load_acquire_system(word) < target) {
    if (aborted(r)) return false;
    if (device_time_ns() - start > static_cast<uint64_t>(r.timeout_ns)) {
      record_failure(r, kNormalTimeout, phase, peer, 0);
      return false;
    }
    device_pause();
  }
  return true;
}

// The whole block waits for every rank's word (`word_of(peer)`) to reach `target`; the answer is
// the same for every thread of the block.
template <typename WordOf>
__device__ bool block_wait_all(const NormalRegion& r, WordOf word_of, uint64_t target, int32_t phase) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int peer = threadIdx.x; peer < r.num_ranks; peer += blockDim.x) {
    if (!wait_at_least(r, word_of(peer), target, phase, peer)) failed = 1;
  }
  __syncthreads();
  return failed == 0;
}

// Step 1 of an exchange: every destination has freed the previous one.
__device__ bool wait_destinations_free(const NormalRegion& r, int32_t phase) {
  const uint64_t epoch = exchanges_done(r) + 1;
  return block_wait_all(r, [&](int peer) { return freed_word(r, r.rank, peer); }, epoch - 1, phase);
}

// Step 3: every source has announced this exchange.
__device__ bool wait_sources_arrived(const NormalRegion& r, int32_t phase) {
  return block_wait_all(r, [&](int peer) { return arrived_word(r, r.rank, peer); }, exchanges_done(r), phase);
}

__global__ void announce_arrival(NormalRegion r) {
  if (aborted(r)) return;
  const uint64_t epoch = exchanges_done(r) + 1;
  for (int peer = threadIdx.x; peer < r.num_ranks; peer += blockDim.x) {
    store_release_system(arrived_word(r, peer, r.rank), epoch);
  }
  __syncthreads();
  if (threadIdx.x == 0) r.control[kNormalExchangesWord] = epoch;
}

__global__ void announce_freed(NormalRegion r) {
  if (aborted(r)) return;
  const uint64_t epoch = exchanges_done(r);
  for (int peer = threadIdx.x; peer < r.num_ranks; peer += blockDim.x) {
    store_release_system(freed_word(r, peer, r.rank), epoch);
  }
}

// ------------------------------------------------------------------------------ copies
struct WarpPosition {
  int lane;
  int first;   // first unit of this warp
  int stride;  // warps in the grid
};

__device__ __forceinline__ WarpPosition warp_position() {
  return WarpPosition{static_cast<int>(threadIdx.x % kWarpSize),
                      static_cast<int>(blockIdx.x * kWarps + threadIdx.x / kWarpSize),
                      static_cast<int>(gridDim.x * kWarps)};
}

// A warp copies `bytes` (a multiple of 4) through L2: in 16-byte vectors when everything is
// aligned to them, else in 4-byte words.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t bytes, int lane) {
  const auto d = reinterpret_cast<uintptr_t>(dst);
  const auto s = reinterpret_cast<uintptr_t>(src);
  if (((d | s | static_cast<uintptr_t>(bytes)) & 15) == 0) {
    for (int64_t i = lane; i < bytes / 16; i += kWarpSize) {
      reinterpret_cast<int4*>(dst)[i] = load_l2_16(reinterpret_cast<const int4*>(src) + i);
    }
  } else {
    for (int64_t i = lane; i < bytes / 4; i += kWarpSize) {
      reinterpret_cast<int32_t*>(dst)[i] = __ldcg(reinterpret_cast<const int32_t*>(src) + i);
    }
  }
}

// A warp zeroes `bytes` (a multiple of 4).
__device__ __forceinline__ void warp_zero(void* dst, int64_t bytes, int lane) {
  for (int64_t i = lane; i < bytes / 4; i += kWarpSize) reinterpret_cast<int32_t*>(dst)[i] = 0;
}

// Tokens `src` sends to `dst`, from the inclusive prefix over sources.
__device__ __forceinline__ int64_t sent_count(const int32_t* rank_prefix_matrix, int num_ranks, int src, int dst) {
  const int64_t before = src > 0 ? rank_prefix_matrix[(src - 1) * num_ranks + dst] : 0;
  return rank_prefix_matrix[src * num_ranks + dst] - before;
}

__device__ __forceinline__ int64_t received_rows(const int32_t* rank_prefix_matrix, int num_ranks, int rank) {
  return rank_prefix_matrix[(num_ranks - 1) * num_ranks + rank];
}

// Rows `src` sends in all (its combine area holds them all).
__device__ __forceinline__ int64_t sent_rows(const int32_t* rank_prefix_matrix, int num_ranks, int src) {
  int64_t rows = 0;
  for (int dst = 0; dst < num_ranks; ++dst) rows += sent_count(rank_prefix_matrix, num_ranks, src, dst);
  return rows;
}

// ------------------------------------------------------------------------------ notify
__global__ void __launch_bounds__(kThreads) notify_dispatch_send(NormalNotifyArgs a) {
  const NormalRegion& r = a.region;
  if (!wait_destinations_free(r, kNormalNotifySend)) return;
  const int num_ranks = r.num_ranks, num_channels = a.num_channels, local = a.num_local_experts;
  const int64_t slot_ints = normal_notify_slot_ints(num_ranks, num_channels, local);
  for (int dst = 0; dst < num_ranks; ++dst) {
    int32_t* slot = reinterpret_cast<int32_t*>(data_area(r, dst)) + r.rank * slot_ints;
    for (int i = threadIdx.x; i < slot_ints; i += blockDim.x) {
      int32_t value;
      if (i < num_ranks) {
        value = a.num_tokens_per_rank[i];
      } else if (i < num_ranks + num_channels) {
        value = a.channel_prefix_matrix[dst * num_channels + (i - num_ranks)];
      } else {
        value = a.num_tokens_per_expert[dst * local + (i - num_ranks - num_channels)];
      }
      slot[i] = value;
    }
  }
  __threadfence_system();
}

__global__ void __launch_bounds__(kThreads) notify_dispatch_receive(NormalNotifyArgs a) {
  const NormalRegion& r = a.region;
  if (!wait_sources_arrived(r, kNormalNotifyRecv)) return;
  const int num_ranks = r.num_ranks, num_channels = a.num_channels, local = a.num_local_experts;
  const int64_t slot_ints = normal_notify_slot_ints(num_ranks, num_channels, local);
  const int32_t* slots = reinterpret_cast<const int32_t*>(data_area(r, r.rank));
  for (int dst = threadIdx.x; dst < num_ranks; dst += blockDim.x) {
    int32_t running = 0;
    for (int src = 0; src < num_ranks; ++src) {
      running += __ldcg(slots + src * slot_ints + dst);
      a.rank_prefix_matrix[src * num_ranks + dst] = running;
    }
    // Every rank sees the same counts, so every rank records this and all stop together.
    if (a.num_worst_tokens > 0 && running > a.num_worst_tokens) {
      record_failure(r, kNormalTooManyRows, kNormalNotifyRecv, dst, running);
    }
  }
  for (int i = threadIdx.x; i < num_ranks * num_channels; i += blockDim.x) {
    const int src = i / num_channels, channel = i % num_channels;
    a.recv_channel_prefix_matrix[i] =
        channel == 0 ? 0 : __ldcg(slots + src * slot_ints + num_ranks + channel - 1);
  }
  for (int expert = threadIdx.x; expert < local; expert += blockDim.x) {
    int32_t total = 0;
    for (int src = 0; src < num_ranks; ++src) total += __ldcg(slots + src * slot_ints + num_ranks + num_channels + expert);
    a.recv_tokens_per_expert[expert] = (total + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
  }
}

// ------------------------------------------------------------------------------ dispatch
__device__ __forceinline__ NormalDispatchArea dispatch_area_of(const NormalDispatchArgs& a, int rank) {
  const int64_t rows = received_rows(a.rank_prefix_matrix, a.region.num_ranks, rank);
  return normal_dispatch_area(rows, a.x_row_bytes, a.scale_row_bytes, a.num_topk);
}

// Whether every rank's data area holds what it receives: the same answer on every rank.
__device__ bool dispatch_fits(const NormalDispatchArgs& a) {
  for (int rank = 0; rank < a.region.num_ranks; ++rank) {
    if (dispatch_area_of(a, rank).total > a.region.data_bytes) return false;
  }
  return true;
}

__global__ void __launch_bounds__(kThreads) dispatch_send(NormalDispatchArgs a) {
  const NormalRegion& r = a.region;
  if (!wait_destinations_free(r, kNormalDispatchSend)) return;
  if (!dispatch_fits(a)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) record_failure(r, kNormalAreaTooSmall, kNormalDispatchSend, -1, 0);
    return;
  }
  const WarpPosition w = warp_position();
  const int num_ranks = r.num_ranks;
  for (int token = w.first; token < a.num_tokens; token += w.stride) {
    for (int dst = 0; dst < num_ranks; ++dst) {
      const int32_t pos = a.send_pos[static_cast<int64_t>(token) * num_ranks + dst];
      if (pos < 0) continue;
      const int64_t row =
          (r.rank > 0 ? a.rank_prefix_matrix[(r.rank - 1) * num_ranks + dst] : 0) + static_cast<int64_t>(pos);
      const NormalDispatchArea area = dispatch_area_of(a, dst);
      uint8_t* base = data_area(r, dst);
      warp_copy(base + area.x + row * a.x_row_bytes,
                static_cast<const uint8_t*>(a.x) + token * a.x_row_bytes, a.x_row_bytes, w.lane);
      if (a.scale_row_bytes > 0) {
        warp_copy(base + area.scales + row * a.scale_row_bytes,
                  static_cast<const uint8_t*>(a.x_scales) + token * a.scale_row_bytes, a.scale_row_bytes, w.lane);
      }
      if (w.lane < a.num_topk) {
        const int64_t entry = static_cast<int64_t>(token) * a.num_topk + w.lane;
        const int64_t expert = a.topk_idx[entry];
        const int64_t local = expert - static_cast<int64_t>(dst) * a.num_local_experts;
        const bool keep = expert >= 0 && local >= 0 && local < a.num_local_experts;
        reinterpret_cast<int64_t*>(base + area.topk_idx)[row * a.num_topk + w.lane] = keep ? local : -1;
        reinterpret_cast<float*>(base + area.topk_weights)[row * a.num_topk + w.lane] =
            keep ? a.topk_weights[entry] : 0.0f;
      }
      if (w.lane == 0) reinterpret_cast<int32_t*>(base + area.src_idx)[row] = token;
    }
  }
  __threadfence_system();
}

__global__ void __launch_bounds__(kThreads) dispatch_receive(NormalDispatchArgs a) {
  const NormalRegion& r = a.region;
  if (!wait_sources_arrived(r, kNormalDispatchRecv)) return;
  if (!dispatch_fits(a)) return;  // the send kernel recorded it
  const WarpPosition w = warp_position();
  const int64_t received = received_rows(a.rank_prefix_matrix, r.num_ranks, r.rank);
  const int64_t num_recv = received < a.num_rows_out ? received : a.num_rows_out;
  const NormalDispatchArea area = dispatch_area_of(a, r.rank);
  const uint8_t* base = data_area(r, r.rank);
  const int k = a.num_topk;
  for (int64_t row = w.first; row < a.num_rows_out; row += w.stride) {
    uint8_t* x_out = static_cast<uint8_t*>(a.recv_x) + row * a.x_row_bytes;
    uint8_t* scales_out =
        a.scale_row_bytes == 0 ? nullptr : static_cast<uint8_t*>(a.recv_x_scales) + row * a.scale_row_bytes;
    if (row < num_recv) {
      warp_copy(x_out, base + area.x + row * a.x_row_bytes, a.x_row_bytes, w.lane);
      if (scales_out != nullptr) {
        warp_copy(scales_out, base + area.scales + row * a.scale_row_bytes, a.scale_row_bytes, w.lane);
      }
      if (a.recv_topk_idx != nullptr && w.lane < k) {
        a.recv_topk_idx[row * k + w.lane] =
            __ldcg(reinterpret_cast<const long long*>(base + area.topk_idx) + row * k + w.lane);
        a.recv_topk_weights[row * k + w.lane] =
            __ldcg(reinterpret_cast<const float*>(base + area.topk_weights) + row * k + w.lane);
      }
      if (a.recv_src_idx != nullptr && w.lane == 0) {
        a.recv_src_idx[row] = __ldcg(reinterpret_cast<const int32_t*>(base + area.src_idx) + row);
      }
    } else {  // padding rows, as the reference pads them
      warp_zero(x_out, a.x_row_bytes, w.lane);
      if (scales_out != nullptr) warp_zero(scales_out, a.scale_row_bytes, w.lane);
      if (a.recv_topk_idx != nullptr && w.lane < k) {
        a.recv_topk_idx[row * k + w.lane] = -1;
        a.recv_topk_weights[row * k + w.lane] = 0.0f;
      }
      if (a.recv_src_idx != nullptr && w.lane == 0) a.recv_src_idx[row] = -1;
    }
  }
}

// ------------------------------------------------------------------------------ combine
__device__ __forceinline__ NormalCombineArea combine_area_of(const NormalCombineArgs& a, int rank) {
  return normal_combine_area(sent_rows(a.rank_prefix_matrix, a.region.num_ranks, rank),
                             static_cast<int64_t>(a.hidden) * 2, a.num_topk);
}

__device__ bool combine_fits(const NormalCombineArgs& a) {
  for (int rank = 0; rank < a.region.num_ranks; ++rank) {
    if (combine_area_of(a, rank).total > a.region.data_bytes) return false;
  }
  return true;
}

__global__ void __launch_bounds__(kThreads) combine_send(NormalCombineArgs a) {
  const NormalRegion& r = a.region;
  if (!wait_destinations_free(r, kNormalCombineSend)) return;
  if (!combine_fits(a)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) record_failure(r, kNormalAreaTooSmall, kNormalCombineSend, -1, 0);
    return;
  }
  const WarpPosition w = warp_position();
  const int num_ranks = r.num_ranks;
  const int64_t received = received_rows(a.rank_prefix_matrix, num_ranks, r.rank);
  const int64_t num_valid = received < a.num_rows ? received : a.num_rows;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  for (int64_t row = w.first; row < num_valid; row += w.stride) {
    int src = 0;
    while (row >= a.rank_prefix_matrix[src * num_ranks + r.rank]) ++src;
    const int64_t index = row - (src > 0 ? a.rank_prefix_matrix[(src - 1) * num_ranks + r.rank] : 0);
    // The source orders its combine area like its sends: by receiver, then token.
    int64_t dst_row = index;
    for (int before = 0; before < r.rank; ++before) dst_row += sent_count(a.rank_prefix_matrix, num_ranks, src, before);
    const NormalCombineArea area = combine_area_of(a, src);
    uint8_t* base = data_area(r, src);
    warp_copy(base + area.x + dst_row * row_bytes, static_cast<const uint8_t*>(a.x) + row * row_bytes, row_bytes,
              w.lane);
    if (w.lane < a.num_topk) {
      reinterpret_cast<float*>(base + area.topk_weights)[dst_row * a.num_topk + w.lane] =
          a.topk_weights[row * a.num_topk + w.lane];
    }
  }
  __threadfence_system();
}

__device__ __forceinline__ void add_bf16_vector(float (&sum)[kBf16PerVector], int4 vector) {
  const auto* values = reinterpret_cast<const __nv_bfloat162*>(&vector);
  for (int i = 0; i < kBf16PerVector / 2; ++i) {
    const float2 pair = __bfloat1622float2(values[i]);
    sum[2 * i] += pair.x;
    sum[2 * i + 1] += pair.y;
  }
}

__global__ void __launch_bounds__(kThreads) combine_receive(NormalCombineArgs a) {
  const NormalRegion& r = a.region;
  if (!wait_sources_arrived(r, kNormalCombineRecv)) return;
  if (!combine_fits(a)) return;  // the send kernel recorded it
  const int num_ranks = r.num_ranks;
  __shared__ int64_t first_row[kNormalMaxRanks];  // where each receiver's rows start in this rank's area
  if (threadIdx.x == 0) {
    int64_t running = 0;
    for (int dst = 0; dst < num_ranks; ++dst) {
      first_row[dst] = running;
      running += sent_count(a.rank_prefix_matrix, num_ranks, r.rank, dst);
    }
  }
  __syncthreads();
  const WarpPosition w = warp_position();
  const NormalCombineArea area = combine_area_of(a, r.rank);
  const uint8_t* base = data_area(r, r.rank);
  const int64_t vectors = a.hidden / kBf16PerVector;
  for (int64_t token = w.first; token < a.num_tokens; token += w.stride) {
    const bool* in_rank = a.is_token_in_rank + token * num_ranks;
    const int32_t* pos = a.send_pos + token * num_ranks;
    for (int64_t v = w.lane; v < vectors; v += kWarpSize) {
      // Summed like the reference: from 0, receivers in rank order, then the biases.
      float sum[kBf16PerVector] = {};
      for (int dst = 0; dst < num_ranks; ++dst) {
        if (!in_rank[dst]) continue;
        const int64_t row = first_row[dst] + pos[dst];
        add_bf16_vector(sum, load_l2_16(base + area.x + (row * vectors + v) * 16));
      }
      if (a.bias0 != nullptr) add_bf16_vector(sum, reinterpret_cast<const int4*>(a.bias0)[token * vectors + v]);
      if (a.bias1 != nullptr) add_bf16_vector(sum, reinterpret_cast<const int4*>(a.bias1)[token * vectors + v]);
      int4 packed;
      auto* out = reinterpret_cast<__nv_bfloat162*>(&packed);
      for (int i = 0; i < kBf16PerVector / 2; ++i) out[i] = __floats2bfloat162_rn(sum[2 * i], sum[2 * i + 1]);
      reinterpret_cast<int4*>(a.combined_x)[token * vectors + v] = packed;
    }
    if (w.lane < a.num_topk) {
      float sum = 0.0f;
      for (int dst = 0; dst < num_ranks; ++dst) {
        if (!in_rank[dst]) continue;
        const int64_t row = first_row[dst] + pos[dst];
        sum += __ldcg(reinterpret_cast<const float*>(base + area.topk_weights) + row * a.num_topk + w.lane);
      }
      a.combined_topk_weights[token * a.num_topk + w.lane] = sum;
    }
  }
}

}  // namespace normal_kernels

// ------------------------------------------------------------------------------ launchers
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

void check_region(const NormalRegion& r) {
  require(r.num_ranks >= 1 && r.num_ranks <= kNormalMaxRanks,
          "num_ranks must be in [1, " + std::to_string(kNormalMaxRanks) + "], got " + std::to_string(r.num_ranks));
  require(r.rank >= 0 && r.rank < r.num_ranks, "rank " + std::to_string(r.rank) + " is outside the group");
  require(r.peer_bases != nullptr && r.control != nullptr && r.status != nullptr,
          "NormalRegion: peer_bases, control and status are required");
  require(r.timeout_ns > 0, "timeout_ns must be positive");
}

void check_num_sms(int32_t num_sms) { require(num_sms >= 1, "num_sms must be >= 1, got " + std::to_string(num_sms)); }

void check_topk(int32_t num_topk) {
  require(num_topk >= 0 && num_topk <= kNormalMaxTopk,
          "num_topk must be in [0, " + std::to_string(kNormalMaxTopk) + "], got " + std::to_string(num_topk));
}

// The four launches of one exchange (see intranode.h).
template <typename Args>
void launch_exchange(void (*send)(Args), void (*receive)(Args), const Args& args, int send_blocks,
                     int receive_blocks, gpuStream_t stream) {
  send<<<send_blocks, normal_kernels::kThreads, 0, stream>>>(args);
  UCCL_EP_GPU_CHECK(gpu_last_error());
  normal_kernels::announce_arrival<<<1, kNormalMaxRanks, 0, stream>>>(args.region);
  UCCL_EP_GPU_CHECK(gpu_last_error());
  receive<<<receive_blocks, normal_kernels::kThreads, 0, stream>>>(args);
  UCCL_EP_GPU_CHECK(gpu_last_error());
  normal_kernels::announce_freed<<<1, kNormalMaxRanks, 0, stream>>>(args.region);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

}  // namespace

void launch_notify_dispatch(const NormalNotifyArgs& args, gpuStream_t stream) {
  check_region(args.region);
  require(args.num_channels >= 1, "num_channels must be >= 1");
  require(args.num_local_experts >= 1, "num_local_experts must be >= 1");
  require(args.expert_alignment >= 1, "expert_alignment must be >= 1");
  require(args.num_worst_tokens >= 0, "num_worst_tokens must be >= 0");
  const int64_t slot_bytes =
      4 * normal_notify_slot_ints(args.region.num_ranks, args.num_channels, args.num_local_experts);
  require(slot_bytes * args.region.num_ranks <= args.region.data_bytes,
          "the data area cannot hold the notify slots (" + std::to_string(slot_bytes * args.region.num_ranks) +
              " bytes)");
  launch_exchange(normal_kernels::notify_dispatch_send, normal_kernels::notify_dispatch_receive, args, 1, 1, stream);
}

void launch_normal_dispatch(const NormalDispatchArgs& args, gpuStream_t stream) {
  check_region(args.region);
  check_num_sms(args.num_sms);
  check_topk(args.num_topk);
  require(args.x_row_bytes > 0 && args.x_row_bytes % 4 == 0, "x_row_bytes must be a positive multiple of 4");
  // Empty tensors have null data pointers, so a pointer is required only where rows use it.
  require(args.scale_row_bytes % 4 == 0, "scale_row_bytes must be a multiple of 4");
  require(args.scale_row_bytes == 0 || args.num_tokens == 0 || args.x_scales != nullptr,
          "scale_row_bytes > 0 needs x_scales");
  require(args.scale_row_bytes == 0 || args.num_rows_out == 0 || args.recv_x_scales != nullptr,
          "scale_row_bytes > 0 needs recv_x_scales");
  require(args.num_topk == 0 || args.num_tokens == 0 || (args.topk_idx != nullptr && args.topk_weights != nullptr),
          "num_topk > 0 needs topk_idx and topk_weights");
  require(args.recv_topk_idx == nullptr || args.num_topk > 0, "recv_topk_idx needs num_topk > 0");
  require((args.recv_topk_idx == nullptr) == (args.recv_topk_weights == nullptr),
          "recv_topk_idx and recv_topk_weights go together");
  require(args.num_topk == 0 || args.num_local_experts >= 1, "num_local_experts must be >= 1 with top-k");
  require(args.num_tokens >= 0 && args.num_rows_out >= 0, "num_tokens and num_rows_out must be >= 0");
  launch_exchange(normal_kernels::dispatch_send, normal_kernels::dispatch_receive, args, args.num_sms, args.num_sms,
                  stream);
}

void launch_normal_combine(const NormalCombineArgs& args, gpuStream_t stream) {
  check_region(args.region);
  check_num_sms(args.num_sms);
  check_topk(args.num_topk);
  require(args.hidden > 0 && args.hidden % normal_kernels::kBf16PerVector == 0,
          "hidden must be a positive multiple of 8 (16-byte bf16 rows)");
  // Empty tensors have null data pointers, so a pointer is required only where rows use it.
  require(args.num_topk == 0 || args.num_rows == 0 || args.topk_weights != nullptr, "num_topk > 0 needs topk_weights");
  require(args.num_topk == 0 || args.num_tokens == 0 || args.combined_topk_weights != nullptr,
          "num_topk > 0 needs combined_topk_weights");
  require(args.num_rows >= 0 && args.num_tokens >= 0, "num_rows and num_tokens must be >= 0");
  launch_exchange(normal_kernels::combine_send, normal_kernels::combine_receive, args, args.num_sms, args.num_sms,
                  stream);
}

}  // namespace uccl_ep
