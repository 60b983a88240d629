// The staging pieces of tcp_staging.h that need no GPU: the chunk pool, the per-connection FIFO,
// and the host-memory StagedRegion of the tests.
#include "transport/tcp_staging.h"

#include <algorithm>
#include <cstring>

namespace uccl_ep {

void ChunkPool::reset(uint8_t* base, uint64_t bytes, uint64_t chunk_bytes) {
  chunk_bytes_ = chunk_bytes;
  chunks_ = static_cast<size_t>(bytes / chunk_bytes);
  free_.clear();
  for (size_t i = 0; i < chunks_; ++i) free_.push_back(base + i * chunk_bytes);
}

uint8_t* ChunkPool::take() {
  if (free_.empty()) return nullptr;
  uint8_t* chunk = free_.back();
  free_.pop_back();
  return chunk;
}

std::pair<uint8_t*, uint64_t> StagingFifo::room(ChunkPool& pool, size_t max_chunks) {
  const uint64_t size = pool.chunk_bytes();
  if (!chunks_.empty()) {
    const uint64_t used = end_ - begin_ - (chunks_.size() - 1) * size;  // of the last chunk
    if (used < size) return {chunks_.back() + used, size - used};
  }
  if (chunks_.size() >= max_chunks) return {nullptr, 0};
  uint8_t* chunk = pool.take();
  if (chunk == nullptr) return {nullptr, 0};
  if (chunks_.empty()) begin_ = end_;
  chunks_.push_back(chunk);
  return {chunk, size};
}

void StagingFifo::gather(const ChunkPool& pool, uint64_t from, uint64_t to, iovec* iov, size_t& count,
                         size_t max) const {
  const uint64_t size = pool.chunk_bytes();
  while (from < to && count < max) {
    const uint64_t index = (from - begin_) / size;
    const uint64_t offset = (from - begin_) % size;
    const uint64_t n = std::min(size - offset, to - from);
    iov[count++] = {chunks_[static_cast<size_t>(index)] + offset, static_cast<size_t>(n)};
    from += n;
  }
}

void StagingFifo::release_before(uint64_t position, ChunkPool& pool) {
  if (position >= end_) {  // all sent: a partly filled last chunk goes back too
    for (uint8_t* chunk : chunks_) pool.give(chunk);
    chunks_.clear();
    begin_ = end_;
    return;
  }
  const uint64_t size = pool.chunk_bytes();
  while (!chunks_.empty() && begin_ + size <= position) {
    pool.give(chunks_.front());
    chunks_.pop_front();
    begin_ += size;
  }
}

namespace {

class HostStagedRegion final : public StagedRegion {
 public:
  HostStagedRegion(MemoryRegion region, uint64_t staging_bytes) : staging_(staging_bytes), writer_(region) {}

  uint8_t* staging() override { return staging_.data(); }
  RegionWriter& writer() override { return writer_; }

  std::string stage(uint8_t* staged, const uint8_t* source, uint64_t bytes) override {
    std::memcpy(staged, source, bytes);
    return {};
  }
  std::string wait_staged() override { return {}; }

  std::string land(uint8_t* dest, const uint8_t* staged, uint64_t bytes) override {
    std::memcpy(dest, staged, bytes);
    return {};
  }
  std::string add(uint8_t* target, int64_t value) override {
    __atomic_fetch_add(reinterpret_cast<int64_t*>(target), value, __ATOMIC_ACQ_REL);
    return {};
  }
  std::string wait_landed() override { return {}; }

  std::string copy_local(uint8_t* dest, const uint8_t* source, uint64_t bytes) override {
    std::memmove(dest, source, bytes);
    return {};
  }
  std::string add_local(uint8_t* target, int64_t value) override { return add(target, value); }

  void release() override { std::vector<uint8_t>().swap(staging_); }

 private:
  std::vector<uint8_t> staging_;
  HostRegionWriter writer_;
};

}  // namespace

std::unique_ptr<StagedRegion> make_host_staged_region(MemoryRegion region, uint64_t staging_bytes) {
  return std::make_unique<HostStagedRegion>(region, staging_bytes);
}

}  // namespace uccl_ep
