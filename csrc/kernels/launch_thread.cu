// Host code only: the thread that queues a normal-mode operation's GPU work (see launch_thread.h).
#include "kernels/launch_thread.h"

#include <chrono>
#include <stdexcept>
#include <utility>

#include "common/deadline.h"
#include "common/require.h"

namespace uccl_ep {

namespace {
// How long the thread stays awake for more work after a wake() or a piece of work: longer than the
// gaps between the calls of a serving or training step. Waking a sleeping thread can take longer
// than queuing the work (tens of microseconds on virtual machines), so work that finds the thread
// asleep is queued by the caller instead (run_on).
constexpr auto kStayAwake = std::chrono::milliseconds(5);
}  // namespace

LaunchThread::LaunchThread(int device, int rank, double join_timeout_s, bool enabled)
    : device_(device),
      rank_(rank),
      join_timeout_s_(join_timeout_s),
      usable_(enabled && gpu_stream_waits_supported(device)) {}

LaunchThread::~LaunchThread() {
  try {
    release();
  } catch (...) {
    // A destructor cannot raise; release() already left nothing it could free safely.
  }
}

void LaunchThread::start() {
  // The caller made device_ current.
  UCCL_EP_GPU_CHECK(gpu_stream_create_nonblocking(&stream_));
  UCCL_EP_GPU_CHECK(gpu_event_create(&handover_));
  void* word = nullptr;
  UCCL_EP_GPU_CHECK(gpu_device_alloc(&word, sizeof(uint64_t)));
  word_ = static_cast<uint64_t*>(word);
  // Zero before any stream waits on it, and in the order of the thread's stream: a plain memset goes
  // on the legacy default stream, which may run it after the thread's first raise.
  UCCL_EP_GPU_CHECK(gpu_memset_async(word_, 0, sizeof(uint64_t), stream_));
  UCCL_EP_GPU_CHECK(gpu_stream_synchronize(stream_));
  thread_ = std::thread([this] { serve(); });
}

void LaunchThread::wake() {
  // No thread before the first work; an awake one looks for work without being told.
  if (!thread_.joinable() || awake_.load(std::memory_order_acquire)) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_ = true;
  }
  woken_.notify_one();
}

void LaunchThread::run_on(gpuStream_t caller, const char* operation, Work work) {
  require(!released_, "rank " + std::to_string(rank_) + ": this normal-mode launcher was released");
  join();
  if (!usable_) {
    work(caller);
    return;
  }
  bool capturing = false;
  UCCL_EP_GPU_CHECK(gpu_stream_capturing(caller, &capturing));
  if (!thread_.joinable()) start();
  if (capturing || !awake_.load(std::memory_order_acquire)) {
    wake();  // for the next work
    work(caller);
    return;
  }
  UCCL_EP_GPU_CHECK(gpu_event_record(handover_, caller));
  const uint64_t sequence = submitted_.load(std::memory_order_relaxed) + 1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    work_ = std::move(work);
    submitted_.store(sequence, std::memory_order_release);
  }
  operation_ = operation;
  woken_.notify_one();
  UCCL_EP_GPU_CHECK(gpu_stream_wait_at_least(caller, word_, sequence));
}

void LaunchThread::join() {
  const uint64_t target = submitted_.load(std::memory_order_relaxed);  // only this thread hands over
  if (queued_.load(std::memory_order_acquire) != target) {
    const auto deadline = deadline_after(join_timeout_s_);
    while (queued_.load(std::memory_order_acquire) != target) {
      if (std::chrono::steady_clock::now() >= deadline) {
        throw std::runtime_error("rank " + std::to_string(rank_) + ": the launch thread did not finish queuing the " +
                                 operation_ + "'s GPU work within " + format_seconds(join_timeout_s_));
      }
      std::this_thread::yield();
    }
  }
  if (!error_) return;
  const std::exception_ptr error = std::exchange(error_, nullptr);
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    throw std::runtime_error("rank " + std::to_string(rank_) + ": queuing the GPU work of the last " +
                             operation_ + " failed: " + e.what());
  }
}

void LaunchThread::serve() {
  // Without a current device every call would go to device 0; relaxed capture lets these calls on
  // streams of our own go on while the caller's thread captures a graph elsewhere.
  std::exception_ptr start_error;
  if (gpu_set_device(device_) != kGpuSuccess || gpu_relax_stream_capture() != kGpuSuccess) {
    start_error = std::make_exception_ptr(
        std::runtime_error("the launch thread could not make device " + std::to_string(device_) + " current"));
  }
  uint64_t done = 0;
  for (;;) {
    awake_.store(true, std::memory_order_release);
    const auto stay_awake_until = std::chrono::steady_clock::now() + kStayAwake;
    while (submitted_.load(std::memory_order_acquire) == done && std::chrono::steady_clock::now() < stay_awake_until) {
      std::this_thread::yield();
    }
    Work work;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      awake_.store(false, std::memory_order_release);  // run_on queues work itself until it is set again
      woken_.wait(lock, [&] { return stop_ || wake_ || submitted_.load(std::memory_order_relaxed) != done; });
      wake_ = false;
      if (submitted_.load(std::memory_order_relaxed) == done) {
        if (stop_) return;
        continue;  // a wake(): stay awake for the work it announces
      }
      work = std::move(work_);
      done = submitted_.load(std::memory_order_relaxed);
    }
    queue(start_error ? Work() : work, done);
    if (start_error) error_ = start_error;
    queued_.store(done, std::memory_order_release);
  }
}

void LaunchThread::queue(const Work& work, uint64_t sequence) {
  try {
    UCCL_EP_GPU_CHECK(gpu_stream_wait_event(stream_, handover_));
    if (work) work(stream_);
  } catch (...) {
    error_ = std::current_exception();
  }
  // The caller's stream waits for this value whatever the work did.
  const gpuError_t status = gpu_stream_write_word(stream_, word_, sequence);
  if (status != kGpuSuccess && !error_) {
    error_ = std::make_exception_ptr(GpuError(status, "gpu_stream_write_word", __FILE__, __LINE__));
  }
}

void LaunchThread::release() {
  if (released_) return;
  released_ = true;
  std::exception_ptr failure;
  try {
    join();
  } catch (...) {
    failure = std::current_exception();
  }
  if (thread_.joinable()) {
    if (queued_.load(std::memory_order_acquire) != submitted_.load(std::memory_order_relaxed)) {
      // Still queuing past the timeout: it keeps its stream, event and word.
      thread_.detach();
      std::rethrow_exception(failure);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    woken_.notify_one();
    thread_.join();
  }
  // The caller's stream may still wait on the word: the free waits for the device.
  if (word_ != nullptr) (void)gpu_device_free(word_);
  word_ = nullptr;
  if (handover_ != nullptr) (void)gpu_event_destroy(handover_);
  handover_ = nullptr;
  if (stream_ != nullptr) (void)gpu_stream_destroy(stream_);
  stream_ = nullptr;
  if (failure) std::rethrow_exception(failure);
}

}  // namespace uccl_ep
