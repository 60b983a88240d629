#include "channel/stress.h"

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "channel/fifo.h"
#include "channel/fifo_host.h"

namespace uccl_ep {

void check_stress_sizes(uint64_t num_producers, uint64_t commands_per_producer, uint64_t capacity) {
  if (num_producers == 0 || num_producers > kMaxCounterIndex)
    throw std::invalid_argument("num_producers must be in [1, " + std::to_string(kMaxCounterIndex) + "]");
  if (commands_per_producer == 0 || commands_per_producer >= kMaxLengthUnits)
    throw std::invalid_argument("commands per producer must be in [1, " + std::to_string(kMaxLengthUnits) + ")");
  check_fifo_capacity(static_cast<int64_t>(capacity));
}

ChannelStressResult run_host_channel_stress(uint32_t num_producers, uint64_t commands_per_producer,
                                            uint64_t capacity, double timeout_s) {
  check_stress_sizes(num_producers, commands_per_producer, capacity);
  std::vector<Command> slots(capacity, Command{0, 0});
  alignas(64) uint64_t tail = 0;
  alignas(64) uint64_t head = 0;
  const FifoView fifo{slots.data(), &tail, &head, capacity};
  const auto deadline = deadline_after(timeout_s);

  ChannelStressResult result;
  result.expected = num_producers * commands_per_producer;
  result.capacity = capacity;
  result.num_fifos = 1;
  std::vector<uint64_t> pushed(num_producers, 0);
  FifoConsumer consumer(fifo);
  StressChecker checker(num_producers);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> producers;
  for (uint32_t p = 0; p < num_producers; ++p) {
    producers.emplace_back([&, p] {
      HostFifoOps ops(deadline);
      for (uint64_t seq = 0; seq < commands_per_producer; ++seq) {
        if (fifo_push(fifo, stress_command(p, seq), ops) != PushResult::kPushed) return;
        ++pushed[p];
      }
    });
  }
  Command command;
  while (consumer.taken() < result.expected && std::chrono::steady_clock::now() < deadline) {
    if (consumer.try_pop(command)) {
      checker.take(command);
    } else {
      std::this_thread::yield();  // producers may outnumber the cores
    }
  }
  for (auto& t : producers) t.join();
  // Producers that timed out claimed tickets they never filled; nothing more will arrive.
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (uint64_t n : pushed) result.pushed += n;
  checker.merge_into(result);
  result.lost = result.expected - result.popped;
  return result;
}

}  // namespace uccl_ep
