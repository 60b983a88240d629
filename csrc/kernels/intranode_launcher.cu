// Host code only: the orchestration of the normal-mode launchers (see intranode_launcher.h).
#include "kernels/intranode_launcher.h"

#include <algorithm>
#include <utility>

#include "common/require.h"

namespace uccl_ep {

NormalLauncher::NormalLauncher(const NormalRegion& region, NormalCopyEngine* copy_engine, const LowLatencyState* state,
                               int device, NormalRowPath rows, bool launch_thread)
    : region_(region),
      copy_engine_(copy_engine),
      state_(state),
      device_(device),
      rows_(rows),
      launch_thread_(device, region.rank, region.timeout_ns * 1e-9 + 5.0, launch_thread) {
  require(copy_engine != nullptr && state != nullptr, "NormalLauncher needs a copy engine and a state");
}

std::string NormalLauncher::does_not_fit(const std::string& what, int64_t needed) const {
  if (needed <= region_.data_bytes) return {};
  return what + " needs " + std::to_string(needed + kNormalControlBytes) +
         " bytes of num_nvl_bytes (the whole exchange must fit, plus " + std::to_string(kNormalControlBytes) +
         " control bytes), this Buffer has num_nvl_bytes=" + std::to_string(region_.data_bytes + kNormalControlBytes);
}

std::string NormalLauncher::rows_do_not_fit(int64_t most_received, int64_t most_sent, const NormalDispatchArgs& args,
                                            int64_t combine_row_bytes) const {
  // The messages are built only for what does not fit: this runs on every dispatch.
  const int64_t dispatch_bytes =
      normal_dispatch_area(most_received, args.x_row_bytes, args.scale_row_bytes, args.num_topk).total;
  if (dispatch_bytes > region_.data_bytes) {
    return does_not_fit("dispatch of up to " + std::to_string(most_received) + " rows to one rank", dispatch_bytes);
  }
  const int64_t combine_bytes = normal_combine_area(most_sent, combine_row_bytes, args.num_topk).total;
  if (combine_bytes > region_.data_bytes) {
    return does_not_fit("combine of up to " + std::to_string(most_sent) + " rows back to one rank", combine_bytes);
  }
  return {};
}

bool NormalLauncher::copy_engine_fits(const NormalHostCounts* host_counts, NormalRowBytes combine,
                                      const NormalRowBytes* dispatch) const {
  if (host_counts == nullptr) return false;
  const std::vector<int32_t>& prefix = host_counts->rank_prefix_matrix;
  const int num_ranks = region_.num_ranks;
  if (normal_staging_most_bytes(NormalStaging::kCombine, prefix, num_ranks, combine) > region_.data_bytes) return false;
  return dispatch == nullptr ||
         normal_staging_most_bytes(NormalStaging::kDispatch, prefix, num_ranks, *dispatch) <= region_.data_bytes;
}

NormalDispatchResult NormalLauncher::dispatch(const NormalDispatchRequest& q, const NormalOutputsAllocator& allocate,
                                              gpuStream_t stream) {
  NormalDispatchResult result;
  launch_thread_.join();  // the engine's streams and state are this thread's again
  const bool rows_by_copy_engine = normal_dispatch_by_copy_engine(rows_, region_.num_ranks, 2 * q.num_channels);
  if (rows_by_copy_engine && q.num_worst_tokens == 0) launch_thread_.wake();  // awake when the rows are known
  if (failed()) {
    result.status = NormalCallStatus::kFailed;
    return result;
  }
  const int num_ranks = region_.num_ranks;
  const int64_t rank_tokens = static_cast<int64_t>(q.num_tokens) * num_ranks;
  const int64_t rank_channels = static_cast<int64_t>(num_ranks) * q.num_channels;
  int32_t* send_pos = q.handle_ints;
  int32_t* channel_prefix_matrix = send_pos + rank_tokens;
  int32_t* send_head = channel_prefix_matrix + rank_channels;
  int32_t* recv_channel_prefix_matrix = send_head + rank_tokens;
  int32_t* counts = recv_channel_prefix_matrix + rank_channels;  // rank_prefix_matrix, then per local expert
  // The outputs are set once the rows are known (receive).
  NormalDispatchArgs args{region_,    q.x,        q.x_row_bytes,  q.x_scales, q.scale_row_bytes, q.topk_idx,
                          q.topk_weights, q.num_topk, q.num_local_experts, send_pos, counts, q.num_tokens,
                          0,          nullptr,    nullptr,        nullptr,    nullptr,           nullptr,
                          2 * q.num_channels, q.num_channels, recv_channel_prefix_matrix};
  const int64_t notify_bytes = normal_notify_area_bytes(num_ranks, q.num_channels, q.num_local_experts);
  if (notify_bytes > region_.data_bytes) {
    result.too_large = does_not_fit("dispatch's layout exchange (" + std::to_string(q.num_channels) + " channels, " +
                                        std::to_string(q.num_local_experts) + " local experts)",
                                    notify_bytes);
  }
  if (result.too_large.empty() && q.num_worst_tokens > 0) {
    // No counts on the host: a rank receives at most num_worst_tokens rows, so it sent at most num_ranks
    // times that (no receiver took more from it).
    result.too_large = rows_do_not_fit(q.num_worst_tokens, static_cast<int64_t>(num_ranks) * q.num_worst_tokens,
                                       args, q.combine_row_bytes);
  }
  if (!result.too_large.empty()) {
    result.status = NormalCallStatus::kTooLarge;
    return result;
  }
  const NormalSendLayoutArgs layout{q.is_token_in_rank, q.num_tokens, num_ranks, q.num_channels,
                                    send_pos,          channel_prefix_matrix, send_head};
  const NormalNotifyArgs notify{region_,
                                q.num_tokens_per_rank,
                                channel_prefix_matrix,
                                q.num_tokens_per_expert,
                                q.num_channels,
                                q.num_local_experts,
                                q.expert_alignment,
                                q.num_worst_tokens,
                                0,  // pull_chunks: start_dispatch sets them when it gathers
                                0,  // sm_push_percent: start_dispatch sets it
                                counts,
                                recv_channel_prefix_matrix,
                                counts + static_cast<int64_t>(num_ranks) * num_ranks,
                                nullptr,
                                send_pos,
                                q.num_tokens,
                                false,   // push_rows: start_dispatch sets it
                                false};  // sends: start_dispatch sets it
  const CurrentDevice on_device(device_);
  if (q.num_worst_tokens > 0) {
    launch_normal_layout_and_notify(layout, notify, stream);
    args.num_rows_out = q.num_worst_tokens;
    receive(args, allocate, NormalRowsFrom::kSms, {}, stream);
    return result;
  }
  // The copy engines' gather needs only the counts on the device: it runs while the host waits for them.
  const bool rows_by_sends = normal_rows_by_sends(rows_, num_ranks, 2 * q.num_channels);
  const NormalDispatchStart start = copy_engine_->start_dispatch(
      layout, notify, rows_by_copy_engine ? &args : nullptr, rows_by_sends, q.combine_row_bytes, stream);
  if (failed()) {  // the notify gave up (start_dispatch ended the exchange)
    result.status = NormalCallStatus::kFailed;
    return result;
  }
  const int64_t prefix_size = static_cast<int64_t>(num_ranks) * num_ranks;
  std::vector<int32_t> prefix(start.counts.begin(), start.counts.begin() + prefix_size);
  result.expert_counts.assign(start.counts.begin() + prefix_size, start.counts.end());
  args.num_rows_out = prefix[prefix_size - num_ranks + region_.rank];
  if (!start.by_copy_engine) {
    int64_t most_received = 0, most_sent = 0;
    for (int a = 0; a < num_ranks; ++a) {
      int64_t received = 0, sent = 0;
      for (int b = 0; b < num_ranks; ++b) {
        received += normal_sent(prefix.data(), num_ranks, b, a);
        sent += normal_sent(prefix.data(), num_ranks, a, b);
      }
      most_received = std::max(most_received, received);
      most_sent = std::max(most_sent, sent);
    }
    result.too_large = rows_do_not_fit(most_received, most_sent, args, q.combine_row_bytes);
    if (!result.too_large.empty()) {  // every rank alike, from the shared counts; no rows moved
      result.status = NormalCallStatus::kTooLarge;
      return result;
    }
  }
  const NormalRowsFrom from =
      start.by_sends ? NormalRowsFrom::kSends : start.by_copy_engine ? NormalRowsFrom::kPulls : NormalRowsFrom::kSms;
  receive(args, allocate, from, prefix, stream);
  if (start.by_copy_engine) {
    result.host_counts =
        std::make_shared<const NormalHostCounts>(NormalHostCounts{std::move(prefix), start.recv_channel_prefix,
                                                                  start.own_runs});
  }
  return result;
}

void NormalLauncher::receive(NormalDispatchArgs args, const NormalOutputsAllocator& allocate, NormalRowsFrom from,
                             const std::vector<int32_t>& rank_prefix_matrix, gpuStream_t stream) {
  const bool by_copy_engine = from != NormalRowsFrom::kSms;
  // Queued by this thread, the pulls start before the other outputs are allocated: the GPU idles until the first.
  const bool pulls_first = from == NormalRowsFrom::kPulls && !launch_thread_.usable();
  try {
    NormalDispatchOutputs outputs{};
    outputs.recv_x = allocate.recv_x(args.num_rows_out);
    args.recv_x = outputs.recv_x;
    if (pulls_first) copy_engine_->pull_rows(args, rank_prefix_matrix, stream);
    allocate.rest(args.num_rows_out, outputs);
    args.recv_x_scales = outputs.recv_x_scales;
    args.recv_topk_idx = outputs.recv_topk_idx;
    args.recv_topk_weights = outputs.recv_topk_weights;
    args.recv_src_idx = outputs.recv_src_idx;
  } catch (...) {
    // The peers wait for this rank's end of a copy-engine exchange (an SM exchange times out there).
    if (by_copy_engine) copy_engine_->abandon_receive(region_, stream);
    throw;
  }
  if (!by_copy_engine) {
    launch_normal_dispatch(args, stream);
    return;
  }
  if (from == NormalRowsFrom::kSends) {  // a few calls: not worth the launch thread's handover
    copy_engine_->receive_sends(args, stream);  // ends the exchange whatever happens
    return;
  }
  if (pulls_first) {
    copy_engine_->receive_rest(args, stream);  // ends the exchange whatever happens
    return;
  }
  launch_thread_.run_on(stream, "dispatch", [this, args, rank_prefix_matrix](gpuStream_t work_stream) {
    try {
      copy_engine_->pull_rows(args, rank_prefix_matrix, work_stream);
    } catch (...) {
      copy_engine_->abandon_receive(region_, work_stream);
      throw;
    }
    copy_engine_->receive_rest(args, work_stream);  // ends the exchange whatever happens
  });
}

NormalCallStatus NormalLauncher::cached_dispatch(const NormalDispatchArgs& args, int64_t combine_row_bytes,
                                                 const NormalHostCounts* host_counts, gpuStream_t stream) {
  launch_thread_.join();
  if (failed()) return NormalCallStatus::kFailed;
  const NormalRowBytes dispatch_rows{args.x_row_bytes, args.scale_row_bytes, args.num_topk};
  const NormalRowBytes combine_rows{combine_row_bytes, 0, args.num_topk};
  const int handle_sms = 2 * args.num_channels;
  const bool sends = normal_rows_by_sends(rows_, region_.num_ranks, handle_sms);
  const bool by_copy_engine =
      normal_cached_dispatch_by_copy_engine(rows_, region_.num_ranks, handle_sms) &&
      copy_engine_fits(host_counts, combine_rows, sends ? nullptr : &dispatch_rows) &&
      (!sends || NormalCopyEngine::sends_fit(args, host_counts->rank_prefix_matrix));
  const CurrentDevice on_device(device_);
  if (!by_copy_engine) {
    launch_normal_dispatch(args, stream);
    return NormalCallStatus::kDone;
  }
  if (sends) {
    copy_engine_->dispatch_by_sends(args, stream);
    return NormalCallStatus::kDone;
  }
  // The counts by value: the handle that holds them may go before the thread uses them.
  launch_thread_.run_on(stream, "cached dispatch", [this, args, counts = *host_counts](gpuStream_t work_stream) {
    copy_engine_->dispatch(args, counts.rank_prefix_matrix, counts.recv_channel_prefix, counts.own_runs, work_stream);
  });
  return NormalCallStatus::kDone;
}

NormalCallStatus NormalLauncher::combine(const NormalCombineArgs& args, const NormalHostCounts* host_counts,
                                         gpuStream_t stream) {
  launch_thread_.join();
  if (failed()) return NormalCallStatus::kFailed;
  const bool by_copy_engine =
      copy_engine_fits(host_counts, NormalRowBytes{2 * static_cast<int64_t>(args.hidden), 0, args.num_topk}, nullptr);
  const CurrentDevice on_device(device_);
  if (!by_copy_engine) {
    launch_normal_combine(args, stream);
    return NormalCallStatus::kDone;
  }
  launch_thread_.run_on(stream, "combine",
                        [this, args, prefix = host_counts->rank_prefix_matrix](gpuStream_t work_stream) {
                          copy_engine_->combine(args, prefix, work_stream);
                        });
  return NormalCallStatus::kDone;
}

}  // namespace uccl_ep
