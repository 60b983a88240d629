#include "proxy/proxy.h"

#if defined(UCCL_EP_WITH_VERBS)
#include "transport/verbs_transport.h"
#endif

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/settings.h"

namespace uccl_ep {

namespace {

using Clock = std::chrono::steady_clock;

uint64_t nanoseconds_since(Clock::time_point start) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
}

// Request ids: which FIFO posted the request and what completing it releases.
//   bits 62..63  type: 0 a data write, 1 an emulated atomic add, 2 a count flag or control write
//   bits 48..61  FIFO index
//   type 0: bits 0..47 the write's bytes
//   type 1: bits 32..43 destination rank, bits 8..18 counter, bits 0..3 sequence number mod 16
constexpr uint64_t kIdWrite = 0, kIdAdd = 1, kIdOther = 2;
constexpr uint32_t kMaxFifos = 1u << 14;

uint64_t make_id(uint64_t type, uint32_t fifo, uint64_t payload) {
  return type << 62 | static_cast<uint64_t>(fifo) << 48 | (payload & ((1ull << 48) - 1));
}
uint64_t add_payload(uint32_t dst, uint32_t counter, uint32_t seq) {
  return static_cast<uint64_t>(dst) << 32 | static_cast<uint64_t>(counter) << 8 | (seq & (kImmSeqModulus - 1));
}

const char* kind_name(uint32_t kind) {
  switch (kind) {
    case 1: return "kWrite";
    case 2: return "kWriteWithCount";
    case 3: return "kAtomicAdd";
    case 4: return "kQuiet";
    case 5: return "kBarrier";
  }
  return "unknown";
}

}  // namespace

void ProxyConfig::apply_environ(const std::map<std::string, std::string>& env) {
  auto get = [&](const char* key) -> const std::string* {
    auto it = env.find(key);
    return it == env.end() ? nullptr : &it->second;
  };
  if (auto* v = get("UCCL_IB_MAX_INFLIGHT_BYTES")) {
    max_inflight_bytes = (v->empty() || *v == "null" || *v == "None") ? 0 : parse_setting_unsigned("UCCL_IB_MAX_INFLIGHT_BYTES", *v, 1);
  }
  if (auto* v = get("UCCL_IB_MAX_INFLIGHT_NORMAL")) {
    const uint64_t n = parse_setting_unsigned("UCCL_IB_MAX_INFLIGHT_NORMAL", *v, 1);
    max_inflight_normal = static_cast<uint32_t>(std::min<uint64_t>(n, UINT32_MAX));
  }
  if (auto* v = get("UCCL_IB_MAX_INFLIGHT_LOW_LATENCY")) {
    const uint64_t n = parse_setting_unsigned("UCCL_IB_MAX_INFLIGHT_LOW_LATENCY", *v, 1);
    max_inflight_low_latency = static_cast<uint32_t>(std::min<uint64_t>(n, UINT32_MAX));
  }
  if (auto* v = get("UCCL_RDMA_ADAPTIVE_SLEEP")) adaptive_sleep = parse_setting_flag("UCCL_RDMA_ADAPTIVE_SLEEP", *v);
  if (auto* v = get("UCCL_IB_NATIVE_ATOMICS")) native_atomics = parse_setting_flag("UCCL_IB_NATIVE_ATOMICS", *v);
}

bool transport_orders_atomics(const Transport& transport) {
#if defined(UCCL_EP_WITH_VERBS)
  // One reliable-connected queue pair per peer: the NIC applies an atomic after every write posted to that
  // peer before it, unless reorder injection holds requests back. With several, an atomic may overtake
  // a write that took another queue pair.
  if (const auto* verbs = dynamic_cast<const VerbsTransport*>(&transport)) {
    return verbs->native_atomics() && !verbs->reorder_config().enabled && verbs->qps_per_peer() == 1;
  }
#endif
  (void)transport;  // tcp and cuda-copy may apply atomics in any order
  return false;
}

std::string describe_command(const Command& command) {
  const DecodedCommand d = decode_command(command);
  const uint32_t kind = static_cast<uint32_t>(d.kind);
  std::string s = std::string("{kind=") + kind_name(kind) + " (" + std::to_string(kind) + ")";
  s += ", dst_rank=" + std::to_string(d.dst_rank) + ", flags=" + std::to_string(d.flags);
  if (d.kind == CommandKind::kAtomicAdd) {
    s += ", value=" + std::to_string(atomic_value(d));
  } else {
    s += ", length_bytes=" + std::to_string(d.length_units * kCommandUnitBytes);
  }
  s += ", counter_index=" + std::to_string(d.counter_index);
  s += ", local_offset=" + std::to_string(d.local_offset_units * kCommandUnitBytes);
  s += ", remote_offset=" + std::to_string(d.remote_offset_units * kCommandUnitBytes) + "}";
  return s;
}

// ---------------------------------------------------------------------------------------
// Construction and lifetime
// ---------------------------------------------------------------------------------------

namespace {
OrderingConfig ordering_for(const Transport& t, OrderingConfig c) {
  c.num_ranks = static_cast<uint32_t>(t.num_ranks());
  return c;
}
}  // namespace

Proxy::Proxy(Transport& transport, std::vector<FifoView> fifos, const ProxyConfig& config)
    : transport_(transport),
      rank_(transport.rank()),
      num_ranks_(transport.num_ranks()),
      region_(transport.region()),
      config_(config),
      native_atomics_(config.native_atomics && transport_orders_atomics(transport)),
      ordering_(transport.region_writer(), transport.region().bytes, ordering_for(transport, config.ordering)) {
  config_.ordering.num_ranks = static_cast<uint32_t>(num_ranks_);
  if (config.num_threads < 1 || config.num_threads > 256) {
    throw std::invalid_argument("num_threads must be in [1, 256] (got " + std::to_string(config.num_threads) + ")");
  }
  if (fifos.empty()) throw std::invalid_argument("fifos must name at least one FIFO");
  if (fifos.size() > kMaxFifos) throw std::invalid_argument("fifos: at most " + std::to_string(kMaxFifos) + " FIFOs");
  for (size_t i = 0; i < fifos.size(); ++i) {
    const FifoView& v = fifos[i];
    // The head is the producers' business: a consumer never reads it (it may be device memory).
    if (!v.slots || !v.tail || v.capacity == 0 || (v.capacity & (v.capacity - 1)) != 0) {
      throw std::invalid_argument("fifos[" + std::to_string(i) + "] is not a valid FIFO (null or non-power-of-two)");
    }
    for (size_t j = 0; j < i; ++j) {
      if (fifos[j].slots == v.slots) {
        throw std::invalid_argument("fifos[" + std::to_string(i) + "] is the same FIFO as fifos[" +
                                    std::to_string(j) + "] (one consumer per FIFO)");
      }
    }
  }
  if (config.max_inflight_normal < 1) throw std::invalid_argument("max_inflight_normal must be >= 1");
  if (config.max_inflight_low_latency < 1) throw std::invalid_argument("max_inflight_low_latency must be >= 1");
  if (!(config.timeout_s > 0)) throw std::invalid_argument("timeout_s must be > 0");
  if (config.token_bytes % kCommandUnitBytes != 0) {
    throw std::invalid_argument("token_bytes must be a multiple of " + std::to_string(kCommandUnitBytes) + " (got " +
                                std::to_string(config.token_bytes) + ")");
  }
  if (!config.cpu_affinity.empty()) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) CPU_ZERO(&allowed);
    for (size_t i = 0; i < config.cpu_affinity.size(); ++i) {
      const int cpu = config.cpu_affinity[i];
      if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed)) {
        throw std::invalid_argument("cpu_affinity[" + std::to_string(i) + "] = " + std::to_string(cpu) +
                                    " is not a CPU this process may run on");
      }
    }
  }
  for (size_t i = 0; i < fifos.size(); ++i) {
    fifos_.push_back(std::make_unique<FifoState>(fifos[i], static_cast<uint32_t>(i)));
  }
  send_windows_.resize(static_cast<size_t>(num_ranks_) * config_.ordering.num_counters);
}

Proxy::~Proxy() {
  stop_.store(true);
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void Proxy::start() {
  if (running_) throw ProxyError(who() + ": start() while running");
  if (!threads_.empty()) throw ProxyError(who() + ": start() after stop() (create a new Proxy)");
  stop_.store(false);
  running_ = true;
  joined_ = false;
  for (uint32_t t = 0; t < config_.num_threads; ++t) {
    threads_.emplace_back([this, t] { thread_main(t); });
  }
}

void Proxy::stop() {
  stop_.store(true);
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  running_ = false;
  joined_ = true;
  check();
}

std::string Proxy::who() const { return "proxy rank " + std::to_string(rank_); }

void Proxy::fail(const std::string& what) {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (error_.empty()) {
    error_ = what;
  } else {
    ++more_errors_;
  }
  has_error_.store(true, std::memory_order_release);
}

void Proxy::fail_command(FifoState& fifo, const Command& command, const std::string& why) {
  const DecodedCommand d = decode_command(command);
  fail(who() + ", peer " + std::to_string(d.dst_rank) + ": cannot execute command #" +
       std::to_string(fifo.command_number) + " of FIFO " + std::to_string(fifo.index) + ": " + why + "; command " +
       describe_command(command) + " (the FIFO stops here)");
}

void Proxy::check() const {
  if (!has_error_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(error_mu_);
  std::string e = error_;
  if (more_errors_) e += " (and " + std::to_string(more_errors_) + " more error(s))";
  throw ProxyError(e);
}

std::string Proxy::error() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (error_.empty()) return error_;
  return more_errors_ ? error_ + " (and " + std::to_string(more_errors_) + " more error(s))" : error_;
}

ProxyStats Proxy::stats() const {
  ProxyStats s;
  s.commands = st_commands_.load();
  s.requests_posted = st_posted_.load();
  s.requests_completed = st_completed_.load();
  s.inflight_peak = st_inflight_peak_.load();
  s.flow_stalls = st_flow_stalls_.load();
  s.window_stalls = st_window_stalls_.load();
  s.native_adds = st_native_adds_.load();
  s.quiets = quiets_done_.load();
  s.barriers = barriers_done_.load();
  s.immediates = st_immediates_.load();
  s.idle_sleeps = st_idle_sleeps_.load();
  s.execute_ns = st_execute_ns_.load();
  s.quiet_wait_ns = st_quiet_wait_ns_.load();
  s.quiets_on_gpu = st_quiets_on_gpu_.load();
  std::lock_guard<std::mutex> lock(ordering_mu_);
  s.ordering = ordering_.stats();
  return s;
}

// ---------------------------------------------------------------------------------------
// The loop
// ---------------------------------------------------------------------------------------

void Proxy::thread_main(uint32_t thread_index) {
  // Named for top -H, perf and tests ("uccl-ep-proxyN": at most 15 characters).
  pthread_setname_np(pthread_self(), ("uccl-ep-proxy" + std::to_string(thread_index % 100)).c_str());
  transport_.bind_thread();
  if (!config_.cpu_affinity.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    const int cpu = config_.cpu_affinity[thread_index % config_.cpu_affinity.size()];
    CPU_SET(cpu, &set);
    const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    if (rc != 0) {
      fail(who() + ": thread " + std::to_string(thread_index) + " could not be pinned to CPU " +
           std::to_string(cpu) + ": " + std::strerror(rc));
    }
  }
  std::vector<FifoState*> mine;
  for (auto& f : fifos_) {
    if (f->index % config_.num_threads == thread_index) mine.push_back(f.get());
  }
  uint64_t idle = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    bool did = poll_completions();
    for (FifoState* f : mine) did |= progress(*f);
    if (thread_index == 0) did |= poll_immediates();
    if (did) {
      idle = 0;
      continue;
    }
    ++idle;
    if (config_.adaptive_sleep && idle > 64) {
      // Back off from 1 us up to 256 us while nothing happens.
      const uint64_t us = std::min<uint64_t>(256, 1ull << std::min<uint64_t>(8, (idle - 64) / 64));
      st_idle_sleeps_.fetch_add(1, std::memory_order_relaxed);
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    } else {
      std::this_thread::yield();
    }
  }
}

bool Proxy::poll_completions() {
  uint64_t ids[256];
  size_t n = 0;
  try {
    n = transport_.poll_completions(ids, 256);
  } catch (const std::exception& e) {
    fail(who() + ": transport " + transport_.name() + " failed: " + e.what());
    return true;
  }
  for (size_t i = 0; i < n; ++i) retire(ids[i]);
  return n > 0;
}

void Proxy::retire(uint64_t id) {
  const uint64_t type = id >> 62;
  const uint32_t fifo = static_cast<uint32_t>((id >> 48) & (kMaxFifos - 1));
  uint64_t bytes = 0;
  if (type == kIdWrite) bytes = id & ((1ull << 48) - 1);
  if (type == kIdAdd) {
    const uint32_t dst = static_cast<uint32_t>((id >> 32) & 0xFFF);
    const uint32_t counter = static_cast<uint32_t>((id >> 8) & (kImmMaxCounters - 1));
    const uint32_t seq = static_cast<uint32_t>(id & (kImmSeqModulus - 1));
    std::lock_guard<std::mutex> lock(send_mu_);
    SendWindow& w = send_windows_[static_cast<size_t>(dst) * config_.ordering.num_counters + counter];
    const uint32_t d = (seq - w.low) & (kImmSeqModulus - 1);
    w.acked_mask |= 1u << d;
    while (w.acked_mask & 1u) {
      ++w.low;
      w.acked_mask >>= 1;
    }
  }
  if (bytes) inflight_bytes_.fetch_sub(bytes);
  inflight_requests_.fetch_sub(1);
  st_completed_.fetch_add(1, std::memory_order_relaxed);
  if (fifo < fifos_.size()) fifos_[fifo]->completed.fetch_add(1, std::memory_order_acq_rel);
}

bool Proxy::reserve(uint64_t bytes, bool force) {
  std::lock_guard<std::mutex> lock(flow_mu_);
  const uint64_t reqs = inflight_requests_.load();
  const uint64_t inbytes = inflight_bytes_.load();
  if (!force && reqs > 0) {
    if (reqs + 1 > config_.max_inflight_requests() ||
        (config_.max_inflight_bytes && inbytes + bytes > config_.max_inflight_bytes)) {
      st_flow_stalls_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
  }
  // Added, not stored: retire() takes completions off without flow_mu_, and a store of the values
  // read above would undo one that landed in between (the count then never returns to 0).
  inflight_requests_.fetch_add(1);
  inflight_bytes_.fetch_add(bytes);
  uint64_t peak = st_inflight_peak_.load(std::memory_order_relaxed);
  while (reqs + 1 > peak && !st_inflight_peak_.compare_exchange_weak(peak, reqs + 1)) {
  }
  return true;
}

void Proxy::unreserve(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(flow_mu_);
  inflight_requests_.fetch_sub(1);
  inflight_bytes_.fetch_sub(bytes);
}

bool Proxy::waited_too_long(FifoState& fifo, const char* what) {
  const double waited = std::chrono::duration<double>(Clock::now() - fifo.wait_since).count();
  if (waited < config_.timeout_s) return false;
  const uint64_t posted = fifo.posted.load(), completed = fifo.completed.load();
  std::string detail = std::string(what) + " of FIFO " + std::to_string(fifo.index) + " waited " +
                       std::to_string(waited) + " s (timeout_s): " + std::to_string(posted - completed) +
                       " of its requests outstanding (the transport holds " +
                       std::to_string(transport_.outstanding()) + " unfinished)";
  const std::string oldest = transport_.oldest_outstanding();
  if (!oldest.empty()) detail += "; its oldest: " + oldest;
  if (fifo.wait == Wait::kBarrierPeers) {
    detail += ", " + std::to_string(arrivals_[fifo.barrier_epoch % 4].load()) + " of " +
              std::to_string(num_ranks_) + " ranks arrived at barrier " + std::to_string(fifo.barrier_epoch);
  }
  fail(who() + ": " + detail);
  fifo.wait = Wait::kFailed;
  return true;
}

bool Proxy::send_barrier_arrivals(FifoState& fifo) {
  const uint32_t imm = encode_immediate(ImmKind::kControl, 0, 0, kControlBarrierArrive,
                                        fifo.barrier_epoch & kImmMaxUnsignedValue);
  // Every rank, this one included: our own arrival reaches our immediate queue after the
  // immediates of our earlier writes to ourselves, so counting it proves those were applied.
  for (int peer = 0; peer < num_ranks_; ++peer) {
    reserve(0, true);
    try {
      transport_.post_write(peer, 0, 0, 0, imm, make_id(kIdOther, fifo.index, 0));
    } catch (const std::exception& e) {
      unreserve(0);
      fail(who() + ", peer " + std::to_string(peer) + ": barrier " + std::to_string(fifo.barrier_epoch) +
           " could not be announced: " + e.what());
      fifo.wait = Wait::kFailed;
      return false;
    }
    fifo.posted.fetch_add(1, std::memory_order_acq_rel);
    st_posted_.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

bool Proxy::progress(FifoState& fifo) {
  fifo.busy.store(true, std::memory_order_release);
  const bool did = advance(fifo);
  fifo.busy.store(fifo.has_pending || fifo.wait != Wait::kNone, std::memory_order_release);
  return did;
}

bool Proxy::idle() const {
  // In this order: a command is published before it is taken, and taken while its FIFO is busy, and
  // posted (counted in flight) before its FIFO stops being busy.
  for (const auto& fifo : fifos_) {
    if (fifo->consumer.published()) return false;
  }
  for (const auto& fifo : fifos_) {
    if (fifo->busy.load(std::memory_order_acquire)) return false;
  }
  return inflight_requests_.load(std::memory_order_acquire) == 0 && transport_.outstanding() == 0;
}

bool Proxy::advance(FifoState& fifo) {
  bool did = false;
  for (int budget = 0; budget < 64; ++budget) {
    switch (fifo.wait) {
      case Wait::kFailed:
        return did;
      case Wait::kQuiet:
        if (fifo.completed.load(std::memory_order_acquire) < fifo.posted.load(std::memory_order_relaxed)) {
          waited_too_long(fifo, "quiet");
          return did;
        }
        fifo.wait = Wait::kNone;
        st_quiet_wait_ns_.fetch_add(nanoseconds_since(fifo.wait_since), std::memory_order_relaxed);
        quiets_done_.fetch_add(1, std::memory_order_acq_rel);
        did = true;
        break;
      case Wait::kBarrierDrain: {
        bool drained = fifo.completed.load(std::memory_order_acquire) >= fifo.posted.load();
        for (size_t i = 0; drained && i < fifos_.size(); ++i) {
          drained = fifos_[i]->completed.load(std::memory_order_acquire) >= fifo.barrier_snapshot[i];
        }
        if (!drained) {
          waited_too_long(fifo, "barrier (draining)");
          return did;
        }
        if (!send_barrier_arrivals(fifo)) return true;
        fifo.wait = Wait::kBarrierPeers;
        did = true;
        [[fallthrough]];
      }
      case Wait::kBarrierPeers: {
        std::atomic<uint32_t>& slot = arrivals_[fifo.barrier_epoch % 4];
        if (slot.load(std::memory_order_acquire) < static_cast<uint32_t>(num_ranks_)) {
          waited_too_long(fifo, "barrier (waiting for peers)");
          return did;
        }
        slot.fetch_sub(static_cast<uint32_t>(num_ranks_), std::memory_order_acq_rel);
        barrier_epoch_.store(fifo.barrier_epoch + 1, std::memory_order_release);
        barriers_done_.fetch_add(1, std::memory_order_acq_rel);
        barrier_owner_.store(-1, std::memory_order_release);
        fifo.wait = Wait::kNone;
        did = true;
        break;
      }
      case Wait::kNone:
        break;
    }
    if (!fifo.has_pending) {
      if (!fifo.consumer.try_pop(fifo.pending)) return did;
      fifo.has_pending = true;
      did = true;
    }
    const Clock::time_point started = Clock::now();
    const Step step = execute(fifo, fifo.pending);
    if (step == Step::kBlocked) return did;
    st_execute_ns_.fetch_add(nanoseconds_since(started), std::memory_order_relaxed);
    fifo.has_pending = false;
    ++fifo.command_number;
    did = true;
    if (step == Step::kFailed) {
      fifo.wait = Wait::kFailed;
      return did;
    }
  }
  return did;
}

Proxy::Step Proxy::execute(FifoState& fifo, const Command& command) {
  const DecodedCommand d = decode_command(command);
  const uint32_t kind = static_cast<uint32_t>(d.kind);
  if (kind < 1 || kind > 5) {
    fail_command(fifo, command, "unknown command kind " + std::to_string(kind));
    return Step::kFailed;
  }
  if (d.kind == CommandKind::kQuiet) {
    st_commands_.fetch_add(1, std::memory_order_relaxed);
    if (config_.quiet_on_gpu) {
      // The writes after the QUIET need only start after those before it have landed: a transport
      // that can order its streams on the device saves the round trip through this thread.
      bool fenced = false;
      try {
        fenced = transport_.fence();
      } catch (const std::exception& e) {
        fail_command(fifo, command, std::string("the transport could not fence: ") + e.what());
        return Step::kFailed;
      }
      if (fenced) {
        st_quiets_on_gpu_.fetch_add(1, std::memory_order_relaxed);
        quiets_done_.fetch_add(1, std::memory_order_acq_rel);
        return Step::kDone;
      }
    }
    fifo.wait = Wait::kQuiet;
    fifo.wait_since = Clock::now();
    return Step::kDone;
  }
  if (d.kind == CommandKind::kBarrier) {
    int64_t none = -1;
    if (!barrier_owner_.compare_exchange_strong(none, fifo.index, std::memory_order_acq_rel)) {
      return Step::kBlocked;  // another FIFO's barrier is running
    }
    st_commands_.fetch_add(1, std::memory_order_relaxed);
    fifo.barrier_epoch = barrier_epoch_.load(std::memory_order_acquire);
    fifo.barrier_snapshot.resize(fifos_.size());
    for (size_t i = 0; i < fifos_.size(); ++i) fifo.barrier_snapshot[i] = fifos_[i]->posted.load();
    fifo.wait = Wait::kBarrierDrain;
    fifo.wait_since = Clock::now();
    return Step::kDone;
  }

  const int dst = static_cast<int>(d.dst_rank);
  if (dst >= num_ranks_) {
    fail_command(fifo, command, "destination rank " + std::to_string(dst) + " is out of range [0, num_ranks=" +
                                    std::to_string(num_ranks_) + ")");
    return Step::kFailed;
  }
  const uint32_t counters = config_.ordering.num_counters;

  if (d.kind == CommandKind::kAtomicAdd) {
    if (d.flags & ~(kCommandFlagBuffer | kCommandFlagCountFlag)) {
      fail_command(fifo, command, "unknown flags " + std::to_string(d.flags));
      return Step::kFailed;
    }
    if (d.counter_index >= counters) {
      fail_command(fifo, command, "counter_index " + std::to_string(d.counter_index) +
                                      " is out of range [0, num_counters=" + std::to_string(counters) + ")");
      return Step::kFailed;
    }
    const int64_t value = atomic_value(d);
    const uint32_t buffer = d.flags & kCommandFlagBuffer;
    if (d.flags & kCommandFlagCountFlag) {
      if (value < 0 || !imm_value_fits(static_cast<uint64_t>(value))) {
        fail_command(fifo, command, "a count flag announces " + std::to_string(value) + " rows, outside [0, " +
                                        std::to_string(kImmMaxUnsignedValue) + "]");
        return Step::kFailed;
      }
      if (!reserve(0, false)) return Step::kBlocked;
      const uint32_t imm = encode_immediate(ImmKind::kCountFlag, buffer, 0, d.counter_index, static_cast<uint32_t>(value));
      try {
        transport_.post_write(dst, 0, 0, 0, imm, make_id(kIdOther, fifo.index, 0));
      } catch (const std::exception& e) {
        unreserve(0);
        fail_command(fifo, command, std::string("the transport refused it: ") + e.what());
        return Step::kFailed;
      }
    } else if (native_atomics_) {
      if (!reserve(0, false)) return Step::kBlocked;
      try {
        transport_.post_atomic_add(dst, config_.ordering.counters_offset + 8ull * d.counter_index, value,
                                   make_id(kIdOther, fifo.index, 0));
      } catch (const std::exception& e) {
        unreserve(0);
        fail_command(fifo, command, std::string("the transport refused it: ") + e.what());
        return Step::kFailed;
      }
      st_native_adds_.fetch_add(1, std::memory_order_relaxed);
    } else {
      if (!imm_add_fits(value)) {
        fail_command(fifo, command, "the add amount " + std::to_string(value) + " does not fit an immediate [" +
                                        std::to_string(kImmMinAdd) + ", " + std::to_string(kImmMaxAdd) + "]");
        return Step::kFailed;
      }
      uint32_t seq;
      {
        std::lock_guard<std::mutex> lock(send_mu_);
        SendWindow& w = send_windows_[static_cast<size_t>(dst) * counters + d.counter_index];
        if (w.next - w.low >= config_.ordering.window) {
          st_window_stalls_.fetch_add(1, std::memory_order_relaxed);
          return Step::kBlocked;
        }
        if (!reserve(0, false)) return Step::kBlocked;
        seq = w.next++;
      }
      const uint32_t imm = encode_add_immediate(seq, d.counter_index, static_cast<int32_t>(value));
      try {
        transport_.post_write(dst, 0, 0, 0, imm, make_id(kIdAdd, fifo.index, add_payload(dst, d.counter_index, seq)));
      } catch (const std::exception& e) {
        unreserve(0);
        fail_command(fifo, command, std::string("the transport refused it: ") + e.what());
        return Step::kFailed;
      }
    }
    fifo.posted.fetch_add(1, std::memory_order_acq_rel);
    st_posted_.fetch_add(1, std::memory_order_relaxed);
    st_commands_.fetch_add(1, std::memory_order_relaxed);
    return Step::kDone;
  }

  // kWrite / kWriteWithCount.
  if (d.flags & ~kCommandFlagBuffer) {
    fail_command(fifo, command, "unknown flags " + std::to_string(d.flags));
    return Step::kFailed;
  }
  const uint64_t length = d.length_units * kCommandUnitBytes;
  const uint64_t local = d.local_offset_units * kCommandUnitBytes;
  const uint64_t remote = d.remote_offset_units * kCommandUnitBytes;
  if (local > region_.bytes || length > region_.bytes - local) {
    fail_command(fifo, command, "local range [" + std::to_string(local) + ", +" + std::to_string(length) +
                                    ") is outside the local region (" + std::to_string(region_.bytes) + " bytes)");
    return Step::kFailed;
  }
  std::optional<uint32_t> imm;
  if (d.kind == CommandKind::kWriteWithCount) {
    if (d.counter_index >= counters) {
      fail_command(fifo, command, "counter_index " + std::to_string(d.counter_index) +
                                      " is out of range [0, num_counters=" + std::to_string(counters) + ")");
      return Step::kFailed;
    }
    uint64_t rows = 1;
    if (config_.token_bytes) {
      if (length % config_.token_bytes != 0) {
        fail_command(fifo, command, "length is not a multiple of token_bytes " + std::to_string(config_.token_bytes));
        return Step::kFailed;
      }
      rows = length / config_.token_bytes;
    }
    if (!imm_value_fits(rows)) {
      fail_command(fifo, command, std::to_string(rows) + " token rows exceed the immediate's " +
                                      std::to_string(kImmMaxUnsignedValue));
      return Step::kFailed;
    }
    imm = encode_immediate(ImmKind::kWriteLanded, d.flags & kCommandFlagBuffer, 0, d.counter_index,
                           static_cast<uint32_t>(rows));
  }
  if (!reserve(length, false)) return Step::kBlocked;
  try {
    transport_.post_write(dst, local, remote, length, imm, make_id(kIdWrite, fifo.index, length));
  } catch (const std::exception& e) {
    unreserve(length);
    fail_command(fifo, command, std::string("the transport refused it: ") + e.what());
    return Step::kFailed;
  }
  fifo.posted.fetch_add(1, std::memory_order_acq_rel);
  st_posted_.fetch_add(1, std::memory_order_relaxed);
  st_commands_.fetch_add(1, std::memory_order_relaxed);
  return Step::kDone;
}

bool Proxy::poll_immediates() {
  ImmediateEvent events[256];
  size_t n = 0;
  try {
    n = transport_.poll_immediates(events, 256);
  } catch (const std::exception& e) {
    fail(who() + ": transport " + transport_.name() + " failed polling immediates: " + e.what());
    return true;
  }
  if (n == 0) return false;
  st_immediates_.fetch_add(n, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(ordering_mu_);
  for (size_t i = 0; i < n; ++i) {
    const ImmediateEvent& ev = events[i];
    const ImmFields f = decode_immediate(ev.imm);
    if (f.kind == ImmKind::kControl) {
      if (f.counter != kControlBarrierArrive) {
        fail(who() + ": unknown control immediate " + describe_immediate(ev.imm) + " from source rank " +
             std::to_string(ev.src_rank));
        continue;
      }
      const uint32_t current = barrier_epoch_.load(std::memory_order_acquire) & kImmMaxUnsignedValue;
      const uint32_t ahead = (f.value - current) & kImmMaxUnsignedValue;
      if (ahead > 1) {
        fail(who() + ": barrier arrival for epoch " + std::to_string(f.value) + " from source rank " +
             std::to_string(ev.src_rank) + " while this proxy is at barrier " + std::to_string(current) +
             " (ranks issued different numbers of barriers?)");
        continue;
      }
      arrivals_[(current + ahead) % 4].fetch_add(1, std::memory_order_acq_rel);
      continue;
    }
    try {
      ordering_.on_immediate(ev.src_rank, ev.imm);
    } catch (const std::exception& e) {
      fail(who() + ": " + e.what());
    }
  }
  return true;
}

}  // namespace uccl_ep
