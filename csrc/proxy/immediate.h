// The 32-bit immediate a proxy attaches to a write. The receiving proxy decodes it
// and applies its effect through the ordering layer (proxy/ordering.h). The source rank is not
// in the immediate: the transport reports it (ImmediateEvent::src_rank).
//
//   bits 30..31  kind      0 write-landed: `value` token rows of (buffer, counter) have landed
//                          1 atomic add:   add the signed `value` to counter `counter`
//                          2 count flag:   the sender announces `value` token rows for (buffer, counter)
//                          3 control:      `counter` is the operation (kControlBarrierArrive),
//                                          `value` its argument (the barrier epoch, modulo 2^14)
//   bit  29      buffer    which of the two low-latency buffers (write-landed and count flag)
//   bits 25..28  seq       per-(source, counter) sequence number of an atomic add, modulo 16
//   bits 14..24  counter   the expert or tail counter (0 .. 2047)
//   bits  0..13  value     unsigned 0 .. 16383 (token counts, control arguments);
//                          for an atomic add a two's complement number in -8192 .. 8191
//
// Limits that follow: at most 2048 counters (experts) per receiver, at most 16383 tokens per
// write or count flag, add amounts in [-8192, 8191] (the proxy reports a larger add as an
// unexecutable command), and a reorder window of at most kMaxImmWindow = 8 adds in flight per
// (source, destination, counter): with 16 sequence numbers a window of 8 still tells a
// duplicate or stale sequence number from a new one.
#pragma once

#include <cstdint>
#include <string>

namespace uccl_ep {

enum class ImmKind : uint32_t {
  kWriteLanded = 0,
  kAtomicAdd = 1,
  kCountFlag = 2,
  kControl = 3,
};

// Control operations (the counter field of a control immediate).
constexpr uint32_t kControlBarrierArrive = 1;

constexpr uint32_t kImmSeqBits = 4;
constexpr uint32_t kImmCounterBits = 11;
constexpr uint32_t kImmValueBits = 14;

constexpr uint32_t kImmSeqModulus = 1u << kImmSeqBits;             // 16
constexpr uint32_t kImmMaxCounters = 1u << kImmCounterBits;        // 2048
constexpr uint32_t kImmMaxUnsignedValue = (1u << kImmValueBits) - 1;  // 16383
constexpr int32_t kImmMinAdd = -(1 << (kImmValueBits - 1));        // -8192
constexpr int32_t kImmMaxAdd = (1 << (kImmValueBits - 1)) - 1;     // 8191
constexpr uint32_t kMaxImmWindow = kImmSeqModulus / 2;             // 8

struct ImmFields {
  ImmKind kind = ImmKind::kWriteLanded;
  uint32_t buffer = 0;   // 0 or 1
  uint32_t seq = 0;      // 0 .. 15
  uint32_t counter = 0;  // 0 .. 2047
  uint32_t value = 0;    // the raw 14-bit field; imm_add_value() for an add's signed amount
};

// Packs the fields; bits outside each field's width are masked off (callers check ranges first:
// imm_value_fits / imm_add_fits).
inline uint32_t encode_immediate(ImmKind kind, uint32_t buffer, uint32_t seq, uint32_t counter, uint32_t value) {
  return (static_cast<uint32_t>(kind) & 0x3u) << 30 | (buffer & 0x1u) << 29 |
         (seq & (kImmSeqModulus - 1)) << 25 | (counter & (kImmMaxCounters - 1)) << 14 |
         (value & kImmMaxUnsignedValue);
}

inline uint32_t encode_add_immediate(uint32_t seq, uint32_t counter, int32_t amount) {
  return encode_immediate(ImmKind::kAtomicAdd, 0, seq, counter, static_cast<uint32_t>(amount));
}

inline ImmFields decode_immediate(uint32_t imm) {
  ImmFields f;
  f.kind = static_cast<ImmKind>(imm >> 30);
  f.buffer = (imm >> 29) & 0x1u;
  f.seq = (imm >> 25) & (kImmSeqModulus - 1);
  f.counter = (imm >> 14) & (kImmMaxCounters - 1);
  f.value = imm & kImmMaxUnsignedValue;
  return f;
}

// The signed amount of an add: the value field sign-extended from 14 bits.
inline int32_t imm_add_value(const ImmFields& f) {
  return static_cast<int32_t>(f.value << (32 - kImmValueBits)) >> (32 - kImmValueBits);
}

inline bool imm_add_fits(int64_t amount) { return amount >= kImmMinAdd && amount <= kImmMaxAdd; }
inline bool imm_value_fits(uint64_t value) { return value <= kImmMaxUnsignedValue; }

inline const char* imm_kind_name(ImmKind kind) {
  switch (kind) {
    case ImmKind::kWriteLanded: return "write-landed";
    case ImmKind::kAtomicAdd: return "atomic-add";
    case ImmKind::kCountFlag: return "count-flag";
    case ImmKind::kControl: return "control";
  }
  return "?";
}

inline std::string describe_immediate(uint32_t imm) {
  const ImmFields f = decode_immediate(imm);
  std::string s = std::string("{kind=") + imm_kind_name(f.kind) + ", buffer=" + std::to_string(f.buffer) +
                  ", seq=" + std::to_string(f.seq) + ", counter=" + std::to_string(f.counter) + ", value=";
  s += f.kind == ImmKind::kAtomicAdd ? std::to_string(imm_add_value(f)) : std::to_string(f.value);
  return s + "}";
}

}  // namespace uccl_ep
