// Low-latency dispatch and combine between GPUs that map each other's buffer (CUDA IPC over
// NVLink): every rank's kernel stores straight into its peers' receive areas.
//
// Protocol, per half of the double-buffered region (see uccl_ep_plugin.dispatch_config.
// LowLatencyLayout for the byte layout, which the Python side passes in as offsets):
//  * Every use of a half has an epoch: the number of earlier uses plus one, kept on the
//    device (LowLatencyRegion::control), so CUDA-graph replays advance it too. All ranks use
//    their halves in the same order, so their epochs agree.
//  * A sender writes its rows, then one 64-bit flag per (receiver, expert) holding
//    (epoch << 32) | rows with a system-scope release store. A receiver waits until the
//    flag's epoch is the current one, so flags never need zeroing between uses, and a flag
//    from a peer that ran ahead is not mistaken for the current one.
//  * A rank counts the uses of a half it has read (each block of the reading launch adds its share
//    as it finishes). Its next send launch on that half first tells every peer that count (a
//    per-reader word in the peer's half), then waits for each peer's count before storing into
//    the half, so a half reused back to back (one call captured in a graph and replayed) never
//    overwrites rows that are still being read, and a receive ends without a release tail.
//  * A dispatched token crosses to each destination rank once, whatever the number of its experts
//    there; an index per (source, expert, row) names the token each packed row copies.
//  * Dispatch rows of one (expert, source) are numbered by (token, top-k slot), so the
//    packed output is the same on every run and equals the reference engine's.
// Waits give up after timeout_ns: the first failure is written to a status block in mapped
// host memory (the Python side raises it), or, with a mask array (enable_shrink), the silent
// rank is masked and treated as sending nothing.
#pragma once

#include <cstdint>

#include "channel/fifo.h"
#include "common/portability.h"

namespace uccl_ep {

constexpr int kLowLatencyMaxTopk = 32;
constexpr int kLowLatencyMaxRanks = 256;
constexpr int kLowLatencyChannelsPerScale = 128;

// First failure of a low-latency kernel, in mapped host memory (written once: code goes
// from 0 to non-zero with an atomic compare-and-swap).
struct LowLatencyStatus {
  int32_t code;    // LowLatencyError
  int32_t phase;   // LowLatencyPhase
  int32_t peer;    // the rank waited for
  int32_t detail;  // expert (dispatch: local, combine: global) or token
};

enum LowLatencyError : int32_t {
  kLowLatencyOk = 0,
  kLowLatencyTimeout = 1,       // a peer's flag did not arrive in time
  kLowLatencyTooManyRows = 2,   // an expert got more than num_max_tokens rows from one rank
  kLowLatencyProxyStalled = 3,  // a proxy FIFO stayed full for the whole timeout
};

enum LowLatencyPhase : int32_t {
  kLowLatencyDispatchRecv = 1,
  kLowLatencyCombineRecv = 2,
  kLowLatencyDispatchSend = 3,
  kLowLatencyCombineSend = 4,
  kLowLatencyRelease = 5,       // telling the peers a half was read (through the proxy)
  kLowLatencyCombineRecords = 6,  // pre-reduced combine send: waiting for a source's routing records
};

// What a kernel launch does: the sends, the receives, or both (one kernel, no hook).
enum LowLatencyPhases : int32_t { kLowLatencySend = 1, kLowLatencyRecv = 2 };

// One half of the region, as this rank sees it. Byte offsets of this half's areas inside every
// rank's buffer (uccl_ep_plugin.dispatch_config.LowLatencyLayout computes them):
struct LowLatencyRegion {
  const uint64_t* peer_bases;  // device [num_ranks]: base of each rank's buffer in this process
  int64_t signal_offset;       // uint64 count flags [source][low_latency_flags_per_source]
  int64_t counters_offset;     // this rank's own: int32 rows sent [num_experts], int32 staged [2][num_ranks]
  int64_t release_offset;      // uses of this half each rank has finished reading, 16 bytes per rank
  int64_t recv_offset;
  uint64_t* control;           // device [3]: completed uses of this half (in shares), spare, aborted
  // The other half's count and release counts: a send launch publishes both halves' counts, so a
  // peer's next write into either half finds its count a call early.
  const uint64_t* other_half_control;
  int64_t other_half_release_offset;
  uint8_t* masked;             // device bool [num_ranks], or null without enable_shrink
  LowLatencyStatus* status;    // mapped host memory
  int64_t timeout_ns;
  int32_t rank;
  int32_t num_ranks;
  bool aggressive_atomics;     // flags as relaxed accesses between explicit fences (portability.h publish_flag)
  // Peers reached through the CPU proxy (another host, or UCCL_EP_FORCE_PROXY): what this rank
  // would store into such a peer's block is staged in its outbox (same layout as the block), and
  // the unit that completes a phase pushes the writes. via_proxy null: every peer is mapped.
  const uint8_t* via_proxy;    // device [num_ranks]: 1 = through the proxy
  const FifoView* fifos;       // device [num_fifos]: the proxy's command FIFOs
  int32_t num_fifos;
  int64_t outbox_offset;       // this half's outboxes, one per peer
  int64_t other_half_outbox_offset;
  int64_t outbox_peer_bytes;
  int64_t outbox_index_pos;    // inside one outbox: dispatch index block (data rows start at 0)
  int64_t outbox_flags_pos;    // count flags block
  int64_t outbox_release_pos;  // a 16-byte release count
};

// A proxy moves whole 16-byte units, so each source's blocks are padded to them.
UCCL_EP_HOST_DEVICE inline int64_t low_latency_flags_per_source(int64_t local_experts) {
  return (local_experts + 1) / 2 * 2;
}
UCCL_EP_HOST_DEVICE inline int64_t low_latency_index_per_source(int64_t local_experts, int64_t num_max_tokens) {
  return (local_experts * num_max_tokens + 3) / 4 * 4;
}
constexpr int64_t kLowLatencyReleaseStride = 16;

struct LowLatencyDispatchArgs {
  LowLatencyRegion region;
  const void* x;               // bf16 [num_tokens, hidden]
  const int64_t* topk_idx;     // [num_tokens, num_topk], -1 = none
  int32_t num_tokens;
  int32_t num_max_tokens;      // T: rows one rank may send to one expert
  int32_t hidden;
  int32_t num_topk;
  int32_t num_experts;
  bool use_fp8;
  bool round_scale;            // power-of-two scales
  bool use_ue8m0;              // scales packed as exponent bytes, 4 per int32
  void* recv_x;                // [El, R*T, hidden] fp8 or bf16
  void* recv_scales;           // base of the column-major [El, R*T, S] scales (float, or int32 ue8m0)
  int32_t* recv_count;         // [El]
  int32_t* src_info;           // [El, R*T]
  int64_t* layout_range;       // [El, R]: begin << 32 | count
  int32_t* positions;          // [2, num_tokens, num_topk]: where each entry's combined row lands (see below),
                               // then its slot among its expert's rows from this rank (-1 both: not sent)
  int32_t* cumulative_recv_stats;  // [El] or null
  int64_t* wait_cost_stats;        // [R] or null: nanoseconds waited per source
  int32_t phases;              // LowLatencyPhases
  int32_t num_sms;             // most thread blocks to use
};

struct LowLatencyCombineArgs {
  LowLatencyRegion region;
  const void* x;               // bf16 [El, R*T, hidden], contiguous
  const int64_t* topk_idx;     // [num_tokens, num_topk]
  const float* topk_weights;   // [num_tokens, num_topk]
  const int32_t* src_info;     // from the dispatch
  const int64_t* layout_range;
  const int32_t* positions;    // from the dispatch: [2, num_tokens, num_topk]
  int32_t num_tokens;
  int32_t num_max_tokens;
  int32_t hidden;
  int32_t num_topk;
  int32_t num_experts;
  bool use_logfmt;
  void* out;                   // bf16 [num_tokens, hidden]
  int64_t* wait_cost_stats;    // [R] or null
  int32_t phases;
  int32_t num_sms;
  // Pre-reduce where it fits (low_latency_combine_prereduces); every rank must choose the same. Its send waits
  // for every source's routing records, so a rank whose peers call later waits for them before it sends.
  bool prereduce;
};

// Bytes of one dispatch message (16-byte header, then the row, then fp8 scales) and of one
// combine message (the bf16 row, then a LogFMT header per 128 channels). They must match
// LowLatencyLayout in Python, which checks them against these at start.
UCCL_EP_HOST_DEVICE inline int64_t low_latency_dispatch_msg_bytes(int64_t hidden) { return 16 + 2 * hidden; }
// The dispatch message slots of one half's receive area (one per source rank and token), before
// its row index.
UCCL_EP_HOST_DEVICE inline int64_t low_latency_dispatch_messages_bytes(int64_t num_ranks, int64_t num_max_tokens,
                                                                       int64_t hidden) {
  return num_ranks * num_max_tokens * low_latency_dispatch_msg_bytes(hidden);
}
// Combine receive area: a block of rows per source rank, that rank's experts in order and each
// expert's rows in dispatch slot order, so a source's rows are one contiguous run (what one write
// through a proxy needs). An entry's place in its owner's block is its dispatch position:
// entries of this rank choosing a smaller expert of the same owner, plus its slot. A block holds
// num_max_tokens * min(num_topk, local experts) rows (each token sends a rank at most that many).
UCCL_EP_HOST_DEVICE inline int64_t low_latency_combine_rows_per_source(int64_t num_max_tokens, int64_t num_topk,
                                                                       int64_t local_experts) {
  return num_max_tokens * (num_topk < local_experts ? num_topk : local_experts);
}
UCCL_EP_HOST_DEVICE inline int64_t low_latency_combine_msg_bytes(int64_t hidden) {
  const int64_t groups = (hidden + kLowLatencyChannelsPerScale - 1) / kLowLatencyChannelsPerScale;
  return (2 * hidden + 8 * groups + 15) / 16 * 16;
}
// Pre-reduced combine (bf16 rows, every peer mapped, and room for it in the blocks): the expert's rank
// sums a token's rows for all of its local experts into one float32 row (one bf16 row, unweighted, when
// the token has a single expert there), so each (rank, token) pair crosses NVLink once. Each source first
// writes its tokens' routing records (per top-k entry: local expert and slot, or -1, and the weight) into
// every rank's block for it. Rank X's block from rank b then holds, in rows of combine messages: a slot
// of two rows per token of X (what b returns for it, a flag in the slot's last 8 bytes), then from row
// 2 * num_max_tokens b's records for X ([num_max_tokens, num_topk] int2, then float) and their flag.
UCCL_EP_HOST_DEVICE inline int64_t low_latency_combine_records_bytes(int64_t num_max_tokens, int64_t num_topk) {
  return (num_max_tokens * num_topk * 12 + 15) / 16 * 16 + 16;
}
UCCL_EP_HOST_DEVICE inline bool low_latency_combine_prereduces(int64_t num_max_tokens, int64_t hidden,
                                                               int64_t num_topk, int64_t local_experts) {
  const int64_t msg_bytes = low_latency_combine_msg_bytes(hidden);
  return num_topk >= 2 &&
         2 * num_max_tokens * msg_bytes + low_latency_combine_records_bytes(num_max_tokens, num_topk) <=
             low_latency_combine_rows_per_source(num_max_tokens, num_topk, local_experts) * msg_bytes;
}

// Enqueue on `stream`; asynchronous. Throw std::invalid_argument naming a bad argument
// before any launch, GpuError if the launch fails.
// Loads the kernels of the two launchers below into the current device's context (gpu_load_kernels).
void load_low_latency_kernels();

void launch_low_latency_dispatch(const LowLatencyDispatchArgs& args, gpuStream_t stream);
void launch_low_latency_combine(const LowLatencyCombineArgs& args, gpuStream_t stream);

}  // namespace uccl_ep
