#if defined(UCCL_EP_WITH_VERBS)
#include "transport/verbs_registration.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "common/portability.h"
#if defined(UCCL_EP_GPU_RUNTIME)
#include "transport/device_region_ops.h"
#endif

namespace uccl_ep {

#if defined(UCCL_EP_GPU_RUNTIME)
namespace {

// The DMA-BUF way: the whole pages around the region are exported, the region registered inside them.
// Returns null and says why in `outcome` where it is not available or fails.
ibv_mr* register_dmabuf(const VerbsLibrary& ibv, ibv_pd* pd, MemoryRegion region, int access, int gpu,
                        std::string& outcome) {
  if (ibv.reg_dmabuf_mr == nullptr) {
    outcome = "libibverbs has no ibv_reg_dmabuf_mr (rdma-core before 34)";
    return nullptr;
  }
  const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const auto address = reinterpret_cast<uint64_t>(region.base);
  const uint64_t first = address / page * page;
  const uint64_t end = (address + region.bytes + page - 1) / page * page;
  const int fd = gpu_dmabuf_fd(reinterpret_cast<void*>(first), end - first, gpu, &outcome);
  if (fd < 0) return nullptr;
  ibv_mr* mr = ibv.reg_dmabuf_mr(pd, address - first, region.bytes, address, fd, access);
  const int error = errno;
  (void)::close(fd);  // the registration holds the dma-buf itself
  if (mr == nullptr) outcome = "ibv_reg_dmabuf_mr failed: " + errno_text(error);
  return mr;
}

}  // namespace
#endif

std::string gpu_registration_failure(uint64_t bytes, const std::string& dmabuf, int peer_errno) {
  std::string message = "registering the region (" + std::to_string(bytes) + " bytes of GPU memory) failed. DMA-BUF: " +
                        dmabuf + ". Peer memory (ibv_reg_mr on the device pointer): " + errno_text(peer_errno) + ". ";
  if (peer_errno == EINVAL || peer_errno == EFAULT || peer_errno == EOPNOTSUPP) {
    message += "The NIC driver cannot reach GPU memory: load the peer-memory module (nvidia_peermem for NVIDIA GPUs, "
               "efa_nv_peermem on AWS EFA, ib_peer_mem / amdgpu's peer memory for AMD GPUs), or use DMA-BUF (CUDA "
               "11.7+ with the open kernel modules, Linux 5.12+, rdma-core 34+)";
  } else if (peer_errno == ENOMEM) {
    message += "The pages could not be pinned: raise `ulimit -l` (locked memory) or register a smaller Buffer";
  } else {
    message += "Check that the GPU and the NIC share a PCIe root that allows peer-to-peer traffic";
  }
  return message + "; or choose UCCL_EP_PROXY_TRANSPORT=tcp";
}

RegisteredRegion register_region(const VerbsLibrary& ibv, ibv_pd* pd, MemoryRegion region, int access, int gpu,
                                 const std::string& who) {
  if (gpu < 0) {
    ibv_mr* mr = ibv.reg_mr(pd, region.base, region.bytes, access);
    if (mr == nullptr) {
      throw TransportError(who + ": registering the region (" + std::to_string(region.bytes) +
                           " bytes of host memory) failed: " + errno_text(errno) +
                           " (check `ulimit -l`: the memory is pinned)");
    }
    return RegisteredRegion{mr, "host memory"};
  }
#if defined(UCCL_EP_GPU_RUNTIME)
  std::string dmabuf;
  {
    ScopedDevice current(gpu);  // checked by the transport already
    if (ibv_mr* mr = register_dmabuf(ibv, pd, region, access, gpu, dmabuf)) return RegisteredRegion{mr, "DMA-BUF"};
  }
  ibv_mr* mr = ibv.reg_mr(pd, region.base, region.bytes, access);
  if (mr == nullptr) throw TransportError(who + ": " + gpu_registration_failure(region.bytes, dmabuf, errno));
  return RegisteredRegion{mr, "peer memory"};
#else
  (void)who;
  throw std::invalid_argument("gpu=" + std::to_string(gpu) + ": this build has no GPU support (region must be host "
                              "memory, gpu -1)");
#endif
}

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
