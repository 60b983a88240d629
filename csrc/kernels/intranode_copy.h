// Normal-mode dispatch and combine whose NVLink traffic the copy engines carry, leaving the SMs
// local work only. Used when every rank's counts are known on the host (a dispatch that read
// them, or a handle that kept them); the SM path (intranode.h) serves the rest.
//
// Both are one exchange of the protocol in intranode.h, over the staging of each rank's data
// area (NormalStaging):
//   dispatch: SMs gather the rows this rank sends each peer into its staging (x, scales, top-k
//     converted to the peer's local experts, source index) in pull chunks (NormalPullChunks), each
//     announced in the peer's chunk word once gathered, then announce arrival; each peer's stream
//     pulls that peer's rows for this rank straight into recv_x, every peer at once, chunk by
//     chunk: a stream wait on the chunk word (no kernel) lets each copy start as soon as its rows
//     are gathered. SMs meanwhile copy this rank's own rows, then, after the arrival, the pulled
//     rows' fp8 scales, top-k and source index (small) from the peers' staging; freed
//     follows all of them. A cached dispatch, whose exchange number the host does not know, pulls
//     each block whole after a kernel waited for its owner's arrival. With push_rows, a sender whose
//     rows for a peer are a few runs of x (normal_pushes_rows) pushes them instead, piece by piece,
//     into the peer's landing (each piece followed by an 8-byte copy that raises the peer's chunk
//     word), and the peer copies each piece from its landing into recv_x once its word says so.
//   dispatch by sends (NormalRowPath::kSends): every SM sends, storing each row straight into the data
//     area of each rank it goes to (past that rank's notify slots, as one NormalDispatchArea of all it
//     receives); the kernel's last block announces the arrival and waits for every source's; then this
//     rank's copy engine copies the rows' data out while SMs copy their small fields, then freed.
//   combine: wait until every rank freed the previous exchange, announce arrival, then on each
//     peer's stream push the top-k weights and the rows received from that peer (a contiguous block
//     of x) back into its staging, the rows in combine_chunks chunks, each followed by an 8-byte
//     copy that raises the peer's chunk word; SMs store the last sm_push_percent of each peer's rows
//     themselves (then raise its sm_pushed word), and sum each token's rows (its own straight from x)
//     once the chunks holding them have landed, then freed.
//   A stream wait has no timeout: the kernel that records a failure on a rank (every rank's own
//   receive waits for the same owners with a deadline) raises that rank's chunk words past every
//   target, so its streams drain.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels/intranode.h"

namespace uccl_ep {

// Loads NormalCopyEngine's kernels into the current device's context (gpu_load_kernels).
void load_normal_copy_kernels();

// The copy streams an exchange's last kernel waits for before it ends the exchange (a kernel argument):
// stream i (the peer streams by rank, then the push streams by rank) writes 1 into done[i] once its
// copies are done, and that kernel's last block sets the word back to 0. The value is always the same,
// so a CUDA graph that captured the exchange replays it correctly.
struct NormalCopiesDone {
  static constexpr int kMaxStreams = 2 * kNormalMaxRanks;
  uint64_t* done = nullptr;
  uint64_t streams[kMaxStreams / 64] = {};  // bit i: wait for stream i

  UCCL_EP_HOST_DEVICE bool has(int i) const { return (streams[i / 64] >> (i % 64)) & 1; }
  void add(int i) { streams[i / 64] |= uint64_t{1} << (i % 64); }
};

// What start_dispatch brings back: the dispatch's counts on the host (rank_prefix_matrix
// flattened, then the tokens each local expert receives) and whether the copy engines carry its rows.
struct NormalDispatchStart {
  std::vector<int32_t> counts;
  std::vector<int32_t> recv_channel_prefix;  // [R, C] as the notify wrote it (with a gather)
  bool by_copy_engine = false;
  bool by_sends = false;  // of the copy engines' dispatches, one whose rows the SMs sent (normal_rows_by_sends)
  // The runs of the tokens this rank keeps for itself, where the notify listed the others (few enough):
  // its cached dispatches may copy their own rows by copy engine as well.
  std::optional<std::vector<NormalTokenRun>> own_runs;
};

// Also the normal mode's host side in general: start_dispatch serves the SM path too.
class NormalCopyEngine {
 public:
  // peer_bases[r]: rank r's buffer as mapped in this process (host addresses); combine_chunks: the
  // pieces each peer's combine block is pushed in (1 .. kNormalMaxChunks; more start the sums
  // earlier, at one more copy and announcement each), or kNormalCombineChunksBySms: by the combine's
  // SMs (normal_combine_chunks); each rank may use its own (the chunk words carry the count).
  // pull_chunks: the most pieces a dispatch's pulls come in (1 .. kNormalMaxChunks; at most the
  // dispatch's channels); every rank must use the same (the notify checks: kNormalSettingsDiffer).
  // sm_pull_percent: the share of each peer's dispatch rows (0..100, from the end of its block) that
  // SMs copy over NVLink loads beside the copy engines; each rank may use its own.
  // sm_push_percent: the share of the rows a combine returns to each peer (0..100, from the end of its
  // block) that SMs store into the peer's staging before they sum; every rank must use the same (the
  // notify checks).
  // own_rows: what copies this rank's rows to itself (normal_own_rows_by_engine); a copy engine copies
  // them only as runs of consecutive tokens, when the notify found at most kNormalMaxGaps tokens it
  // does not keep, else the SMs do.
  // push_rows: a dispatch's senders push the rows for a peer from x where normal_pushes_rows says so
  // (needs stream waits on the device, and at most kNormalMaxCombineRanks ranks); every rank must use
  // the same (the notify checks).
  NormalCopyEngine(int device, std::vector<std::uintptr_t> peer_bases, int combine_chunks = kNormalCombineChunksBySms,
                   int pull_chunks = kNormalPullChunks, int sm_pull_percent = kNormalSmPullPercent,
                   int sm_push_percent = kNormalSmPushPercent, NormalOwnRows own_rows = NormalOwnRows::kAuto,
                   bool push_rows = false);
  ~NormalCopyEngine();
  NormalCopyEngine(const NormalCopyEngine&) = delete;
  NormalCopyEngine& operator=(const NormalCopyEngine&) = delete;

  // A dispatch's first half and its one host sync: the send layout and notify, whose kernel writes
  // the counts into mapped host memory as well (notify.host_counts is set here). `gather` (the
  // dispatch's arguments, outputs not set yet; or null) runs behind the notify, while the host waits.
  // by_copy_engine: `gather` was given and every owner's staging fits its rows and a combine of bf16
  // rows of `combine_row_bytes`; otherwise the gather's exchange is ended unread (every rank decides
  // alike, from shared counts) and the rows go by SMs. With `sends`, the SMs send the gather's rows
  // into their receivers' data areas instead (send_rows; by_sends when they fit, and receive_sends
  // follows). Throws if the counts are not on the host 5 s after the region's timeout (by then the
  // device's record names the peer).
  NormalDispatchStart start_dispatch(const NormalSendLayoutArgs& layout, const NormalNotifyArgs& notify,
                                     const NormalDispatchArgs* gather, bool sends, int64_t combine_row_bytes,
                                     gpuStream_t stream);
  // The second half after start_dispatch chose the copy engines, in two calls so that the pulls are
  // queued as soon as recv_x exists. pull_rows: every peer's rows for this rank into args.recv_x
  // (rank_prefix_matrix_host is the [R, R] matrix read on the host, args.num_rows_out the rows this
  // rank receives; the other outputs may be unset yet), chunk by chunk when that start_dispatch was
  // the last one. receive_rest: this rank's own rows and every row's small fields into all of
  // `args`'s outputs (the same recv_x and num_rows_out), then the end of the exchange.
  void pull_rows(const NormalDispatchArgs& args, const std::vector<int32_t>& rank_prefix_matrix_host,
                 gpuStream_t stream);
  void receive_rest(const NormalDispatchArgs& args, gpuStream_t stream);
  // After a start_dispatch that chose sends (or send_rows): the rows every source sent into this rank's
  // data area into `args`'s outputs (args.num_rows_out of them), the data by this rank's copy engine and
  // the small fields by SMs, then the exchange's end.
  void receive_sends(const NormalDispatchArgs& args, gpuStream_t stream);
  // A whole dispatch by sends (a cached one), where sends_fit.
  void dispatch_by_sends(const NormalDispatchArgs& args, gpuStream_t stream);
  // Whether every rank's data area holds the rows it receives by sends (rank_prefix_matrix_host's counts).
  static bool sends_fit(const NormalDispatchArgs& args, const std::vector<int32_t>& rank_prefix_matrix_host);
  // Ends the exchange of a start_dispatch that chose the copy engines when the caller fails before
  // receive_rest (after pull_rows or not; the outputs stay unwritten): the peers wait for its end.
  void abandon_receive(const NormalRegion& region, gpuStream_t stream);
  // The pieces a gathered dispatch of num_channels channels is pulled in (its notify's pull_chunks).
  int pull_chunks(int num_channels) const { return std::min(pull_chunks_, num_channels); }
  // Whether its gathered dispatches push rows where they can (its notifies' push_rows).
  bool pushes_rows() const { return push_rows_ && stream_waits_; }
  // How many blocks of rows (one per peer and dispatch) its dispatches have pushed so far.
  int64_t blocks_pushed() const { return blocks_pushed_; }
  // How long the last start_dispatch waited for the counts to reach the host (the peers' notify).
  int64_t last_count_wait_ns() const { return last_count_wait_ns_; }
  // How many dispatches so far copied this rank's own rows by copy engine.
  int64_t own_rows_by_engine() const { return own_rows_by_engine_; }
  // A whole dispatch (a cached one: its counts are known on the host already, recv_channel_prefix_host
  // [R, C] too, so from kNormalCachedPiecesMinChannels channels on each peer's block is pulled in
  // pieces as the gather completes them). own_runs: its fresh dispatch's (NormalDispatchStart), if any:
  // then the own rows go the way they would in a fresh dispatch of these rows.
  void dispatch(const NormalDispatchArgs& args, const std::vector<int32_t>& rank_prefix_matrix_host,
                const std::vector<int32_t>& recv_channel_prefix_host,
                const std::optional<std::vector<NormalTokenRun>>& own_runs, gpuStream_t stream);
  // args.x starts with the dispatch's received rows (grouped by source rank); rows past them are ignored.
  void combine(const NormalCombineArgs& args, const std::vector<int32_t>& rank_prefix_matrix_host,
               gpuStream_t stream);
  // Frees the peer streams, events and pinned memory; later calls raise. Idempotent.
  void release();

 private:
  // The gather and the arrival, from args.rank_prefix_matrix on the device (the output pointers are
  // not used yet). A rank whose staging would not fit gathers nothing.
  void dispatch_send(const NormalDispatchArgs& args, NormalPullChunks chunks, bool push_rows, gpuStream_t stream);
  // Where sent rows lie in every data area (normal_sends_offset).
  static int64_t sends_offset(const NormalDispatchArgs& args);
  // The sends (send_to_receivers): every row into its receivers' data areas, then the arrival and the
  // wait for every source's.
  void send_rows(const NormalDispatchArgs& args, gpuStream_t stream);
  // This rank's rows for `peer` from x into the peer's landing, on the peer's push stream after the
  // notify, as the runs between `gaps` (the notify's list for the peer), in the pieces of pulls_.
  void queue_pushes(const NormalDispatchArgs& args, const std::vector<int32_t>& rank_prefix_matrix_host, int peer,
                    const int32_t* gaps);
  // Each peer's rows for this rank into recv_x on the peer's stream: whole after a wait for its
  // arrival, or chunk by chunk when pulls_ holds the exchange, each piece behind a stream wait (or a
  // waiting kernel when only the device knows the exchange's number).
  void queue_pulls(const NormalDispatchArgs& args, const std::vector<int32_t>& rank_prefix_matrix_host, int src,
                   gpuStream_t peer_stream);
  // The receive's last kernel on `stream`: with `rest`, receive_own_rows into its outputs, else only
  // the exchange's end; either waits for the pulls (and the own rows' copies and the pushes when queued)
  // before it announces freed.
  void end_receive(gpuStream_t stream, const NormalDispatchArgs* rest);
  // Has the copy streams this exchange queued copies on (every peer's stream but this rank's own
  // unless `own`, when `peers`; the push streams in pushed_to_) write their done words after them.
  NormalCopiesDone mark_copies(int me, bool peers, bool own);
  // The exchange's end on its own, after `copies`.
  void end_exchange(const NormalRegion& region, const NormalCopiesDone& copies, gpuStream_t stream);
  // Waits until the notify launched by start_dispatch has written its exchange number into
  // host_counts_ (at epoch_index), and returns it (kNormalNotifyFailed: a wait on the device gave up).
  uint64_t wait_for_notify(const NormalRegion& region, int64_t epoch_index) const;
  void check_usable(const NormalRegion& region, const std::vector<int32_t>& rank_prefix_matrix_host) const;
  void require_unreleased() const;
  // Each peer's stream waits for `stream` up to now (or up to the event `since`, recorded on it),
  // then `queue(peer, peer_stream)` puts that peer's copies on it (mark_copies ends them).
  template <typename Queue>
  void fork_peer_streams(int me, gpuStream_t stream, gpuEvent_t since, Queue&& queue);
  // The own rows' data by copy engine, on this rank's own stream (peer_streams_[me]) after the
  // event `since`, when own_runs_ holds this dispatch's runs (then own_rows_queued_).
  void queue_own_rows(const NormalDispatchArgs& args, gpuEvent_t since);
  // Holds `runs` in own_runs_ for this dispatch's receive_rest where the own rows (kept tokens of
  // row_bytes) go by copy engine at num_sms.
  void take_own_runs(std::vector<NormalTokenRun> runs, int64_t row_bytes, int num_sms);
  uint8_t* staging(int owner) const;

  int device_;
  int combine_chunks_;
  int pull_chunks_;
  int sm_pull_percent_;
  int sm_push_percent_;
  NormalOwnRows own_rows_;
  bool push_rows_;
  int64_t last_count_wait_ns_ = 0;
  bool stream_waits_ = false;  // the device supports them; else every pull waits for the whole block
  std::vector<std::uintptr_t> peer_bases_;
  // What pull_rows needs to pull chunk by chunk, from the last start_dispatch (cleared once used).
  struct PendingPulls {
    bool ready = false;
    uint64_t epoch = 0;                        // the dispatch's exchange number; 0: only the device knows it
    NormalPullChunks chunks{1, 1};
    std::vector<int32_t> recv_channel_prefix;  // [R, C] as read on the host
    uint32_t pushing_sources = 0;              // those that push their rows into this rank's landing
    int64_t landing_offset = 0;                // in every data area
  } pulls_;
  uint32_t receive_pushing_sources_ = 0;  // pulls_.pushing_sources, from pull_rows to receive_rest
  uint32_t pushed_to_ = 0;                // the peers the last start_dispatch queued pushes to
  int64_t blocks_pushed_ = 0;
  int64_t own_rows_by_engine_ = 0;
  // Between pull_rows and receive_rest: the exchange's pulls are queued into pulled_into_.
  bool receive_pending_ = false;
  bool own_rows_queued_ = false;  // this rank's own rows' data go by copy engine (queue_own_rows)
  NormalRegion pending_region_{};
  const void* pulled_into_ = nullptr;
  int64_t pulled_rows_ = 0;
  // The own rows' runs of the last start_dispatch, for its receive_rest (cleared once used), and
  // where the own rows start in the outputs (set by pull_rows).
  struct OwnRuns {
    bool ready = false;
    std::vector<NormalTokenRun> runs;
    int64_t first_row = 0;
  } own_runs_;
  // Device words: the chunk word values of the current combine (written by its first kernel, copied
  // to the owners after each chunk), then the gather's per-chunk warp counters (back to 0 after use),
  // then the copy streams' done words (NormalCopiesDone).
  uint64_t* chunk_values_ = nullptr;
  uint32_t* gathered_warps_ = nullptr;
  uint64_t* copies_done_ = nullptr;
  // One stream per peer (indexed by rank; this rank's own carries the own rows' copies): each peer's pulls or pushes
  // run on their own stream beside the SMs' work, so at 4 or 8 ranks the copy engines move every
  // peer's block at once instead of one after another.
  std::vector<gpuStream_t> peer_streams_;
  // With push_rows, one more stream per peer for the pushes to it: on the peer's stream they would
  // hold back the copies out of this rank's landing.
  std::vector<gpuStream_t> push_streams_;
  uint64_t* push_values_ = nullptr;    // pinned: the chunk words the pushes' 8-byte copies write
  gpuEvent_t fork_ = nullptr;          // the caller's stream up to the copies
  gpuEvent_t before_gather_ = nullptr;  // the caller's stream up to the gather (after a fresh dispatch's notify)
  int32_t* host_counts_ = nullptr;     // mapped pinned memory the notify writes, host_counts_capacity_ int32
  int32_t* host_counts_device_ = nullptr;
  int64_t host_counts_capacity_ = 0;
};

// Bytes of `owner`'s data area that an exchange of this kind with these counts needs.
int64_t normal_staging_bytes(NormalStaging kind, const std::vector<int32_t>& rank_prefix_matrix_host, int num_ranks,
                             int owner, NormalRowBytes row_bytes);
// The most any owner's data area needs: the path fits when this is at most the region's data_bytes.
int64_t normal_staging_most_bytes(NormalStaging kind, const std::vector<int32_t>& rank_prefix_matrix_host,
                                  int num_ranks, NormalRowBytes row_bytes);

}  // namespace uccl_ep
