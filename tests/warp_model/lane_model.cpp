// Runs the kernels' warp and block collectives and lane maps (csrc/kernels/lanes.h) on the host, every
// lane a thread, with 32 or 64 lanes: what an NVIDIA warp and a CDNA wavefront do, without either GPU.
// tests/test_lanes.py builds it, sends a case per line on stdin and checks each answer line:
//
//   inclusive_sum LANES v0 .. v{LANES-1}      -> each lane's inclusive sum
//   total LANES v0 ..                         -> each lane's warp total
//   compact LANES p0 .. p{LANES-1} i0 ..      -> the count, then each lane's item (-1: none)
//   groups LANES GROUP_THREADS GROUPS_PER_BLOCK NUM_BLOCKS
//                                             -> index thread warp lane first stride, per block and thread
//   warps LANES BLOCK_THREADS NUM_BLOCKS      -> lane first stride, per block and thread
//   block_sum LANES THREADS v0 .. v{THREADS-1}
//                                             -> per thread: its exclusive block sum, the block's total
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels/lanes.h"

namespace {

// A barrier of `count` host threads, reusable.
class Meeting {
 public:
  explicit Meeting(int count) : count_(count) {}
  void meet() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      all_arrived_.notify_all();
      return;
    }
    all_arrived_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  const int count_;
  std::mutex mutex_;
  std::condition_variable all_arrived_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

// One warp's lanes meet at every collective: each publishes its value, all wait, each reads what it
// asked for, all wait again before the slots are reused.
template <int kLaneCount>
class WarpModel {
 public:
  struct Warp {
    static constexpr int kLanes = kLaneCount;
    using Mask = std::conditional_t<(kLaneCount > 32), uint64_t, uint32_t>;
    WarpModel* model;
    int index;

    int lane() const { return index; }
    template <typename T>
    T shuffle(T value, int src) const { return model->exchange(index, value, src % kLanes); }
    template <typename T>
    T shuffle_up(T value, int delta) const {
      return model->exchange(index, value, index >= delta ? index - delta : index);
    }
    template <typename T>
    T shuffle_xor(T value, int mask) const { return model->exchange(index, value, (index ^ mask) % kLanes); }
    Mask ballot(bool predicate) const {
      Mask mask = 0;
      for (int l = 0; l < kLanes; ++l) {
        if (model->exchange(index, predicate, l)) mask |= Mask{1} << l;
      }
      return mask;
    }
    int lowest(Mask mask) const { return __builtin_ctzll(static_cast<unsigned long long>(mask)); }
  };

  // Calls body(warp) on every lane of one warp, each in its own thread, and waits for all of them.
  template <typename Body>
  void run(Body body) {
    std::vector<std::thread> lanes;
    for (int l = 0; l < kLaneCount; ++l) lanes.emplace_back([this, l, &body] { body(Warp{this, l}); });
    for (std::thread& t : lanes) t.join();
  }

 private:
  template <typename T>
  T exchange(int lane, T value, int src) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t), "one word per lane");
    uint64_t word = 0;
    std::memcpy(&word, &value, sizeof(T));
    slots_[lane] = word;
    lanes_.meet();
    T seen;
    std::memcpy(&seen, &slots_[src], sizeof(T));
    lanes_.meet();
    return seen;
  }

  uint64_t slots_[kLaneCount] = {};
  Meeting lanes_{kLaneCount};
};

// A block of `threads` (whole warps): each thread's warp meets its own lanes, sync() meets the block.
template <int kLanes>
class BlockModel {
 public:
  struct Block {
    BlockModel* model;
    int index;
    typename WarpModel<kLanes>::Warp warp() const { return {&model->warps_[index / kLanes], index % kLanes}; }
    int thread() const { return index; }
    int threads() const { return model->threads_; }
    void sync() const { model->block_.meet(); }
  };

  explicit BlockModel(int threads) : threads_(threads), warps_(threads / kLanes), block_(threads) {}

  template <typename Body>
  void run(Body body) {
    std::vector<std::thread> threads;
    for (int t = 0; t < threads_; ++t) threads.emplace_back([this, t, &body] { body(Block{this, t}); });
    for (std::thread& t : threads) t.join();
  }

 private:
  const int threads_;
  std::vector<WarpModel<kLanes>> warps_;
  Meeting block_;
};

std::vector<int64_t> read_values(std::istringstream& in, int count) {
  std::vector<int64_t> values(count);
  for (int64_t& v : values) in >> v;
  if (!in) throw std::runtime_error("expected " + std::to_string(count) + " values");
  return values;
}

template <int kLanes>
std::string block_case(std::istringstream& in) {
  int threads = 0;
  in >> threads;
  if (threads < kLanes || threads % kLanes != 0 || threads / kLanes > kLanes) {
    throw std::runtime_error("threads must be whole warps, at most a warp's worth of them");
  }
  const std::vector<int64_t> values = read_values(in, threads);
  std::vector<int64_t> before(threads), totals(threads);
  std::vector<int64_t> warp_totals(threads / kLanes, -7);   // poisoned
  BlockModel<kLanes> model(threads);
  model.run([&](auto block) {
    int64_t total = -1;
    before[block.thread()] = uccl_ep::block_exclusive_sum(block, values[block.thread()], warp_totals.data(), total);
    totals[block.thread()] = total;
  });
  std::ostringstream answer;
  for (int t = 0; t < threads; ++t) answer << before[t] << ' ' << totals[t] << ' ';
  return answer.str();
}

template <int kLanes>
std::string warp_case(const std::string& what, std::istringstream& in) {
  WarpModel<kLanes> model;
  std::vector<int64_t> out(kLanes);
  std::ostringstream answer;
  if (what == "inclusive_sum" || what == "total") {
    const std::vector<int64_t> values = read_values(in, kLanes);
    model.run([&](auto warp) {
      const int64_t v = values[warp.lane()];
      out[warp.lane()] = what == "total" ? uccl_ep::warp_total(warp, v) : uccl_ep::warp_inclusive_sum(warp, v);
    });
  } else if (what == "compact") {
    const std::vector<int64_t> present = read_values(in, kLanes);
    const std::vector<int64_t> items = read_values(in, kLanes);
    std::vector<int> counts(kLanes);
    model.run([&](auto warp) {
      int64_t mine = -1;
      counts[warp.lane()] = uccl_ep::warp_compact(warp, present[warp.lane()] != 0, items[warp.lane()], mine);
      out[warp.lane()] = mine;
    });
    for (int c : counts) {
      if (c != counts[0]) throw std::runtime_error("lanes disagree on the count");
    }
    answer << counts[0] << ' ';
  } else {
    throw std::runtime_error("unknown case " + what);
  }
  for (int64_t v : out) answer << v << ' ';
  return answer.str();
}

std::string map_case(const std::string& what, int lanes, std::istringstream& in) {
  std::ostringstream answer;
  if (what == "groups") {
    int group_threads = 0, groups_per_block = 0, num_blocks = 0;
    in >> group_threads >> groups_per_block >> num_blocks;
    for (int block = 0; block < num_blocks; ++block) {
      for (int thread = 0; thread < group_threads * groups_per_block; ++thread) {
        const uccl_ep::GroupPosition g =
            uccl_ep::group_position_of(thread, block, num_blocks, lanes, group_threads, groups_per_block);
        answer << g.index << ' ' << g.thread << ' ' << g.warp << ' ' << g.lane << ' ' << g.first << ' ' << g.stride
               << ' ';
      }
    }
  } else {
    int block_threads = 0, num_blocks = 0;
    in >> block_threads >> num_blocks;
    for (int block = 0; block < num_blocks; ++block) {
      for (int thread = 0; thread < block_threads; ++thread) {
        const uccl_ep::WarpPosition w = uccl_ep::warp_position_of(thread, block, num_blocks, block_threads, lanes);
        answer << w.lane << ' ' << w.first << ' ' << w.stride << ' ';
      }
    }
  }
  return answer.str();
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string what;
    int lanes = 0;
    in >> what >> lanes;
    try {
      if (what == "groups" || what == "warps") {
        std::cout << map_case(what, lanes, in) << std::endl;
      } else if (what == "block_sum") {
        std::cout << (lanes == 32 ? block_case<32>(in) : lanes == 64 ? block_case<64>(in) : "error lanes") << std::endl;
      } else if (lanes == 32) {
        std::cout << warp_case<32>(what, in) << std::endl;
      } else if (lanes == 64) {
        std::cout << warp_case<64>(what, in) << std::endl;
      } else {
        throw std::runtime_error("lanes must be 32 or 64");
      }
    } catch (const std::exception& error) {
      std::cout << "error " << error.what() << std::endl;
    }
  }
  return 0;
}
