// Which thread does what (lane maps), and the warp and block collectives the kernels build from
// shuffles, ballots and barriers, written once over `Warp` and `Block` types: on a GPU DeviceWarp and
// DeviceBlock (portability.h's warp_* wrappers, 32 lanes on NVIDIA, 64 on CDNA; __syncthreads); in
// the host tests (tests/warp_model/) a model that runs every lane as a host thread, so the same code
// is checked with 32 and with 64 lanes without an AMD GPU.
//
// A Warp has: kLanes; lane(); shuffle(v, src), shuffle_up(v, delta) (a lane below `delta` keeps its
// own), shuffle_xor(v, mask); ballot(p) -> Mask (a bit per lane) and lowest(mask) (its lowest lane).
// Every lane of the warp calls a collective together.
#pragma once

#include "common/portability.h"

namespace uccl_ep {

// Each lane's value plus those of the lanes below it.
template <typename Warp, typename T>
UCCL_EP_HOST_DEVICE inline T warp_inclusive_sum(const Warp& warp, T value) {
#pragma unroll
  for (int shift = 1; shift < Warp::kLanes; shift <<= 1) {
    const T below = warp.shuffle_up(value, shift);
    if (warp.lane() >= shift) value += below;
  }
  return value;
}

// The sum over all lanes, in every lane.
template <typename Warp, typename T>
UCCL_EP_HOST_DEVICE inline T warp_total(const Warp& warp, T value) {
#pragma unroll
  for (int mask = Warp::kLanes / 2; mask > 0; mask >>= 1) value += warp.shuffle_xor(value, mask);
  return value;
}

// Lane i receives (in `mine`) the `item` of the i-th lane, in lane order, whose `present` holds;
// lanes past the last keep `mine` as it was. Returns how many lanes hold one.
template <typename Warp, typename T>
UCCL_EP_HOST_DEVICE inline int warp_compact(const Warp& warp, bool present, T item, T& mine) {
  int count = 0;
  for (auto left = warp.ballot(present); left != 0; left &= left - 1, ++count) {
    const T taken = warp.shuffle(item, warp.lowest(left));
    if (warp.lane() == count) mine = taken;
  }
  return count;
}

// A block-wide exclusive scan of one value per thread (every thread of the block calls it): the sum of
// the values of the threads before this one, and the whole block's in `total`. `warp_totals`: memory
// the block shares, a slot per warp (at most a warp's worth of warps), free again on return. A Block
// has: warp() (this thread's Warp), thread(), threads() and sync() (a barrier of the whole block).
template <typename Block, typename T>
UCCL_EP_HOST_DEVICE inline T block_exclusive_sum(const Block& block, T value, T* warp_totals, T& total) {
  const auto warp = block.warp();
  constexpr int kLanes = decltype(warp)::kLanes;
  const int lane = warp.lane(), index = block.thread() / kLanes, num_warps = block.threads() / kLanes;
  const T inclusive = warp_inclusive_sum(warp, value);
  if (lane == kLanes - 1) warp_totals[index] = inclusive;
  block.sync();
  if (index == 0) {
    const T sum = warp_inclusive_sum(warp, lane < num_warps ? warp_totals[lane] : T(0));
    if (lane < num_warps) warp_totals[lane] = sum;
  }
  block.sync();
  const T before = (index > 0 ? warp_totals[index - 1] : T(0)) + inclusive - value;
  total = warp_totals[num_warps - 1];
  block.sync();  // warp_totals is reused
  return before;
}

// A thread's place when a block is cut into groups of whole warps that work as units (the
// low-latency kernels): the grid's first groups are the blocks' first ones, one per SM.
struct GroupPosition {
  int index;   // group in the block
  int thread;  // thread in the group
  int warp;    // warp in the group
  int lane;
  int first;   // first unit of this group
  int stride;  // groups in the grid
};

UCCL_EP_HOST_DEVICE inline GroupPosition group_position_of(int thread, int block, int num_blocks, int lanes,
                                                           int group_threads, int groups_per_block) {
  GroupPosition g;
  g.index = thread / group_threads;
  g.thread = thread % group_threads;
  g.warp = g.thread / lanes;
  g.lane = thread % lanes;
  g.first = g.index * num_blocks + block;
  g.stride = num_blocks * groups_per_block;
  return g;
}

// A thread's place when every warp of the grid is a unit (the normal-mode copies).
struct WarpPosition {
  int lane;
  int first;   // first unit of this warp
  int stride;  // warps in the grid
};

UCCL_EP_HOST_DEVICE inline WarpPosition warp_position_of(int thread, int block, int num_blocks, int block_threads,
                                                         int lanes) {
  const int warps_per_block = block_threads / lanes;
  return WarpPosition{thread % lanes, block * warps_per_block + thread / lanes, num_blocks * warps_per_block};
}

#if defined(UCCL_EP_DEVICE_COMPILER)
struct DeviceWarp {
  static constexpr int kLanes = kWarpSize;
  __device__ __forceinline__ int lane() const { return static_cast<int>(threadIdx.x % kWarpSize); }
  template <typename T>
  __device__ __forceinline__ T shuffle(T value, int src) const { return warp_shuffle(value, src); }
  template <typename T>
  __device__ __forceinline__ T shuffle_up(T value, int delta) const { return warp_shuffle_up(value, delta); }
  template <typename T>
  __device__ __forceinline__ T shuffle_xor(T value, int mask) const { return warp_shuffle_xor(value, mask); }
  __device__ __forceinline__ LaneMask ballot(bool predicate) const { return warp_ballot(predicate); }
  __device__ __forceinline__ int lowest(LaneMask mask) const { return lowest_lane(mask); }
};

struct DeviceBlock {
  __device__ __forceinline__ DeviceWarp warp() const { return DeviceWarp{}; }
  __device__ __forceinline__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
};
#endif

}  // namespace uccl_ep
