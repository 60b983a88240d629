// The CPU proxy: threads that take 16-byte commands from FIFOs and execute them
// through a Transport.
//
// FIFO f belongs to thread f % num_threads. Each thread loops:
//   poll completions (any thread may retire any FIFO's requests: the request id names the FIFO)
//   -> take new commands of its FIFOs within the in-flight limits
//   -> (thread 0 only) poll immediates and apply them through the ordering layer, count barrier
//      arrivals
//   -> barrier checks; then back off (yield, or sleep with adaptive_sleep) if nothing happened.
//
// Commands (channel/command.h):
//   kWrite           write length bytes local -> remote offset of dst_rank.
//   kWriteWithCount  the same write carrying a write-landed immediate for (buffer = flags bit 0,
//                    counter_index): length / token_bytes token rows (one row if token_bytes is 0).
//   kAtomicAdd       add the command's value to counter counter_index at dst_rank (the ordering
//                    layout's counters_offset + 8 * counter_index; the command's remote offset is
//                    not used). Sent as a zero-length write with an atomic-add immediate carrying a
//                    per-(dst, counter) sequence number; the sender keeps at most `window` adds
//                    per (dst, counter) unacknowledged. Native post_atomic_add is used instead where
//                    the transport applies atomics after the writes posted before them
//                    (transport_orders_atomics(): verbs RC, one queue pair per peer, on a device with
//                    atomics, without reorder injection) and config.native_atomics allows it.
//                    With flags bit 1 (kCommandFlagCountFlag) it is the low-latency count flag:
//                    value = N token rows announced for (buffer = flags bit 0, counter_index).
//   kQuiet           the FIFO takes nothing more until every earlier request of it completed.
//   kBarrier         one barrier at a time per proxy: wait until the FIFO's requests and every
//                    request any FIFO of this proxy had posted when the barrier was taken have
//                    completed, send a barrier-arrive control immediate to every rank (itself
//                    included: its own arrival proves its earlier self-writes' immediates were
//                    applied), and wait until all num_ranks arrivals were processed. The k-th
//                    barrier of each proxy matches the k-th of every other.
//
// Errors: a command that cannot be executed (bad kind or flags, destination out of range,
// offsets out of bounds, value that does not fit an immediate) stops its FIFO and is stored as
// the proxy's error with rank, peer and the decoded command; transport and ordering failures
// likewise. check() (and stop()) throw the stored error; nothing is dropped silently.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "channel/command.h"
#include "channel/fifo.h"
#include "proxy/immediate.h"
#include "proxy/ordering.h"
#include "transport/transport.h"

namespace uccl_ep {

class ProxyError : public std::runtime_error {
 public:
  explicit ProxyError(const std::string& what) : std::runtime_error(what) {}
};

struct ProxyConfig {
  uint32_t num_threads = 1;
  // Flow control, per proxy (per GPU): requests and bytes in flight. 0 bytes: unlimited.
  uint64_t max_inflight_bytes = 0;        // UCCL_IB_MAX_INFLIGHT_BYTES (unset: unlimited)
  uint32_t max_inflight_normal = 8;       // UCCL_IB_MAX_INFLIGHT_NORMAL
  uint32_t max_inflight_low_latency = 32; // UCCL_IB_MAX_INFLIGHT_LOW_LATENCY
  bool low_latency = false;               // which of the two request limits applies
  bool adaptive_sleep = false;            // UCCL_RDMA_ADAPTIVE_SLEEP
  bool native_atomics = true;             // UCCL_IB_NATIVE_ATOMICS: the NIC's atomics where they are ordered
  std::vector<int> cpu_affinity;          // thread t runs on cpu_affinity[t % size]; empty: any
  uint64_t token_bytes = 0;               // bytes per token row of kWriteWithCount; 0: one row
  double timeout_s = 60.0;                // a quiet or barrier waiting longer is an error
  bool quiet_on_gpu = true;               // a QUIET asks the transport for a fence on the device first
  OrderingConfig ordering;                // counter layout, window, the ordering switch
                                          // (num_ranks is taken from the transport)

  // Reads the UCCL_* keys above from an environment map (e.g. the Python platform config's
  // resolve_config().as_environ()); absent keys keep their defaults. Throws
  // std::invalid_argument naming a malformed key.
  void apply_environ(const std::map<std::string, std::string>& env);

  uint32_t max_inflight_requests() const { return low_latency ? max_inflight_low_latency : max_inflight_normal; }
};

struct ProxyStats {
  uint64_t commands = 0;            // commands executed (taken and started)
  uint64_t requests_posted = 0;
  uint64_t requests_completed = 0;
  uint64_t inflight_peak = 0;       // most requests in flight at once
  uint64_t flow_stalls = 0;         // times a command waited for the in-flight limits
  uint64_t window_stalls = 0;       // times an add waited for its (dst, counter) window
  uint64_t native_adds = 0;         // plain adds sent as the NIC's own atomics
  uint64_t quiets = 0;
  uint64_t quiets_on_gpu = 0;       // of those, ordered by a transport fence instead of waited for
  uint64_t barriers = 0;
  uint64_t immediates = 0;
  uint64_t idle_sleeps = 0;
  // Where a round trip's time goes: executing commands (decoding, posting to the transport: a
  // cudaMemcpyAsync for cuda-copy) and waiting in quiets for the requests before them to complete.
  uint64_t execute_ns = 0;
  uint64_t quiet_wait_ns = 0;
  OrderingStats ordering;
};

// Whether a transport applies an atomic to one peer after every write posted to that peer before it
// (then kAtomicAdd may use post_atomic_add): verbs over one RC queue pair per peer on a device with
// atomics and without reorder injection. tcp and cuda-copy are unordered.
bool transport_orders_atomics(const Transport& transport);

std::string describe_command(const Command& command);

class Proxy {
 public:
  // The FIFOs' memory and the transport must outlive the proxy. Throws std::invalid_argument
  // naming a bad setting.
  Proxy(Transport& transport, std::vector<FifoView> fifos, const ProxyConfig& config);
  ~Proxy();

  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  void start();
  // Joins every thread (idempotent), then throws the stored error, if any.
  void stop();
  bool running() const { return running_; }

  // Throws the stored error, if any (it stays stored).
  void check() const;
  std::string error() const;  // empty if none

  uint64_t barriers_done() const { return barriers_done_.load(std::memory_order_acquire); }
  uint64_t quiets_done() const { return quiets_done_.load(std::memory_order_acquire); }
  uint64_t inflight_requests() const { return inflight_requests_.load(); }
  // Whether every command published so far has been taken and executed, and every request it posted has
  // completed: what a producer that has stopped pushing (a GPU after a synchronize) waits for before the
  // transport may close. Any thread may ask.
  bool idle() const;
  ProxyStats stats() const;
  const ProxyConfig& config() const { return config_; }
  // Whether plain counter adds go as the transport's own atomics (else as immediates). Every rank must agree:
  // a NIC's atomic and a host atomic on one word are not atomic with each other.
  bool native_atomics() const { return native_atomics_; }
  const ReceiverOrdering& ordering() const { return ordering_; }

 private:
  enum class Wait { kNone, kQuiet, kBarrierDrain, kBarrierPeers, kFailed };
  enum class Step { kDone, kBlocked, kFailed };

  struct FifoState {
    explicit FifoState(const FifoView& view, uint32_t idx) : consumer(view), index(idx) {}
    FifoConsumer consumer;
    uint32_t index;
    bool has_pending = false;
    Command pending{};
    uint64_t command_number = 0;  // of `pending`, counted from 0 per FIFO
    Wait wait = Wait::kNone;
    std::chrono::steady_clock::time_point wait_since{};
    std::vector<uint64_t> barrier_snapshot;  // requests posted by each FIFO when the barrier began
    uint32_t barrier_epoch = 0;
    std::atomic<uint64_t> posted{0};
    std::atomic<uint64_t> completed{0};
    // Set by its thread while it takes and executes commands, and kept while one is held back or
    // waited on, so idle() never sees a command between the FIFO and the transport.
    std::atomic<bool> busy{false};
  };

  struct SendWindow {
    uint32_t next = 0;       // next sequence number to assign
    uint32_t low = 0;        // oldest unacknowledged sequence number
    uint32_t acked_mask = 0; // bit d: low + d acknowledged
  };

  void thread_main(uint32_t thread_index);
  bool poll_completions();
  bool progress(FifoState& fifo);
  bool advance(FifoState& fifo);
  bool poll_immediates();
  Step execute(FifoState& fifo, const Command& command);
  bool reserve(uint64_t bytes, bool force);
  void unreserve(uint64_t bytes);
  bool send_barrier_arrivals(FifoState& fifo);
  void retire(uint64_t request_id);
  void fail(const std::string& what);
  void fail_command(FifoState& fifo, const Command& command, const std::string& why);
  bool waited_too_long(FifoState& fifo, const char* what);
  std::string who() const;

  Transport& transport_;
  const int rank_;
  const int num_ranks_;
  const MemoryRegion region_;
  ProxyConfig config_;
  const bool native_atomics_;
  std::vector<std::unique_ptr<FifoState>> fifos_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  bool running_ = false;
  bool joined_ = true;

  // Flow control.
  std::mutex flow_mu_;
  std::atomic<uint64_t> inflight_requests_{0};
  std::atomic<uint64_t> inflight_bytes_{0};

  // Sender side of emulated atomics: per (dst, counter).
  std::mutex send_mu_;
  std::vector<SendWindow> send_windows_;

  // Receiver side (thread 0).
  ReceiverOrdering ordering_;
  mutable std::mutex ordering_mu_;  // guards ordering_'s stats for stats()

  // Barriers.
  std::atomic<int64_t> barrier_owner_{-1};  // FIFO index running a barrier, or -1
  std::atomic<uint32_t> barrier_epoch_{0};  // written by the barrier's owner only
  std::atomic<uint32_t> arrivals_[4] = {};  // by epoch % 4
  std::atomic<uint64_t> barriers_done_{0};
  std::atomic<uint64_t> quiets_done_{0};

  // Errors.
  mutable std::mutex error_mu_;
  std::string error_;
  uint64_t more_errors_ = 0;
  std::atomic<bool> has_error_{false};

  // Statistics (relaxed counters).
  std::atomic<uint64_t> st_commands_{0}, st_posted_{0}, st_completed_{0}, st_inflight_peak_{0}, st_flow_stalls_{0},
      st_window_stalls_{0}, st_native_adds_{0}, st_immediates_{0}, st_idle_sleeps_{0}, st_execute_ns_{0}, st_quiet_wait_ns_{0},
      st_quiets_on_gpu_{0};
};

}  // namespace uccl_ep
