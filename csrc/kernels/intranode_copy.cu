// Normal-mode dispatch and combine with the copy engines carrying the NVLink traffic (the steps
// are in intranode_copy.h).
#include "kernels/intranode_copy.h"

#include <algorithm>
#include <stdexcept>
#include <thread>
#include <string>
#include <utility>

#include "common/deadline.h"
#include "common/require.h"
#include "kernels/intranode_device.cuh"

namespace uccl_ep {
namespace normal_kernels {

// The gather is bound by its loads' latency: with half the threads of the other kernels a lane keeps a
// whole round of kGatherUnroll vectors of a row in flight without spilling (14: DeepSeek's fp8 row of
// 7168 bytes in one round). receive_own_rows stays at kWideThreads: its small-field loops need the warps.
constexpr int kGatherThreads = 512;
constexpr int kGatherUnroll = 14;

__device__ __forceinline__ NormalRowBytes dispatch_row_bytes(const NormalDispatchArgs& a) {
  return NormalRowBytes{a.x_row_bytes, a.scale_row_bytes, a.num_topk};
}
__device__ __forceinline__ NormalRowBytes combine_row_bytes(const NormalCombineArgs& a) {
  return NormalRowBytes{static_cast<int64_t>(a.hidden) * 2, 0, a.num_topk};
}

// Combine, before the pushes: every rank has freed the previous exchange. Then the values each pushed
// chunk's 8-byte copy writes into its owner's chunk word (the exchange's number, which only the device
// knows), and the arrival, which counts the exchange (the chunk words tell when rows landed).
__global__ void wait_destinations_freed_then_arrive(NormalRegion r, uint64_t* chunk_values, int32_t chunks) {
  if (wait_destinations_free(r, kNormalCombineSend)) {
    const uint64_t epoch = exchanges_done(r) + 1;
    for (int chunk = threadIdx.x; chunk < chunks; chunk += blockDim.x) {
      chunk_values[chunk] = normal_chunk_word(epoch, chunk + 1, chunks);
    }
  }
  block_announce_arrival(r);  // not after a failed wait: it recorded the failure, and the arrival skips
}

// Dispatch, on `source`'s stream before its pull: `source` announced this exchange (its staging is
// complete; this rank's own arrival, before the fork, counted the exchange).
__global__ void wait_source_arrived(NormalRegion r, int32_t source) {
  wait_at_least(r, arrived_word(r, r.rank, source), exchanges_done(r), kNormalDispatchRecv, source);
}

// Dispatch, on `source`'s stream before a pull piece when the host does not know the exchange's number
// (a cached dispatch): `source` has gathered `chunks` pieces. The stream forked before the gather, whose
// arrival may or may not have counted the exchange yet; this rank's freed word for itself has the last
// exchange until this one ends, after its pulls.
__global__ void wait_source_gathered(NormalRegion r, int32_t source, int32_t chunks) {
  const uint64_t epoch = poll_flag(freed_word(r, r.rank, r.rank), r.aggressive_atomics) + 1;
  wait_at_least(r, chunk_word(r, r.rank, source), normal_chunk_word(epoch, chunks, 0), kNormalDispatchRecv, source);
}

// The calling warp has written its rows of one pull chunk; the last warp of the grid to get here
// raises the chunk word for this rank of every peer that pulls (not `pushed` to) to `value` (all
// warps' rows first, at system scope: the peers' copy engines read them). Warps, not blocks, count: a
// block would wait for its slowest warp at every chunk. Every warp takes the chunks in order, so they
// complete in order.
__device__ inline void announce_gathered(const NormalRegion& r, const bool* pushed, uint32_t* warps_done,
                                         uint64_t value, int lane) {
  __threadfence_system();
  warp_sync();
  const uint32_t warps = gridDim.x * (blockDim.x / kWarpSize);
  if (lane != 0 || atomicAdd(warps_done, 1u) != warps - 1) return;
  *warps_done = 0;  // the next gather, after this kernel, counts from zero
  __threadfence_system();
  for (int peer = 0; peer < r.num_ranks; ++peer) {
    if (peer != r.rank && !pushed[peer]) {
      atomicMax_system(reinterpret_cast<unsigned long long*>(chunk_word(r, peer, r.rank)), value);
    }
  }
}

// A warp per token of `tokens` over the grid: the token's row loaded once and stored for every rank
// `position(token, group)` names (lane t: the position among this rank's rows for rank group * warp + t,
// -1 for none), where `row_at(dst, pos)` says, its data only where `with_x(dst)`; then its small fields,
// loaded with the data and stored after it. The next (token, group)'s positions load during this row, so
// no load waits alone.
template <typename Position, typename RowAt, typename WithX>
__device__ __forceinline__ void store_token_rows(const NormalDispatchArgs& a, NormalTokenRange tokens,
                                                 const WarpPosition& w, Position position, RowAt row_at,
                                                 WithX with_x) {
  const int groups = (a.region.num_ranks + kWarpSize - 1) / kWarpSize;
  int token = static_cast<int>(tokens.first) + w.first, group = 0;
  int32_t pos = token < tokens.end ? position(token, group) : -1;
  while (token < tokens.end) {
    int next_token = token, next_group = group + 1;
    if (next_group == groups) next_token += w.stride, next_group = 0;
    const int32_t next_pos = next_token < tokens.end ? position(next_token, next_group) : -1;
    const LaneMask sent = warp_ballot(pos >= 0);
    if (sent != 0) {
      const DispatchRowFields fields = load_dispatch_fields(a, token, w.lane);
      const int mine = group * kWarpSize + w.lane;
      const bool my_x = pos >= 0 && with_x(mine);
      uint8_t* to = my_x ? row_at(mine, pos).x : nullptr;
      const uint8_t* row = static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(token) * a.x_row_bytes;
      warp_copy_to_each<kGatherUnroll, true>(warp_ballot(my_x), to, row, a.x_row_bytes, w.lane);
      for (LaneMask rest = sent; rest != 0; rest &= rest - 1) {
        const int dst = group * kWarpSize + lowest_lane(rest);
        store_dispatch_fields(a, fields, token, dst, row_at(dst, warp_shuffle(pos, lowest_lane(rest))), w.lane);
      }
    }
    token = next_token, group = next_group, pos = next_pos;
  }
}

// Dispatch, a block's part: the rows for every other rank into this rank's staging, one pull chunk
// after another, each announced to the peers once every warp has gathered its part. With push_rows,
// the rows for peers it pushes to (normal_pushes_rows) without their data, which the copy engines
// push from x, and unannounced: the pushes raise those peers' chunk words.
__device__ void gather_block_for_peers(const NormalDispatchArgs& a, NormalPullChunks chunks, bool push_rows,
                                       uint32_t* gathered_warps) {
  const NormalRegion& r = a.region;
  if (!wait_destinations_free(r, kNormalDispatchSend)) return;
  // The host checks the same counts before it pulls; here only: gather nothing that would not fit.
  if (normal_staging_offset(NormalStaging::kDispatch, a.rank_prefix_matrix, r.num_ranks, r.rank, r.num_ranks,
                            dispatch_row_bytes(a)) > r.data_bytes) {
    return;
  }
  __shared__ uint8_t* block[kNormalMaxRanks];
  __shared__ NormalDispatchArea area[kNormalMaxRanks];
  __shared__ bool pushed[kNormalMaxRanks];
  __shared__ bool landing_fits;
  if (threadIdx.x == 0) {
    landing_fits =
        push_rows &&
        normal_landing_fits(a.rank_prefix_matrix, r.num_ranks,
                            normal_landing_offset(a.rank_prefix_matrix, r.num_ranks, dispatch_row_bytes(a),
                                                  normal_notify_area_bytes(r.num_ranks, chunks.num_channels,
                                                                           a.num_local_experts)),
                            a.x_row_bytes, r.data_bytes);
  }
  __syncthreads();
  for (int dst = threadIdx.x; dst < r.num_ranks; dst += blockDim.x) {
    const int64_t sent = normal_sent(a.rank_prefix_matrix, r.num_ranks, r.rank, dst);
    block[dst] = data_area(r, r.rank) + normal_staging_offset(NormalStaging::kDispatch, a.rank_prefix_matrix,
                                                               r.num_ranks, r.rank, dst, dispatch_row_bytes(a));
    area[dst] = normal_dispatch_area(sent, a.x_row_bytes, a.scale_row_bytes, a.num_topk);
    pushed[dst] = dst != r.rank && normal_pushes_rows(push_rows, landing_fits, a.num_tokens, sent);
  }
  __syncthreads();
  const uint64_t epoch = exchanges_done(r) + 1;  // the arrival after this kernel counts the exchange
  const WarpPosition w = warp_position();
  const auto position = [&](int token, int group) -> int32_t {  // -1 also for the rank itself
    const int mine = group * kWarpSize + w.lane;
    return mine < r.num_ranks && mine != r.rank ? a.send_pos[static_cast<int64_t>(token) * r.num_ranks + mine] : -1;
  };
  const auto row_at = [&](int dst, int32_t pos) { return dispatch_row_in_area(block[dst], area[dst], pos, a); };
  const auto with_x = [&](int dst) { return !pushed[dst]; };
  for (int chunk = 0; chunk < chunks.count; ++chunk) {
    store_token_rows(a, normal_pull_chunk_tokens(chunks, chunk, a.num_tokens), w, position, row_at, with_x);
    announce_gathered(r, pushed, gathered_warps + chunk, normal_chunk_word(epoch, chunk + 1, chunks.count),
                      w.lane);
  }
}

// Dispatch: the gather, then the arrival by the last block to finish (a rank whose staging would not
// fit arrives with nothing gathered). The system fence puts every block's rows before the arrival.
__global__ void __launch_bounds__(kGatherThreads, 1)
    gather_for_peers(NormalDispatchArgs a, NormalPullChunks chunks, bool push_rows, uint32_t* gathered_warps) {
  gather_block_for_peers(a, chunks, push_rows, gathered_warps);
  __threadfence_system();
  if (last_block_to_finish(a.region.control + kNormalBlocksDoneWord)) block_announce_arrival(a.region);
}

// The end of a copy-engine exchange, by the last block of its last kernel: the copy streams in
// `copies` have done their copies (which read and write the caller's tensors: its stream may reuse
// them after this kernel), then freed. A stream late past the timeout records the failure, which
// raises this rank's chunk words so that its stream waits let go; after twice the timeout the wait
// gives up on that stream.
__device__ void end_after_copies(const NormalRegion& r, const NormalCopiesDone& copies, int32_t phase) {
  for (int i = threadIdx.x; i < 2 * r.num_ranks; i += blockDim.x) {
    if (!copies.has(i)) continue;
    const uint64_t start = device_time_ns();
    bool recorded = false;
    while (load_acquire_system(copies.done + i) == 0) {
      const uint64_t waited = device_time_ns() - start;
      if (!recorded && waited > static_cast<uint64_t>(r.timeout_ns)) {
        record_failure(r, kNormalTimeout, phase, i % r.num_ranks, 0);
        recorded = true;
      }
      if (waited > 2 * static_cast<uint64_t>(r.timeout_ns)) break;
      device_pause();
    }
    copies.done[i] = 0;  // for the next exchange's streams, which start after this kernel
  }
  __syncthreads();
  block_announce_freed(r);
}

// An exchange's end on its own (the caller gave up before its last kernel).
__global__ void end_exchange_after_copies(NormalRegion r, NormalCopiesDone copies, int32_t phase) {
  end_after_copies(r, copies, phase);
}

// Without stream writes on the device: a copy stream's done word, after its copies.
__global__ void mark_copies_done(uint64_t* word) { store_release_system(word, 1); }

// Dispatch by sends (normal_rows_by_sends), a block's part: every row into the data area of each rank it
// goes to, this one's included, at `offset` (normal_sends_offset), as that rank receives it. A rank whose
// rows would not fit sends nothing (every rank decides alike; the host then ends the exchange unread).
__device__ void send_block_to_receivers(const NormalDispatchArgs& a, int64_t offset) {
  const NormalRegion& r = a.region;
  if (!wait_destinations_free(r, kNormalDispatchSend)) return;
  if (!normal_sends_fit(a.rank_prefix_matrix, r.num_ranks, offset, dispatch_row_bytes(a), r.data_bytes)) return;
  __shared__ uint8_t* base[kNormalMaxRanks];
  __shared__ NormalDispatchArea area[kNormalMaxRanks];
  __shared__ int64_t first[kNormalMaxRanks];  // this rank's first row among each receiver's
  for (int dst = threadIdx.x; dst < r.num_ranks; dst += blockDim.x) {
    base[dst] = data_area(r, dst) + offset;
    area[dst] = normal_dispatch_area(received_rows(a.rank_prefix_matrix, r.num_ranks, dst), a.x_row_bytes,
                                     a.scale_row_bytes, a.num_topk);
    first[dst] = normal_rows_before(a.rank_prefix_matrix, r.num_ranks, r.rank, dst);
  }
  __syncthreads();
  const WarpPosition w = warp_position();
  const auto position = [&](int token, int group) -> int32_t {
    const int mine = group * kWarpSize + w.lane;
    return mine < r.num_ranks ? a.send_pos[static_cast<int64_t>(token) * r.num_ranks + mine] : -1;
  };
  const auto row_at = [&](int dst, int32_t pos) {
    return dispatch_row_in_area(base[dst], area[dst], first[dst] + pos, a);
  };
  store_token_rows(a, NormalTokenRange{0, a.num_tokens}, w, position, row_at, [](int) { return true; });
}

// Dispatch by sends: the sends, then, by the last block to finish, the arrival and the wait for every
// source's (their rows are in this rank's data area when the kernel ends). The system fence puts every
// block's rows before the arrival.
__global__ void __launch_bounds__(kGatherThreads, 1) send_to_receivers(NormalDispatchArgs a, int64_t offset) {
  send_block_to_receivers(a, offset);
  __threadfence_system();
  if (last_block_to_finish(a.region.control + kNormalBlocksDoneWord)) {
    block_announce_arrival(a.region);
    wait_sources_arrived(a.region, kNormalDispatchRecv);
  }
}

// Dispatch by sends, after send_to_receivers: the received rows' small fields (fp8 scales, top-k, source
// index: each a contiguous array at `offset` in this rank's data area and in its output) by the SMs, beside
// the copy engine's copy of their data; then the exchange's end once `copies` are done.
__global__ void __launch_bounds__(kWideThreads, 1)
    receive_sent_fields(NormalDispatchArgs a, int64_t offset, NormalCopiesDone copies) {
  const uint8_t* rows = data_area(a.region, a.region.rank) + offset;
  const int64_t n = a.num_rows_out, k = a.num_topk;
  const NormalDispatchArea area = normal_dispatch_area(n, a.x_row_bytes, a.scale_row_bytes, k);
  const WarpPosition w = warp_position();
  // Each field in one slice per warp, 16-byte aligned where it starts (every size is a multiple of 4 bytes).
  const auto copy_field = [&](void* to, int64_t from, int64_t bytes) {
    if (to == nullptr) return;
    const int64_t slice = ((bytes + w.stride - 1) / w.stride + 15) & ~int64_t{15};
    const int64_t begin = w.first * slice < bytes ? w.first * slice : bytes;
    const int64_t end = begin + slice < bytes ? begin + slice : bytes;
    warp_copy<kWideCopyUnroll>(static_cast<uint8_t*>(to) + begin, rows + from + begin, end - begin, w.lane);
  };
  if (!aborted(a.region)) {
    copy_field(a.recv_x_scales, area.scales, n * a.scale_row_bytes);
    copy_field(a.recv_topk_idx, area.topk_idx, n * k * 8);
    copy_field(a.recv_topk_weights, area.topk_weights, n * k * 4);
    copy_field(a.recv_src_idx, area.src_idx, n * 4);
  }
  if (last_block_to_finish(a.region.control + kNormalBlocksDoneWord)) {
    end_after_copies(a.region, copies, kNormalDispatchRecv);
  }
}

// A peer's block for this rank in its staging.
struct PeerBlock {
  const uint8_t* base;
  NormalDispatchArea area;
  int64_t rows;   // rows it holds
  int64_t first;  // where they go in the outputs
};
__device__ __forceinline__ PeerBlock peer_block(const NormalDispatchArgs& a, int src) {
  const NormalRegion& r = a.region;
  const int64_t rows = normal_sent(a.rank_prefix_matrix, r.num_ranks, src, r.rank);
  return PeerBlock{data_area(r, src) + normal_staging_offset(NormalStaging::kDispatch, a.rank_prefix_matrix,
                                                             r.num_ranks, src, r.rank, dispatch_row_bytes(a)),
                   normal_dispatch_area(rows, a.x_row_bytes, a.scale_row_bytes, a.num_topk), rows,
                   normal_rows_before(a.rank_prefix_matrix, r.num_ranks, src, r.rank)};
}

// Dispatch, a block's part after the arrival (beside the pulls): this rank's rows to itself, the tail of each peer's
// block that the copy engines leave to SMs (sm_pull_percent; none of the peers in `pushing_sources`,
// whose rows the copy engines move whole), and the small fields of every peer row (fp8 scales,
// top-k, source index), read from the peers' staging: copy engines would pay a ramp per extra copy
// for them. With `own_x_by_engine` a copy engine copies the own rows' data (runs of consecutive
// tokens), and the SMs write the rest of each own row.
__device__ void receive_block_own_rows(const NormalDispatchArgs& a, int32_t sm_pull_percent, bool own_x_by_engine,
                                       uint32_t pushing_sources) {
  const NormalRegion& r = a.region;
  if (!wait_sources_arrived(r, kNormalDispatchRecv)) return;
  const int num_ranks = r.num_ranks, me = r.rank, k = a.num_topk;
  const WarpPosition w = warp_position();
  const int64_t own_first = normal_rows_before(a.rank_prefix_matrix, num_ranks, me, me);
  // As the gather: the next token's position loads during this row.
  const auto own_position = [&](int token) -> int32_t {
    return token < a.num_tokens ? a.send_pos[static_cast<int64_t>(token) * num_ranks + me] : -1;
  };
  int32_t pos = own_position(w.first);
  for (int token = w.first; token < a.num_tokens; token += w.stride) {
    const int32_t next_pos = own_position(token + w.stride);
    if (pos >= 0) {
      const int64_t row = own_first + pos;
      const DispatchRowOut out{
          static_cast<uint8_t*>(a.recv_x) + row * a.x_row_bytes,
          static_cast<uint8_t*>(a.recv_x_scales) + row * a.scale_row_bytes,
          a.recv_topk_idx == nullptr ? nullptr : a.recv_topk_idx + row * k,
          a.recv_topk_weights == nullptr ? nullptr : a.recv_topk_weights + row * k,
          a.recv_src_idx == nullptr ? nullptr : a.recv_src_idx + row};
      write_dispatch_row<kWideCopyUnroll>(a, token, me, out, w.lane, !own_x_by_engine);
    }
    pos = next_pos;
  }
  for (int src = 0; src < num_ranks && sm_pull_percent > 0; ++src) {
    if (src == me || normal_rank_in_mask(pushing_sources, src)) continue;
    const PeerBlock b = peer_block(a, src);
    for (int64_t row = normal_copy_engine_rows(b.rows, sm_pull_percent) + w.first; row < b.rows; row += w.stride) {
      warp_copy<kWideCopyUnroll>(static_cast<uint8_t*>(a.recv_x) + (b.first + row) * a.x_row_bytes,
                                 b.base + b.area.x + row * a.x_row_bytes, a.x_row_bytes, w.lane);
    }
  }
  if (a.scale_row_bytes == 0 && a.recv_topk_idx == nullptr && a.recv_src_idx == nullptr) return;
  for (int src = 0; src < num_ranks; ++src) {
    if (src == me) continue;
    const PeerBlock b = peer_block(a, src);
    for (int64_t row = w.first; row < b.rows; row += w.stride) {
      if (a.scale_row_bytes > 0) {
        warp_copy<1>(static_cast<uint8_t*>(a.recv_x_scales) + (b.first + row) * a.scale_row_bytes,
                     b.base + b.area.scales + row * a.scale_row_bytes, a.scale_row_bytes, w.lane);
      }
      if (a.recv_topk_idx != nullptr && w.lane < k) {
        a.recv_topk_idx[(b.first + row) * k + w.lane] =
            load_l2(reinterpret_cast<const long long*>(b.base + b.area.topk_idx) + row * k + w.lane);
        a.recv_topk_weights[(b.first + row) * k + w.lane] =
            load_l2(reinterpret_cast<const float*>(b.base + b.area.topk_weights) + row * k + w.lane);
      }
      if (a.recv_src_idx != nullptr && w.lane == 0) {
        a.recv_src_idx[b.first + row] = load_l2(reinterpret_cast<const int32_t*>(b.base + b.area.src_idx) + row);
      }
    }
  }
}

// Dispatch, after the arrival (beside the pulls), then the exchange's end once the copies are done.
__global__ void __launch_bounds__(kWideThreads, 1)
    receive_own_rows(NormalDispatchArgs a, int32_t sm_pull_percent, bool own_x_by_engine, uint32_t pushing_sources,
                     NormalCopiesDone copies) {
  receive_block_own_rows(a, sm_pull_percent, own_x_by_engine, pushing_sources);
  if (last_block_to_finish(a.region.control + kNormalBlocksDoneWord)) {
    end_after_copies(a.region, copies, kNormalDispatchRecv);
  }
}

// Combine, before the sums: the rows the copy engines leave to SMs (the last sm_push_percent of
// each peer's, with their top-k weights) into that peer's staging, then, once every warp stored its
// part, the exchange's number into each peer's sm_pushed word for this rank.
__device__ void push_sm_share(const NormalCombineArgs& a, int32_t sm_push_percent, uint32_t* warps_done,
                              uint64_t epoch) {
  const NormalRegion& r = a.region;
  const int num_ranks = r.num_ranks, me = r.rank, k = a.num_topk;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const WarpPosition w = warp_position();
  for (int owner = 0; owner < num_ranks; ++owner) {
    if (owner == me) continue;
    const int64_t rows = normal_sent(a.rank_prefix_matrix, num_ranks, owner, me);
    const int64_t first = normal_rows_before(a.rank_prefix_matrix, num_ranks, owner, me);
    uint8_t* block = data_area(r, owner) + normal_staging_offset(NormalStaging::kCombine, a.rank_prefix_matrix,
                                                                 num_ranks, owner, me, combine_row_bytes(a));
    const NormalCombineArea area = normal_combine_area(rows, row_bytes, k);
    for (int64_t row = normal_copy_engine_rows(rows, sm_push_percent) + w.first; row < rows; row += w.stride) {
      warp_copy<kWideCopyUnroll>(block + area.x + row * row_bytes,
                                 static_cast<const uint8_t*>(a.x) + (first + row) * row_bytes, row_bytes, w.lane);
      if (w.lane < k) {
        reinterpret_cast<float*>(block + area.topk_weights)[row * k + w.lane] =
            a.topk_weights[(first + row) * k + w.lane];
      }
    }
  }
  __threadfence_system();
  warp_sync();
  const uint32_t warps = gridDim.x * (blockDim.x / kWarpSize);
  if (w.lane != 0 || atomicAdd(warps_done, 1u) != warps - 1) return;
  *warps_done = 0;  // the next combine counts from zero
  __threadfence_system();
  for (int owner = 0; owner < num_ranks; ++owner) {
    if (owner != me) publish_flag(sm_pushed_word(r, owner, me), epoch, r.aggressive_atomics);
  }
}

// Combine, a block's part: each token's rows, its own straight from x, the others' from the blocks
// the peers push into this rank's staging, summed as soon as the chunks holding them have landed
// (or, for the rows their SMs store, once their sm_pushed word names this exchange).
__device__ void reduce_block_from_staging(const NormalCombineArgs& a, int32_t sm_push_percent,
                                          uint32_t* pushed_warps) {
  const NormalRegion& r = a.region;
  const int num_ranks = r.num_ranks, me = r.rank;
  __shared__ CombineSources from;
  __shared__ int64_t engine_rows[kNormalMaxRanks];  // of the rows each peer returns, those its copy engines push
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  for (int dst = threadIdx.x; dst < num_ranks; dst += blockDim.x) {
    const int64_t rows = normal_sent(a.rank_prefix_matrix, num_ranks, me, dst);
    engine_rows[dst] = normal_copy_engine_rows(rows, sm_push_percent);
    if (dst == me) {
      const int64_t own_first = normal_rows_before(a.rank_prefix_matrix, num_ranks, me, me);
      from.x[dst] = static_cast<const uint8_t*>(a.x) + own_first * row_bytes;
      from.topk_weights[dst] = a.topk_weights + own_first * a.num_topk;
    } else {
      const uint8_t* base = data_area(r, me) + normal_staging_offset(NormalStaging::kCombine, a.rank_prefix_matrix,
                                                                      num_ranks, me, dst, combine_row_bytes(a));
      const NormalCombineArea area = normal_combine_area(rows, row_bytes, a.num_topk);
      from.x[dst] = base + area.x;
      from.topk_weights[dst] = reinterpret_cast<const float*>(base + area.topk_weights);
    }
  }
  __syncthreads();
  if (aborted(r)) return;
  const uint64_t epoch = exchanges_done(r);  // counted by the arrival before this kernel
  if (sm_push_percent > 0) push_sm_share(a, sm_push_percent, pushed_warps, epoch);
  // Lane d watches peer d and remembers what it has seen of it: how many of its engine rows have
  // landed, and whether its SM share has. Tokens run in order, so most find their rows already known
  // to be there and cost no load of a peer's word.
  int32_t landed = 0;  // rows between two ranks fit an int32 (the layout's counts are int32)
  bool pushed = false;
  const NormalTokenRange all_tokens{0, a.num_tokens};
  reduce_combined_tokens(a, from, all_tokens, warp_position(), [&](int dst, bool has_row, int64_t pos) {
    bool ready = true;
    if (has_row && dst != me) {
      const int64_t by_engines = engine_rows[dst];
      if (pos < by_engines) {
        if (pos >= landed) {
          // The pusher's chunk count comes with its word: ranks may combine with different SMs.
          int64_t seen = 0;
          ready = wait_until(
              r, chunk_word(r, me, dst),
              [&](uint64_t word) { return (seen = normal_combine_rows_landed(word, epoch, by_engines)) > pos; },
              kNormalCombineRecv, dst);
          landed = static_cast<int32_t>(seen);
        }
      } else if (!pushed) {
        ready = pushed = wait_at_least(r, sm_pushed_word(r, me, dst), epoch, kNormalCombineRecv, dst);
      }
    }
    return warp_all(ready);
  });
}

// Combine: the sums, then the exchange's end once this rank's pushes are done.
__global__ void __launch_bounds__(kWideThreads, 1)
    reduce_from_staging(NormalCombineArgs a, int32_t sm_push_percent, uint32_t* pushed_warps,
                        NormalCopiesDone copies) {
  reduce_block_from_staging(a, sm_push_percent, pushed_warps);
  if (last_block_to_finish(a.region.control + kNormalBlocksDoneWord)) {
    end_after_copies(a.region, copies, kNormalCombineSend);
  }
}

}  // namespace normal_kernels

void load_normal_copy_kernels() {
  using namespace normal_kernels;
  gpu_load_kernels(wait_destinations_freed_then_arrive, wait_source_arrived, wait_source_gathered, gather_for_peers,
                   receive_own_rows, send_to_receivers, receive_sent_fields, reduce_from_staging,
                   end_exchange_after_copies, mark_copies_done);
}

namespace {

void copy_async(void* dst, const void* src, int64_t bytes, gpuStream_t stream) {
  if (bytes > 0) UCCL_EP_GPU_CHECK(gpu_copy_async(dst, src, static_cast<size_t>(bytes), stream));
}

// The rows of x in `runs`, those of tokens in `tokens`, to their rows counted from `rows` (a run's
// row r at rows + r * row_bytes): one batched copy.
void copy_token_runs(const std::vector<NormalTokenRun>& runs, NormalTokenRange tokens, const void* x, uint8_t* rows,
                     int64_t row_bytes, gpuStream_t stream) {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for (const NormalTokenRun& run : runs) {
    const int64_t from = std::max(run.token, tokens.first), to = std::min(run.token + run.count, tokens.end);
    if (from >= to) continue;
    dsts.push_back(rows + (run.row + from - run.token) * row_bytes);
    srcs.push_back(static_cast<const uint8_t*>(x) + from * row_bytes);
    sizes.push_back(static_cast<size_t>((to - from) * row_bytes));
  }
  if (!sizes.empty()) UCCL_EP_GPU_CHECK(gpu_copy_batch_async(dsts.data(), srcs.data(), sizes.data(), sizes.size(), stream));
}

}  // namespace

int64_t normal_staging_bytes(NormalStaging kind, const std::vector<int32_t>& rank_prefix_matrix_host, int num_ranks,
                             int owner, NormalRowBytes row_bytes) {
  require(static_cast<int64_t>(rank_prefix_matrix_host.size()) == static_cast<int64_t>(num_ranks) * num_ranks,
          "rank_prefix_matrix must have num_ranks * num_ranks entries");
  require(owner >= 0 && owner < num_ranks, "owner " + std::to_string(owner) + " is outside the group");
  return normal_staging_offset(kind, rank_prefix_matrix_host.data(), num_ranks, owner, num_ranks, row_bytes);
}

int64_t normal_staging_most_bytes(NormalStaging kind, const std::vector<int32_t>& rank_prefix_matrix_host,
                                  int num_ranks, NormalRowBytes row_bytes) {
  int64_t most = 0;
  for (int owner = 0; owner < num_ranks; ++owner) {
    most = std::max(most, normal_staging_bytes(kind, rank_prefix_matrix_host, num_ranks, owner, row_bytes));
  }
  return most;
}

NormalCopyEngine::NormalCopyEngine(int device, std::vector<std::uintptr_t> peer_bases, int combine_chunks,
                                   int pull_chunks, int sm_pull_percent, int sm_push_percent, NormalOwnRows own_rows,
                                   bool push_rows)
    : device_(device),
      combine_chunks_(combine_chunks),
      pull_chunks_(pull_chunks),
      sm_pull_percent_(sm_pull_percent),
      sm_push_percent_(sm_push_percent),
      own_rows_(own_rows),
      push_rows_(push_rows),
      peer_bases_(std::move(peer_bases)) {
  require(sm_pull_percent >= 0 && sm_pull_percent <= 100,
          "sm_pull_percent must be in 0..100, got " + std::to_string(sm_pull_percent));
  require(sm_push_percent >= 0 && sm_push_percent <= 100,
          "sm_push_percent must be in 0..100, got " + std::to_string(sm_push_percent));
  const auto in_range = [](int chunks) { return chunks >= 1 && chunks <= kNormalMaxChunks; };
  const std::string range = "1.." + std::to_string(kNormalMaxChunks);
  require(combine_chunks == kNormalCombineChunksBySms || in_range(combine_chunks),
          "combine_chunks must be 0 (by the combine's SMs) or in " + range + ", got " + std::to_string(combine_chunks));
  require(in_range(pull_chunks), "pull_chunks must be in " + range + ", got " + std::to_string(pull_chunks));
  require(peer_bases_.size() <= static_cast<size_t>(kNormalMaxRanks),
          "the copy engine serves at most " + std::to_string(kNormalMaxRanks) + " ranks");
  require(!push_rows || peer_bases_.size() <= static_cast<size_t>(kNormalMaxCombineRanks),
          "push_rows serves at most " + std::to_string(kNormalMaxCombineRanks) + " ranks");
  int previous = 0;
  UCCL_EP_GPU_CHECK(gpu_get_device(&previous));
  UCCL_EP_GPU_CHECK(gpu_set_device(device_));
  stream_waits_ = gpu_stream_waits_supported(device_);
  void* words = nullptr;
  // kNormalMaxChunks combine chunk values, then the gather's warp counters (one per chunk) and the
  // combine's SM share's (after them), then a done word per copy stream.
  const size_t words_bytes = (2 * kNormalMaxChunks + 2 * peer_bases_.size()) * sizeof(uint64_t);
  gpuError_t status = gpu_device_alloc(&words, words_bytes);
  if (status == kGpuSuccess) {
    chunk_values_ = static_cast<uint64_t*>(words);
    gathered_warps_ = reinterpret_cast<uint32_t*>(chunk_values_ + kNormalMaxChunks);
    copies_done_ = chunk_values_ + 2 * kNormalMaxChunks;
    status = gpu_memset(words, 0, words_bytes);
  }
  peer_streams_.assign(peer_bases_.size(), nullptr);
  for (size_t peer = 0; peer < peer_bases_.size() && status == kGpuSuccess; ++peer) {
    status = gpu_stream_create_nonblocking(&peer_streams_[peer]);
  }
  if (push_rows_) {
    push_streams_.assign(peer_bases_.size(), nullptr);
    for (size_t peer = 0; peer < peer_bases_.size() && status == kGpuSuccess; ++peer) {
      status = gpu_stream_create_nonblocking(&push_streams_[peer]);
    }
    void* values = nullptr;
    void* values_device = nullptr;  // unused: the copies read the host address
    if (status == kGpuSuccess) status = gpu_host_alloc_mapped(&values, &values_device, kNormalMaxChunks * sizeof(uint64_t));
    if (status == kGpuSuccess) push_values_ = static_cast<uint64_t*>(values);
  }
  if (status == kGpuSuccess) status = gpu_event_create(&fork_);
  if (status == kGpuSuccess) status = gpu_event_create(&before_gather_);
  if (status != kGpuSuccess) release();
  (void)gpu_set_device(previous);
  UCCL_EP_GPU_CHECK(status);
}

NormalCopyEngine::~NormalCopyEngine() { release(); }

void NormalCopyEngine::release() {
  // Nothing is in flight here that the caller did not order before: its stream's last kernel of an
  // exchange waits for the copy streams.
  if (host_counts_ != nullptr) (void)gpu_host_free(host_counts_);
  host_counts_ = nullptr;
  host_counts_device_ = nullptr;
  host_counts_capacity_ = 0;
  if (chunk_values_ != nullptr) (void)gpu_device_free(chunk_values_);
  chunk_values_ = nullptr;
  gathered_warps_ = nullptr;
  copies_done_ = nullptr;
  if (before_gather_ != nullptr) (void)gpu_event_destroy(before_gather_);
  before_gather_ = nullptr;
  if (fork_ != nullptr) (void)gpu_event_destroy(fork_);
  fork_ = nullptr;
  if (push_values_ != nullptr) (void)gpu_host_free(push_values_);
  push_values_ = nullptr;
  for (std::vector<gpuStream_t>* streams : {&peer_streams_, &push_streams_}) {
    for (gpuStream_t peer_stream : *streams) {
      if (peer_stream != nullptr) (void)gpu_stream_destroy(peer_stream);
    }
    streams->clear();
  }
}

void NormalCopyEngine::require_unreleased() const {
  require(fork_ != nullptr, "this NormalCopyEngine was released");
}

template <typename Queue>
void NormalCopyEngine::fork_peer_streams(int me, gpuStream_t stream, gpuEvent_t since, Queue&& queue) {
  if (since == nullptr) {
    UCCL_EP_GPU_CHECK(gpu_event_record(fork_, stream));
    since = fork_;
  }
  for (int peer = 0; peer < static_cast<int>(peer_streams_.size()); ++peer) {
    if (peer == me) continue;
    UCCL_EP_GPU_CHECK(gpu_stream_wait_event(peer_streams_[peer], since));
    queue(peer, peer_streams_[peer]);
  }
}

NormalCopiesDone NormalCopyEngine::mark_copies(int me, bool peers, bool own) {
  NormalCopiesDone copies;
  copies.done = copies_done_;
  const int num_ranks = static_cast<int>(peer_streams_.size());
  const auto mark = [&](int index, gpuStream_t copy_stream) {
    if (stream_waits_) {
      UCCL_EP_GPU_CHECK(gpu_stream_write_word(copy_stream, copies_done_ + index, 1));
    } else {
      normal_kernels::mark_copies_done<<<1, 1, 0, copy_stream>>>(copies_done_ + index);
      UCCL_EP_GPU_CHECK(gpu_last_error());
    }
    copies.add(index);
  };
  for (int peer = 0; peer < num_ranks; ++peer) {
    if (peer != me ? peers : own) mark(peer, peer_streams_[peer]);
    if (normal_rank_in_mask(pushed_to_, peer)) mark(num_ranks + peer, push_streams_[peer]);
  }
  pushed_to_ = 0;
  return copies;
}

void NormalCopyEngine::queue_own_rows(const NormalDispatchArgs& a, gpuEvent_t since) {
  const bool ready = own_runs_.ready;
  own_runs_.ready = false;
  if (!ready) return;
  const int me = a.region.rank;
  const gpuStream_t own_stream = peer_streams_[me];
  UCCL_EP_GPU_CHECK(gpu_stream_wait_event(own_stream, since));
  own_rows_queued_ = true;  // from here end_receive waits for the own stream, whatever fails after
  ++own_rows_by_engine_;
  copy_token_runs(own_runs_.runs, NormalTokenRange{0, a.num_tokens}, a.x,
                  static_cast<uint8_t*>(a.recv_x) + own_runs_.first_row * a.x_row_bytes, a.x_row_bytes, own_stream);
}

void NormalCopyEngine::take_own_runs(std::vector<NormalTokenRun> runs, int64_t row_bytes, int num_sms) {
  int64_t kept = 0;
  for (const NormalTokenRun& run : runs) kept += run.count;
  own_runs_.ready = normal_own_rows_by_engine(own_rows_, kept * row_bytes, num_sms);
  if (own_runs_.ready) own_runs_.runs = std::move(runs);
}

uint8_t* NormalCopyEngine::staging(int owner) const {
  return reinterpret_cast<uint8_t*>(peer_bases_[owner]) + kNormalControlBytes;
}

void NormalCopyEngine::check_usable(const NormalRegion& region, const std::vector<int32_t>& prefix) const {
  require_unreleased();
  require(static_cast<int>(peer_bases_.size()) == region.num_ranks,
          "the copy engine maps " + std::to_string(peer_bases_.size()) + " ranks, the region has " +
              std::to_string(region.num_ranks));
  require(static_cast<int64_t>(prefix.size()) == static_cast<int64_t>(region.num_ranks) * region.num_ranks,
          "rank_prefix_matrix must have num_ranks * num_ranks entries");
}

void NormalCopyEngine::dispatch_send(const NormalDispatchArgs& a, NormalPullChunks chunks, bool push_rows,
                                     gpuStream_t stream) {
  check_normal_dispatch_args(a);
  require_unreleased();
  require(chunks.count >= 1 && chunks.count <= chunks.num_channels && chunks.count <= kNormalMaxChunks,
          "pull chunks must be in 1..min(num_channels, " + std::to_string(kNormalMaxChunks) + "), got " +
              std::to_string(chunks.count) + " for " + std::to_string(chunks.num_channels) + " channels");
  normal_kernels::gather_for_peers<<<a.num_sms, normal_kernels::kGatherThreads, 0, stream>>>(a, chunks, push_rows,
                                                                                            gathered_warps_);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

void NormalCopyEngine::pull_rows(const NormalDispatchArgs& a, const std::vector<int32_t>& prefix,
                                 gpuStream_t stream) {
  NormalDispatchArgs sent = a;  // every argument but the outputs other than recv_x, unset yet
  sent.num_rows_out = 0;
  check_normal_dispatch_args(sent);
  check_usable(a.region, prefix);
  require(!receive_pending_, "rank " + std::to_string(a.region.rank) +
                                 ": pull_rows again before receive_rest ended the last dispatch's exchange");
  const int num_ranks = a.region.num_ranks, me = a.region.rank;
  const NormalRowBytes row_bytes{a.x_row_bytes, a.scale_row_bytes, a.num_topk};
  require(a.num_rows_out == prefix[(num_ranks - 1) * num_ranks + me],
          "num_rows_out must be the rows this rank receives (" +
              std::to_string(prefix[(num_ranks - 1) * num_ranks + me]) + ")");
  require(a.num_rows_out == 0 || a.recv_x != nullptr, "recv_x is needed for " + std::to_string(a.num_rows_out) +
                                                          " received rows");
  for (int owner = 0; owner < num_ranks; ++owner) {
    require(normal_staging_bytes(NormalStaging::kDispatch, prefix, num_ranks, owner, row_bytes) <= a.region.data_bytes,
            "rank " + std::to_string(owner) + "'s rows for its peers do not fit in the data area");
  }
  // Chunked pulls need not wait for the gather: their waits do. Nothing on `stream` after the gather's
  // start can touch the outputs (a fresh dispatch allocates them on it before that end, a cached one's
  // caller before the call).
  fork_peer_streams(me, stream, pulls_.ready ? before_gather_ : nullptr,
                    [&](int src, gpuStream_t peer_stream) { queue_pulls(a, prefix, src, peer_stream); });
  receive_pushing_sources_ = pulls_.ready ? pulls_.pushing_sources : 0;
  pulls_.ready = false;
  own_runs_.first_row = normal_rows_before(prefix.data(), num_ranks, me, me);
  receive_pending_ = true;
  pending_region_ = a.region;
  pulled_into_ = a.recv_x;
  pulled_rows_ = a.num_rows_out;
}

void NormalCopyEngine::receive_rest(const NormalDispatchArgs& a, gpuStream_t stream) {
  require_unreleased();
  require(receive_pending_, "receive_rest needs pull_rows first");
  try {
    check_normal_dispatch_args(a);
    require(a.recv_x == pulled_into_ && a.num_rows_out == pulled_rows_,
            "receive_rest's recv_x and num_rows_out must be those given to pull_rows");
    // The own rows' copies start with the gather, as the pulls do (unless start_dispatch queued them).
    queue_own_rows(a, before_gather_);
  } catch (...) {
    end_receive(stream, nullptr);
    throw;
  }
  end_receive(stream, &a);
}

void NormalCopyEngine::abandon_receive(const NormalRegion& region, gpuStream_t stream) {
  require_unreleased();
  if (receive_pending_) {
    end_receive(stream, nullptr);
    return;
  }
  own_runs_.ready = false;
  end_exchange(region, mark_copies(region.rank, false, false), stream);  // after the pushes queued so far
}

void NormalCopyEngine::end_receive(gpuStream_t stream, const NormalDispatchArgs* rest) {
  receive_pending_ = false;
  own_runs_.ready = false;
  const bool own_rows_queued = own_rows_queued_;
  const uint32_t pushing_sources = receive_pushing_sources_;
  own_rows_queued_ = false;
  receive_pushing_sources_ = 0;
  const NormalCopiesDone copies = mark_copies(pending_region_.rank, true, own_rows_queued);
  if (rest == nullptr) {
    end_exchange(pending_region_, copies, stream);
    return;
  }
  normal_kernels::receive_own_rows<<<rest->num_sms, normal_kernels::kWideThreads, 0, stream>>>(
      *rest, sm_pull_percent_, own_rows_queued, pushing_sources, copies);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

void NormalCopyEngine::end_exchange(const NormalRegion& region, const NormalCopiesDone& copies, gpuStream_t stream) {
  normal_kernels::end_exchange_after_copies<<<1, kNormalMaxRanks, 0, stream>>>(region, copies, kNormalDispatchRecv);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

void NormalCopyEngine::queue_pulls(const NormalDispatchArgs& a, const std::vector<int32_t>& prefix, int src,
                                   gpuStream_t peer_stream) {
  const int num_ranks = a.region.num_ranks, me = a.region.rank;
  if (!pulls_.ready) {
    normal_kernels::wait_source_arrived<<<1, 1, 0, peer_stream>>>(a.region, src);
    UCCL_EP_GPU_CHECK(gpu_last_error());
  }
  const int64_t rows = normal_sent(prefix.data(), num_ranks, src, me);
  // A source that pushes its rows pushes them all, into this rank's landing; receive_own_rows copies
  // the rest of a pulled block.
  const bool pushed = pulls_.ready && normal_rank_in_mask(pulls_.pushing_sources, src);
  const int64_t engine_rows = pushed ? rows : normal_copy_engine_rows(rows, sm_pull_percent_);
  if (engine_rows == 0) return;
  const int64_t first = normal_rows_before(prefix.data(), num_ranks, src, me);
  const uint8_t* rows_x =
      pushed ? staging(me) + pulls_.landing_offset + first * a.x_row_bytes
             : staging(src) +
                   normal_staging_offset(NormalStaging::kDispatch, prefix.data(), num_ranks, src, me,
                                         NormalRowBytes{a.x_row_bytes, a.scale_row_bytes, a.num_topk}) +
                   normal_dispatch_area(rows, a.x_row_bytes, a.scale_row_bytes, a.num_topk).x;
  const auto pull = [&](int64_t begin, int64_t end) {  // the rows' data only: receive_own_rows copies their scales
    copy_async(static_cast<uint8_t*>(a.recv_x) + (first + begin) * a.x_row_bytes, rows_x + begin * a.x_row_bytes,
               (end - begin) * a.x_row_bytes, peer_stream);
  };
  if (!pulls_.ready) {
    pull(0, engine_rows);
    return;
  }
  const NormalPullChunks chunks = pulls_.chunks;
  const int32_t* channel_starts = pulls_.recv_channel_prefix.data() + static_cast<int64_t>(src) * chunks.num_channels;
  auto* word = reinterpret_cast<uint64_t*>(peer_bases_[me] + normal_chunk_word_offset(src));
  for (int chunk = 0; chunk < chunks.count; ++chunk) {
    const int64_t begin = channel_starts[normal_pull_chunk_first_channel(chunks, chunk)];
    const int64_t end = std::min(
        engine_rows, chunk + 1 < chunks.count ? channel_starts[normal_pull_chunk_first_channel(chunks, chunk + 1)] : rows);
    if (end <= begin) continue;
    // At least chunk + 1 of the owner's pieces (the notify checked that it gathers in as many; a
    // cached dispatch's owner gathers as its fresh one did).
    if (pulls_.epoch == 0) {
      normal_kernels::wait_source_gathered<<<1, 1, 0, peer_stream>>>(a.region, src, chunk + 1);
      UCCL_EP_GPU_CHECK(gpu_last_error());
    } else {
      UCCL_EP_GPU_CHECK(gpu_stream_wait_at_least(peer_stream, word, normal_chunk_word(pulls_.epoch, chunk + 1, 0)));
    }
    pull(begin, end);
  }
}

void NormalCopyEngine::queue_pushes(const NormalDispatchArgs& a, const std::vector<int32_t>& prefix, int peer,
                                    const int32_t* gaps) {
  const int num_ranks = a.region.num_ranks, me = a.region.rank;
  const std::vector<NormalTokenRun> runs = normal_token_runs(gaps + 1, gaps[0], a.num_tokens);
  uint8_t* landing =
      staging(peer) + pulls_.landing_offset + normal_rows_before(prefix.data(), num_ranks, me, peer) * a.x_row_bytes;
  uint8_t* word = reinterpret_cast<uint8_t*>(peer_bases_[peer]) + normal_chunk_word_offset(me);
  const gpuStream_t push_stream = push_streams_[peer];
  UCCL_EP_GPU_CHECK(gpu_stream_wait_event(push_stream, before_gather_));
  pushed_to_ |= 1u << peer;  // from here the exchange's end waits for this stream
  ++blocks_pushed_;
  // The pieces are the pull chunks' token ranges, so the peer finds each one's rows in its
  // recv_channel_prefix_matrix, as it does for pulled ones.
  const NormalPullChunks chunks = pulls_.chunks;
  for (int piece = 0; piece < chunks.count; ++piece) {
    copy_token_runs(runs, normal_pull_chunk_tokens(chunks, piece, a.num_tokens), a.x, landing, a.x_row_bytes,
                    push_stream);
    // Every peer's copies of a piece write the same value; the next dispatch rewrites it only after
    // its count read, when every copy of this exchange is done (its end waited for them).
    push_values_[piece] = normal_chunk_word(pulls_.epoch, piece + 1, chunks.count);
    copy_async(word, push_values_ + piece, sizeof(uint64_t), push_stream);
  }
}

void NormalCopyEngine::dispatch(const NormalDispatchArgs& a, const std::vector<int32_t>& prefix,
                                const std::vector<int32_t>& recv_channel_prefix,
                                const std::optional<std::vector<NormalTokenRun>>& own_runs, gpuStream_t stream) {
  check_usable(a.region, prefix);
  require(static_cast<int64_t>(recv_channel_prefix.size()) == static_cast<int64_t>(a.region.num_ranks) * a.num_channels,
          "recv_channel_prefix_host must have num_ranks * num_channels entries");
  own_runs_.ready = false;
  if (own_runs.has_value()) take_own_runs(*own_runs, a.x_row_bytes, a.num_sms);
  // The host does not know the exchange's number: the pieces' waits read it on the device (epoch 0).
  // Pulls in pieces fork before the gather, as a fresh dispatch's do before theirs; whole blocks after
  // it. The own rows' copies start with the gather either way (receive_rest).
  const NormalPullChunks chunks{
      a.num_channels, a.num_channels >= kNormalCachedPiecesMinChannels ? pull_chunks(a.num_channels) : 1};
  pulls_.ready = chunks.count > 1;
  pulls_.epoch = 0;
  pulls_.chunks = chunks;
  pulls_.recv_channel_prefix = recv_channel_prefix;
  pulls_.pushing_sources = 0;
  UCCL_EP_GPU_CHECK(gpu_event_record(before_gather_, stream));
  dispatch_send(a, chunks, false, stream);
  pull_rows(a, prefix, stream);
  receive_rest(a, stream);
}

int64_t NormalCopyEngine::sends_offset(const NormalDispatchArgs& a) {
  return normal_sends_offset(a.region.num_ranks, a.num_channels, a.num_local_experts);
}

bool NormalCopyEngine::sends_fit(const NormalDispatchArgs& a, const std::vector<int32_t>& prefix) {
  return normal_sends_fit(prefix.data(), a.region.num_ranks, sends_offset(a),
                          NormalRowBytes{a.x_row_bytes, a.scale_row_bytes, a.num_topk}, a.region.data_bytes);
}

void NormalCopyEngine::send_rows(const NormalDispatchArgs& a, gpuStream_t stream) {
  check_normal_dispatch_args(a);
  require_unreleased();
  normal_kernels::send_to_receivers<<<a.num_sms, normal_kernels::kGatherThreads, 0, stream>>>(a, sends_offset(a));
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

void NormalCopyEngine::receive_sends(const NormalDispatchArgs& a, gpuStream_t stream) {
  require_unreleased();
  try {
    check_normal_dispatch_args(a);
  } catch (...) {
    end_exchange(a.region, mark_copies(a.region.rank, false, false), stream);
    throw;
  }
  const int me = a.region.rank;
  const int64_t offset = sends_offset(a);
  const NormalDispatchArea area = normal_dispatch_area(a.num_rows_out, a.x_row_bytes, a.scale_row_bytes, a.num_topk);
  // The data by this rank's copy engine, on its own stream after the sends; the small fields by SMs beside it.
  UCCL_EP_GPU_CHECK(gpu_event_record(fork_, stream));
  UCCL_EP_GPU_CHECK(gpu_stream_wait_event(peer_streams_[me], fork_));
  copy_async(a.recv_x, staging(me) + offset + area.x, a.num_rows_out * a.x_row_bytes, peer_streams_[me]);
  const NormalCopiesDone copies = mark_copies(me, false, true);
  normal_kernels::receive_sent_fields<<<a.num_sms, normal_kernels::kWideThreads, 0, stream>>>(a, offset, copies);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

void NormalCopyEngine::dispatch_by_sends(const NormalDispatchArgs& a, gpuStream_t stream) {
  send_rows(a, stream);
  receive_sends(a, stream);
}

uint64_t NormalCopyEngine::wait_for_notify(const NormalRegion& region, int64_t epoch_index) const {
  const double wait_s = region.timeout_ns * 1e-9 + 5.0;
  const auto deadline = deadline_after(wait_s);
  const uint64_t* word = reinterpret_cast<const uint64_t*>(host_counts_ + epoch_index);
  for (;;) {
    const uint64_t epoch = host_load_acquire(word);
    if (epoch != 0) return epoch;
    if (std::chrono::steady_clock::now() >= deadline) {
      throw std::runtime_error("rank " + std::to_string(region.rank) +
                               ": the dispatch's counts did not reach the host within " + format_seconds(wait_s) +
                               " (the timeout and 5 s)");
    }
    std::this_thread::yield();
  }
}

NormalDispatchStart NormalCopyEngine::start_dispatch(const NormalSendLayoutArgs& layout, const NormalNotifyArgs& notify,
                                                     const NormalDispatchArgs* gather, bool sends,
                                                     int64_t combine_row_bytes, gpuStream_t stream) {
  const NormalRegion& region = notify.region;
  const int num_ranks = region.num_ranks;
  const int64_t prefix_size = static_cast<int64_t>(num_ranks) * num_ranks;
  const int64_t channel_ints = static_cast<int64_t>(num_ranks) * notify.num_channels;
  require_unreleased();
  pulls_.ready = false;
  pulls_.pushing_sources = 0;
  own_runs_.ready = false;
  require(layout.num_channels == notify.num_channels, "the layout and the notify must use the same num_channels");
  if (gather != nullptr) {
    // Checked before the notify too: a bad gather must not leave the exchange half started.
    check_normal_dispatch_args(*gather);
    require(gather->send_pos == layout.send_pos && gather->rank_prefix_matrix == notify.rank_prefix_matrix,
            "the gather must read this dispatch's send_pos and rank_prefix_matrix");
  }
  // The notify writes its counts into mapped host memory, its exchange number last: no copy, no event.
  const int64_t epoch_index = normal_host_counts_epoch_index(notify);
  const int64_t host_ints = normal_host_counts_ints(epoch_index, num_ranks);
  if (host_ints > host_counts_capacity_) {
    if (host_counts_ != nullptr) UCCL_EP_GPU_CHECK(gpu_host_free(host_counts_));
    host_counts_ = nullptr;
    host_counts_capacity_ = 0;
    void* host = nullptr;
    void* device = nullptr;
    UCCL_EP_GPU_CHECK(gpu_host_alloc_mapped(&host, &device, static_cast<size_t>(host_ints) * sizeof(int32_t)));
    host_counts_ = static_cast<int32_t*>(host);
    host_counts_device_ = static_cast<int32_t*>(device);
    host_counts_capacity_ = host_ints;
  }
  host_store_release(reinterpret_cast<uint64_t*>(host_counts_ + epoch_index), 0);  // the last notify's is read
  NormalNotifyArgs to_host = notify;
  to_host.host_counts = host_counts_device_;
  sends = sends && gather != nullptr;
  const bool push = gather != nullptr && !sends && pushes_rows();
  to_host.push_rows = push;
  to_host.sends = sends;
  // The notify lists the tokens not sent to a rank (a pass over send_pos each) only where they are used:
  // the pushes' runs, and this rank's own runs where a copy engine may copy its own rows (not where even
  // every token kept would leave them to the SMs, as with 24 SMs at 4096 x 7168).
  const bool own_runs_wanted =
      gather != nullptr && !sends &&
      normal_own_rows_by_engine(own_rows_, notify.num_tokens * gather->x_row_bytes, gather->num_sms);
  if (!own_runs_wanted && !push) to_host.send_pos = nullptr;
  const NormalPullChunks chunks{notify.num_channels, pull_chunks(notify.num_channels)};
  to_host.pull_chunks = gather != nullptr && !sends ? chunks.count : 0;
  to_host.sm_push_percent = sm_push_percent_;
  launch_normal_layout_and_notify(layout, to_host, stream);
  if (sends) {  // run while the host waits
    send_rows(*gather, stream);
  } else if (gather != nullptr) {  // the copy engines' later work starts after the notify
    UCCL_EP_GPU_CHECK(gpu_event_record(before_gather_, stream));
    dispatch_send(*gather, chunks, push, stream);
  }
  const auto wait_begin = std::chrono::steady_clock::now();
  const uint64_t notify_epoch = wait_for_notify(region, epoch_index);
  last_count_wait_ns_ =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - wait_begin).count();
  NormalDispatchStart start;
  if (notify_epoch == kNormalNotifyFailed) {  // recorded on the device: the caller raises it
    start.counts.assign(prefix_size + notify.num_local_experts, 0);
    if (gather != nullptr) abandon_receive(region, stream);
    return start;
  }
  const int32_t* counts = host_counts_ + channel_ints;
  start.counts.assign(counts, counts + prefix_size + notify.num_local_experts);
  if (gather == nullptr) return start;
  start.recv_channel_prefix.assign(host_counts_, host_counts_ + channel_ints);
  const std::vector<int32_t> prefix(start.counts.begin(), start.counts.begin() + prefix_size);
  const NormalRowBytes dispatch_rows{gather->x_row_bytes, gather->scale_row_bytes, gather->num_topk};
  const NormalRowBytes combine_rows{combine_row_bytes, 0, gather->num_topk};
  start.by_copy_engine =
      (sends ? sends_fit(*gather, prefix)
             : normal_staging_most_bytes(NormalStaging::kDispatch, prefix, num_ranks, dispatch_rows) <=
                   region.data_bytes) &&
      normal_staging_most_bytes(NormalStaging::kCombine, prefix, num_ranks, combine_rows) <= region.data_bytes;
  start.by_sends = sends && start.by_copy_engine;
  if (!start.by_copy_engine) {
    abandon_receive(region, stream);
    return start;
  }
  if (sends) return start;
  const int32_t* gaps = host_counts_ + normal_host_gaps_index(epoch_index, region.rank);
  if (to_host.send_pos != nullptr && gaps[0] <= kNormalMaxGaps) {  // it keeps every token but its gaps
    start.own_runs = normal_token_runs(gaps + 1, gaps[0], notify.num_tokens);
    take_own_runs(*start.own_runs, gather->x_row_bytes, gather->num_sms);
  }
  if (stream_waits_) {
    pulls_.ready = true;
    pulls_.epoch = notify_epoch + 1;  // the gather's exchange follows the notify's
    pulls_.chunks = chunks;
    pulls_.recv_channel_prefix = start.recv_channel_prefix;
  }
  if (push) {  // pushes_rows: stream waits, so pulls_ holds this exchange
    const int64_t notify_bytes = normal_notify_area_bytes(num_ranks, notify.num_channels, notify.num_local_experts);
    pulls_.landing_offset = normal_landing_offset(prefix.data(), num_ranks, dispatch_rows, notify_bytes);
    const bool fits =
        normal_landing_fits(prefix.data(), num_ranks, pulls_.landing_offset, gather->x_row_bytes, region.data_bytes);
    const int32_t* source_tokens =
        host_counts_ + normal_host_source_tokens_index(num_ranks, notify.num_channels, notify.num_local_experts);
    const int me = region.rank;
    try {
      for (int peer = 0; peer < num_ranks; ++peer) {
        if (peer == me) continue;
        if (normal_pushes_rows(true, fits, source_tokens[peer], normal_sent(prefix.data(), num_ranks, peer, me))) {
          pulls_.pushing_sources |= 1u << peer;
        }
        if (normal_pushes_rows(true, fits, source_tokens[me], normal_sent(prefix.data(), num_ranks, me, peer))) {
          queue_pushes(*gather, prefix, peer, host_counts_ + normal_host_gaps_index(epoch_index, peer));
        }
      }
    } catch (...) {
      pulls_.ready = false;
      abandon_receive(region, stream);  // waits for the pushes queued so far, and ends the exchange
      throw;
    }
  }
  return start;
}

void NormalCopyEngine::combine(const NormalCombineArgs& a, const std::vector<int32_t>& prefix, gpuStream_t stream) {
  check_normal_combine_args(a);
  check_usable(a.region, prefix);
  const int num_ranks = a.region.num_ranks, me = a.region.rank;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const NormalRowBytes bytes{row_bytes, 0, a.num_topk};
  require(a.num_rows >= prefix[(num_ranks - 1) * num_ranks + me],
          "x must hold the rows this rank received (" + std::to_string(prefix[(num_ranks - 1) * num_ranks + me]) +
              "), it has " + std::to_string(a.num_rows));
  for (int owner = 0; owner < num_ranks; ++owner) {
    require(normal_staging_bytes(NormalStaging::kCombine, prefix, num_ranks, owner, bytes) <= a.region.data_bytes,
            "the rows rank " + std::to_string(owner) + " gets back do not fit in the data area");
  }
  const int chunks = normal_combine_chunks(combine_chunks_, a.num_sms);
  // The arrival goes first: the pushes on the peers' streams and the sums on this one then share its epoch.
  normal_kernels::wait_destinations_freed_then_arrive<<<1, kNormalMaxRanks, 0, stream>>>(a.region, chunk_values_,
                                                                                        chunks);
  UCCL_EP_GPU_CHECK(gpu_last_error());
  // Each owner's chunks in order on its own stream, every owner at once: the sums start early everywhere.
  // Copies only: a kernel between them would hold each next copy back by its launch.
  fork_peer_streams(me, stream, nullptr, [&](int owner, gpuStream_t peer_stream) {
    const int64_t rows = normal_sent(prefix.data(), num_ranks, owner, me);
    const int64_t engine_rows = normal_copy_engine_rows(rows, sm_push_percent_);  // reduce_from_staging stores the rest
    const int64_t first = normal_rows_before(prefix.data(), num_ranks, owner, me);
    uint8_t* block =
        staging(owner) + normal_staging_offset(NormalStaging::kCombine, prefix.data(), num_ranks, owner, me, bytes);
    const NormalCombineArea area = normal_combine_area(rows, row_bytes, a.num_topk);
    if (a.num_topk > 0) {  // every chunk's weights, before the first chunk word rises
      const int64_t weight_bytes = a.num_topk * static_cast<int64_t>(sizeof(float));
      copy_async(block + area.topk_weights, reinterpret_cast<const uint8_t*>(a.topk_weights + first * a.num_topk),
                 engine_rows * weight_bytes, peer_stream);
    }
    uint8_t* word = reinterpret_cast<uint8_t*>(peer_bases_[owner]) + normal_chunk_word_offset(me);
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int64_t begin = normal_combine_chunk_begin(engine_rows, chunks, chunk);
      const int64_t count = normal_combine_chunk_begin(engine_rows, chunks, chunk + 1) - begin;
      if (count == 0) continue;  // few rows: this chunk's word stays below, and no token waits for it
      copy_async(block + area.x + begin * row_bytes, static_cast<const uint8_t*>(a.x) + (first + begin) * row_bytes,
                 count * row_bytes, peer_stream);
      copy_async(word, chunk_values_ + chunk, sizeof(uint64_t), peer_stream);  // after the rows, in stream order
    }
  });
  normal_kernels::reduce_from_staging<<<a.num_sms, normal_kernels::kWideThreads, 0, stream>>>(
      a, sm_push_percent_, gathered_warps_ + kNormalMaxChunks, mark_copies(me, true, false));
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

}  // namespace uccl_ep
