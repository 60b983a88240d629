// The 16-byte command a GPU hands to a CPU proxy through a FIFO.
//
//   word0: bits  0..3   kind (never 0 for a valid command: a zero word0 marks an empty slot)
//          bits  4..15  destination rank (up to 4096 ranks)
//          bits 16..19  flags (e.g. which of the two low-latency buffers)
//          bits 20..43  length in 16-byte units (up to 256 MiB per command)
//          bits 44..63  counter index: the expert or tail counter a write announces (20 bits)
//   word1: bits  0..31  local offset in 16-byte units (up to 64 GiB into the source buffer)
//          bits 32..63  remote offset in 16-byte units (up to 64 GiB into the peer's buffer)
//
// For an atomic, the length field carries the signed value to add and the remote offset
// addresses the counter.
#pragma once

#include <cstdint>

#include "common/portability.h"

namespace uccl_ep {

enum class CommandKind : uint32_t {
  kWrite = 1,           // copy length bytes from local to remote offset
  kWriteWithCount = 2,  // the same, then add its token count to counter_index at the peer
  kAtomicAdd = 3,       // add value to the counter at the remote offset
  kQuiet = 4,           // wait until every earlier command of this FIFO has completed
  kBarrier = 5,         // quiet, then synchronise with every peer's proxy
};

// Flags of a command (the proxy's header says what each kind does with them).
constexpr uint32_t kCommandFlagBuffer = 1u;     // which of two buffers (of counts, of count flags) it concerns
constexpr uint32_t kCommandFlagCountFlag = 2u;  // kAtomicAdd: a count flag, not an add

constexpr uint64_t kCommandUnitBytes = 16;
constexpr uint32_t kMaxRanks = 1u << 12;
constexpr uint32_t kMaxFlags = 1u << 4;
constexpr uint64_t kMaxLengthUnits = 1ull << 24;
constexpr uint32_t kMaxCounterIndex = 1u << 20;

struct alignas(16) Command {
  uint64_t word0;
  uint64_t word1;
};

struct DecodedCommand {
  CommandKind kind;
  uint32_t dst_rank;
  uint32_t flags;
  uint64_t length_units;  // or the value of an atomic, sign-extended by atomic_value()
  uint32_t counter_index;
  uint64_t local_offset_units;
  uint64_t remote_offset_units;
};

UCCL_EP_HOST_DEVICE inline Command encode_command(CommandKind kind, uint32_t dst_rank, uint32_t flags,
                                                  uint64_t length_units, uint32_t counter_index,
                                                  uint64_t local_offset_units, uint64_t remote_offset_units) {
  Command c;
  c.word0 = (static_cast<uint64_t>(kind) & 0xF) | (static_cast<uint64_t>(dst_rank & 0xFFF) << 4) |
            (static_cast<uint64_t>(flags & 0xF) << 16) | ((length_units & 0xFFFFFF) << 20) |
            (static_cast<uint64_t>(counter_index & 0xFFFFF) << 44);
  c.word1 = (local_offset_units & 0xFFFFFFFFull) | ((remote_offset_units & 0xFFFFFFFFull) << 32);
  return c;
}

UCCL_EP_HOST_DEVICE inline DecodedCommand decode_command(const Command& c) {
  DecodedCommand d;
  d.kind = static_cast<CommandKind>(c.word0 & 0xF);
  d.dst_rank = static_cast<uint32_t>((c.word0 >> 4) & 0xFFF);
  d.flags = static_cast<uint32_t>((c.word0 >> 16) & 0xF);
  d.length_units = (c.word0 >> 20) & 0xFFFFFF;
  d.counter_index = static_cast<uint32_t>(c.word0 >> 44);
  d.local_offset_units = c.word1 & 0xFFFFFFFFull;
  d.remote_offset_units = c.word1 >> 32;
  return d;
}

// The value of an atomic command: the 24-bit length field as a signed number.
UCCL_EP_HOST_DEVICE inline int64_t atomic_value(const DecodedCommand& d) {
  return static_cast<int64_t>(d.length_units << 40) >> 40;
}

}  // namespace uccl_ep
