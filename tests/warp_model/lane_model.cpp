// Runs the kernels' warp collectives and lane maps (csrc/kernels/lanes.h) on the host, every lane a
// thread, with 32 or 64 lanes: what an NVIDIA warp and a CDNA wavefront do, without either GPU.
// tests/test_lanes.py builds it, sends a case per line on stdin and checks each answer line:
//
//   inclusive_sum LANES v0 .. v{LANES-1}      -> each lane's inclusive sum
//   total LANES v0 ..                         -> each lane's warp total
//   compact LANES p0 .. p{LANES-1} i0 ..      -> the count, then each lane's item (-1: none)
//   groups LANES GROUP_THREADS GROUPS_PER_BLOCK NUM_BLOCKS
//                                             -> index thread warp lane first stride, per block and thread
//   warps LANES BLOCK_THREADS NUM_BLOCKS      -> lane first stride, per block and thread
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

// Lanes meet at every collective: each publishes its value, all wait, each reads what it asked
// for, all wait again before the slots are reused.
template <int kLaneCount>
class LaneModel {
 public:
  struct Warp {
    static constexpr int kLanes = kLaneCount;
    using Mask = std::conditional_t<(kLaneCount > 32), uint64_t, uint32_t>;
    LaneModel* model;
    int index;

    int lane() const { return index; }
    template <typename T>
    T shuffle(T value, int src) const { return model->exchange(index, value, src % kLanes); }
    template <typename T>
    T shuffle_up(T value, int delta) const { return model->exchange(index, value, index >= delta ? index - delta : index); }
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

  // Calls body(warp) on every lane, each in its own thread, and waits for all of them.
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
    meet();
    T seen;
    std::memcpy(&seen, &slots_[src], sizeof(T));
    meet();
    return seen;
  }

  void meet() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == kLaneCount) {
      arrived_ = 0;
      ++generation_;
      all_arrived_.notify_all();
      return;
    }
    all_arrived_.wait(lock, [&] { return generation_ != generation; });
  }

  uint64_t slots_[kLaneCount] = {};
  std::mutex mutex_;
  std::condition_variable all_arrived_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

std::vector<int64_t> read_values(std::istringstream& in, int count) {
  std::vector<int64_t> values(count);
  for (int64_t& v : values) in >> v;
  if (!in) throw std::runtime_error("expected " + std::to_string(count) + " values");
  return values;
}

template <int kLanes>
std::string warp_case(const std::string& what, std::istringstream& in) {
  LaneModel<kLanes> model;
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
