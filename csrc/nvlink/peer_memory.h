// Device memory that the ranks of one host map into each other's address space with CUDA
// IPC, so kernels store straight into a peer's buffer over NVLink (no NVSHMEM).
//
// Each rank allocates its buffer, hands ipc_handle() to the others (the Python side moves
// the bytes through the Buffer's process group), and calls open_peers() with every rank's
// handle. peer_bases() is then a device array of each rank's buffer base as seen from here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/portability.h"

namespace uccl_ep {

class PeerMemory {
 public:
  // Allocates `num_bytes` (zeroed) on `device`.
  PeerMemory(int64_t num_bytes, int device);
  ~PeerMemory();
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;

  std::string ipc_handle() const;  // opaque bytes, valid in other processes of this host
  // Maps every other rank's buffer; handles[rank] must be this buffer's own handle. An empty handle
  // leaves that rank unmapped (another host: its base reads 0 in peer_bases()).
  void open_peers(const std::vector<std::string>& handles, int rank);
  // Unmaps the peers and frees the buffer; later calls do nothing.
  void release();

  std::uintptr_t local_base() const { return reinterpret_cast<std::uintptr_t>(base_); }
  std::uintptr_t peer_bases() const { return reinterpret_cast<std::uintptr_t>(peer_bases_device_); }
  // Host-side: `rank`'s buffer as mapped into this process (our own base for this rank).
  // Throws std::runtime_error before open_peers(), std::invalid_argument for a rank it did not map
  // (out of range, or left unmapped).
  std::uintptr_t peer_base(int rank) const;
  int64_t num_bytes() const { return num_bytes_; }
  int device() const { return device_; }
  std::string pci_bus_id() const;

 private:
  int64_t num_bytes_;
  int device_;
  void* base_ = nullptr;
  std::vector<void*> opened_;  // peers' mappings, null for this rank and unmapped ones
  std::vector<uint64_t> bases_;  // what peer_bases() holds: every rank's base here, 0 where unmapped
  uint64_t* peer_bases_device_ = nullptr;
};

}  // namespace uccl_ep
