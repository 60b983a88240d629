// Dispatch layout: from each token's top-k expert choice, count tokens per rank and per
// expert and mark which ranks every token must be sent to.
#pragma once

#include <cstdint>

#include "common/portability.h"

namespace uccl_ep {

// Largest num_topk and num_ranks that launch_dispatch_layout accepts.
constexpr int kDispatchLayoutMaxTopk = 32;
constexpr int kDispatchLayoutMaxRanks = 131072;

// Computes the dispatch layout on `stream`. All pointers are device memory.
//
//   topk_idx               int64 [num_tokens, num_topk], row-major. Entry k of token t is
//                          the expert chosen in slot k, or -1 for an empty slot. Entries
//                          outside [0, num_experts) are treated like -1.
//   num_tokens_per_rank    int32 [num_ranks]: tokens with at least one expert on the rank.
//   num_tokens_per_expert  int32 [num_experts]: how many (token, slot) entries name the
//                          expert. A token that lists one expert twice counts twice for
//                          it (once per listing); it still counts once per rank.
//   is_token_in_rank       bool  [num_tokens, num_ranks], row-major.
//
// Rank r owns experts [r * E / R, (r + 1) * E / R), with E = num_experts, R = num_ranks.
// Every element of the three outputs is written, so they need no zeroing beforehand.
// One or two kernels are enqueued, all named dispatch_layout_*: with more than one tile
// of tokens (or more than 4096 experts / 1024 ranks) a small kernel first zeroes the two
// count arrays, which the main kernel's blocks then add to.
// topk_idx may be null when num_tokens * num_topk == 0 and is_token_in_rank when
// num_tokens == 0.
//
// Throws std::invalid_argument naming the argument for a bad size or pointer (checked
// before any runtime call) and GpuError if the launch fails. The results are ready once
// `stream` has reached the kernel; this function does not synchronise.
// Loads the kernels launch_dispatch_layout uses into the current device's context (gpu_load_kernels).
void load_dispatch_layout_kernels();

void launch_dispatch_layout(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                            int64_t num_ranks, int64_t num_experts,
                            int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                            bool* is_token_in_rank, gpuStream_t stream);

}  // namespace uccl_ep
