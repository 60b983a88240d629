// A multi-producer, single-consumer FIFO of 16-byte commands in memory both sides can reach
// (pinned, mapped host memory between a GPU and its CPU proxy; plain host memory in tests).
//
// Producers claim a slot with an atomic on `head`, wait while the ring is full (the consumer
// advances `tail`), write word1, then publish with a release store of word0 (never zero).
// The consumer polls the slot at `tail` with an acquire load, takes the command, clears the
// slot and advances `tail` with a release store, so the slot is free for the producer that
// claimed `tail + capacity`. A command is therefore taken as soon as it is seen: only
// QUIET/BARRIER wait for completion, and they do so in the proxy, not here.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "channel/command.h"
#include "common/portability.h"

namespace uccl_ep {

// Where a FIFO lives; trivially copyable so kernels take it by value.
struct FifoView {
  Command* slots;     // [capacity], zeroed before first use
  uint64_t* tail;     // advanced by the consumer; read by producers
  uint64_t* head;     // claimed by producers (device memory when the producers are a GPU)
  uint64_t capacity;  // a power of two
};

enum class PushResult { kPushed, kTimedOut };

// Throws std::invalid_argument unless `capacity` is a power of two in [2, 2**24] (the upper bound
// keeps slot bytes far from overflowing and pinned allocations sane).
inline void check_fifo_capacity(int64_t capacity) {
  constexpr int64_t kMaxCapacity = int64_t(1) << 24;
  if (capacity < 2 || capacity > kMaxCapacity || (capacity & (capacity - 1)) != 0) {
    throw std::invalid_argument("capacity must be a power of two in [2, " + std::to_string(kMaxCapacity) +
                                "] (got " + std::to_string(capacity) + ")");
  }
}

// The producer side, one algorithm for every kind of producer. `Ops` supplies the memory
// operations: fetch_add_relaxed(head), load_acquire(tail), store_relaxed(word1),
// store_release(word0), pause(), and expired() for the caller's deadline.
template <typename Ops>
UCCL_EP_HOST_DEVICE inline PushResult fifo_push(const FifoView& fifo, const Command& command, Ops& ops) {
  const uint64_t ticket = ops.fetch_add_relaxed(fifo.head, 1);
  while (ticket - ops.load_acquire(fifo.tail) >= fifo.capacity) {
    if (ops.expired()) return PushResult::kTimedOut;
    ops.pause();
  }
  Command* slot = fifo.slots + (ticket & (fifo.capacity - 1));
  ops.store_relaxed(&slot->word1, command.word1);
  ops.store_release(&slot->word0, command.word0);
  return PushResult::kPushed;
}

// The consumer side (a proxy thread). Not thread-safe: one consumer per FIFO.
class FifoConsumer {
 public:
  explicit FifoConsumer(const FifoView& fifo) : fifo_(fifo), next_(host_load_acquire(fifo.tail)) {}

  // Takes the next command if one has been published.
  bool try_pop(Command& out) {
    Command* slot = fifo_.slots + (next_ & (fifo_.capacity - 1));
    const uint64_t word0 = host_load_acquire(&slot->word0);
    if (word0 == 0) return false;
    out.word0 = word0;
    out.word1 = __atomic_load_n(&slot->word1, __ATOMIC_RELAXED);
    host_store_relaxed(&slot->word0, 0);
    host_store_release(fifo_.tail, ++next_);
    return true;
  }

  uint64_t taken() const { return next_; }

  // Whether a command waits at the head of the ring; unlike try_pop, any thread may ask.
  bool published() const {
    const uint64_t tail = host_load_acquire(fifo_.tail);
    return host_load_acquire(&fifo_.slots[tail & (fifo_.capacity - 1)].word0) != 0;
  }

 private:
  FifoView fifo_;
  uint64_t next_;
};

}  // namespace uccl_ep
