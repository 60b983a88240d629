// Dispatch layout kernel (see layout.h for the contract).
//
// The tokens are cut into tiles of whole tokens and one thread block handles one tile.
// A tile holds at most kTileEntries top-k entries and its is_token_in_rank rows fit a
// shared-memory bitmap of kBitmapWords words (one bit per token and rank). The block
//   1. loads the tile's entries coalesced (kEntriesPerThread independent loads per
//      thread) while it clears its shared counters and bitmap;
//   2. for each valid entry bumps the expert's counter and sets the (token, rank) bit
//      with an atomic OR; the entry that finds the bit clear is its token's first on that
//      rank, and it alone bumps the rank's counter (a token counts once per rank);
//   3. expands the bitmap into the tile's is_token_in_rank rows (one contiguous byte
//      range, written with 16-byte stores where aligned) and writes its counters.
// Counters live in shared memory when E <= kMaxSharedExperts and R <= kMaxSharedRanks,
// else they are global atomics. With a single block and shared counters (few tokens:
// the low-latency case) the block stores its counts directly: one launch in all.
// Otherwise the counts are sums over blocks: dispatch_layout_clear_kernel zeroes them
// first on the same stream and the blocks add theirs with atomics. Either way every
// output element is written by the launcher's kernels, so nothing needs zeroing before.
#include "kernels/layout.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

namespace uccl_ep {
namespace kernels {

constexpr int kLayoutThreads = 256;
constexpr int kEntriesPerThread = 8;
constexpr int kTileEntries = kLayoutThreads * kEntriesPerThread;
constexpr int kBitmapWords = 4096;  // 16 KiB: 131072 (token, rank) bits a tile
constexpr int kMaxRanks = kBitmapWords * 32;  // a tile holds at least one token
static_assert(kMaxRanks == kDispatchLayoutMaxRanks, "layout.h states the limit");
constexpr int kMaxSharedExperts = 4096;
constexpr int kMaxSharedRanks = 1024;
constexpr int kClearThreads = 256;
constexpr int kMaxClearBlocks = 64;

static_assert(kLayoutThreads % kWarpSize == 0, "blocks must be made of whole warps");
static_assert(kTileEntries >= kDispatchLayoutMaxTopk, "a tile must hold one whole token");

// Adds one to counter `index`: in the block's shared counters or straight in global memory.
__device__ __forceinline__ void count_one(int* shared_counters, int32_t* global_counters,
                                          bool use_shared, int index) {
  if (use_shared) {
    atomic_add_block_relaxed(shared_counters + index, 1);
  } else {
    atomic_add_device_relaxed(global_counters + index, 1);
  }
}

// Stores (direct) or adds (accumulate) the block's shared counters to `out`.
__device__ __forceinline__ void flush_counters(const int* counters, int32_t* out, int count,
                                               bool accumulate) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int value = counters[i];
    if (!accumulate) {
      out[i] = value;
    } else if (value != 0) {
      atomic_add_device_relaxed(out + i, value);
    }
  }
}

// Reads bools out of a tile bitmap in row-major (token, rank) order, starting at a given
// byte offset of the tile's rows and moving forward one byte at a time.
class BitmapCursor {
 public:
  __device__ BitmapCursor(const uint32_t* bitmap, int num_ranks, int row_words, int64_t offset)
      : bitmap_(bitmap), num_ranks_(num_ranks), row_words_(row_words),
        token_(static_cast<int>(offset / num_ranks)), rank_(static_cast<int>(offset % num_ranks)) {}

  __device__ __forceinline__ uint32_t next() {
    const uint32_t bit = (bitmap_[token_ * row_words_ + (rank_ >> 5)] >> (rank_ & 31)) & 1u;
    if (++rank_ == num_ranks_) {
      rank_ = 0;
      ++token_;
    }
    return bit;
  }

 private:
  const uint32_t* bitmap_;
  int num_ranks_;
  int row_words_;
  int token_;
  int rank_;
};

// Writes the tile's rows, dst[0, count) (count = tokens * num_ranks bytes), from the
// bitmap, with 16-byte stores on the aligned part.
__device__ __forceinline__ void store_rows(uint8_t* dst, int64_t count, const uint32_t* bitmap,
                                           int num_ranks, int row_words) {
  const int64_t misalignment =
      static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(dst) & 15u)) & 15u);
  const int64_t head = count < misalignment ? count : misalignment;
  const int64_t chunks = (count - head) / 16;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) {
    dst[i] = static_cast<uint8_t>(BitmapCursor(bitmap, num_ranks, row_words, i).next());
  }
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    BitmapCursor cursor(bitmap, num_ranks, row_words, head + c * 16);
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) word |= cursor.next() << (8 * b);
      words[w] = word;
    }
    reinterpret_cast<uint4*>(dst + head)[c] = make_uint4(words[0], words[1], words[2], words[3]);
  }
  for (int64_t i = head + chunks * 16 + threadIdx.x; i < count; i += blockDim.x) {
    dst[i] = static_cast<uint8_t>(BitmapCursor(bitmap, num_ranks, row_words, i).next());
  }
}

__global__ void __launch_bounds__(kLayoutThreads)
    dispatch_layout_kernel(const int64_t* __restrict__ topk_idx, int64_t num_tokens,
                           int num_topk, int num_ranks, int num_experts, int tile_tokens,
                           bool accumulate, bool shared_counts,
                           int32_t* __restrict__ num_tokens_per_rank,
                           int32_t* __restrict__ num_tokens_per_expert,
                           bool* __restrict__ is_token_in_rank) {
  __shared__ uint32_t bitmap[kBitmapWords];  // bit (token, rank) of the tile
  __shared__ int expert_counts[kMaxSharedExperts];
  __shared__ int rank_counts[kMaxSharedRanks];

  const int64_t token_begin = static_cast<int64_t>(blockIdx.x) * tile_tokens;
  const int64_t tokens_left = num_tokens - token_begin;
  const int tokens_here =
      static_cast<int>(tokens_left < tile_tokens ? (tokens_left > 0 ? tokens_left : 0) : tile_tokens);
  const int num_entries = tokens_here * num_topk;
  const int experts_per_rank = num_experts / num_ranks;
  const int row_words = (num_ranks + 31) / 32;
  const int64_t* tile_topk = topk_idx + token_begin * num_topk;

  int64_t experts[kEntriesPerThread];
#pragma unroll
  for (int u = 0; u < kEntriesPerThread; ++u) {
    const int i = threadIdx.x + u * kLayoutThreads;
    experts[u] = i < num_entries ? __ldg(tile_topk + i) : -1;
  }
  for (int i = threadIdx.x; i < tokens_here * row_words; i += blockDim.x) bitmap[i] = 0;
  if (shared_counts) {
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) expert_counts[i] = 0;
    for (int i = threadIdx.x; i < num_ranks; i += blockDim.x) rank_counts[i] = 0;
  }
  __syncthreads();  // bitmap and counters cleared

#pragma unroll
  for (int u = 0; u < kEntriesPerThread; ++u) {
    const int i = threadIdx.x + u * kLayoutThreads;
    const int64_t expert = experts[u];
    if (i >= num_entries || expert < 0 || expert >= num_experts) continue;
    count_one(expert_counts, num_tokens_per_expert, shared_counts, static_cast<int>(expert));
    const int rank = static_cast<int>(expert) / experts_per_rank;
    const uint32_t bit = 1u << (rank & 31);
    const uint32_t before =
        atomic_or_block_relaxed(&bitmap[(i / num_topk) * row_words + (rank >> 5)], bit);
    if ((before & bit) == 0) count_one(rank_counts, num_tokens_per_rank, shared_counts, rank);
  }
  __syncthreads();  // bitmap complete

  store_rows(reinterpret_cast<uint8_t*>(is_token_in_rank) + token_begin * num_ranks,
             static_cast<int64_t>(tokens_here) * num_ranks, bitmap, num_ranks, row_words);
  if (shared_counts) {
    flush_counters(expert_counts, num_tokens_per_expert, num_experts, accumulate);
    flush_counters(rank_counts, num_tokens_per_rank, num_ranks, accumulate);
  }
}

__global__ void __launch_bounds__(kClearThreads)
    dispatch_layout_clear_kernel(int32_t* __restrict__ num_tokens_per_rank, int num_ranks,
                                 int32_t* __restrict__ num_tokens_per_expert, int num_experts) {
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_ranks + num_experts; i += stride) {
    if (i < num_ranks) {
      num_tokens_per_rank[i] = 0;
    } else {
      num_tokens_per_expert[i - num_ranks] = 0;
    }
  }
}

}  // namespace kernels

void load_dispatch_layout_kernels() {
  gpu_load_kernels(kernels::dispatch_layout_kernel, kernels::dispatch_layout_clear_kernel);
}

namespace {

[[noreturn]] void bad_argument(const char* name, const std::string& what) {
  throw std::invalid_argument(std::string("dispatch_layout: ") + name + " " + what);
}

bool aligned(const void* ptr, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0;
}

void check_arguments(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                     int64_t num_ranks, int64_t num_experts, const int32_t* num_tokens_per_rank,
                     const int32_t* num_tokens_per_expert, const bool* is_token_in_rank) {
  if (num_tokens < 0) bad_argument("num_tokens", "must be >= 0, got " + std::to_string(num_tokens));
  if (num_tokens > INT32_MAX) {
    bad_argument("num_tokens", "must fit in int32 (the counts are int32), got " +
                                   std::to_string(num_tokens));
  }
  if (num_topk < 0 || num_topk > kDispatchLayoutMaxTopk) {
    bad_argument("num_topk", "must be in [0, " + std::to_string(kDispatchLayoutMaxTopk) +
                                 "], got " + std::to_string(num_topk));
  }
  if (num_ranks <= 0 || num_ranks > kernels::kMaxRanks) {
    bad_argument("num_ranks", "must be in [1, " + std::to_string(kernels::kMaxRanks) + "], got " +
                                  std::to_string(num_ranks));
  }
  if (num_experts <= 0 || num_experts > INT32_MAX - num_ranks) {
    bad_argument("num_experts", "must be in [1, 2^31 - num_ranks), got " + std::to_string(num_experts));
  }
  if (num_experts % num_ranks != 0) {
    bad_argument("num_experts", "must be divisible by num_ranks, got num_experts=" +
                                    std::to_string(num_experts) +
                                    " and num_ranks=" + std::to_string(num_ranks));
  }
  if (topk_idx == nullptr && num_tokens * num_topk > 0) bad_argument("topk_idx", "is a null pointer");
  if (!aligned(topk_idx, alignof(int64_t))) bad_argument("topk_idx", "is not 8-byte aligned");
  if (num_tokens_per_rank == nullptr) bad_argument("num_tokens_per_rank", "is a null pointer");
  if (!aligned(num_tokens_per_rank, alignof(int32_t))) {
    bad_argument("num_tokens_per_rank", "is not 4-byte aligned");
  }
  if (num_tokens_per_expert == nullptr) bad_argument("num_tokens_per_expert", "is a null pointer");
  if (!aligned(num_tokens_per_expert, alignof(int32_t))) {
    bad_argument("num_tokens_per_expert", "is not 4-byte aligned");
  }
  if (is_token_in_rank == nullptr && num_tokens > 0) bad_argument("is_token_in_rank", "is a null pointer");
}

}  // namespace

void launch_dispatch_layout(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                            int64_t num_ranks, int64_t num_experts,
                            int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                            bool* is_token_in_rank, gpuStream_t stream) {
  check_arguments(topk_idx, num_tokens, num_topk, num_ranks, num_experts, num_tokens_per_rank,
                  num_tokens_per_expert, is_token_in_rank);

  // Tiles as large as the entry slots and the row bitmap allow.
  const int row_words = static_cast<int>((num_ranks + 31) / 32);
  const int tile_tokens = std::min(
      num_topk > 0 ? kernels::kTileEntries / static_cast<int>(num_topk) : kernels::kTileEntries,
      kernels::kBitmapWords / row_words);
  const int64_t blocks = std::max<int64_t>(1, (num_tokens + tile_tokens - 1) / tile_tokens);
  const bool shared_counts =
      num_experts <= kernels::kMaxSharedExperts && num_ranks <= kernels::kMaxSharedRanks;
  const bool accumulate = blocks > 1 || !shared_counts;

  if (accumulate) {
    const int64_t clear_blocks = std::min<int64_t>(
        kernels::kMaxClearBlocks,
        (num_ranks + num_experts + kernels::kClearThreads - 1) / kernels::kClearThreads);
    kernels::dispatch_layout_clear_kernel<<<static_cast<unsigned int>(clear_blocks),
                                            kernels::kClearThreads, 0, stream>>>(
        num_tokens_per_rank, static_cast<int>(num_ranks), num_tokens_per_expert,
        static_cast<int>(num_experts));
    UCCL_EP_GPU_CHECK(gpu_last_error());
  }
  kernels::dispatch_layout_kernel<<<static_cast<unsigned int>(blocks), kernels::kLayoutThreads,
                                    0, stream>>>(
      topk_idx, num_tokens, static_cast<int>(num_topk), static_cast<int>(num_ranks),
      static_cast<int>(num_experts), tile_tokens, accumulate, shared_counts,
      num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank);
  UCCL_EP_GPU_CHECK(gpu_last_error());
}

}  // namespace uccl_ep
