// GPU producers for the channel stress and latency runs (see stress.h).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "channel/fifo.h"
#include "channel/fifo_device.cuh"
#include "channel/mapped_fifos.h"
#include "channel/stress.h"

namespace uccl_ep {
namespace {

constexpr size_t kLine = 64;

// Untimed round trips before the timed ones: they take the first touches of the mapped pages
// and the kernel's start-up out of the figures.
constexpr uint64_t kLatencyWarmup = 1000;

__global__ void channel_stress_push_kernel(const FifoView* fifos, uint32_t blocks_per_fifo, uint64_t commands_per_thread,
                                           uint64_t timeout_ns, unsigned long long* pushed, unsigned int* timed_out) {
  const FifoView fifo = fifos[blockIdx.x / blocks_per_fifo];
  const uint32_t producer = blockIdx.x * blockDim.x + threadIdx.x;
  DeviceFifoOps ops{device_time_ns() + timeout_ns};
  uint64_t done = 0;
  for (uint64_t seq = 0; seq < commands_per_thread; ++seq) {
    if (fifo_push(fifo, stress_command(producer, seq), ops) != PushResult::kPushed) {
      atomicAdd(timed_out, 1u);
      break;
    }
    ++done;
  }
  atomicAdd(pushed, static_cast<unsigned long long>(done));
}

enum class LatencyFailure : uint32_t { kNone, kNoFreeSlot, kNoAck };

// What the latency kernel reports when it ends (one thread writes it once).
struct LatencyStatus {
  uint64_t pushed;    // commands pushed
  uint64_t answered;  // round trips completed, warm-up included
  uint64_t last_ack;  // the acknowledgement word when the kernel ended
  uint64_t loop_ns;   // globaltimer time of the timed round trips; 0 unless all completed
  LatencyFailure failure;
};

// Spins on the host's acknowledgement word until it reads `expected`; false at the deadline.
// No pause between polls: each poll already crosses to host memory, and a sleep would add to the figure.
__device__ bool wait_for_ack(const uint64_t* ack, uint64_t expected, const DeviceFifoOps& ops) {
  while (load_acquire_system(ack) != expected) {
    if (ops.expired()) return false;
  }
  return true;
}

// One thread: push command `seq`, wait until the host acknowledges it with seq + 1, record the
// round trip from before the push to the acknowledgement seen, repeat.
__global__ void channel_latency_kernel(FifoView fifo, const uint64_t* ack, uint64_t warmup, uint64_t iterations,
                                       uint64_t timeout_ns, uint64_t* round_trip_ns, LatencyStatus* status) {
  DeviceFifoOps ops{device_time_ns() + timeout_ns};
  LatencyStatus s{0, 0, 0, 0, LatencyFailure::kNone};
  uint64_t loop_start = 0;
  for (uint64_t seq = 0; seq < warmup + iterations; ++seq) {
    const uint64_t sent = device_time_ns();
    if (seq == warmup) loop_start = sent;
    if (fifo_push(fifo, stress_command(0, seq), ops) != PushResult::kPushed) {
      s.failure = LatencyFailure::kNoFreeSlot;
      break;
    }
    ++s.pushed;
    if (!wait_for_ack(ack, seq + 1, ops)) {
      s.failure = LatencyFailure::kNoAck;
      break;
    }
    const uint64_t answered = device_time_ns();
    ++s.answered;
    if (seq >= warmup) round_trip_ns[seq - warmup] = answered - sent;
  }
  if (s.failure == LatencyFailure::kNone) s.loop_ns = device_time_ns() - loop_start;
  s.last_ack = load_acquire_system(ack);
  *status = s;
}

// What a run holds: its FIFOs (channel/mapped_fifos.h, GPU producers), pinned mapped host bytes and
// device bytes of its own (both zeroed), and a stream; all released on every path, including a
// failure part-way through acquiring them.
struct ChannelRun {
  std::unique_ptr<MappedFifos> fifos;
  void* host = nullptr;
  void* host_on_device = nullptr;  // `host` as the GPU addresses it
  void* device = nullptr;
  gpuStream_t stream = nullptr;

  // The device memory is cleared on `stream`: a non-blocking stream does not wait for the legacy
  // default stream, so work put there would not be ordered before the run's kernel.
  void acquire(uint32_t num_fifos, uint64_t capacity, size_t host_bytes, size_t device_bytes) {
    int current = 0;
    UCCL_EP_GPU_CHECK(gpu_get_device(&current));
    fifos = std::make_unique<MappedFifos>(static_cast<int>(num_fifos), static_cast<int64_t>(capacity), current, false);
    UCCL_EP_GPU_CHECK(gpu_stream_create_nonblocking(&stream));
    if (host_bytes > 0) {
      UCCL_EP_GPU_CHECK(gpu_host_alloc_mapped(&host, &host_on_device, host_bytes));
      std::memset(host, 0, host_bytes);
    }
    UCCL_EP_GPU_CHECK(gpu_device_alloc(&device, device_bytes));
    UCCL_EP_GPU_CHECK(gpu_memset_async(device, 0, device_bytes, stream));
  }
  ~ChannelRun() {
    if (stream != nullptr) (void)gpu_stream_destroy(stream);
    if (host != nullptr) (void)gpu_host_free(host);
    if (device != nullptr) (void)gpu_device_free(device);
  }
};

uint64_t timeout_ns(double timeout_s) { return static_cast<uint64_t>(timeout_s * 1e9); }

// "60", "0.5", "nan": seconds as a person writes them (std::to_string gives "60.000000"). snprintf,
// not a stream: a stream's locale machinery crashed inside this nvcc-built object.
std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", seconds);
  return text;
}

void check_latency_arguments(int64_t iterations, int64_t capacity, double timeout_s) {
  // Commands carry their sequence number in the 24-bit length field (stress_command).
  const int64_t max_iterations = static_cast<int64_t>(kMaxLengthUnits - 1 - kLatencyWarmup);
  if (iterations < 1 || iterations > max_iterations)
    throw std::invalid_argument("iterations must be in [1, " + std::to_string(max_iterations) + "], got " +
                                std::to_string(iterations));
  check_fifo_capacity(capacity);
  if (!std::isfinite(timeout_s) || timeout_s <= 0 || timeout_s > 86400)
    throw std::invalid_argument("timeout_s must be in (0, 86400] seconds, got " + seconds_text(timeout_s));
}

// The host's half of the ping-pong: takes each command, checks it, and acknowledges it by
// storing how many commands it has taken, until `expected` are taken or the deadline passes.
void answer_commands(const FifoView& fifo, uint64_t* ack, uint64_t expected,
                     std::chrono::steady_clock::time_point deadline, ChannelStressResult& counts) {
  FifoConsumer consumer(fifo);
  StressChecker checker(1);
  Command command;
  while (consumer.taken() < expected && std::chrono::steady_clock::now() < deadline) {
    if (!consumer.try_pop(command)) continue;
    host_store_release(ack, consumer.taken());
    checker.take(command);  // after the answer, so the check is not in the round trip
  }
  checker.merge_into(counts);
}

// Says what the latency kernel waited for in vain; empty if it completed.
std::string latency_error(const LatencyStatus& status, double timeout_s) {
  const std::string after = "the GPU gave up after " + seconds_text(timeout_s) + " s waiting for ";
  switch (status.failure) {
    case LatencyFailure::kNone:
      return "";
    case LatencyFailure::kNoFreeSlot:
      return after + "a free FIFO slot for command " + std::to_string(status.pushed) + " (the host had taken " +
             std::to_string(status.last_ack) + ")";
    case LatencyFailure::kNoAck:
      return after + "the host's acknowledgement " + std::to_string(status.pushed) + " of command " +
             std::to_string(status.pushed - 1) + " (the acknowledgement word read " +
             std::to_string(status.last_ack) + ")";
  }
  return "unknown latency kernel failure";
}

}  // namespace

ChannelStressResult run_gpu_channel_stress(uint32_t num_fifos, uint32_t blocks_per_fifo, uint32_t threads_per_block,
                                           uint64_t commands_per_thread, uint64_t capacity, double timeout_s) {
  if (num_fifos == 0 || blocks_per_fifo == 0 || threads_per_block == 0 || threads_per_block > 1024)
    throw std::invalid_argument("num_fifos, blocks_per_fifo and threads_per_block (<= 1024) must be positive");
  const uint64_t num_producers = uint64_t(num_fifos) * blocks_per_fifo * threads_per_block;
  check_stress_sizes(num_producers, commands_per_thread, capacity);

  // Device bytes: two counter lines.
  ChannelRun run;
  run.acquire(num_fifos, capacity, 0, 2 * kLine);
  auto* counters = static_cast<uint8_t*>(run.device);
  auto* device_pushed = reinterpret_cast<unsigned long long*>(counters);
  auto* device_timed_out = reinterpret_cast<unsigned int*>(counters + kLine);
  const FifoView* device_views = run.fifos->device_views();
  std::vector<FifoView> host_views;
  for (uint32_t f = 0; f < num_fifos; ++f) host_views.push_back(run.fifos->host_view(static_cast<int>(f)));

  ChannelStressResult result;
  result.expected = num_producers * commands_per_thread;
  result.capacity = capacity;
  result.num_fifos = num_fifos;
  const uint64_t per_fifo = result.expected / num_fifos;
  const auto deadline = deadline_after(timeout_s);
  std::vector<StressChecker> checkers(num_fifos, StressChecker(static_cast<uint32_t>(num_producers)));
  std::vector<std::thread> consumers;
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t f = 0; f < num_fifos; ++f) {
    consumers.emplace_back([&, f] {
      FifoConsumer consumer(host_views[f]);
      Command command;
      while (consumer.taken() < per_fifo && std::chrono::steady_clock::now() < deadline) {
        if (consumer.try_pop(command)) checkers[f].take(command);
      }
    });
  }
  channel_stress_push_kernel<<<num_fifos * blocks_per_fifo, threads_per_block, 0, run.stream>>>(
      device_views, blocks_per_fifo, commands_per_thread, timeout_ns(timeout_s), device_pushed, device_timed_out);
  const gpuError_t launch = gpu_last_error();
  for (auto& t : consumers) t.join();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  UCCL_EP_GPU_CHECK(launch);
  UCCL_EP_GPU_CHECK(gpu_stream_synchronize(run.stream));
  unsigned long long pushed = 0;
  UCCL_EP_GPU_CHECK(gpu_copy(&pushed, device_pushed, sizeof(pushed)));
  result.pushed = pushed;
  for (const auto& checker : checkers) checker.merge_into(result);
  result.lost = result.expected - result.popped;
  return result;
}

ChannelLatencyResult run_gpu_channel_latency(int64_t iterations, int64_t capacity, double timeout_s) {
  check_latency_arguments(iterations, capacity, timeout_s);
  const uint64_t timed = static_cast<uint64_t>(iterations);
  const uint64_t slots = static_cast<uint64_t>(capacity);

  // Host bytes: the acknowledgement line. Device bytes: the status line, then the samples.
  ChannelRun run;
  run.acquire(1, slots, kLine, kLine + timed * sizeof(uint64_t));
  auto* host_ack = static_cast<uint64_t*>(run.host);
  auto* device_ack = static_cast<const uint64_t*>(run.host_on_device);
  auto* device_status = static_cast<LatencyStatus*>(run.device);
  auto* device_samples = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(run.device) + kLine);

  ChannelLatencyResult result;
  result.warmup = kLatencyWarmup;
  result.iterations = timed;
  result.commands.expected = kLatencyWarmup + timed;
  result.commands.capacity = slots;
  result.commands.num_fifos = 1;
  const auto deadline = deadline_after(timeout_s);
  const auto start = std::chrono::steady_clock::now();
  channel_latency_kernel<<<1, 1, 0, run.stream>>>(run.fifos->device_view(0), device_ack, kLatencyWarmup,
                                                  timed, timeout_ns(timeout_s), device_samples, device_status);
  UCCL_EP_GPU_CHECK(gpu_last_error());  // nothing runs if the launch failed: no answers are awaited
  answer_commands(run.fifos->host_view(0), host_ack, result.commands.expected, deadline, result.commands);
  result.commands.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  UCCL_EP_GPU_CHECK(gpu_stream_synchronize(run.stream));

  LatencyStatus status;
  UCCL_EP_GPU_CHECK(gpu_copy(&status, device_status, sizeof(status)));
  result.commands.pushed = status.pushed;
  result.commands.lost = result.commands.expected - result.commands.popped;
  result.loop_ns = status.loop_ns;
  result.error = latency_error(status, timeout_s);
  const uint64_t completed = status.answered > kLatencyWarmup ? status.answered - kLatencyWarmup : 0;
  result.round_trip_ns.resize(completed);
  if (completed > 0)
    UCCL_EP_GPU_CHECK(gpu_copy(result.round_trip_ns.data(), device_samples, completed * sizeof(uint64_t)));
  return result;
}

}  // namespace uccl_ep
