// How the verbs transport's region becomes memory the NIC may read and write (an ibv_mr):
//
//   host memory   ibv_reg_mr (the pages are pinned: `ulimit -l` must allow the region).
//   GPU memory    DMA-BUF first: the GPU driver exports the range as a dma-buf file and
//                 ibv_reg_dmabuf_mr registers it (CUDA 11.7+ with the open kernel modules, Linux 5.12+,
//                 rdma-core 34+, a NIC driver that takes dma-bufs). Else peer memory: ibv_reg_mr on the
//                 device pointer, which works where a peer-memory module lets the NIC driver pin GPU pages
//                 (nvidia_peermem; efa_nv_peermem on EFA; amdgpu's peer-memory client on AMD).
#pragma once

#if defined(UCCL_EP_WITH_VERBS)
#include <infiniband/verbs.h>

#include <string>

#include "transport/transport.h"
#include "transport/verbs_library.h"

namespace uccl_ep {

struct RegisteredRegion {
  ibv_mr* mr = nullptr;
  const char* method = "";  // "host memory", "DMA-BUF" or "peer memory"
};

// Registers `region` (memory of GPU `gpu`, or host memory where gpu < 0) with `access`. Throws
// TransportError beginning with `who` that names every way tried, why each failed and what to do.
RegisteredRegion register_region(const VerbsLibrary& ibv, ibv_pd* pd, MemoryRegion region, int access, int gpu,
                                 const std::string& who);

// Why `bytes` of GPU memory could not be registered, and what to do: `dmabuf` says how the DMA-BUF
// way ended, `peer_errno` is ibv_reg_mr's errno on the device pointer.
std::string gpu_registration_failure(uint64_t bytes, const std::string& dmabuf, int peer_errno);

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
