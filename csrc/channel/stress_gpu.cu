// GPU producers for the channel stress run (see stress.h).
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "channel/fifo.h"
#include "channel/fifo_device.cuh"
#include "channel/stress.h"

namespace uccl_ep {
namespace {

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

// Pinned host and device allocations released on every path.
struct GpuStressMemory {
  void* host = nullptr;    // slots of every FIFO, then one 64-byte tail line per FIFO
  void* device = nullptr;  // one 64-byte head line per FIFO, the views, and two counters
  ~GpuStressMemory() {
    if (host != nullptr) cudaFreeHost(host);
    if (device != nullptr) cudaFree(device);
  }
};

constexpr size_t kLine = 64;

}  // namespace

ChannelStressResult run_gpu_channel_stress(uint32_t num_fifos, uint32_t blocks_per_fifo, uint32_t threads_per_block,
                                           uint64_t commands_per_thread, uint64_t capacity, double timeout_s) {
  if (num_fifos == 0 || blocks_per_fifo == 0 || threads_per_block == 0 || threads_per_block > 1024)
    throw std::invalid_argument("num_fifos, blocks_per_fifo and threads_per_block (<= 1024) must be positive");
  const uint64_t num_producers = uint64_t(num_fifos) * blocks_per_fifo * threads_per_block;
  check_stress_sizes(num_producers, commands_per_thread, capacity);

  GpuStressMemory memory;
  const size_t slot_bytes = size_t(num_fifos) * capacity * sizeof(Command);
  UCCL_EP_GPU_CHECK(cudaHostAlloc(&memory.host, slot_bytes + num_fifos * kLine, cudaHostAllocMapped));
  std::memset(memory.host, 0, slot_bytes + num_fifos * kLine);
  const size_t device_bytes = num_fifos * kLine + num_fifos * sizeof(FifoView) + 2 * kLine;
  UCCL_EP_GPU_CHECK(cudaMalloc(&memory.device, device_bytes));
  UCCL_EP_GPU_CHECK(cudaMemset(memory.device, 0, device_bytes));
  void* host_on_device = nullptr;
  UCCL_EP_GPU_CHECK(cudaHostGetDevicePointer(&host_on_device, memory.host, 0));

  auto* host_slots = static_cast<Command*>(memory.host);
  auto* host_tails = reinterpret_cast<uint8_t*>(memory.host) + slot_bytes;
  auto* device_slots = static_cast<Command*>(host_on_device);
  auto* device_tails = static_cast<uint8_t*>(host_on_device) + slot_bytes;
  auto* device_heads = static_cast<uint8_t*>(memory.device);
  auto* device_views = reinterpret_cast<FifoView*>(device_heads + num_fifos * kLine);
  auto* counters = reinterpret_cast<uint8_t*>(device_views + num_fifos);
  auto* device_pushed = reinterpret_cast<unsigned long long*>(counters);
  auto* device_timed_out = reinterpret_cast<unsigned int*>(counters + kLine);

  std::vector<FifoView> host_views, views_for_device;
  for (uint32_t f = 0; f < num_fifos; ++f) {
    host_views.push_back({host_slots + f * capacity, reinterpret_cast<uint64_t*>(host_tails + f * kLine), nullptr, capacity});
    views_for_device.push_back({device_slots + f * capacity, reinterpret_cast<uint64_t*>(device_tails + f * kLine),
                                reinterpret_cast<uint64_t*>(device_heads + f * kLine), capacity});
  }
  UCCL_EP_GPU_CHECK(cudaMemcpy(device_views, views_for_device.data(), num_fifos * sizeof(FifoView),
                               cudaMemcpyHostToDevice));

  ChannelStressResult result;
  result.expected = num_producers * commands_per_thread;
  result.capacity = capacity;
  result.num_fifos = num_fifos;
  const uint64_t per_fifo = result.expected / num_fifos;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  std::vector<StressChecker> checkers(num_fifos, StressChecker(static_cast<uint32_t>(num_producers)));
  std::vector<std::thread> consumers;
  cudaStream_t stream;
  UCCL_EP_GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
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
  channel_stress_push_kernel<<<num_fifos * blocks_per_fifo, threads_per_block, 0, stream>>>(
      device_views, blocks_per_fifo, commands_per_thread, static_cast<uint64_t>(timeout_s * 1e9), device_pushed,
      device_timed_out);
  const cudaError_t launch = cudaGetLastError();
  for (auto& t : consumers) t.join();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const cudaError_t finished = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  UCCL_EP_GPU_CHECK(launch);
  UCCL_EP_GPU_CHECK(finished);
  unsigned long long pushed = 0;
  UCCL_EP_GPU_CHECK(cudaMemcpy(&pushed, device_pushed, sizeof(pushed), cudaMemcpyDeviceToHost));
  result.pushed = pushed;
  for (const auto& checker : checkers) checker.merge_into(result);
  result.lost = result.expected - result.popped;
  return result;
}

}  // namespace uccl_ep
