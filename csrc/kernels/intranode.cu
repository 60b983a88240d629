// Normal-mode dispatch and combine over mapped peer memory, SMs moving every row (protocol in
// intranode.h). The copy-engine path (intranode_copy.cu) shares the notify and the checks.
//
// Work split: a block per channel at a time; within it a warp per token (dispatch send, combine
// receive) or per row (dispatch receive, combine send). A receiver block depends on the sender
// blocks of every rank (their channel words), so the kernel's blocks must all be resident: at most
// one per SM, no more than the GPU has (DeepEP's num_sms rule).
#include "kernels/intranode.h"

#include <string>

#include "common/require.h"
#include "kernels/intranode_device.cuh"

namespace uccl_ep {
namespace normal_kernels {

// ------------------------------------------------------------------------------ send layout
// One block per rank scans that rank's column of is_token_in_rank: a token's position among the
// tokens sent to the rank (send_pos), the inclusive count at the end of each channel's token range
// (channel_prefix_matrix), and the position within its channel (send_head).
__device__ void send_layout_of_rank(const NormalSendLayoutArgs& a) {
  const int rank = blockIdx.x, num_ranks = a.num_ranks;
  const int64_t per_channel = (a.num_tokens + a.num_channels - 1) / a.num_channels;
  __shared__ int32_t warp_totals[kWideThreads / kWarpSize];
  int32_t carry = 0;  // tokens sent to `rank` before this chunk (the same in every thread)
  for (int64_t first = 0; first < a.num_tokens; first += blockDim.x) {
    const int64_t token = first + threadIdx.x;
    const int32_t sent = token < a.num_tokens && a.is_token_in_rank[token * num_ranks + rank] ? 1 : 0;
    int32_t chunk_sent = 0;
    const int32_t before = carry + block_exclusive_sum(DeviceBlock{}, sent, warp_totals, chunk_sent);
    if (token < a.num_tokens) {
      a.send_pos[token * num_ranks + rank] = sent ? before : -1;
      const bool channel_ends = (token + 1) % per_channel == 0 || token == a.num_tokens - 1;
      if (a.channel_prefix_matrix != nullptr && channel_ends) {
        a.channel_prefix_matrix[static_cast<int64_t>(rank) * a.num_channels + token / per_channel] = before + sent;
      }
    }
    carry += chunk_sent;
  }
  if (a.channel_prefix_matrix == nullptr) return;
  // Channels whose token range starts past the last token (their range is empty) end at the total.
  for (int channel = threadIdx.x; channel < a.num_channels; channel += blockDim.x) {
    if (channel * per_channel >= a.num_tokens) {
      a.channel_prefix_matrix[static_cast<int64_t>(rank) * a.num_channels + channel] = carry;
    }
  }
  if (a.send_head == nullptr) return;
  __syncthreads();  // the channel ends above are visible to the whole block
  for (int64_t token = threadIdx.x; token < a.num_tokens; token += blockDim.x) {
    const int32_t pos = a.send_pos[token * num_ranks + rank];
    const int64_t channel = token / per_channel;
    const int32_t channel_start =
        channel > 0 ? a.channel_prefix_matrix[static_cast<int64_t>(rank) * a.num_channels + channel - 1] : 0;
    a.send_head[token * num_ranks + rank] = pos < 0 ? -1 : pos - channel_start;
  }
}

__global__ void __launch_bounds__(kWideThreads) send_layout(NormalSendLayoutArgs a) { send_layout_of_rank(a); }

// ------------------------------------------------------------------------------ notify
// The notify is one block on every rank, so its whole exchange is one kernel: send, arrival,
// receive, freed.
__device__ bool notify_send_slots(const NormalNotifyArgs& a) {
  const NormalRegion& r = a.region;
  if (!wait_destinations_free(r, kNormalNotifySend)) return false;
  const int num_ranks = r.num_ranks, num_channels = a.num_channels, local = a.num_local_experts;
  const int64_t slot_ints = normal_notify_slot_ints(num_ranks, num_channels, local);
  for (int dst = threadIdx.x; dst < num_ranks; dst += blockDim.x) {
    reinterpret_cast<int32_t*>(data_area(r, dst))[r.rank] =
        normal_notify_settings_word(num_channels, a.pull_chunks, a.sm_push_percent, a.push_rows, a.sends);
  }
  for (int dst = 0; dst < num_ranks; ++dst) {
    int32_t* slot =
        reinterpret_cast<int32_t*>(data_area(r, dst)) + normal_notify_slots_offset_ints(num_ranks) + r.rank * slot_ints;
    for (int i = threadIdx.x; i < slot_ints; i += blockDim.x) {
      int32_t value;
      if (i < num_ranks) {
        value = a.num_tokens_per_rank[i];
      } else if (i < num_ranks + num_channels) {
        value = load_l2(a.channel_prefix_matrix + dst * num_channels + (i - num_ranks));
      } else if (i < slot_ints - 1) {
        value = a.num_tokens_per_expert[dst * local + (i - num_ranks - num_channels)];
      } else {
        value = static_cast<int32_t>(a.num_tokens);
      }
      slot[i] = value;
    }
  }
  __threadfence_system();
  __syncthreads();
  return true;
}

// Every source's settings word equals this rank's: else its slot is laid out differently, or it goes
// another way after the notify. Every rank compares every pair, so all of them record the difference.
__device__ bool notify_settings_agree(const NormalNotifyArgs& a) {
  const NormalRegion& r = a.region;
  const int32_t mine =
      normal_notify_settings_word(a.num_channels, a.pull_chunks, a.sm_push_percent, a.push_rows, a.sends);
  const int32_t* words = reinterpret_cast<const int32_t*>(data_area(r, r.rank));
  for (int src = threadIdx.x; src < r.num_ranks; src += blockDim.x) {
    const int32_t theirs = load_l2(words + src);
    if (theirs != mine) record_failure(r, kNormalSettingsDiffer, kNormalNotifyRecv, src, theirs);
  }
  __syncthreads();
  return !aborted(r);
}

// The counts, into the outputs and (when given) the host's copy. Returns false if a source never came
// or dispatches with other settings.
__device__ bool notify_receive_counts(const NormalNotifyArgs& a) {
  const NormalRegion& r = a.region;
  if (!wait_sources_arrived(r, kNormalNotifyRecv) || !notify_settings_agree(a)) return false;
  const int num_ranks = r.num_ranks, num_channels = a.num_channels, local = a.num_local_experts;
  const int64_t slot_ints = normal_notify_slot_ints(num_ranks, num_channels, local);
  const int32_t* slots =
      reinterpret_cast<const int32_t*>(data_area(r, r.rank)) + normal_notify_slots_offset_ints(num_ranks);
  for (int dst = threadIdx.x; dst < num_ranks; dst += blockDim.x) {
    int32_t running = 0;
    for (int src = 0; src < num_ranks; ++src) {
      running += load_l2(slots + src * slot_ints + dst);
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
        channel == 0 ? 0 : load_l2(slots + src * slot_ints + num_ranks + channel - 1);
  }
  for (int expert = threadIdx.x; expert < local; expert += blockDim.x) {
    int32_t total = 0;
    for (int src = 0; src < num_ranks; ++src) total += load_l2(slots + src * slot_ints + num_ranks + num_channels + expert);
    a.recv_tokens_per_expert[expert] = (total + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
  }
  __syncthreads();  // every output written, the slots read
  if (a.host_counts != nullptr) {
    const int64_t channel_ints = static_cast<int64_t>(num_ranks) * num_channels;
    const int64_t prefix_ints = static_cast<int64_t>(num_ranks) * num_ranks;
    for (int64_t i = threadIdx.x; i < channel_ints + prefix_ints + local; i += blockDim.x) {
      a.host_counts[i] = i < channel_ints                 ? a.recv_channel_prefix_matrix[i]
                         : i < channel_ints + prefix_ints ? a.rank_prefix_matrix[i - channel_ints]
                                                          : a.recv_tokens_per_expert[i - channel_ints - prefix_ints];
    }
    int32_t* source_tokens = a.host_counts + normal_host_source_tokens_index(num_ranks, num_channels, local);
    for (int src = threadIdx.x; src < num_ranks; src += blockDim.x) {
      source_tokens[src] = load_l2(slots + src * slot_ints + slot_ints - 1);
    }
  }
  return true;
}

// The tokens this rank does not send `dst`, in order, into `out` (a count, then the first
// kNormalMaxGaps tokens): the whole block, a pass of blockDim.x tokens at a time.
__device__ void notify_gaps(const NormalNotifyArgs& a, int dst, int32_t* out) {
  __shared__ int32_t warp_totals[kWideThreads / kWarpSize];
  const int num_ranks = a.region.num_ranks;
  int32_t found = 0;  // gaps in the passes before, alike in every thread
  for (int64_t first = 0; first < a.num_tokens; first += blockDim.x) {
    const int64_t token = first + threadIdx.x;
    const int32_t gap = token < a.num_tokens && load_l2(a.send_pos + token * num_ranks + dst) < 0 ? 1 : 0;
    int32_t pass_gaps = 0;
    const int32_t before = found + block_exclusive_sum(DeviceBlock{}, gap, warp_totals, pass_gaps);
    if (gap && before < kNormalMaxGaps) out[1 + before] = static_cast<int32_t>(token);
    found += pass_gaps;
  }
  if (threadIdx.x == 0) out[0] = found;
}

__device__ void notify_exchange(const NormalNotifyArgs& a) {
  const NormalRegion& r = a.region;
  bool done = notify_send_slots(a);
  if (done) {
    block_announce_arrival(r);
    // Local work while the peers' counts are on their way.
    if (a.host_counts != nullptr && a.send_pos != nullptr) {
      const int64_t epoch_index = normal_host_counts_epoch_index(a);
      for (int dst = 0; dst < r.num_ranks; ++dst) {
        if (dst == r.rank || a.push_rows) notify_gaps(a, dst, a.host_counts + normal_host_gaps_index(epoch_index, dst));
      }
    }
    done = notify_receive_counts(a);
    if (done) block_announce_freed(r);
  }
  __syncthreads();  // every thread's host_counts writes come before the fence below
  if (a.host_counts == nullptr || threadIdx.x != 0) return;
  // The host polls this word: the notify's exchange number once its counts are there, else kNormalNotifyFailed.
  __threadfence_system();
  const uint64_t epoch = done ? exchanges_done(r) : kNormalNotifyFailed;
  *reinterpret_cast<volatile uint64_t*>(a.host_counts + normal_host_counts_epoch_index(a)) = epoch;
}

// The send layout, a block per rank, then the notify in the block that finishes last: one launch. The
// notify reads what the other blocks wrote (send_pos, channel_prefix_matrix) from L2: this SM's L1 may
// hold lines of them from its own block's pass, from before those writes.
__global__ void __launch_bounds__(kWideThreads, 1)
    layout_and_notify(NormalSendLayoutArgs layout, NormalNotifyArgs notify) {
  send_layout_of_rank(layout);
  if (last_block_to_finish(notify.region.control + kNormalBlocksDoneWord)) notify_exchange(notify);
}

// ------------------------------------------------------------------------------ channels
// Threads of an SM-path block (DeepEP's too): 24 warps keep rows in flight, and their 80 registers hold
// a sender's and a receiver's work (at 1024 threads, 64 registers, both spilled 100 bytes or more).
constexpr int kChannelThreads = 768;
// The SM path's exchange (intranode.h): blocks [0, S) send and [S, 2S) receive, S = gridDim.x / 2;
// the block with index b among its kind takes the channels b, b + S, ...
struct ChannelBlock {
  bool sends;
  int first_channel;
  int channel_stride;
  WarpPosition warp;  // among the block's warps
};
__device__ __forceinline__ ChannelBlock channel_block() {
  const int senders = gridDim.x / 2;
  const bool sends = static_cast<int>(blockIdx.x) < senders;
  return ChannelBlock{sends, sends ? static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x) - senders, senders,
                      warp_position_of(threadIdx.x, 0, 1, blockDim.x, kWarpSize)};
}

// In `rank`'s control area: the word of (src, channel).
__device__ __forceinline__ uint64_t* channel_word(const NormalRegion& r, int rank, int src, int channel,
                                                  int num_channels) {
  return reinterpret_cast<uint64_t*>(rank_base(r, rank) + normal_channel_word_offset(src, channel, num_channels));
}

// One thread waits until `src`'s word of `channel` here reaches `target`. `seen` keeps the last value it read
// of that word, so a target already passed costs no load (rows in order mostly find theirs there).
__device__ __forceinline__ bool wait_channel_word(const NormalRegion& r, int src, int channel, int num_channels,
                                                  uint64_t target, int32_t phase, uint64_t& seen) {
  if (seen >= target) return true;
  return wait_until(
      r, channel_word(r, r.rank, src, channel, num_channels), [&](uint64_t word) { return (seen = word) >= target; },
      phase, src);
}

// A warp waits until `src` has stored send position `position` of `channel` here: its lane 0 waits, and
// remembers the last word it saw of one source at a time.
struct ChannelWatch {
  int src = -1;
  uint64_t seen = 0;
  __device__ bool wait(const NormalRegion& r, int src_rank, int channel, int num_channels, uint64_t epoch,
                       int64_t position, int32_t phase, int lane) {
    const uint64_t target = normal_channel_progress(epoch, position + 1);
    if (src_rank == src && seen >= target) return true;   // the same in every lane: no shuffle
    if (src_rank != src) seen = 0;
    src = src_rank;
    bool ready = true;
    if (lane == 0) ready = wait_channel_word(r, src_rank, channel, num_channels, target, phase, seen);
    seen = warp_shuffle(static_cast<unsigned long long>(seen), 0);
    return warp_shuffle(ready ? 1 : 0, 0) != 0;
  }
};

// After a round of stores by every warp of the block: thread t, for rank t, raises that rank's word of
// this channel to `positions(t)` (-1: nothing to tell). The block's barrier, then the publishing thread's
// system fence, make every warp's stores of the round visible before the word (as a grid barrier does).
template <typename Positions>
__device__ __forceinline__ void publish_round(const NormalRegion& r, int channel, int num_channels, uint64_t epoch,
                                              Positions positions) {
  __syncthreads();
  for (int dst = threadIdx.x; dst < r.num_ranks; dst += blockDim.x) {
    const int64_t stored = positions(dst);
    if (stored >= 0) {
      __threadfence_system();
      publish_flag(channel_word(r, dst, r.rank, channel, num_channels), normal_channel_progress(epoch, stored),
                   r.aggressive_atomics);
    }
  }
}

// The end of an SM-path exchange, by the block that finishes last (every other block has read what it
// needed): count it as done, announce freed.
__device__ void finish_exchange(const NormalRegion& r) {
  if (aborted(r)) return;  // written by this grid's blocks only, all done: the same in every thread
  const uint64_t epoch = exchanges_done(r) + 1;
  __syncthreads();  // every thread read the count before it moves
  if (threadIdx.x == 0) r.control[kNormalExchangesWord] = epoch;
  for (int peer = threadIdx.x; peer < r.num_ranks; peer += blockDim.x) {
    publish_flag(freed_word(r, peer, r.rank), epoch, r.aggressive_atomics);
  }
}

// An SM-path kernel's block: when the exchange fits every rank's data area (else block 0 records it, and
// every block of every rank returns alike), a sender block waits for its destinations to be free, then sends;
// a receiver block receives. Both get the exchange's number. The last block to finish ends the exchange.
template <typename Send, typename Receive>
__device__ __forceinline__ void run_channel_block(const NormalRegion& r, bool fits, int32_t send_phase, Send send,
                                                  Receive receive) {
  const ChannelBlock b = channel_block();
  const uint64_t epoch = exchanges_done(r) + 1;
  if (!fits) {
    if (blockIdx.x == 0 && threadIdx.x == 0) record_failure(r, kNormalAreaTooSmall, send_phase, -1, 0);
  } else if (b.sends) {
    if (wait_destinations_free(r, send_phase)) send(b, epoch);
  } else {
    receive(b, epoch);
  }
  if (last_block_to_finish(r.control + kNormalBlocksDoneWord)) finish_exchange(r);
}

// Of the rows `src` sends `dst` (a dispatch's, or their way back in a combine), the send positions in
// `channel` from `dst`'s recv_channel_prefix_matrix: [first, first + count).
struct ChannelPositions {
  int32_t first, count;
};
__device__ __forceinline__ ChannelPositions channel_positions(const int32_t* recv_channel_prefix_matrix,
                                                              const int32_t* rank_prefix_matrix, int num_ranks,
                                                              int num_channels, int src, int dst, int channel) {
  const int32_t* prefix = recv_channel_prefix_matrix + static_cast<int64_t>(src) * num_channels;
  const int32_t end = channel + 1 < num_channels
                          ? prefix[channel + 1]
                          : static_cast<int32_t>(normal_sent(rank_prefix_matrix, num_ranks, src, dst));
  return ChannelPositions{prefix[channel], end - prefix[channel]};
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

// A sender block: its channels' tokens, a token per warp in each round; a row's place at the destination
// is the rows of the sources below this rank there plus its send position.
__device__ void send_dispatch_channels(const NormalDispatchArgs& a, const ChannelBlock& b, uint64_t epoch) {
  const NormalRegion& r = a.region;
  const int num_ranks = r.num_ranks;
  // Per destination, the highest send position stored in a round, + 1, by the round's parity: a round
  // fills one while the rank's thread reads and clears the other round's (one barrier per round).
  __shared__ int32_t round_most[2][kNormalMaxRanks];
  __shared__ int64_t first_row[kNormalMaxRanks];
  __shared__ NormalDispatchArea area[kNormalMaxRanks];
  for (int dst = threadIdx.x; dst < num_ranks; dst += blockDim.x) {
    first_row[dst] = normal_rows_before(a.rank_prefix_matrix, num_ranks, r.rank, dst);
    area[dst] = dispatch_area_of(a, dst);
    round_most[0][dst] = round_most[1][dst] = 0;
  }
  __syncthreads();
  int32_t told = 0;  // thread t: what rank t's word of this channel says
  int parity = 0;
  for (int channel = b.first_channel; channel < a.num_channels; channel += b.channel_stride) {
    told = 0;
    const NormalTokenRange tokens = normal_channel_tokens(a.num_channels, channel, channel + 1, a.num_tokens);
    for (int64_t round = tokens.first; round < tokens.end; round += b.warp.stride, parity ^= 1) {
      const int64_t token = round + b.warp.first;
      // The token's destinations a warp's width at a time: lane t reads destination group + t's send
      // position, and the row's x is loaded once for all of them.
      for (int group = 0; token < tokens.end && group < num_ranks; group += kWarpSize) {
        const int mine = group + b.warp.lane;
        const int32_t pos = mine < num_ranks ? a.send_pos[token * num_ranks + mine] : -1;
        const LaneMask sent = warp_ballot(pos >= 0);
        uint8_t* my_x = nullptr;
        if (pos >= 0) {
          my_x = dispatch_row_in_area(data_area(r, mine), area[mine], first_row[mine] + pos, a).x;
          atomicMax(&round_most[parity][mine], pos + 1);
        }
        warp_copy_to_each<kWideCopyUnroll>(sent, my_x,
                                           static_cast<const uint8_t*>(a.x) + token * a.x_row_bytes,
                                           a.x_row_bytes, b.warp.lane);
        // the rest, loaded once for every destination (scales of a few hundred bytes: a vector per lane)
        const DispatchRowFields fields = load_dispatch_fields(a, static_cast<int>(token), b.warp.lane);
        for (LaneMask rest = sent; rest != 0; rest &= rest - 1) {
          const int dst = group + lowest_lane(rest);
          const int32_t dst_pos = warp_shuffle(pos, lowest_lane(rest));
          const DispatchRowOut out = dispatch_row_in_area(data_area(r, dst), area[dst], first_row[dst] + dst_pos, a);
          store_dispatch_fields(a, fields, static_cast<int>(token), dst, out, b.warp.lane);
        }
      }
      publish_round(r, channel, a.num_channels, epoch, [&](int dst) -> int64_t {
        const int32_t most = round_most[parity][dst];
        round_most[parity][dst] = 0;
        if (most <= told) return -1;
        told = most;
        return most;
      });
    }
  }
}

// A receiver block: the rows of its channels from every source, sources in turn, each once its word says
// it is there, into the outputs (received rows are grouped by source, then in token order).
__device__ void receive_dispatch_channels(const NormalDispatchArgs& a, const ChannelBlock& b, uint64_t epoch) {
  const NormalRegion& r = a.region;
  const int num_ranks = r.num_ranks, k = a.num_topk;
  const NormalDispatchArea area = dispatch_area_of(a, r.rank);
  const uint8_t* base = data_area(r, r.rank);
  __shared__ int32_t first_pos[kNormalMaxRanks], count[kNormalMaxRanks];
  __shared__ int64_t first_row[kNormalMaxRanks];
  __shared__ int32_t most;
  bool failed = false;  // a wait gave up: the warp skips its other rows but meets the block's barriers
  for (int channel = b.first_channel; channel < a.num_channels; channel += b.channel_stride) {
    ChannelWatch watch;
    if (threadIdx.x == 0) most = 0;
    __syncthreads();
    for (int src = threadIdx.x; src < num_ranks; src += blockDim.x) {
      const ChannelPositions positions = channel_positions(a.recv_channel_prefix_matrix, a.rank_prefix_matrix,
                                                           num_ranks, a.num_channels, src, r.rank, channel);
      first_pos[src] = positions.first;
      count[src] = positions.count;
      first_row[src] = normal_rows_before(a.rank_prefix_matrix, num_ranks, src, r.rank);
      atomicMax(&most, count[src]);
    }
    __syncthreads();
    const int64_t items = static_cast<int64_t>(most) * num_ranks;
    for (int64_t item = b.warp.first; item < items; item += b.warp.stride) {
      const int src = static_cast<int>(item % num_ranks);
      const int32_t index = static_cast<int32_t>(item / num_ranks);
      if (failed || index >= count[src]) continue;
      const int64_t pos = first_pos[src] + index;
      if (!watch.wait(r, src, channel, a.num_channels, epoch, pos, kNormalDispatchRecv, b.warp.lane)) {
        failed = true;
        continue;
      }
      const int64_t row = first_row[src] + pos;
      warp_copy<kWideCopyUnroll>(static_cast<uint8_t*>(a.recv_x) + row * a.x_row_bytes,
                                 base + area.x + row * a.x_row_bytes, a.x_row_bytes, b.warp.lane);
      if (a.scale_row_bytes > 0) {
        warp_copy(static_cast<uint8_t*>(a.recv_x_scales) + row * a.scale_row_bytes,
                  base + area.scales + row * a.scale_row_bytes, a.scale_row_bytes, b.warp.lane);
      }
      if (a.recv_topk_idx != nullptr && b.warp.lane < k) {
        a.recv_topk_idx[row * k + b.warp.lane] =
            load_l2(reinterpret_cast<const long long*>(base + area.topk_idx) + row * k + b.warp.lane);
        a.recv_topk_weights[row * k + b.warp.lane] =
            load_l2(reinterpret_cast<const float*>(base + area.topk_weights) + row * k + b.warp.lane);
      }
      if (a.recv_src_idx != nullptr && b.warp.lane == 0) {
        a.recv_src_idx[row] = load_l2(reinterpret_cast<const int32_t*>(base + area.src_idx) + row);
      }
    }
    __syncthreads();  // `most` and the tables serve the next channel
  }
}

// Rows past the received ones (num_worst_tokens), as the reference pads them: the receiver blocks' warps in turn.
__device__ void pad_dispatch_rows(const NormalDispatchArgs& a, const ChannelBlock& b) {
  const int64_t received = received_rows(a.rank_prefix_matrix, a.region.num_ranks, a.region.rank);
  const int k = a.num_topk;
  const int64_t stride = static_cast<int64_t>(b.channel_stride) * b.warp.stride;
  for (int64_t row = received + static_cast<int64_t>(b.first_channel) * b.warp.stride + b.warp.first;
       row < a.num_rows_out; row += stride) {
    warp_zero(static_cast<uint8_t*>(a.recv_x) + row * a.x_row_bytes, a.x_row_bytes, b.warp.lane);
    if (a.scale_row_bytes > 0) {
      warp_zero(static_cast<uint8_t*>(a.recv_x_scales) + row * a.scale_row_bytes, a.scale_row_bytes, b.warp.lane);
    }
    if (a.recv_topk_idx != nullptr && b.warp.lane < k) {
      a.recv_topk_idx[row * k + b.warp.lane] = -1;
      a.recv_topk_weights[row * k + b.warp.lane] = 0.0f;
    }
    if (a.recv_src_idx != nullptr && b.warp.lane == 0) a.recv_src_idx[row] = -1;
  }
}

__global__ void __launch_bounds__(kChannelThreads, 1) dispatch_by_channels(NormalDispatchArgs a) {
  run_channel_block(a.region, dispatch_fits(a), kNormalDispatchSend,
                    [&](const ChannelBlock& b, uint64_t epoch) { send_dispatch_channels(a, b, epoch); },
                    [&](const ChannelBlock& b, uint64_t epoch) {
                      receive_dispatch_channels(a, b, epoch);
                      pad_dispatch_rows(a, b);
                    });
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

// A sender block (this rank as the experts' rank): the rows of its channels back to the other sources,
// in turn, a row per warp in each round. A source's area holds the rows it sent, ordered like its sends
// (by receiver, then send position); its own rows it reads from x (receive_combine_channels).
__device__ void send_combine_channels(const NormalCombineArgs& a, const ChannelBlock& b, uint64_t epoch) {
  const NormalRegion& r = a.region;
  const int num_ranks = r.num_ranks, me = r.rank, k = a.num_topk, others = num_ranks - 1;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  __shared__ int32_t first_pos[kNormalMaxCombineRanks], count[kNormalMaxCombineRanks];
  __shared__ const uint8_t* from[kNormalMaxCombineRanks];  // this rank's rows from each source, in x
  __shared__ uint8_t* x_to[kNormalMaxCombineRanks];         // and where the source's area takes them
  __shared__ const float* weights_from[kNormalMaxCombineRanks];
  __shared__ float* weights_to[kNormalMaxCombineRanks];
  __shared__ int32_t most;
  for (int channel = b.first_channel; channel < a.num_channels; channel += b.channel_stride) {
    if (threadIdx.x == 0) most = 0;
    __syncthreads();
    for (int src = threadIdx.x; src < num_ranks; src += blockDim.x) {
      const ChannelPositions positions = channel_positions(a.recv_channel_prefix_matrix, a.rank_prefix_matrix,
                                                           num_ranks, a.num_channels, src, me, channel);
      first_pos[src] = positions.first;
      count[src] = src == me ? 0 : positions.count;
      const int64_t first_row = normal_rows_before(a.rank_prefix_matrix, num_ranks, src, me);
      from[src] = static_cast<const uint8_t*>(a.x) + first_row * row_bytes;
      weights_from[src] = a.topk_weights + first_row * k;
      int64_t before = 0;  // the rows `src` sent to ranks below this one
      for (int rank = 0; rank < me; ++rank) before += normal_sent(a.rank_prefix_matrix, num_ranks, src, rank);
      const NormalCombineArea area = combine_area_of(a, src);
      x_to[src] = data_area(r, src) + area.x + before * row_bytes;
      weights_to[src] = reinterpret_cast<float*>(data_area(r, src) + area.topk_weights) + before * k;
      atomicMax(&most, count[src]);
    }
    __syncthreads();
    const int64_t items = static_cast<int64_t>(most) * others;
    for (int64_t round = 0; round < items; round += b.warp.stride) {
      const int64_t item = round + b.warp.first;
      const int other = static_cast<int>(item % others);
      const int src = other < me ? other : other + 1;
      const int32_t index = static_cast<int32_t>(item / others);
      if (item < items && index < count[src]) {
        const int64_t pos = first_pos[src] + index;
        warp_copy<kWideCopyUnroll>(x_to[src] + pos * row_bytes, from[src] + pos * row_bytes, row_bytes, b.warp.lane);
        if (b.warp.lane < k) {
          weights_to[src][pos * k + b.warp.lane] = weights_from[src][pos * k + b.warp.lane];
        }
      }
      // Items go to the other sources in turn: after `done` items, the o-th has had those with item % others == o.
      const int64_t done = round + b.warp.stride < items ? round + b.warp.stride : items;
      publish_round(r, channel, a.num_channels, epoch, [&](int src) -> int64_t {
        if (count[src] == 0) return -1;
        const int other = src < me ? src : src - 1;
        const int64_t had = done > other ? (done - other + others - 1) / others : 0;
        return first_pos[src] + (had < count[src] ? had : count[src]);
      });
    }
  }
}

// A receiver block: the tokens of its channels, each summed once the rows it needs are there (lane d keeps
// what it saw of rank d's word: a warp's tokens come in order, so their send positions rise).
__device__ void receive_combine_channels(const NormalCombineArgs& a, const ChannelBlock& b, uint64_t epoch) {
  const NormalRegion& r = a.region;
  const int num_ranks = r.num_ranks, me = r.rank;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  __shared__ CombineSources from;
  if (threadIdx.x == 0) {
    const NormalCombineArea area = combine_area_of(a, me);
    const uint8_t* base = data_area(r, me);
    int64_t first_row = 0;
    for (int dst = 0; dst < num_ranks; ++dst) {
      from.x[dst] = base + area.x + first_row * row_bytes;
      from.topk_weights[dst] = reinterpret_cast<const float*>(base + area.topk_weights) + first_row * a.num_topk;
      first_row += normal_sent(a.rank_prefix_matrix, num_ranks, me, dst);
    }
    // This rank's own rows are where the combine found them: in x.
    const int64_t own_first = normal_rows_before(a.rank_prefix_matrix, num_ranks, me, me);
    from.x[me] = static_cast<const uint8_t*>(a.x) + own_first * row_bytes;
    from.topk_weights[me] = a.topk_weights + own_first * a.num_topk;
  }
  __syncthreads();
  for (int channel = b.first_channel; channel < a.num_channels; channel += b.channel_stride) {
    uint64_t seen = 0;  // lane d: of rank d's word
    reduce_combined_tokens(a, from, normal_channel_tokens(a.num_channels, channel, channel + 1, a.num_tokens), b.warp,
                           [&](int dst, bool has_row, int64_t pos) {
                             const bool ready = !has_row || dst == me ||
                                                wait_channel_word(r, dst, channel, a.num_channels,
                                                                  normal_channel_progress(epoch, pos + 1),
                                                                  kNormalCombineRecv, seen);
                             return warp_all(ready);
                           });
  }
}

__global__ void __launch_bounds__(kChannelThreads, 1) combine_by_channels(NormalCombineArgs a) {
  run_channel_block(a.region, combine_fits(a), kNormalCombineSend,
                    [&](const ChannelBlock& b, uint64_t epoch) { send_combine_channels(a, b, epoch); },
                    [&](const ChannelBlock& b, uint64_t epoch) { receive_combine_channels(a, b, epoch); });
}

}  // namespace normal_kernels

// ------------------------------------------------------------------------------ launchers
namespace {

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

// An SM-path exchange (see intranode.h): its senders and receivers.
template <typename Args>
void launch_by_channels(void (*kernel)(Args), const Args& args, gpuStream_t stream) {
  const int blocks_per_kind = args.num_sms / 2 > 0 ? args.num_sms / 2 : 1;
  kernel<<<2 * blocks_per_kind, normal_kernels::kChannelThreads, 0, stream>>>(args);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

// The channels of an SM-path exchange and their words.
void check_channels(int32_t num_channels, const int32_t* recv_channel_prefix_matrix, int num_ranks) {
  require(num_channels >= 1, "num_channels must be >= 1, got " + std::to_string(num_channels));
  require(static_cast<int64_t>(num_channels) * num_ranks <= kNormalChannelWords,
          "num_ranks * num_channels must be at most " + std::to_string(kNormalChannelWords) + ", got " +
              std::to_string(num_ranks) + " * " + std::to_string(num_channels));
  require(recv_channel_prefix_matrix != nullptr, "recv_channel_prefix_matrix is required");
}

void check_normal_send_layout_args(const NormalSendLayoutArgs& args) {
  require(args.num_ranks >= 1 && args.num_ranks <= kNormalMaxRanks,
          "num_ranks must be in [1, " + std::to_string(kNormalMaxRanks) + "], got " + std::to_string(args.num_ranks));
  require(args.num_tokens >= 0, "num_tokens must be >= 0");
  require(args.num_channels >= 1, "num_channels must be >= 1");
  require(args.num_tokens == 0 || (args.is_token_in_rank != nullptr && args.send_pos != nullptr),
          "is_token_in_rank and send_pos are required");
  require(args.send_head == nullptr || args.channel_prefix_matrix != nullptr,
          "send_head needs channel_prefix_matrix");
}

void check_notify_args(const NormalNotifyArgs& args) {
  check_region(args.region);
  require(args.num_channels >= 1, "num_channels must be >= 1");
  require(args.num_local_experts >= 1, "num_local_experts must be >= 1");
  require(args.expert_alignment >= 1, "expert_alignment must be >= 1");
  require(args.num_worst_tokens >= 0, "num_worst_tokens must be >= 0");
  require(args.num_channels <= kNormalMaxNotifyChannels,
          "num_channels must be at most " + std::to_string(kNormalMaxNotifyChannels));
  require(args.pull_chunks >= 0 && args.pull_chunks <= kNormalMaxChunks,
          "pull_chunks must be in 0.." + std::to_string(kNormalMaxChunks));
  require(args.sm_push_percent >= 0 && args.sm_push_percent <= 100, "sm_push_percent must be in 0..100");
  const int64_t area_bytes = normal_notify_area_bytes(args.region.num_ranks, args.num_channels, args.num_local_experts);
  require(area_bytes <= args.region.data_bytes,
          "the data area cannot hold the notify slots (" + std::to_string(area_bytes) + " bytes)");
  require(args.host_counts == nullptr || reinterpret_cast<std::uintptr_t>(args.host_counts) % 8 == 0,
          "host_counts must be 8-byte aligned");
}

}  // namespace

void load_normal_kernels() {
  using namespace normal_kernels;
  gpu_load_kernels(send_layout, layout_and_notify, dispatch_by_channels, combine_by_channels);
}

void launch_normal_send_layout(const NormalSendLayoutArgs& args, gpuStream_t stream) {
  check_normal_send_layout_args(args);
  normal_kernels::send_layout<<<args.num_ranks, normal_kernels::kWideThreads, 0, stream>>>(args);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

void launch_normal_layout_and_notify(const NormalSendLayoutArgs& layout, const NormalNotifyArgs& notify,
                                     gpuStream_t stream) {
  check_normal_send_layout_args(layout);
  check_notify_args(notify);
  require(layout.channel_prefix_matrix == notify.channel_prefix_matrix && layout.num_channels == notify.num_channels,
          "the notify must read the layout's channel_prefix_matrix");
  require(layout.num_ranks == notify.region.num_ranks, "the layout and the notify must have the same num_ranks");
  normal_kernels::layout_and_notify<<<layout.num_ranks, normal_kernels::kWideThreads, 0, stream>>>(layout, notify);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

void check_normal_dispatch_args(const NormalDispatchArgs& args) {
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
}

void launch_normal_dispatch(const NormalDispatchArgs& args, gpuStream_t stream) {
  check_normal_dispatch_args(args);
  check_channels(args.num_channels, args.recv_channel_prefix_matrix, args.region.num_ranks);
  launch_by_channels(normal_kernels::dispatch_by_channels, args, stream);
}

void check_normal_combine_args(const NormalCombineArgs& args) {
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
  require(args.region.num_ranks <= kNormalMaxCombineRanks,
          "a combine serves at most " + std::to_string(kNormalMaxCombineRanks) + " ranks, got " +
              std::to_string(args.region.num_ranks));
}

void launch_normal_combine(const NormalCombineArgs& args, gpuStream_t stream) {
  check_normal_combine_args(args);
  check_channels(args.num_channels, args.recv_channel_prefix_matrix, args.region.num_ranks);
  launch_by_channels(normal_kernels::combine_by_channels, args, stream);
}

}  // namespace uccl_ep
