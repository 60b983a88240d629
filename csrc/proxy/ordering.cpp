#include "proxy/ordering.h"

#include <algorithm>

namespace uccl_ep {

namespace {

void check_array(const char* name, uint64_t offset, uint64_t entries, uint64_t region_bytes) {
  if (offset % 8 != 0) {
    throw std::invalid_argument(std::string(name) + " " + std::to_string(offset) + " is not a multiple of 8");
  }
  const uint64_t bytes = entries * 8;
  if (offset > region_bytes || bytes > region_bytes - offset) {
    throw std::invalid_argument(std::string(name) + " " + std::to_string(offset) + " with " +
                                std::to_string(entries) + " int64 entries runs past the end of the region (" +
                                std::to_string(region_bytes) + " bytes)");
  }
}

}  // namespace

void ReceiverOrdering::validate(uint64_t region_bytes, const OrderingConfig& c) {
  if (c.num_ranks == 0) throw std::invalid_argument("num_ranks must be >= 1");
  if (c.num_counters > kImmMaxCounters) {
    throw std::invalid_argument("num_counters must be <= " + std::to_string(kImmMaxCounters) +
                                " (the immediate's counter field) (got " + std::to_string(c.num_counters) + ")");
  }
  if (c.window < 1 || c.window > kMaxImmWindow) {
    throw std::invalid_argument("window must be in [1, " + std::to_string(kMaxImmWindow) + "] (got " +
                                std::to_string(c.window) + ")");
  }
  if (c.num_counters == 0) return;
  check_array("counters_offset", c.counters_offset, c.num_counters, region_bytes);
  check_array("flags_offset", c.flags_offset, 2ull * c.num_counters * c.num_ranks, region_bytes);
}

ReceiverOrdering::ReceiverOrdering(RegionWriter& writer, uint64_t region_bytes, const OrderingConfig& config)
    : writer_(writer), config_(config) {
  validate(region_bytes, config);
  adds_.resize(static_cast<size_t>(config.num_ranks) * config.num_counters);
  flags_.resize(2ull * config.num_counters * config.num_ranks);
}

uint64_t ReceiverOrdering::counter_offset(uint32_t counter) const { return config_.counters_offset + 8ull * counter; }

uint64_t ReceiverOrdering::flag_offset(uint32_t buffer, uint32_t counter, uint32_t src) const {
  const uint64_t index = (static_cast<uint64_t>(buffer) * config_.num_counters + counter) * config_.num_ranks + src;
  return config_.flags_offset + 8 * index;
}

std::string ReceiverOrdering::where(uint32_t src, uint32_t counter) const {
  return "source rank " + std::to_string(src) + ", counter " + std::to_string(counter);
}

void ReceiverOrdering::apply_add(uint32_t counter, int64_t amount) {
  writer_.add(counter_offset(counter), amount);
  ++stats_.adds_applied;
}

void ReceiverOrdering::release_flag(uint32_t buffer, uint32_t counter, uint32_t src, uint64_t rows) {
  writer_.store_release(flag_offset(buffer, counter, src), -static_cast<int64_t>(rows) - 1);
  ++stats_.flags_released;
}

void ReceiverOrdering::on_immediate(uint32_t src, uint32_t imm) {
  const ImmFields f = decode_immediate(imm);
  if (f.kind == ImmKind::kControl) {
    throw OrderingError("control immediate " + describe_immediate(imm) + " from source rank " +
                        std::to_string(src) + " reached the ordering layer");
  }
  if (src >= config_.num_ranks) {
    throw OrderingError("immediate " + describe_immediate(imm) + " from source rank " + std::to_string(src) +
                        " beyond num_ranks " + std::to_string(config_.num_ranks));
  }
  if (f.counter >= config_.num_counters) {
    throw OrderingError("immediate " + describe_immediate(imm) + " from " + where(src, f.counter) +
                        ": counter beyond num_counters " + std::to_string(config_.num_counters));
  }

  if (f.kind == ImmKind::kAtomicAdd) {
    const int32_t amount = imm_add_value(f);
    if (!config_.enabled) {
      apply_add(f.counter, amount);
      return;
    }
    AddWindow& w = adds_[static_cast<size_t>(src) * config_.num_counters + f.counter];
    const uint32_t d = (f.seq - w.expected) & (kImmSeqModulus - 1);
    if (d >= config_.window) {
      throw OrderingError("atomic add from " + where(src, f.counter) + ": sequence " + std::to_string(f.seq) +
                          " is outside the window [" + std::to_string(w.expected % kImmSeqModulus) + ", +" +
                          std::to_string(config_.window) + ") (mod " + std::to_string(kImmSeqModulus) +
                          "; stale, duplicate, or the sender exceeded the window)");
    }
    if (w.held_mask & (1u << d)) {
      throw OrderingError("atomic add from " + where(src, f.counter) + ": sequence " + std::to_string(f.seq) +
                          " arrived twice");
    }
    if (d != 0) {
      w.held[d] = amount;
      w.held_mask |= 1u << d;
      ++stats_.adds_held_now;
      stats_.adds_held_peak = std::max(stats_.adds_held_peak, stats_.adds_held_now);
      return;
    }
    apply_add(f.counter, amount);
    ++w.expected;
    w.held_mask >>= 1;
    for (uint32_t i = 0; i + 1 < kMaxImmWindow; ++i) w.held[i] = w.held[i + 1];
    while (w.held_mask & 1u) {
      apply_add(f.counter, w.held[0]);
      ++stats_.adds_applied_late;
      --stats_.adds_held_now;
      ++w.expected;
      w.held_mask >>= 1;
      for (uint32_t i = 0; i + 1 < kMaxImmWindow; ++i) w.held[i] = w.held[i + 1];
    }
    return;
  }

  FlagSlot& slot = flags_[(static_cast<size_t>(f.buffer) * config_.num_counters + f.counter) * config_.num_ranks + src];
  if (f.kind == ImmKind::kWriteLanded) {
    stats_.tokens_landed += f.value;
    slot.landed += f.value;
    if (config_.enabled && slot.pending >= 0 && slot.landed >= static_cast<uint64_t>(slot.pending)) {
      const uint64_t rows = static_cast<uint64_t>(slot.pending);
      slot.landed -= rows;
      slot.pending = -1;
      --stats_.flags_held_now;
      ++stats_.flags_released_late;
      release_flag(f.buffer, f.counter, src, rows);
    }
    return;
  }

  // A count flag.
  const uint64_t rows = f.value;
  if (!config_.enabled) {
    release_flag(f.buffer, f.counter, src, rows);
    return;
  }
  if (slot.pending >= 0) {
    throw OrderingError("count flag of buffer " + std::to_string(f.buffer) + " from " + where(src, f.counter) +
                        " announcing " + std::to_string(rows) + " rows arrived while one announcing " +
                        std::to_string(slot.pending) + " rows is still held");
  }
  if (slot.landed >= rows) {
    slot.landed -= rows;
    release_flag(f.buffer, f.counter, src, rows);
    return;
  }
  slot.pending = static_cast<int64_t>(rows);
  ++stats_.flags_held_now;
  stats_.flags_held_peak = std::max(stats_.flags_held_peak, stats_.flags_held_now);
}

}  // namespace uccl_ep
