// The rail hop of normal mode across hosts, driven by the GPU: a kernel copies each destination host's rows into
// a send slot of this rank's rail region and hands the proxy the commands that write them into that host's
// receive slot for this rank and announce them; the same kernel's receiving blocks wait for each source's
// announcement, copy its rows out and give the slot back. The host only launches the kernel.
//
// Region (every rank of the rail the same; offsets and lengths in multiples of 16, as the commands need):
//   control area:
//     kFreed        one 16-byte word per host h, written by destination host h: the sequence of our last piece
//                   to h that h has copied out
//     kFreedStaged  one per host: what this rank writes into that word of host h (the proxy reads it)
//     the proxies' ordering layout (proxy/ordering.h) with one counter: int64 counters[1], then the count flags
//                   int64 flags[2][1][num_hosts], flags[piece sequence % 2][0][h] for host h's piece
//   send slots, one per destination host, then receive slots, one per source host, slot_bytes each.
// A piece's rows go as one write carrying a write-landed immediate, then a count flag announcing that one write
// (none for an empty piece); the receiving proxy releases the flag only once the write has landed, whatever the
// order the transport delivered them in (and flushes the NIC's writes first where the GPU might see them out of
// order), and the receiver resets it after copying out. A block larger than a slot goes in pieces; each piece to
// a host waits until that host freed the one before (sequences count pieces per pair of hosts over the rail's
// life, on both ends alike), so at most one flag per source is held at a time and every write to a peer's freed
// word follows, through that peer's answer, the landing of the one before: nothing goes back out of order.
#pragma once

#include <cstdint>
#include <vector>

#include "channel/fifo.h"
#include "common/portability.h"

namespace uccl_ep {

constexpr int kRailMaxHosts = 64;
constexpr int64_t kRailWordBytes = 16;
constexpr int kRailWordKinds = 2;  // freed, and its staged value
enum RailWord : int { kRailFreed = 0, kRailFreedStaged = 1 };
constexpr uint32_t kRailCounter = 0;  // the ordering layout's one counter (its count flags announce the pieces)

// Where a wait failed, as the host reports it.
enum RailPhase : int32_t { kRailWaitFreed = 1, kRailWaitArrived = 2, kRailBadCount = 3, kRailFifoFull = 4 };

struct RailFailure {
  int32_t failed;  // nonzero once a failure is recorded (written last)
  int32_t phase;   // RailPhase
  int32_t peer;    // the host waited on
  int32_t pad;
  int64_t exchange;  // the host's number of the exchange (DeviceRail::exchange's count)
  int64_t expected;  // the piece awaited (the writes it announces, for kRailBadCount)
  int64_t seen;      // what the word held (the writes announced, for kRailBadCount)
};

// Where the proxies' ordering layout starts in the control area of a rail of `num_hosts`, and its flags.
UCCL_EP_HOST_DEVICE inline int64_t rail_counters_offset(int num_hosts) {
  return kRailWordKinds * kRailWordBytes * num_hosts;
}
UCCL_EP_HOST_DEVICE inline int64_t rail_flags_offset(int num_hosts) { return rail_counters_offset(num_hosts) + 16; }
// The flag that announces piece `seq` of host `source`.
UCCL_EP_HOST_DEVICE inline int64_t rail_flag_offset(int num_hosts, uint64_t seq, int source) {
  return rail_flags_offset(num_hosts) + ((static_cast<int64_t>(seq % 2) * num_hosts) + source) * 8;
}
// The control area's bytes for `num_hosts`.
UCCL_EP_HOST_DEVICE inline int64_t rail_control_bytes(int num_hosts) {
  const int64_t bytes = rail_flags_offset(num_hosts) + 2 * 8 * static_cast<int64_t>(num_hosts);
  return (bytes + 255) / 256 * 256;
}

#if defined(UCCL_EP_GPU_RUNTIME)

// One rank's GPU-driven rail over a region that a proxy's transport reaches on every host. Not thread-safe.
class DeviceRail {
 public:
  // `region`: device memory of `region_bytes`, zeroed, the proxy's region; `fifos`: the device array of the
  // proxy's `num_fifos` FIFO views. Throws std::invalid_argument naming a bad argument.
  DeviceRail(uint8_t* region, int64_t region_bytes, int host, int num_hosts, const FifoView* fifos, int num_fifos,
             double timeout_s, int device);
  ~DeviceRail();
  DeviceRail(const DeviceRail&) = delete;
  DeviceRail& operator=(const DeviceRail&) = delete;

  int64_t slot_bytes() const { return slot_bytes_; }

  // Each host's block of `rows` (send_counts[h] rows of `width` bytes, by host) to the rail's rank on that host,
  // and the blocks received (recv_counts[h] rows from host h, by host) into `out`, in one launch on `stream`.
  // `width` is a multiple of 16 and a row fits a slot. Returns the transport writes it asks of the proxy (rows,
  // count flags, freed slots). A failed wait is recorded (failure()), and later exchanges end at once.
  int64_t exchange(const uint8_t* rows, uint8_t* out, int64_t width, const std::vector<int64_t>& send_counts,
                   const std::vector<int64_t>& recv_counts, gpuStream_t stream);

  // The first failure the kernels recorded, if any (failed == 0: none).
  RailFailure failure() const;
  int64_t exchanges() const { return exchanges_; }

  // Waits for the device, frees what the rail allocated (idempotent).
  void release();

 private:
  uint8_t* region_;
  int64_t region_bytes_, slot_bytes_;
  int host_, num_hosts_, num_fifos_, device_;
  const FifoView* fifos_;
  int64_t timeout_ns_;
  int64_t exchanges_ = 0;
  std::vector<uint32_t> sent_, received_;  // pieces so far, per peer host
  RailFailure* failure_host_ = nullptr;     // mapped pinned memory
  RailFailure* failure_device_ = nullptr;
  uint32_t* scratch_ = nullptr;            // device: [0] abort, then the blocks' counters per (role, host)
  bool released_ = false;
};

#endif  // UCCL_EP_GPU_RUNTIME

}  // namespace uccl_ep
