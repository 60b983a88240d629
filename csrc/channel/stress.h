// Channel stress runs: many producers push numbered commands through FIFOs while consumers
// check that every command arrives exactly once, untorn, and in each producer's order.
// Used by the tests (host threads as producers) and the channel benchmark (GPU threads).
// The latency run is the same channel with one command in flight at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "channel/command.h"
#include "common/deadline.h"
#include "common/portability.h"

namespace uccl_ep {

struct ChannelStressResult {
  uint64_t expected = 0;     // commands the producers were asked to push
  uint64_t pushed = 0;       // commands the producers reported pushed
  uint64_t popped = 0;       // commands the consumers took
  uint64_t lost = 0;         // pushed but never taken (or never pushed because of a timeout)
  uint64_t out_of_order = 0; // a producer's command taken twice, or before an earlier one
  uint64_t torn = 0;         // word1 does not match its word0
  uint64_t capacity = 0;
  uint64_t num_fifos = 0;
  double seconds = 0;        // first push to last pop
};

// The command a producer pushes as its seq-th: its identity in word0, a checksum of word0 in word1.
UCCL_EP_HOST_DEVICE inline Command stress_command(uint32_t producer, uint64_t seq) {
  Command c = encode_command(CommandKind::kWrite, producer & (kMaxRanks - 1), 0, seq, producer, 0, 0);
  uint64_t mixed = c.word0 * 0x9E3779B97F4A7C15ull;
  c.word1 = mixed ^ (mixed >> 29);
  return c;
}

// Checks the commands one consumer takes.
class StressChecker {
 public:
  StressChecker(uint32_t num_producers) : next_seq_(num_producers, 0) {}

  void take(const Command& c) {
    ++popped_;
    const DecodedCommand d = decode_command(c);
    const Command expected = stress_command(d.counter_index, d.length_units);
    if (expected.word0 != c.word0 || expected.word1 != c.word1 || d.counter_index >= next_seq_.size()) {
      ++torn_;
      return;
    }
    uint64_t& next = next_seq_[d.counter_index];
    if (d.length_units != next) ++out_of_order_;
    next = d.length_units + 1;
  }

  // Adds this consumer's counts to `result`.
  void merge_into(ChannelStressResult& result) const {
    result.popped += popped_;
    result.out_of_order += out_of_order_;
    result.torn += torn_;
  }

 private:
  std::vector<uint64_t> next_seq_;
  uint64_t popped_ = 0;
  uint64_t out_of_order_ = 0;
  uint64_t torn_ = 0;
};

// Latency of the GPU->CPU channel: one GPU thread pushes a command, a host thread takes it and
// acknowledges it through a word in pinned mapped host memory, and the GPU thread times the
// round trip with its globaltimer before pushing the next.
struct ChannelLatencyResult {
  ChannelStressResult commands;        // the checks of every command (warm-up included); seconds: the whole run
  uint64_t warmup = 0;                 // untimed round trips before the timed ones
  uint64_t iterations = 0;             // timed round trips asked for
  std::vector<uint64_t> round_trip_ns; // one per timed round trip completed, in order
  uint64_t loop_ns = 0;                // GPU time of all timed round trips together; 0 unless all completed
  std::string error;                   // empty, or what the GPU waited for in vain
};

// Host threads as producers: `num_producers` threads push `commands_per_producer` commands each
// into one FIFO of `capacity` slots; this thread consumes. Throws std::invalid_argument on bad sizes.
ChannelStressResult run_host_channel_stress(uint32_t num_producers, uint64_t commands_per_producer,
                                            uint64_t capacity, double timeout_s);

#if defined(UCCL_EP_GPU_RUNTIME)
// GPU threads as producers: `num_fifos` FIFOs in pinned mapped host memory, each fed by
// `blocks_per_fifo` blocks of `threads_per_block` producers pushing `commands_per_thread`
// commands, each drained and checked by its own host thread.
ChannelStressResult run_gpu_channel_stress(uint32_t num_fifos, uint32_t blocks_per_fifo, uint32_t threads_per_block,
                                           uint64_t commands_per_thread, uint64_t capacity, double timeout_s);

// `iterations` timed round trips (after a fixed warm-up) through one FIFO of `capacity` slots.
// Throws std::invalid_argument naming a bad argument before touching the GPU; a timeout (the
// whole run is bounded by `timeout_s`) is reported in `error`, with the round trips done so far.
ChannelLatencyResult run_gpu_channel_latency(int64_t iterations, int64_t capacity, double timeout_s);
#endif

// Shared argument checks (std::invalid_argument naming the argument).
void check_stress_sizes(uint64_t num_producers, uint64_t commands_per_producer, uint64_t capacity);

}  // namespace uccl_ep
