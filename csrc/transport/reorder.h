// Reorder injection, shared by every transport.
//
// With a seed set (the constructor's reorder_seed, else UCCL_EP_TRANSPORT_REORDER=<seed>),
// a transport's sender keeps, per peer, a window of up to `window` requests
// (UCCL_EP_TRANSPORT_REORDER_WINDOW, default 16). Once the window is full, each new request
// releases one held request chosen at random; quiet() and close() release all of them in a
// random order, and so does the transport once the oldest held request has waited
// `max_hold_us` (UCCL_EP_TRANSPORT_REORDER_HOLD_US, default 2000), so a window never holds a
// request that someone is waiting for forever. Writes, atomics and immediates therefore
// reach the peer out of order. The random sequence depends only on the seed, the rank and
// the peer (its own generator, not the standard library's distributions).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common/settings.h"
#include <utility>
#include <vector>

namespace uccl_ep {

struct ReorderConfig {
  bool enabled = false;
  uint64_t seed = 0;
  size_t window = 16;
  int64_t max_hold_us = 2000;

  static constexpr const char* kSeedEnv = "UCCL_EP_TRANSPORT_REORDER";
  static constexpr const char* kWindowEnv = "UCCL_EP_TRANSPORT_REORDER_WINDOW";
  static constexpr const char* kHoldEnv = "UCCL_EP_TRANSPORT_REORDER_HOLD_US";

  // seed_arg >= 0 enables reordering with that seed; -1 reads the environment (unset, empty
  // or "off" keeps it off); anything else below -1 is an error.
  static ReorderConfig resolve(int64_t seed_arg) {
    ReorderConfig config;
    if (seed_arg < -1) throw std::invalid_argument("reorder_seed must be >= 0, or -1 to read " +
                                                   std::string(kSeedEnv) + " (got " + std::to_string(seed_arg) + ")");
    if (seed_arg >= 0) {
      config.enabled = true;
      config.seed = static_cast<uint64_t>(seed_arg);
    } else if (const char* env = std::getenv(kSeedEnv)) {
      const std::string text(env);
      if (!text.empty() && text != "off") {
        config.enabled = true;
        config.seed = parse_setting_unsigned(kSeedEnv, text);
      }
    }
    if (const char* env = std::getenv(kWindowEnv)) {
      if (*env) config.window = static_cast<size_t>(parse_setting_unsigned(kWindowEnv, env, 2));
    }
    if (const char* env = std::getenv(kHoldEnv)) {
      if (*env) config.max_hold_us = static_cast<int64_t>(parse_setting_unsigned(kHoldEnv, env));
    }
    return config;
  }
};

// A small deterministic generator (splitmix64): the same seed gives the same order everywhere.
class ReorderRng {
 public:
  explicit ReorderRng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform enough in [0, n) for n far below 2^64.
  size_t below(size_t n) { return static_cast<size_t>(next() % n); }

 private:
  uint64_t state_;
};

// The window of one (rank, peer) stream. Not thread-safe: the owner locks around it.
// `Sink` is called with each released item (an rvalue), in release order.
template <typename T>
class ReorderWindow {
 public:
  using Clock = std::chrono::steady_clock;

  ReorderWindow() = default;
  ReorderWindow(const ReorderConfig& config, uint32_t rank, uint32_t peer)
      : config_(config), rng_(config.seed ^ (0xA5A5A5A5ull + (static_cast<uint64_t>(rank) << 32) + peer) * 0x2545F4914F6CDD1Dull) {}

  bool enabled() const { return config_.enabled; }
  size_t size() const { return held_.size(); }
  bool empty() const { return held_.empty(); }

  template <typename Sink>
  void push(T item, Clock::time_point now, Sink&& sink) {
    if (!config_.enabled) {
      sink(std::move(item));
      return;
    }
    if (held_.empty()) oldest_ = now;
    held_.push_back(std::move(item));
    if (held_.size() >= config_.window) release_one(sink);
  }

  // Whether the oldest held item has waited longer than max_hold_us.
  bool expired(Clock::time_point now) const {
    return !held_.empty() && now - oldest_ >= std::chrono::microseconds(config_.max_hold_us);
  }

  // Releases everything held, in a random order.
  template <typename Sink>
  void flush(Sink&& sink) {
    while (!held_.empty()) release_one(sink);
  }

  // Drops everything held without releasing it (a connection that is gone).
  size_t discard() {
    const size_t n = held_.size();
    held_.clear();
    return n;
  }

 private:
  template <typename Sink>
  void release_one(Sink& sink) {
    const size_t pick = rng_.below(held_.size());
    if (pick != held_.size() - 1) std::swap(held_[pick], held_.back());
    T item = std::move(held_.back());
    held_.pop_back();
    // The remaining items are younger than the one that left only approximately; restart the
    // clock so a steady trickle of posts keeps being reordered rather than flushed.
    oldest_ = Clock::now();
    sink(std::move(item));
  }

  ReorderConfig config_;
  ReorderRng rng_{0};
  std::vector<T> held_;
  Clock::time_point oldest_{};
};

}  // namespace uccl_ep
