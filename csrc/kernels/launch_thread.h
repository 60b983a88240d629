// A host thread that queues the GPU work of a normal-mode operation (its copies, stream waits and
// launches: about 15 calls for a copy-engine dispatch, 20 for a combine, each several microseconds)
// after the caller's thread has made the outputs, so that the operation returns to Python as soon
// as its outputs exist and the caller can queue its next work meanwhile.
//
// Ordering: the thread queues the work on a stream of its own that first waits for the caller's
// stream up to the handover (an event), and the caller's stream waits for all of it with one stream
// wait on a device word that the thread's stream raises last. An event cannot serve for that second
// wait: a stream that waits on an event not recorded yet does not wait. The word only grows (one
// value per handover), so a wait never sees a later handover's value too early.
//
// One piece of work at a time: join() returns once the last one is queued, and every caller that
// touches what the work uses (the copy engine's streams and state) joins first.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "common/portability.h"

namespace uccl_ep {

class LaunchThread {
 public:
  // Work queues on `stream`; what it queues elsewhere it must make `stream` wait for.
  using Work = std::function<void(gpuStream_t stream)>;

  // device: the GPU the work is for; rank and join_timeout_s: for the error of a join that waits too long;
  // enabled: false queues all work on the caller's thread (a setting, for comparisons).
  LaunchThread(int device, int rank, double join_timeout_s, bool enabled);
  ~LaunchThread();
  LaunchThread(const LaunchThread&) = delete;
  LaunchThread& operator=(const LaunchThread&) = delete;

  // Whether work is handed over at all (enabled, and 64-bit stream waits on the device); else run_on
  // queues it on the caller's thread.
  bool usable() const { return usable_; }
  // Starts waking the thread (if it sleeps), so that it is running when the next work comes.
  void wake();
  // After join(): `work` queued in stream order after what `caller` holds now, `caller` waiting for it.
  // By the caller's thread, on `caller` itself, when the thread is not usable, is asleep (it is woken
  // for the next work), or `caller` is being captured into a graph (a graph holds only what the
  // capturing thread queues on its streams). `operation` names the work in a later error.
  void run_on(gpuStream_t caller, const char* operation, Work work);
  // Returns once the work handed over last has been queued; raises what it raised, naming this rank
  // and the operation, or if it takes longer than the join timeout.
  void join();
  // Joins, then stops the thread and frees its stream, event and word. Idempotent; later run_on raise.
  void release();

 private:
  void start();
  void serve();
  // Queues one piece of work (none: only the word) on stream_ after the handover, and raises the word
  // to `sequence` whatever the work raised.
  void queue(const Work& work, uint64_t sequence);

  int device_;
  int rank_;
  double join_timeout_s_;
  bool usable_ = false;
  bool released_ = false;
  gpuStream_t stream_ = nullptr;
  gpuEvent_t handover_ = nullptr;  // the caller's stream up to the handover
  uint64_t* word_ = nullptr;       // device memory: the last handover whose work the stream finished
  std::thread thread_;

  std::mutex mutex_;
  std::condition_variable woken_;
  bool stop_ = false;     // under mutex_
  bool wake_ = false;     // under mutex_: a wake() since the thread last looked
  Work work_;             // under mutex_: the work of handover submitted_
  const char* operation_ = "";  // the last handover's (the caller's thread only: for its errors)
  std::atomic<uint64_t> submitted_{0};  // handovers so far (written under mutex_)
  std::atomic<uint64_t> queued_{0};     // handovers whose work is queued
  std::atomic<bool> awake_{false};      // the thread is looking for work without sleeping
  std::exception_ptr error_;            // what the work of the last handover raised (read after join)
};

}  // namespace uccl_ep
