// Normal-mode (high-throughput) dispatch and combine between GPUs of one host that map each
// other's buffer with CUDA IPC. First version: simple and correct; speed comes later.
//
// Every rank's buffer (num_nvl_bytes) is a control area of kNormalControlBytes, then a data area.
// Control area: uint64 arrived[kNormalMaxRanks] (indexed by the writing source), then uint64
// freed[kNormalMaxRanks] (indexed by the rank that finished reading), then uint64
// chunks[kNormalMaxRanks] (indexed by the source: on the copy-engine path, the chunks of an
// exchange the source has ready for this rank: gathered for its pulls, or pushed for its sums), then
// uint64 sm_pushed[kNormalMaxRanks] (indexed by the source: the last combine whose rows the
// source's SMs stored beside its copy engines, see kNormalSmPushPercent), then the channel words of the
// SM path (normal_channel_word_offset).
//
// All normal-mode traffic is a sequence of exchanges (notify, dispatch, combine) that every rank
// runs in the same order. Exchange number e (from 1) is its epoch, counted on the device
// (NormalRegion::control) so that CUDA-graph replays advance it too. Every exchange keeps two rules:
// a rank stores into a destination's data area only once that destination has freed exchange e-1
// (its freed word in the sender's control area reaches e-1), and a rank announces freed (stores e into
// freed[this rank] of every source) only once it has read everything of exchange e. A data area is
// therefore written again only after its reader finished the previous exchange, so the whole data
// area serves every exchange, and flags never need zeroing. Between the two, a receiver learns that
// rows are there from the arrived words (the notify, the copy-engine path: arrived[source] reaches e
// once the source's part is all there) or, on the SM path, from channel words that the senders raise
// as they go, so the receivers copy or sum rows while the rest are still on their way:
//   1. one kernel of 2S blocks: S senders and S receivers (S = num_sms / 2), each taking the channels
//      b, b + S, ... (DeepEP's channels: token ranges of ceil(N / C)). A sender block waits for the
//      destinations to be free, then stores its channel's rows a round at a time (a row per warp),
//      and after each round raises, in each destination's control area, the word of (this rank,
//      channel) to epoch << 32 | the send positions stored so far (a channel's rows for one rank are
//      consecutive send positions). A receiver block waits for each row's word before it reads it.
//   2. the kernel's last block to finish counts the exchange as done and announces freed.
//
// Waits give up after timeout_ns: the first failure goes to a status block in mapped host memory,
// and the aborted control word makes every later kernel of this Buffer return at once (the Python
// side raises; the Buffer must then be recreated). Size failures that every rank detects from the
// same rank_prefix_matrix (too many rows for num_worst_tokens, a data area too small) are recorded
// the same way, so all ranks stop together instead of some waiting forever.
#pragma once

#include <cstdint>
#include <vector>

#include "common/portability.h"
#include "kernels/low_latency.h"  // LowLatencyStatus: the failure record both modes share

namespace uccl_ep {

constexpr int kNormalMaxRanks = 256;
// A combine's sums give each of a token's rows one lane of a warp (sum_token_rows): at most this many ranks.
constexpr int kNormalMaxCombineRanks = 32;
constexpr int kNormalMaxTopk = 32;  // one warp lane per top-k entry
// The SM path's channel words: one per (source, channel), at most this many (num_ranks * num_channels).
constexpr int64_t kNormalChannelWords = 8192;
constexpr int64_t kNormalControlBytes = (4 * kNormalMaxRanks + kNormalChannelWords) * sizeof(uint64_t);
UCCL_EP_HOST_DEVICE inline int64_t normal_channel_word_offset(int src, int channel, int num_channels) {
  return (4 * static_cast<int64_t>(kNormalMaxRanks) + static_cast<int64_t>(src) * num_channels + channel) *
         static_cast<int64_t>(sizeof(uint64_t));
}
// A channel word's value: `positions` send positions of exchange `epoch` stored (exchanges stay below 2^32).
UCCL_EP_HOST_DEVICE inline uint64_t normal_channel_progress(uint64_t epoch, int64_t positions) {
  return epoch << 32 | static_cast<uint64_t>(positions);
}
// The copy-engine combine pushes each block in chunks, so the sums start on the first. By default
// (combine_chunks 0) 6, or 12 with at most kNormalCombineFewSms SMs: there the SM-bound sums gain more
// from an earlier first chunk than a further copy costs (2x H200, EP2: at 8 SMs 12 chunks 430-433 us
// against 446-454; at 24 SMs 6 chunks 269-277 against 300).
constexpr int kNormalCombineChunks = 6;
constexpr int kNormalCombineChunksFewSms = 12;
constexpr int kNormalCombineFewSms = 12;
constexpr int kNormalCombineChunksBySms = 0;  // the default of NormalCopyEngine's combine_chunks
inline int normal_combine_chunks(int setting, int num_sms) {
  if (setting != kNormalCombineChunksBySms) return setting;
  return num_sms <= kNormalCombineFewSms ? kNormalCombineChunksFewSms : kNormalCombineChunks;
}
// A chunk word holds epoch * kNormalChunkStride + landed * kNormalChunkCounts + chunks: of the
// `chunks` pieces (1..kNormalMaxChunks) its writer moves this exchange's block in, `landed` are there.
// Monotonic over exchanges, and self-describing: a reader finds the landed rows without knowing the
// writer's chunking (a combine's depends on the pusher's SMs).
constexpr int kNormalMaxChunks = 63;
constexpr uint64_t kNormalChunkCounts = 64;
constexpr uint64_t kNormalChunkStride = kNormalChunkCounts * kNormalChunkCounts;
UCCL_EP_HOST_DEVICE inline uint64_t normal_chunk_word(uint64_t epoch, int32_t landed, int32_t chunks) {
  return epoch * kNormalChunkStride + static_cast<uint64_t>(landed) * kNormalChunkCounts +
         static_cast<uint64_t>(chunks);
}
// A failing rank raises its own chunk words to this, so that no stream waits on them forever.
constexpr uint64_t kNormalChunkWordsOpen = uint64_t{1} << 62;
// The copy-engine dispatch pulls each peer's block in this many pieces by default, each as soon as
// its owner has gathered it (NormalPullChunks). Each further pull costs the engines 12-16 us, so few
// pieces: 3 measured best at EP2 (4: 25-74 us slower).
constexpr int kNormalPullChunks = 3;
// A cached copy-engine dispatch pulls in pieces from this many channels (16 SMs) on, else whole blocks:
// at EP2 (2x H200, bf16, 4096 tokens) pieces took 244 us back to back against 261 with 24 SMs, and 386
// against 370 with 8, where the slow gather leaves little to overlap and each piece's waiting kernel costs.
constexpr int kNormalCachedPiecesMinChannels = 8;
// Share (percent) of each peer's dispatch rows that SMs copy beside the copy engines: 12 measured best at EP2.
constexpr int kNormalSmPullPercent = 12;
// Share (percent) of the rows a combine returns to each peer that SMs store into its staging beside
// the copy engines' pushes, before they sum: 0 until measured on 2 GPUs. Every rank must use the same
// (a dispatch's notify checks it: the owner finds a row's signal by it).
constexpr int kNormalSmPushPercent = 0;

UCCL_EP_HOST_DEVICE inline int64_t normal_chunk_word_offset(int src) {
  return (2 * static_cast<int64_t>(kNormalMaxRanks) + src) * static_cast<int64_t>(sizeof(uint64_t));
}
UCCL_EP_HOST_DEVICE inline int64_t normal_sm_pushed_word_offset(int src) {
  return (3 * static_cast<int64_t>(kNormalMaxRanks) + src) * static_cast<int64_t>(sizeof(uint64_t));
}

// The pieces of a copy-engine dispatch: consecutive groups of DeepEP's channels (token ranges of
// ceil(N / num_channels)), so a receiver finds each piece's rows in recv_channel_prefix_matrix. The
// first piece is one channel, so the first pull starts early; the others share the rest evenly.
struct NormalPullChunks {
  int32_t num_channels;
  int32_t count;  // 1 .. num_channels
};
UCCL_EP_HOST_DEVICE inline int32_t normal_pull_chunk_first_channel(NormalPullChunks p, int32_t chunk) {
  if (chunk == 0) return 0;
  if (p.count == 1) return p.num_channels;
  return 1 + static_cast<int32_t>(static_cast<int64_t>(chunk - 1) * (p.num_channels - 1) / (p.count - 1));
}

// The tokens of channels [first_channel, end_channel) of a rank with num_tokens tokens: [first, end).
struct NormalTokenRange {
  int64_t first, end;
};
UCCL_EP_HOST_DEVICE inline NormalTokenRange normal_channel_tokens(int32_t num_channels, int32_t first_channel,
                                                                  int32_t end_channel, int64_t num_tokens) {
  const int64_t per_channel = (num_tokens + num_channels - 1) / num_channels;
  const int64_t first = first_channel * per_channel;
  const int64_t end = end_channel * per_channel;
  return NormalTokenRange{first < num_tokens ? first : num_tokens, end < num_tokens ? end : num_tokens};
}
// The tokens of pull chunk `chunk`.
UCCL_EP_HOST_DEVICE inline NormalTokenRange normal_pull_chunk_tokens(NormalPullChunks p, int32_t chunk,
                                                                     int64_t num_tokens) {
  return normal_channel_tokens(p.num_channels, normal_pull_chunk_first_channel(p, chunk),
                               normal_pull_chunk_first_channel(p, chunk + 1), num_tokens);
}

// Of `rows` rows between two ranks, those the copy engines move (from the start); SMs move the rest
// beside them (sm_percent of the rows, 0..100): a dispatch's pulls, or a combine's pushes.
UCCL_EP_HOST_DEVICE inline int64_t normal_copy_engine_rows(int64_t rows, int32_t sm_percent) {
  return rows - rows * sm_percent / 100;
}

// The pieces a copy-engine combine pushes `rows` rows in: the last one half the size of the others,
// so the sums left after the last push are few. Chunk c holds rows [begin(c), begin(c + 1)).
UCCL_EP_HOST_DEVICE inline int64_t normal_combine_chunk_begin(int64_t rows, int32_t chunks, int32_t chunk) {
  return chunk >= chunks ? rows : chunk * 2 * rows / (2 * chunks - 1);
}
// Of the `rows` rows a combine pushes to an owner, how many have landed by a chunk word `word` of
// exchange `epoch`: a word past the exchange (kNormalChunkWordsOpen: the writer failed) counts all.
UCCL_EP_HOST_DEVICE inline int64_t normal_combine_rows_landed(uint64_t word, uint64_t epoch, int64_t rows) {
  if (word < epoch * kNormalChunkStride) return 0;
  if (word >= (epoch + 1) * kNormalChunkStride) return rows;
  const uint64_t within = word - epoch * kNormalChunkStride;
  return normal_combine_chunk_begin(rows, static_cast<int32_t>(within % kNormalChunkCounts),
                                    static_cast<int32_t>(within / kNormalChunkCounts));
}
// Words of NormalRegion::control (the LowLatencyState control block the Python side lends). A kernel
// whose last block to finish does a step of its own (the notify after the send layout, an exchange's
// arrival after the gather, its end) counts its finished blocks in kNormalBlocksDoneWord, which that
// block sets back to 0: a Buffer's normal-mode kernels run one after another, so they share it.
constexpr int kNormalExchangesWord = 0;
constexpr int kNormalBlocksDoneWord = 1;
constexpr int kNormalAbortedWord = 2;

enum NormalError : int32_t {
  kNormalTimeout = 1,        // a peer's flag did not arrive in time
  kNormalTooManyRows = 2,    // a rank would receive more than num_worst_tokens rows (detail: rows)
  kNormalAreaTooSmall = 3,   // a rank's data area cannot hold an exchange (detail: 0)
  kNormalSettingsDiffer = 4, // a peer's dispatch settings differ (detail: normal_notify_settings_word of the peer's)
};

enum NormalPhase : int32_t {
  kNormalNotifySend = 1,     // waiting for a peer to free the previous exchange
  kNormalNotifyRecv = 2,
  kNormalDispatchSend = 3,
  kNormalDispatchRecv = 4,
  kNormalCombineSend = 5,
  kNormalCombineRecv = 6,
};

struct NormalRegion {
  const uint64_t* peer_bases;  // device [num_ranks]: each rank's buffer as mapped in this process
  uint64_t* control;           // device: exchanges done, aborted (see the word indices above)
  LowLatencyStatus* status;    // mapped host memory
  int64_t data_bytes;          // bytes of every rank's data area
  int64_t timeout_ns;
  int32_t rank;
  int32_t num_ranks;
  bool aggressive_atomics;     // flags as relaxed accesses between explicit fences (portability.h publish_flag)
};

UCCL_EP_HOST_DEVICE inline int64_t normal_align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// notify: a destination's data area starts with one int32 per source at a fixed place: the source's
// settings word (normal_notify_settings_word; every rank must use the same, and a receiver checks
// that before it reads the slots), then one slot per source, which holds int32 counts: tokens the
// source sends to each rank [num_ranks], its channel_prefix_matrix row for the destination
// [num_channels], its tokens per expert of the destination [num_local_experts], its token count [1].
UCCL_EP_HOST_DEVICE inline int64_t normal_notify_slot_ints(int64_t num_ranks, int64_t num_channels,
                                                           int64_t num_local_experts) {
  return num_ranks + num_channels + num_local_experts + 1;
}
UCCL_EP_HOST_DEVICE inline int64_t normal_notify_slots_offset_ints(int64_t num_ranks) {
  return normal_align16(num_ranks * 4) / 4;
}
UCCL_EP_HOST_DEVICE inline int64_t normal_notify_area_bytes(int64_t num_ranks, int64_t num_channels,
                                                            int64_t num_local_experts) {
  return 4 * (normal_notify_slots_offset_ints(num_ranks) +
              num_ranks * normal_notify_slot_ints(num_ranks, num_channels, num_local_experts));
}
// What the ranks of a dispatch must agree on, in one word: its channels (the slot layout, and the
// handle's channel tables), the pieces the copy engines' gather after the notify announces (0: no
// gather), whether senders push rows where they can (normal_pushes_rows), whether every rank's SMs
// send its rows (normal_rows_by_sends), and the share of its combine's rows that SMs push.
constexpr int32_t kNormalMaxNotifyChannels = (1 << 16) - 1;
constexpr int32_t kNormalPercentValues = 128;
UCCL_EP_HOST_DEVICE inline int32_t normal_notify_settings_word(int32_t num_channels, int32_t pull_chunks,
                                                               int32_t sm_push_percent, bool push_rows, bool sends) {
  return ((num_channels * 4 + (push_rows ? 1 : 0) + (sends ? 2 : 0)) * kNormalPercentValues + sm_push_percent) *
             static_cast<int32_t>(kNormalChunkCounts) +
         pull_chunks;
}
// The settings back from a word (for the error that names them).
struct NormalNotifySettings {
  int32_t num_channels, pull_chunks, sm_push_percent;
  bool push_rows, sends;
};
inline NormalNotifySettings normal_notify_settings(int32_t word) {
  const int32_t rest = word / static_cast<int32_t>(kNormalChunkCounts);
  const int32_t channels_and_rows = rest / kNormalPercentValues;
  return NormalNotifySettings{channels_and_rows / 4, word % static_cast<int32_t>(kNormalChunkCounts),
                              rest % kNormalPercentValues, channels_and_rows % 2 == 1, channels_and_rows / 2 % 2 == 1};
}

// dispatch: a receiver's data area holds one contiguous array per field, `rows` rows each (rows
// grouped by source rank, then in token order): x, scales, top-k ids (int64), top-k weights
// (float), source token index (int32).
struct NormalDispatchArea {
  int64_t x, scales, topk_idx, topk_weights, src_idx, total;
};
UCCL_EP_HOST_DEVICE inline NormalDispatchArea normal_dispatch_area(int64_t rows, int64_t x_row_bytes,
                                                                  int64_t scale_row_bytes, int64_t num_topk) {
  NormalDispatchArea a;
  a.x = 0;
  a.scales = a.x + normal_align16(rows * x_row_bytes);
  a.topk_idx = a.scales + normal_align16(rows * scale_row_bytes);
  a.topk_weights = a.topk_idx + normal_align16(rows * num_topk * 8);
  a.src_idx = a.topk_weights + normal_align16(rows * num_topk * 4);
  a.total = a.src_idx + normal_align16(rows * 4);
  return a;
}

// combine: a source rank's data area holds the rows it sent, back from their receivers, ordered
// like its sends (by receiver, then token): bf16 x, then top-k weights (float).
struct NormalCombineArea {
  int64_t x, topk_weights, total;
};
UCCL_EP_HOST_DEVICE inline NormalCombineArea normal_combine_area(int64_t rows, int64_t x_row_bytes,
                                                                int64_t num_topk) {
  NormalCombineArea a;
  a.x = 0;
  a.topk_weights = normal_align16(rows * x_row_bytes);
  a.total = a.topk_weights + normal_align16(rows * num_topk * 4);
  return a;
}

// Counts from a rank_prefix_matrix (inclusive prefix over sources: [i][j] = tokens ranks 0..i send
// to rank j), on the host or the device.
UCCL_EP_HOST_DEVICE inline int64_t normal_rows_before(const int32_t* rank_prefix_matrix, int num_ranks, int src,
                                                      int dst) {  // rows of sources below src at dst
  return src > 0 ? rank_prefix_matrix[(src - 1) * num_ranks + dst] : 0;
}
UCCL_EP_HOST_DEVICE inline int64_t normal_sent(const int32_t* rank_prefix_matrix, int num_ranks, int src, int dst) {
  return rank_prefix_matrix[src * num_ranks + dst] - normal_rows_before(rank_prefix_matrix, num_ranks, src, dst);
}

// Copy-engine staging (intranode_copy.h): in a rank's data area, one block per other rank, in
// rank order, each sized for the rows the owner sends that rank. Dispatch: the owner gathers those
// rows into the blocks (a NormalDispatchArea each) and the receivers pull them. Combine: the
// receivers push the rows back (a NormalCombineArea each), and the owner reduces them.
enum class NormalStaging : int32_t { kDispatch = 0, kCombine = 1 };

struct NormalRowBytes {
  int64_t x_row_bytes;
  int64_t scale_row_bytes;  // dispatch only
  int64_t num_topk;
};

UCCL_EP_HOST_DEVICE inline int64_t normal_staging_block_bytes(NormalStaging kind, int64_t rows, NormalRowBytes b) {
  return kind == NormalStaging::kDispatch ? normal_dispatch_area(rows, b.x_row_bytes, b.scale_row_bytes, b.num_topk).total
                                          : normal_combine_area(rows, b.x_row_bytes, b.num_topk).total;
}

// Where `peer`'s block starts in `owner`'s staging; peer = num_ranks gives the staging's size.
UCCL_EP_HOST_DEVICE inline int64_t normal_staging_offset(NormalStaging kind, const int32_t* rank_prefix_matrix,
                                                         int num_ranks, int owner, int peer, NormalRowBytes b) {
  int64_t offset = 0;
  for (int other = 0; other < peer; ++other) {
    if (other != owner) {
      offset += normal_staging_block_bytes(kind, normal_sent(rank_prefix_matrix, num_ranks, owner, other), b);
    }
  }
  return offset;
}

// What a rank sends, from is_token_in_rank [N, R]: send_pos [N, R] (a token's position among the
// tokens sent to that rank, -1 if not sent). Optionally DeepEP's per-channel tables (tokens split
// into num_channels ranges of ceil(N / C)): channel_prefix_matrix [R, C] (tokens sent to each rank
// from channels 0..c) and send_head [N, R] (position within its channel's tokens for that rank).
struct NormalSendLayoutArgs {
  const bool* is_token_in_rank;
  int64_t num_tokens;
  int32_t num_ranks;
  int32_t num_channels;
  int32_t* send_pos;
  int32_t* channel_prefix_matrix;  // or null
  int32_t* send_head;              // or null; needs channel_prefix_matrix
};

struct NormalNotifyArgs {
  NormalRegion region;
  const int32_t* num_tokens_per_rank;    // [R]
  const int32_t* channel_prefix_matrix;  // [R, C], this rank's (inclusive prefix per channel)
  const int32_t* num_tokens_per_expert;  // [R * El]
  int32_t num_channels;
  int32_t num_local_experts;
  int32_t expert_alignment;
  int32_t num_worst_tokens;              // 0: no bound
  int32_t pull_chunks;                   // pieces of the copy engines' gather behind this notify; 0: none
  int32_t sm_push_percent;               // of the copy-engine combines that follow (kNormalSmPushPercent)
  int32_t* rank_prefix_matrix;           // out [R, R]: [i][j] = tokens ranks 0..i send to rank j
  int32_t* recv_channel_prefix_matrix;   // out [R, C]: exclusive prefix of each source's channels
  int32_t* recv_tokens_per_expert;       // out [El], rounded up to expert_alignment
  // Or null: mapped host memory (8-byte aligned) that gets recv_channel_prefix_matrix, rank_prefix_matrix,
  // recv_tokens_per_expert and every source's token count, then at normal_host_counts_epoch_index (a
  // uint64, written last) the notify's exchange number, or kNormalNotifyFailed when a wait gave up.
  int32_t* host_counts;
  // With host_counts: the send layout's send_pos [num_tokens, R]; the tokens this rank does not send
  // itself (and with push_rows, those it does not send each other rank) go to the host after the
  // epoch (normal_host_gaps_index), so that the copy engines can move its rows in runs of consecutive
  // tokens. Or null.
  const int32_t* send_pos;
  int64_t num_tokens;                    // this rank's tokens (each slot carries its source's)
  bool push_rows;                        // the copy-engine dispatch after it pushes rows where it can
  bool sends;                            // every rank's SMs send its rows after it (normal_rows_by_sends)
};

constexpr uint64_t kNormalNotifyFailed = ~uint64_t{0};
// Where host_counts keeps every source's token count, after the other counts.
UCCL_EP_HOST_DEVICE inline int64_t normal_host_source_tokens_index(int64_t num_ranks, int64_t num_channels,
                                                                   int64_t num_local_experts) {
  return num_ranks * num_channels + num_ranks * num_ranks + num_local_experts;
}
// Where host_counts keeps the exchange number: the first 8-byte boundary after the counts.
UCCL_EP_HOST_DEVICE inline int64_t normal_host_counts_epoch_index(int64_t num_ranks, int64_t num_channels,
                                                                  int64_t num_local_experts) {
  return (normal_host_source_tokens_index(num_ranks, num_channels, num_local_experts) + num_ranks + 1) / 2 * 2;
}
UCCL_EP_HOST_DEVICE inline int64_t normal_host_counts_epoch_index(const NormalNotifyArgs& a) {
  return normal_host_counts_epoch_index(a.region.num_ranks, a.num_channels, a.num_local_experts);
}
// After the epoch word, per destination rank: how many tokens this rank does not send it, then the
// first kNormalMaxGaps of them in order. More gaps than that: the copy engines do not move those rows
// as runs (the SMs copy the own rows, and the peer's are gathered and pulled).
constexpr int kNormalMaxGaps = 128;
UCCL_EP_HOST_DEVICE inline int64_t normal_host_gaps_index(int64_t epoch_index, int dst) {
  return epoch_index + 2 + static_cast<int64_t>(dst) * (1 + kNormalMaxGaps);
}
UCCL_EP_HOST_DEVICE inline int64_t normal_host_counts_ints(int64_t epoch_index, int num_ranks) {
  return normal_host_gaps_index(epoch_index, num_ranks);
}

// A run of consecutive tokens that a rank sends one rank (itself, or a peer it pushes to): rows
// `token`.. of x become that rank's received rows `row`.. counted from the sender's first row there.
struct NormalTokenRun {
  int64_t token;
  int64_t row;
  int64_t count;
};
// What moves a dispatch's rows between ranks (UCCL_EP_NORMAL_COPY), and so its combine's: the copy engines
// (intranode_copy.h; they need the counts on the host, so a dispatch with num_worst_tokens goes by SMs), or
// the SM path's channels. kAuto picks by measurement on 4x H200 (docs/PERFORMANCE.md): copy engines below
// kNormalSmRowsFromRanks ranks, where one peer's copy engine outruns SM stores; from there on the SM path
// with kNormalSmRowsFromSms SMs or more (a GPU's copy engines carry one peer copy at a time: about 190 GB/s
// each way when every rank copies to every peer), and sends below it, fresh and cached alike.
// kSends: where the counts are on the host, every SM of the dispatch sends (no SMs set aside to receive):
// each row is stored straight into its receiver's data area, then the receiver's copy engine copies its rows
// out (NormalCopyEngine; for few SMs at 4 ranks and more, where the copy engines' pulls share a GPU's copy
// bandwidth among the peers and half the SM path's SMs only receive). Its handle's combine and cached
// dispatches go the copy engines' way too.
enum class NormalRowPath : int32_t { kAuto = 0, kEngine = 1, kSm = 2, kSends = 3 };
constexpr int kNormalSmRowsFromRanks = 4;
constexpr int kNormalSmRowsFromSms = 16;
// Of the dispatches normal_dispatch_by_copy_engine gives the copy engines, those whose rows SMs send.
inline bool normal_rows_by_sends(NormalRowPath path, int num_ranks, int num_sms) {
  if (path != NormalRowPath::kAuto) return path == NormalRowPath::kSends;
  return num_ranks >= kNormalSmRowsFromRanks && num_sms < kNormalSmRowsFromSms;
}
// Every rank must decide alike: a fresh dispatch's notify checks it (its settings word).
inline bool normal_dispatch_by_copy_engine(NormalRowPath path, int num_ranks, int num_sms) {
  if (path != NormalRowPath::kAuto) return path == NormalRowPath::kEngine || path == NormalRowPath::kSends;
  return num_ranks < kNormalSmRowsFromRanks || num_sms < kNormalSmRowsFromSms;
}
// A cached dispatch (num_sms: its handle's) where its handle kept the counts on the host; else by SMs.
inline bool normal_cached_dispatch_by_copy_engine(NormalRowPath path, int num_ranks, int num_sms) {
  if (path != NormalRowPath::kAuto) return normal_dispatch_by_copy_engine(path, num_ranks, num_sms);
  return num_ranks < kNormalSmRowsFromRanks || normal_rows_by_sends(path, num_ranks, num_sms);
}

// What copies a rank's dispatch rows to itself in the copy-engine dispatch. kAuto: a copy engine
// when the rows' data is at least kNormalOwnRowsEngineBytesPerSm per SM of the dispatch, else the SMs.
// On 2x H200 the engine's copy slows the peers' pulls beside it, so it pays only where the SMs have
// much to copy each: bf16 (4096 tokens, H 7168) won at 8-16 SMs and lost at 20-24, fp8 won at 8 and
// lost at 12-24 (session 15, docs/PERFORMANCE.md).
enum class NormalOwnRows : int { kAuto = 0, kEngine = 1, kSms = 2 };
constexpr int64_t kNormalOwnRowsEngineBytesPerSm = int64_t{3} << 20;
inline bool normal_own_rows_by_engine(NormalOwnRows mode, int64_t own_bytes, int num_sms) {
  if (mode != NormalOwnRows::kAuto) return mode == NormalOwnRows::kEngine;
  return own_bytes >= kNormalOwnRowsEngineBytesPerSm * num_sms;
}
// The runs between the tokens it does not send a rank (`gaps`, ascending, all below num_tokens).
inline std::vector<NormalTokenRun> normal_token_runs(const int32_t* gaps, int64_t num_gaps, int64_t num_tokens) {
  std::vector<NormalTokenRun> runs;
  int64_t start = 0;
  for (int64_t i = 0; i <= num_gaps; ++i) {
    const int64_t end = i < num_gaps ? gaps[i] : num_tokens;
    if (end > start) runs.push_back(NormalTokenRun{start, start - i, end - start});
    start = end + 1;
  }
  return runs;
}

// Pushed dispatch rows (NormalCopyEngine's push_rows): where at most kNormalMaxGaps of a sender's
// tokens do not go to a peer, its copy engines push the rows for that peer straight from x, as runs
// of consecutive tokens, into a landing area in the peer's data area; the peer copies them from
// there into recv_x. No gather, and one NVLink pass in the faster direction (a push). The landing
// holds a rank's received rows (x only) grouped by source, and lies past the dispatch staging and the
// notify's slots: a sender's notify has ended only after every rank freed the exchange before, and no
// other write of this exchange goes there, so the pushes need no wait.
UCCL_EP_HOST_DEVICE inline int64_t normal_landing_offset(const int32_t* rank_prefix_matrix, int num_ranks,
                                                         NormalRowBytes b, int64_t notify_bytes) {
  int64_t most = notify_bytes;
  for (int owner = 0; owner < num_ranks; ++owner) {
    const int64_t staging = normal_staging_offset(NormalStaging::kDispatch, rank_prefix_matrix, num_ranks, owner,
                                                  num_ranks, b);
    most = staging > most ? staging : most;
  }
  return normal_align16(most);
}
// Whether every rank's landing, at `landing_offset`, holds the rows it receives: the same answer on every rank.
UCCL_EP_HOST_DEVICE inline bool normal_landing_fits(const int32_t* rank_prefix_matrix, int num_ranks,
                                                    int64_t landing_offset, int64_t x_row_bytes, int64_t data_bytes) {
  for (int rank = 0; rank < num_ranks; ++rank) {
    if (landing_offset + rank_prefix_matrix[(num_ranks - 1) * num_ranks + rank] * x_row_bytes > data_bytes) {
      return false;
    }
  }
  return true;
}
// Rows sent by SMs (normal_rows_by_sends): a receiver's data area holds every row it receives as one
// NormalDispatchArea past the notify's slots (which it may still be reading when the rows arrive).
UCCL_EP_HOST_DEVICE inline int64_t normal_sends_offset(int num_ranks, int num_channels, int num_local_experts) {
  return normal_align16(normal_notify_area_bytes(num_ranks, num_channels, num_local_experts));
}
// Whether every rank's data area holds its rows at `offset`: the same answer on every rank.
UCCL_EP_HOST_DEVICE inline bool normal_sends_fit(const int32_t* rank_prefix_matrix, int num_ranks, int64_t offset,
                                                 NormalRowBytes b, int64_t data_bytes) {
  for (int rank = 0; rank < num_ranks; ++rank) {
    const int64_t rows = rank_prefix_matrix[(num_ranks - 1) * num_ranks + rank];
    if (offset + normal_dispatch_area(rows, b.x_row_bytes, b.scale_row_bytes, b.num_topk).total > data_bytes) {
      return false;
    }
  }
  return true;
}
// Whether a source of `source_tokens` tokens that sends `sent` of them to another rank pushes them (both
// ends decide alike: the notify gives every rank each source's token count).
UCCL_EP_HOST_DEVICE inline bool normal_pushes_rows(bool push_rows, bool landing_fits, int64_t source_tokens,
                                                   int64_t sent) {
  return push_rows && landing_fits && sent > 0 && source_tokens - sent <= kNormalMaxGaps;
}
// The ranks that push to a rank, or that it pushes to, as a bit mask: pushes serve at most
// kNormalMaxCombineRanks ranks, as the combine does.
UCCL_EP_HOST_DEVICE inline bool normal_rank_in_mask(uint32_t mask, int rank) {
  return rank < kNormalMaxCombineRanks && (mask >> rank & 1u) != 0;
}

struct NormalDispatchArgs {
  NormalRegion region;
  const void* x;                     // [N, x_row_bytes]
  int64_t x_row_bytes;
  const void* x_scales;              // [N, scale_row_bytes] or null
  int64_t scale_row_bytes;
  const int64_t* topk_idx;           // [N, K] global experts (-1: none), or null (K = 0)
  const float* topk_weights;         // [N, K]; null when K = 0 or N = 0
  int32_t num_topk;
  int32_t num_local_experts;
  const int32_t* send_pos;           // [N, R]: token's position among this rank's tokens for that rank, or -1
  const int32_t* rank_prefix_matrix; // [R, R]
  int32_t num_tokens;
  int32_t num_rows_out;              // rows of every output (received rows, then padding)
  void* recv_x;
  void* recv_x_scales;               // or null
  int64_t* recv_topk_idx;            // local experts or -1; or null
  float* recv_topk_weights;          // or null
  int32_t* recv_src_idx;             // or null (cached dispatch keeps the handle's)
  int32_t num_sms;
  // The channels of the dispatch (of its handle, for a cached one): C, and this rank's
  // recv_channel_prefix_matrix [R, C] (exclusive prefix of each source's channels). The SM path's units.
  int32_t num_channels;
  const int32_t* recv_channel_prefix_matrix;
};

struct NormalCombineArgs {
  NormalRegion region;
  const void* x;                     // bf16 [num_rows, hidden]: the dispatch's received rows
  int32_t num_rows;
  int32_t hidden;
  const float* topk_weights;         // [num_rows, K]; null when K = 0 or no rows
  int32_t num_topk;
  const int32_t* rank_prefix_matrix; // [R, R] from the handle
  const bool* is_token_in_rank;      // [N, R]
  const int32_t* send_pos;           // [N, R]
  int32_t num_tokens;
  const void* bias0;                 // bf16 [N, hidden] or null
  const void* bias1;
  void* combined_x;                  // bf16 [N, hidden]
  float* combined_topk_weights;      // [N, K]; null when K = 0 or N = 0
  int32_t num_sms;
  // The handle's channels, as in NormalDispatchArgs: the rows this rank returns to each source are that
  // source's channels' rows (recv_channel_prefix_matrix), and a source sums its channels' tokens.
  int32_t num_channels;
  const int32_t* recv_channel_prefix_matrix;
};

// Enqueue on `stream`; asynchronous. Throw std::invalid_argument naming a bad argument before any
// launch, GpuError if a launch fails.
// Loads the kernels of the launch_normal_* functions into the current device's context (gpu_load_kernels).
void load_normal_kernels();

void launch_normal_send_layout(const NormalSendLayoutArgs& args, gpuStream_t stream);
// A dispatch's first steps in one launch: the send layout, then the notify exchange (which reads
// the layout's channel_prefix_matrix).
void launch_normal_layout_and_notify(const NormalSendLayoutArgs& layout, const NormalNotifyArgs& notify,
                                     gpuStream_t stream);
void launch_normal_dispatch(const NormalDispatchArgs& args, gpuStream_t stream);
void launch_normal_combine(const NormalCombineArgs& args, gpuStream_t stream);

// The argument checks of the launchers above (the copy-engine path shares them).
void check_normal_dispatch_args(const NormalDispatchArgs& args);
void check_normal_combine_args(const NormalCombineArgs& args);

}  // namespace uccl_ep
