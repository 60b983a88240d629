// A normal-mode operation in one host call: the failure check, the checks that the exchange fits
// num_nvl_bytes, the choice between copy engines and SMs, and the launches, so that a Buffer
// operation crosses from Python into the extension once. The send layout and notify, the count
// read and the row movement are those of intranode.h and intranode_copy.h. The copy engines'
// many calls after the outputs exist go to a LaunchThread (launch_thread.h): the call returns
// once the outputs exist, and the caller's stream waits for those calls' work.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/portability.h"
#include "kernels/intranode.h"
#include "kernels/intranode_copy.h"
#include "kernels/launch_thread.h"
#include "kernels/low_latency_state.h"

namespace uccl_ep {

// A dispatch's counts as read on the host, kept with its handle when the copy engines carried the
// dispatch: its cached dispatches and its combine go that way too. recv_channel_prefix is this rank's
// [R, C] recv_channel_prefix_matrix: where each source's pull pieces start in its rows. own_runs:
// NormalDispatchStart's, so that the cached dispatches copy the own rows as the fresh one could.
struct NormalHostCounts {
  std::vector<int32_t> rank_prefix_matrix;
  std::vector<int32_t> recv_channel_prefix;
  std::optional<std::vector<NormalTokenRun>> own_runs;
};

// The receive side of a dispatch: each output the call has, of its rows (the others null).
struct NormalDispatchOutputs {
  void* recv_x;
  void* recv_x_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int32_t* recv_src_idx;
};
// Makes a dispatch's outputs once its rows are known (the caller's allocator, called on the host
// thread of the dispatch), in two steps: recv_x, which is all the copy engines' pulls need (they are
// queued before the other outputs exist), then the others into `outputs`. An exception either step
// throws ends the exchange for the peers, then propagates.
struct NormalOutputsAllocator {
  std::function<void*(int64_t rows)> recv_x;
  std::function<void(int64_t rows, NormalDispatchOutputs& outputs)> rest;
};

// A fresh dispatch (no handle). handle_ints: one int32 array holding send_pos [N, R],
// channel_prefix_matrix [R, C], send_head [N, R], recv_channel_prefix_matrix [R, C], then the
// counts: rank_prefix_matrix [R, R] and the tokens each local expert receives [El].
struct NormalDispatchRequest {
  const void* x;
  int64_t x_row_bytes;
  const void* x_scales;
  int64_t scale_row_bytes;
  const int64_t* topk_idx;
  const float* topk_weights;
  int32_t num_topk;
  const bool* is_token_in_rank;
  int32_t num_tokens;
  const int32_t* num_tokens_per_rank;
  const int32_t* num_tokens_per_expert;
  int32_t num_local_experts;
  int32_t num_channels;
  int32_t expert_alignment;
  int32_t num_worst_tokens;
  int32_t* handle_ints;
  int64_t combine_row_bytes;  // of the bf16 rows its combine returns (2 * hidden)
};

enum class NormalCallStatus : int32_t {
  kDone = 0,      // everything is queued
  kFailed = 1,    // a kernel recorded a failure (before the call, or the notify's): the caller raises it
  kTooLarge = 2,  // the exchange does not fit num_nvl_bytes; no rows moved, every rank decides alike
};

struct NormalDispatchResult {
  NormalCallStatus status = NormalCallStatus::kDone;
  std::vector<int32_t> expert_counts;                    // tokens per local expert, when read on the host
  std::shared_ptr<const NormalHostCounts> host_counts;  // set when the copy engines carried the dispatch
  std::string too_large;                                 // kTooLarge: what does not fit
};

class NormalLauncher {
 public:
  // copy_engine reads every dispatch's counts and carries the rows where `rows` has it do so
  // (normal_dispatch_by_copy_engine, normal_cached_dispatch_by_copy_engine); state holds the failure record
  // the kernels write. Both outlive the launcher. launch_thread: the copy engines' calls after the outputs
  // exist go to a LaunchThread (else this thread makes them).
  NormalLauncher(const NormalRegion& region, NormalCopyEngine* copy_engine, const LowLatencyState* state, int device,
                 NormalRowPath rows, bool launch_thread);

  // Layout, notify and, when the counts are read on the host (num_worst_tokens == 0), the wait for
  // them; then the outputs from `allocate` (num_worst_tokens rows, or the rows received) and the rows
  // into them. The copy engines' gather runs while the host waits and allocates.
  NormalDispatchResult dispatch(const NormalDispatchRequest& request, const NormalOutputsAllocator& allocate,
                                gpuStream_t stream);
  // A dispatch with a handle's layout: host_counts from that handle, or null (SMs move the rows).
  // args carries the outputs (recv_src_idx null: the handle keeps its own); combine_row_bytes as in
  // NormalDispatchRequest.
  NormalCallStatus cached_dispatch(const NormalDispatchArgs& args, int64_t combine_row_bytes,
                                   const NormalHostCounts* host_counts, gpuStream_t stream);
  NormalCallStatus combine(const NormalCombineArgs& args, const NormalHostCounts* host_counts, gpuStream_t stream);

  const NormalRegion& region() const { return region_; }
  int device() const { return device_; }
  // Stops its launch thread (after the work handed over is queued). Before the copy engine's release.
  void release() { launch_thread_.release(); }

 private:
  bool failed() const { return state_->status().code != 0; }
  // An empty string when a dispatch of up to most_received rows to one rank, and a combine of up to
  // most_sent rows back to one, fit every rank's data area; else what does not fit.
  std::string rows_do_not_fit(int64_t most_received, int64_t most_sent, const NormalDispatchArgs& args,
                              int64_t combine_row_bytes) const;
  std::string does_not_fit(const std::string& what, int64_t needed) const;
  // Whether the copy engines' staging holds this handle's rows: the combine's, and with dispatch the
  // cached dispatch's too (the same answer on every rank: the counts are shared).
  bool copy_engine_fits(const NormalHostCounts* host_counts, NormalRowBytes combine,
                        const NormalRowBytes* dispatch) const;
  // Where a fresh dispatch's rows come from once its outputs exist: the SM path, the copy engines' pulls,
  // or this rank's data area, where the sources' SMs sent them.
  enum class NormalRowsFrom { kSms, kPulls, kSends };
  // The dispatch's rows (args without outputs yet) into outputs from `allocate`, after start_dispatch chose
  // how (rank_prefix_matrix: its counts).
  void receive(NormalDispatchArgs args, const NormalOutputsAllocator& allocate, NormalRowsFrom from,
               const std::vector<int32_t>& rank_prefix_matrix, gpuStream_t stream);

  NormalRegion region_;
  NormalCopyEngine* copy_engine_;
  const LowLatencyState* state_;
  int device_;
  NormalRowPath rows_;
  LaunchThread launch_thread_;
};

}  // namespace uccl_ep
