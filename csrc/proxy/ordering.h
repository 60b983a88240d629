// Receiver-side ordering: turns the immediates a receiving proxy sees, in whatever
// order an unordered transport delivers them, into the effects a DeepEP-style receiver expects.
//
// Counters live in the receiver's registered region (every rank uses the same layout):
//
//   counters_offset: int64 counters[num_counters]        targets of atomic adds
//   flags_offset:    int64 flags[2][num_counters][num_ranks]
//                    the low-latency count flag of (buffer, counter = expert, source rank):
//                    0 while nothing was announced, -(N+1) once N token rows have landed
//
// Atomic adds: per (source, counter) a window of `window` sequence numbers starting at the
// next expected one. An add that arrives ahead is held until its predecessors arrive; an add
// whose sequence number is outside the window (a stale or duplicate one, or a sender that
// broke its flow control) is an OrderingError naming source, counter and sequence.
//
// Count flags: write-landed immediates add token rows to landed[buffer][counter][source]; a
// count flag announcing N rows is held until landed >= N, then N rows are consumed and the
// flag is stored (release) as -(N+1). A second flag for the same slot while one is held is an
// error. The receiver resets a flag to 0 itself once it has consumed the rows.
//
// With `enabled` false (a test switch) everything is applied in arrival order: adds at once
// regardless of sequence, flags at once regardless of landed rows.
//
// Not thread-safe: one proxy thread owns it.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "proxy/immediate.h"
#include "transport/transport.h"

namespace uccl_ep {

class OrderingError : public std::runtime_error {
 public:
  explicit OrderingError(const std::string& what) : std::runtime_error(what) {}
};

struct OrderingConfig {
  uint32_t num_ranks = 1;
  uint32_t num_counters = 0;     // at most kImmMaxCounters
  uint64_t counters_offset = 0;  // multiple of 8
  uint64_t flags_offset = 0;     // multiple of 8 (unused when num_counters is 0)
  uint32_t window = kMaxImmWindow;  // 1 .. kMaxImmWindow
  bool enabled = true;
};

struct OrderingStats {
  uint64_t adds_applied = 0;
  uint64_t adds_held_now = 0;
  uint64_t adds_held_peak = 0;
  uint64_t adds_applied_late = 0;  // applied after waiting for a predecessor
  uint64_t tokens_landed = 0;
  uint64_t flags_released = 0;
  uint64_t flags_held_now = 0;
  uint64_t flags_held_peak = 0;
  uint64_t flags_released_late = 0;  // released after waiting for their rows
};

class ReceiverOrdering {
 public:
  // Throws std::invalid_argument (naming the setting) if the layout does not fit a region of
  // `region_bytes`. `writer` applies the effects to the region and must outlive this object.
  ReceiverOrdering(RegionWriter& writer, uint64_t region_bytes, const OrderingConfig& config);

  // Applies (or holds) one data immediate: write-landed, atomic add or count flag. Throws
  // OrderingError for a sequence outside the window, a counter out of range, a second flag, or
  // a control immediate (the proxy handles those itself).
  void on_immediate(uint32_t src_rank, uint32_t imm);

  const OrderingConfig& config() const { return config_; }
  const OrderingStats& stats() const { return stats_; }

  // Byte offsets in the region.
  uint64_t counter_offset(uint32_t counter) const;
  uint64_t flag_offset(uint32_t buffer, uint32_t counter, uint32_t src_rank) const;

  // Checks a layout against a region of `region_bytes` (what the constructor checks).
  static void validate(uint64_t region_bytes, const OrderingConfig& config);

 private:
  struct AddWindow {
    uint32_t expected = 0;   // full sequence number of the next add to apply
    uint32_t held_mask = 0;  // bit d: the add expected + d is held
    int32_t held[kMaxImmWindow] = {};
  };
  struct FlagSlot {
    uint64_t landed = 0;    // token rows landed and not yet consumed by a flag
    int64_t pending = -1;   // announced rows of a held flag, -1 if none
  };

  void apply_add(uint32_t counter, int64_t amount);
  void release_flag(uint32_t buffer, uint32_t counter, uint32_t src, uint64_t rows);
  std::string where(uint32_t src, uint32_t counter) const;

  RegionWriter& writer_;
  OrderingConfig config_;
  std::vector<AddWindow> adds_;    // [num_ranks][num_counters]
  std::vector<FlagSlot> flags_;    // [2][num_counters][num_ranks]
  OrderingStats stats_;
};

}  // namespace uccl_ep
