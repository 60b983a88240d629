#include "nvlink/peer_memory.h"

#include <cstring>
#include <stdexcept>

namespace uccl_ep {
namespace {

// The runtime of this extension keeps its own current device: make it the buffer's.
void use_device(int device) { UCCL_EP_GPU_CHECK(gpu_set_device(device)); }

}  // namespace

PeerMemory::PeerMemory(int64_t num_bytes, int device) : num_bytes_(num_bytes), device_(device) {
  if (num_bytes <= 0) throw std::invalid_argument("PeerMemory: num_bytes must be positive");
  use_device(device);
  UCCL_EP_GPU_CHECK(gpu_device_alloc(&base_, static_cast<size_t>(num_bytes)));
  // Zeroed before any peer can see it: a flag left from an earlier allocation must not
  // look like a current one.
  UCCL_EP_GPU_CHECK(gpu_memset(base_, 0, static_cast<size_t>(num_bytes)));
  UCCL_EP_GPU_CHECK(gpu_device_synchronize());
}

PeerMemory::~PeerMemory() {
  try {
    release();
  } catch (...) {
    // Destructors must not throw; release() already freed what it could.
  }
}

std::string PeerMemory::ipc_handle() const {
  if (base_ == nullptr) throw std::runtime_error("PeerMemory: the buffer was released");
  gpuIpcMemHandle_t handle;
  UCCL_EP_GPU_CHECK(gpu_ipc_get_handle(&handle, base_));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

std::string PeerMemory::pci_bus_id() const {
  char id[64] = {0};
  UCCL_EP_GPU_CHECK(gpu_device_pci_bus_id(id, sizeof(id), device_));
  return std::string(id);
}

void PeerMemory::open_peers(const std::vector<std::string>& handles, int rank) {
  if (base_ == nullptr) throw std::runtime_error("PeerMemory: the buffer was released");
  if (!opened_.empty()) throw std::runtime_error("PeerMemory: open_peers was already called");
  if (rank < 0 || rank >= static_cast<int>(handles.size())) {
    throw std::invalid_argument("PeerMemory.open_peers: rank out of range of handles");
  }
  use_device(device_);
  bases_.assign(handles.size(), 0);
  opened_.assign(handles.size(), nullptr);
  try {
    for (size_t peer = 0; peer < handles.size(); ++peer) {
      if (static_cast<int>(peer) == rank) {
        bases_[peer] = reinterpret_cast<uint64_t>(base_);
        continue;
      }
      if (handles[peer].empty()) continue;  // another host's: reached through the proxy
      if (handles[peer].size() != sizeof(gpuIpcMemHandle_t)) {
        throw std::invalid_argument("PeerMemory.open_peers: handle of rank " + std::to_string(peer) + " has " +
                                    std::to_string(handles[peer].size()) + " bytes, expected " +
                                    std::to_string(sizeof(gpuIpcMemHandle_t)));
      }
      gpuIpcMemHandle_t handle;
      std::memcpy(&handle, handles[peer].data(), sizeof(handle));
      UCCL_EP_GPU_CHECK(gpu_ipc_open_handle(&opened_[peer], handle));
      bases_[peer] = reinterpret_cast<uint64_t>(opened_[peer]);
    }
    const size_t bytes = bases_.size() * sizeof(uint64_t);
    UCCL_EP_GPU_CHECK(gpu_device_alloc(reinterpret_cast<void**>(&peer_bases_device_), bytes));
    UCCL_EP_GPU_CHECK(gpu_copy(peer_bases_device_, bases_.data(), bytes));
  } catch (...) {
    release();
    throw;
  }
}

std::uintptr_t PeerMemory::peer_base(int rank) const {
  if (opened_.empty()) throw std::runtime_error("PeerMemory: open_peers was not called (or the buffer was released)");
  if (rank < 0 || rank >= static_cast<int>(opened_.size())) {
    throw std::invalid_argument("PeerMemory.peer_base: rank " + std::to_string(rank) + " is not in [0, " +
                                std::to_string(opened_.size()) + "), the ranks open_peers mapped");
  }
  if (bases_[rank] == 0) {
    throw std::invalid_argument("PeerMemory.peer_base: rank " + std::to_string(rank) + " was left unmapped (on "
                                "another host)");
  }
  return static_cast<std::uintptr_t>(bases_[rank]);
}

void PeerMemory::release() {
  if (base_ == nullptr && opened_.empty()) return;
  use_device(device_);
  // Kernels that still use the mappings must be done before they go.
  gpuError_t first = gpu_device_synchronize();
  for (void* mapping : opened_) {
    if (mapping == nullptr) continue;
    const gpuError_t status = gpu_ipc_close_handle(mapping);
    if (first == kGpuSuccess) first = status;
  }
  opened_.clear();
  bases_.clear();
  if (peer_bases_device_ != nullptr) (void)gpu_device_free(peer_bases_device_);
  peer_bases_device_ = nullptr;
  if (base_ != nullptr) {
    const gpuError_t status = gpu_device_free(base_);
    if (first == kGpuSuccess) first = status;
  }
  base_ = nullptr;
  UCCL_EP_GPU_CHECK(first);
}

}  // namespace uccl_ep
