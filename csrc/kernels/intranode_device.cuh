// Device helpers of the normal-mode kernels (intranode.cu: SM copies; intranode_copy.cu: copy
// engines): flags and waits of the exchange protocol (intranode.h), warp copies, and the per-row
// work both paths share.
#pragma once


#include "kernels/intranode.h"
#include "kernels/lanes.h"

namespace uccl_ep {
namespace normal_kernels {

// The copy-engine path's SM kernels (local copies and sums), and the send layout with the notify:
// one block of these per SM they are given, enough warps in flight to cover memory latency.
constexpr int kWideThreads = 1024;
// Loads in flight per lane in the row copies of the 1024-thread kernels: 4 fit their 64 registers without
// spilling (8 spilled), and 32 warps per SM keep enough loads in flight.
constexpr int kWideCopyUnroll = 4;
constexpr int kBf16PerVector = 8;  // bf16 values in one 16-byte vector

static_assert(kNormalMaxTopk <= kWarpSize, "one lane per top-k entry");
static_assert(kNormalMaxCombineRanks <= kWarpSize, "the sums give each of a token's rows one lane");

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

// In `rank`'s control area: the chunks `src` has ready for it (normal_chunk_word).
__device__ __forceinline__ uint64_t* chunk_word(const NormalRegion& r, int rank, int src) {
  return reinterpret_cast<uint64_t*>(rank_base(r, rank) + normal_chunk_word_offset(src));
}

// In `rank`'s control area: the last combine whose SM-stored rows `src` has put in its staging.
__device__ __forceinline__ uint64_t* sm_pushed_word(const NormalRegion& r, int rank, int src) {
  return reinterpret_cast<uint64_t*>(rank_base(r, rank) + normal_sm_pushed_word_offset(src));
}

__device__ __forceinline__ uint64_t exchanges_done(const NormalRegion& r) {
  return *reinterpret_cast<const volatile uint64_t*>(r.control + kNormalExchangesWord);
}
__device__ __forceinline__ bool aborted(const NormalRegion& r) {
  return *reinterpret_cast<const volatile uint64_t*>(r.control + kNormalAbortedWord) != 0;
}

__device__ inline void record_failure(const NormalRegion& r, int32_t code, int32_t phase, int32_t peer, int32_t detail) {
  *reinterpret_cast<volatile uint64_t*>(r.control + kNormalAbortedWord) = 1;
  // The copy engines' streams may wait on these words (a dispatch's pulls): let them drain.
  for (int src = 0; src < r.num_ranks; ++src) {
    atomicMax_system(reinterpret_cast<unsigned long long*>(chunk_word(r, r.rank, src)), kNormalChunkWordsOpen);
  }
  if (compare_and_swap_system(&r.status->code, 0, code) == 0) {
    r.status->phase = phase;
    r.status->peer = peer;
    r.status->detail = detail;
    __threadfence_system();
  }
}

// One thread waits until the word `peer` writes satisfies `ready(value)`; false on abort or timeout.
// A word that is already there costs one load: the clock is read only when the wait begins.
template <typename Ready>
__device__ inline bool wait_until(const NormalRegion& r, const uint64_t* word, Ready ready, int32_t phase,
                                  int32_t peer) {
  if (!ready(poll_flag(word, r.aggressive_atomics))) {
    const uint64_t start = device_time_ns();
    while (!ready(poll_flag(word, r.aggressive_atomics))) {
      if (aborted(r)) return false;
      if (device_time_ns() - start > static_cast<uint64_t>(r.timeout_ns)) {
        record_failure(r, kNormalTimeout, phase, peer, 0);
        return false;
      }
      device_pause();
    }
  }
  acquire_polled_flag(r.aggressive_atomics);
  return true;
}
__device__ inline bool wait_at_least(const NormalRegion& r, const uint64_t* word, uint64_t target, int32_t phase,
                                     int32_t peer) {
  return wait_until(r, word, [target](uint64_t value) { return value >= target; }, phase, peer);
}

// Whether this block is the last of its grid to get here (every block calls this once, with every
// thread): that block sees every other block's writes. `counter` goes back to 0 for the next launch.
__device__ inline bool last_block_to_finish(uint64_t* counter) {
  __shared__ bool last;
  __syncthreads();  // the block's writes come before its count
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull) + 1 == gridDim.x;
    if (last) atomicExch(reinterpret_cast<unsigned long long*>(counter), 0ull);
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// The whole block waits for every rank's word (`word_of(peer)`) to reach `target`; the answer is
// the same for every thread of the block.
template <typename WordOf>
__device__ inline bool block_wait_all(const NormalRegion& r, WordOf word_of, uint64_t target, int32_t phase) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int peer = threadIdx.x; peer < r.num_ranks; peer += blockDim.x) {
    if (!wait_at_least(r, word_of(peer), target, phase, peer)) failed = 1;
  }
  __syncthreads();
  return failed == 0;
}

// Before a rank stores into the destinations' data areas: every destination has freed the previous exchange.
__device__ inline bool wait_destinations_free(const NormalRegion& r, int32_t phase) {
  const uint64_t epoch = exchanges_done(r) + 1;
  return block_wait_all(r, [&](int peer) { return freed_word(r, r.rank, peer); }, epoch - 1, phase);
}

// Before a rank reads its data area (the notify, the copy-engine path): every source has announced this exchange.
__device__ inline bool wait_sources_arrived(const NormalRegion& r, int32_t phase) {
  return block_wait_all(r, [&](int peer) { return arrived_word(r, r.rank, peer); }, exchanges_done(r), phase);
}

// An exchange's arrival (which also counts it as done) and its freed announcement, by one block.
__device__ inline void block_announce_arrival(const NormalRegion& r) {
  __shared__ int skip;  // one answer for the block: it meets at barriers below
  if (threadIdx.x == 0) skip = aborted(r);
  __syncthreads();
  if (skip) return;
  const uint64_t epoch = exchanges_done(r) + 1;
  for (int peer = threadIdx.x; peer < r.num_ranks; peer += blockDim.x) {
    publish_flag(arrived_word(r, peer, r.rank), epoch, r.aggressive_atomics);
  }
  __syncthreads();
  if (threadIdx.x == 0) r.control[kNormalExchangesWord] = epoch;
  __syncthreads();  // the whole block sees the new count
}

__device__ inline void block_announce_freed(const NormalRegion& r) {
  if (aborted(r)) return;
  const uint64_t epoch = exchanges_done(r);
  for (int peer = threadIdx.x; peer < r.num_ranks; peer += blockDim.x) {
    publish_flag(freed_word(r, peer, r.rank), epoch, r.aggressive_atomics);
  }
}

// ------------------------------------------------------------------------------ copies
__device__ __forceinline__ WarpPosition warp_position() {
  return warp_position_of(threadIdx.x, blockIdx.x, gridDim.x, blockDim.x, kWarpSize);
}

// A warp copies `bytes` (a multiple of 4) through L2: in 16-byte vectors, kUnroll loads in flight
// per lane before their stores, when everything is aligned to them; else in 4-byte words.
template <int kUnroll = 8>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t bytes, int lane) {
  const auto d = reinterpret_cast<uintptr_t>(dst);
  const auto s = reinterpret_cast<uintptr_t>(src);
  if (((d | s | static_cast<uintptr_t>(bytes)) & 15) == 0) {
    const int64_t vectors = bytes / 16;
    const auto* from = reinterpret_cast<const int4*>(src);
    auto* to = reinterpret_cast<int4*>(dst);
    int64_t i = lane;
    for (; i + (kUnroll - 1) * kWarpSize < vectors; i += kUnroll * kWarpSize) {
      int4 values[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) values[u] = load_l2_16(from + i + u * kWarpSize);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) to[i + u * kWarpSize] = values[u];
    }
    for (; i < vectors; i += kWarpSize) to[i] = load_l2_16(from + i);
  } else {
    for (int64_t i = lane; i < bytes / 4; i += kWarpSize) {
      reinterpret_cast<int32_t*>(dst)[i] = load_l2(reinterpret_cast<const int32_t*>(src) + i);
    }
  }
}

// warp_copy_to_each's rare case, out of line so that its registers do not burden the callers' loops.
__device__ __noinline__ inline void warp_copy_to_each_unaligned(LaneMask targets, void* my_target, const void* src,
                                                                int64_t bytes, int lane) {
  for (LaneMask rest = targets; rest != 0; rest &= rest - 1) {
    warp_copy<1>(reinterpret_cast<void*>(warp_shuffle(reinterpret_cast<unsigned long long>(my_target),
                                                      lowest_lane(rest))),
                 src, bytes, lane);
  }
}

// A warp copies `bytes` (a multiple of 4) from `src` to several places: lane t holds the t-th one's
// address where bit t of `targets` is set. Each piece of `src` is loaded once and stored to every
// target (a dispatched token goes to several ranks, and an SM moves about as many bytes as it loads
// plus stores). Unaligned (rare: rows of 16-byte multiples are the rule): a plain copy per target.
// kMaskedTail: the last round's loads go out together too, masked (more registers than a vector a time).
template <int kUnroll, bool kMaskedTail = false>
__device__ __forceinline__ void warp_copy_to_each(LaneMask targets, void* my_target, const void* src, int64_t bytes,
                                                  int lane) {
  const auto target_at = [&](int t) {
    return reinterpret_cast<int4*>(warp_shuffle(reinterpret_cast<unsigned long long>(my_target), t));
  };
  const bool my_aligned = ((targets >> lane) & 1) == 0 || (reinterpret_cast<uintptr_t>(my_target) & 15) == 0;
  if (!warp_all(my_aligned) || ((reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes)) & 15) != 0) {
    warp_copy_to_each_unaligned(targets, my_target, src, bytes, lane);
    return;
  }
  const int64_t vectors = bytes / 16;
  const auto* from = reinterpret_cast<const int4*>(src);
  int64_t first = 0;
  for (; first + kUnroll * kWarpSize <= vectors; first += kUnroll * kWarpSize) {
    int4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) values[u] = load_l2_16(from + first + u * kWarpSize + lane);
    for (LaneMask rest = targets; rest != 0; rest &= rest - 1) {
      int4* to = target_at(lowest_lane(rest)) + first + lane;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) to[u * kWarpSize] = values[u];
    }
  }
  if constexpr (kMaskedTail) {
    if (first < vectors) {
      int4 values[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = first + u * kWarpSize + lane;
        values[u] = i < vectors ? load_l2_16(from + i) : int4{};
      }
      for (LaneMask rest = targets; rest != 0; rest &= rest - 1) {
        int4* to = target_at(lowest_lane(rest)) + first + lane;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (first + u * kWarpSize + lane < vectors) to[u * kWarpSize] = values[u];
        }
      }
    }
  } else {
    // The tail a vector per lane; every lane takes the shuffles, only those with a vector store.
    for (; first < vectors; first += kWarpSize) {
      const bool mine = first + lane < vectors;
      const int4 value = mine ? load_l2_16(from + first + lane) : int4{};
      for (LaneMask rest = targets; rest != 0; rest &= rest - 1) {
        int4* to = target_at(lowest_lane(rest));
        if (mine) to[first + lane] = value;
      }
    }
  }
}

// A warp zeroes `bytes` (a multiple of 4).
__device__ __forceinline__ void warp_zero(void* dst, int64_t bytes, int lane) {
  for (int64_t i = lane; i < bytes / 4; i += kWarpSize) reinterpret_cast<int32_t*>(dst)[i] = 0;
}

__device__ __forceinline__ int64_t received_rows(const int32_t* rank_prefix_matrix, int num_ranks, int rank) {
  return rank_prefix_matrix[(num_ranks - 1) * num_ranks + rank];
}

// Rows `src` sends in all.
__device__ __forceinline__ int64_t sent_rows(const int32_t* rank_prefix_matrix, int num_ranks, int src) {
  int64_t rows = 0;
  for (int dst = 0; dst < num_ranks; ++dst) rows += normal_sent(rank_prefix_matrix, num_ranks, src, dst);
  return rows;
}

// ------------------------------------------------------------------------------ shared row work
// Where one dispatched row goes: x (required), scales (when scale_row_bytes > 0), top-k ids and
// weights, source index (each skipped when null).
struct DispatchRowOut {
  uint8_t* x;
  uint8_t* scales;
  int64_t* topk_idx;
  float* topk_weights;
  int32_t* src_idx;
};

// Row `row` of a NormalDispatchArea at `base`.
__device__ __forceinline__ DispatchRowOut dispatch_row_in_area(uint8_t* base, const NormalDispatchArea& area,
                                                              int64_t row, const NormalDispatchArgs& a) {
  return DispatchRowOut{base + area.x + row * a.x_row_bytes, base + area.scales + row * a.scale_row_bytes,
                        a.num_topk > 0 ? reinterpret_cast<int64_t*>(base + area.topk_idx) + row * a.num_topk : nullptr,
                        reinterpret_cast<float*>(base + area.topk_weights) + row * a.num_topk,
                        reinterpret_cast<int32_t*>(base + area.src_idx) + row};
}

// A row's small fields as one lane holds them between their loads and their stores, so that a token
// going to several ranks loads them once and each field's load does not wait for the last one's store:
// its 16 bytes of the scales (when the scales are at most a vector per lane and aligned), its top-k entry.
struct DispatchRowFields {
  int4 scales;
  int64_t expert;
  float weight;
};
__device__ __forceinline__ const uint8_t* dispatch_scales_row(const NormalDispatchArgs& a, int token) {
  return static_cast<const uint8_t*>(a.x_scales) + static_cast<int64_t>(token) * a.scale_row_bytes;
}
__device__ __forceinline__ bool scales_in_lanes(const NormalDispatchArgs& a, const void* to) {
  return a.scale_row_bytes <= 16 * kWarpSize &&
         ((reinterpret_cast<uintptr_t>(a.x_scales) | reinterpret_cast<uintptr_t>(to) |
           static_cast<uintptr_t>(a.scale_row_bytes)) & 15) == 0;
}
__device__ __forceinline__ DispatchRowFields load_dispatch_fields(const NormalDispatchArgs& a, int token, int lane) {
  DispatchRowFields fields{};
  fields.expert = -1;
  if (a.scale_row_bytes > 0 && lane * 16 < a.scale_row_bytes && scales_in_lanes(a, nullptr)) {
    fields.scales = load_l2_16(reinterpret_cast<const int4*>(dispatch_scales_row(a, token)) + lane);
  }
  if (a.topk_idx != nullptr && lane < a.num_topk) {
    const int64_t entry = static_cast<int64_t>(token) * a.num_topk + lane;
    fields.expert = a.topk_idx[entry];
    fields.weight = a.topk_weights[entry];
  }
  return fields;
}
// Token `token`'s small fields as rank `dst` receives them: its top-k ids become `dst`'s local experts
// (-1 for the others, their weights 0).
__device__ __forceinline__ void store_dispatch_fields(const NormalDispatchArgs& a, const DispatchRowFields& fields,
                                                      int token, int dst, const DispatchRowOut& out, int lane) {
  if (a.scale_row_bytes > 0) {
    if (scales_in_lanes(a, out.scales)) {
      if (lane * 16 < a.scale_row_bytes) reinterpret_cast<int4*>(out.scales)[lane] = fields.scales;
    } else {
      warp_copy<1>(out.scales, dispatch_scales_row(a, token), a.scale_row_bytes, lane);
    }
  }
  if (out.topk_idx != nullptr && lane < a.num_topk) {
    const int64_t local = fields.expert - static_cast<int64_t>(dst) * a.num_local_experts;
    const bool keep = fields.expert >= 0 && local >= 0 && local < a.num_local_experts;
    out.topk_idx[lane] = keep ? local : -1;
    out.topk_weights[lane] = keep ? fields.weight : 0.0f;
  }
  if (out.src_idx != nullptr && lane == 0) *out.src_idx = token;
}

// A warp writes token `token`'s row as rank `dst` receives it (its small fields first). Without
// `with_x`, all but the row's data.
template <int kUnroll = 8>
__device__ __forceinline__ void write_dispatch_row(const NormalDispatchArgs& a, int token, int dst,
                                                   const DispatchRowOut& out, int lane, bool with_x = true) {
  store_dispatch_fields(a, load_dispatch_fields(a, token, lane), token, dst, out, lane);
  if (with_x) {
    warp_copy<kUnroll>(out.x, static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(token) * a.x_row_bytes,
                       a.x_row_bytes, lane);
  }
}

// The rows summed into one combined token: for each rank the token went to, where that rank's
// rows start (x and top-k weights); the token's row there is its send position.
struct CombineSources {
  const uint8_t* x[kNormalMaxRanks];
  const float* topk_weights[kNormalMaxRanks];
};

__device__ __forceinline__ void add_bf16_vector(float (&sum)[kBf16PerVector], int4 vector) {
  const auto* values = reinterpret_cast<const uint32_t*>(&vector);
  for (int i = 0; i < kBf16PerVector / 2; ++i) {
    const float2 pair = bf16x2_to_float2(values[i]);
    sum[2 * i] += pair.x;
    sum[2 * i + 1] += pair.y;
  }
}

// Per lane, kSumUnroll vectors of two rows (either may be absent: null), added to `sum` in that
// order. All the loads are issued before the first add: with one row's loads at a time, a few SMs
// reached barely half the bandwidth.
constexpr int kSumUnroll = 2;
__device__ __forceinline__ void add_two_rows(float (&sum)[kSumUnroll][kBf16PerVector], const uint8_t* row0,
                                             const uint8_t* row1, int64_t v0, int64_t vectors) {
  int4 values[2][kSumUnroll];
#pragma unroll
  for (int u = 0; u < kSumUnroll; ++u) {
    const bool inside = v0 + u * kWarpSize < vectors;
    if (inside && row0 != nullptr) values[0][u] = load_l2_16(row0 + (v0 + u * kWarpSize) * 16);
    if (inside && row1 != nullptr) values[1][u] = load_l2_16(row1 + (v0 + u * kWarpSize) * 16);
  }
#pragma unroll
  for (int u = 0; u < kSumUnroll; ++u) {
    if (v0 + u * kWarpSize >= vectors) continue;
    if (row0 != nullptr) add_bf16_vector(sum[u], values[0][u]);
    if (row1 != nullptr) add_bf16_vector(sum[u], values[1][u]);
  }
}

// A warp sums one token's `count` rows (lane i holds the i-th row's address, ranks ascending) like
// the reference: from 0, ranks in order, then the biases. The first two rows' addresses are taken
// once, before the vector loop; a token on more ranks adds the others two at a time. In isolation
// (bench/probes/combine_sum.cu, H100, 4096 x 7168 bf16, two rows per token) this takes 242 us at
// 8 SMs and 108 at 24, where one row at a time took 396 and 172. Four vectors per row would gain
// another 15% there, but spill at 1024 threads in the library's kernels.
__device__ __forceinline__ void sum_token_rows(const NormalCombineArgs& a, int64_t token, const uint8_t* my_row,
                                               int count, int lane) {
  constexpr int kUnroll = kSumUnroll;
  const int64_t vectors = a.hidden / kBf16PerVector;
  const auto row_at = [&](int i) {
    const auto address = warp_shuffle(reinterpret_cast<unsigned long long>(my_row), i % kWarpSize);
    return i < count ? reinterpret_cast<const uint8_t*>(address) : nullptr;
  };
  const uint8_t* row0 = row_at(0);
  const uint8_t* row1 = row_at(1);
  for (int64_t v0 = lane; v0 < vectors; v0 += kUnroll * kWarpSize) {
    float sum[kUnroll][kBf16PerVector] = {};
    add_two_rows(sum, row0, row1, v0, vectors);
    for (int i = 2; i < count; i += 2) add_two_rows(sum, row_at(i), row_at(i + 1), v0, vectors);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * kWarpSize;
      if (v >= vectors) continue;
      if (a.bias0 != nullptr) add_bf16_vector(sum[u], reinterpret_cast<const int4*>(a.bias0)[token * vectors + v]);
      if (a.bias1 != nullptr) add_bf16_vector(sum[u], reinterpret_cast<const int4*>(a.bias1)[token * vectors + v]);
      int4 packed;
      auto* out = reinterpret_cast<uint32_t*>(&packed);
      for (int i = 0; i < kBf16PerVector / 2; ++i) {
        out[i] = float2_to_bf16x2(sum[u][2 * i], sum[u][2 * i + 1]);
      }
      reinterpret_cast<int4*>(a.combined_x)[token * vectors + v] = packed;
    }
  }
}

// The warps `w` (w.first counted from the range's first token) take the tokens of `tokens` in turn,
// a warp per token, and sum its rows (sum_token_rows) and its top-k weights, ranks in order. Lane d
// reads rank d's entry of the token (a combine serves at most kNormalMaxCombineRanks ranks):
// `rows_ready(d, has_row, position)` (the whole warp calls it) waits until the token's rows have
// landed; false stops the warp (a failure was recorded).
template <typename RowsReady>
__device__ __forceinline__ void reduce_combined_tokens(const NormalCombineArgs& a, const CombineSources& from,
                                                       NormalTokenRange tokens, WarpPosition w,
                                                       RowsReady rows_ready) {
  const int num_ranks = a.region.num_ranks;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  for (int64_t token = tokens.first + w.first; token < tokens.end; token += w.stride) {
    const bool* in_rank = a.is_token_in_rank + token * num_ranks;
    const int32_t* pos = a.send_pos + token * num_ranks;
    const int dst = w.lane;
    const bool has = dst < num_ranks && in_rank[dst];
    const int64_t position = has ? pos[dst] : 0;
    if (!rows_ready(dst, has, position)) return;
    // Lane i takes the address of the token's i-th row: each present row in turn, ranks ascending.
    const auto row = reinterpret_cast<unsigned long long>(has ? from.x[dst] + position * row_bytes : nullptr);
    unsigned long long my_address = 0;
    const int count = warp_compact(DeviceWarp{}, has, row, my_address);
    const auto* my_row = reinterpret_cast<const uint8_t*>(my_address);
    sum_token_rows(a, token, my_row, count, w.lane);
    if (w.lane < a.num_topk) {
      float sum = 0.0f;
      for (int dst = 0; dst < num_ranks; ++dst) {
        if (!in_rank[dst]) continue;
        sum += load_l2(from.topk_weights[dst] + static_cast<int64_t>(pos[dst]) * a.num_topk + w.lane);
      }
      a.combined_topk_weights[token * a.num_topk + w.lane] = sum;
    }
  }
}

}  // namespace normal_kernels
}  // namespace uccl_ep
