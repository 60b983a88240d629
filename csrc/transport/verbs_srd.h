// AWS EFA's queue pairs for the verbs transport: scalable reliable datagram (SRD) through libefa's
// efadv (loaded at run time, like libibverbs). EFA has no reliable-connected queue pairs: an SRD queue
// pair is reliable but delivers in any order (which the Transport contract and the ordering layer
// already allow), and it is not connected: every request names the peer's address handle and queue
// pair number. Writes (and writes with immediates) need a device that reports RDMA write (EFA's
// second generation on); EFA has no atomics, so counter adds go as the ordering layer's immediates.
//
// Compiled against rdma-core's efadv.h; run on EFA hardware only (no software provider offers SRD).
#pragma once

#if defined(UCCL_EP_WITH_VERBS)
#include <infiniband/efadv.h>
#include <infiniband/verbs.h>

#include <cstdint>
#include <optional>
#include <string>

#include "transport/verbs_library.h"

namespace uccl_ep {

// What an EFA device offers the transport; `efa` false for every other device (or without libefa).
struct EfaDevice {
  bool efa = false;
  bool rdma_write = false;    // RDMA write and write with immediate
  bool rnr_retry = false;     // the device retries a send that found no receive posted
  uint32_t max_rdma_bytes = 0;
};

// Whether `context` is an EFA device, and what it can do.
EfaDevice query_efa_device(const VerbsLibrary& ibv, ibv_context* context);

// A queue pair key both sides use; any value, the same on every rank.
constexpr uint32_t kSrdQueueKey = 0x75cce9u;

// Creates an SRD queue pair on `port` and brings it to ready-to-send (nothing of the peer is needed for
// that). Throws TransportError beginning with `who`.
ibv_qp* create_srd_queue_pair(const VerbsLibrary& ibv, ibv_context* context, ibv_pd* pd, ibv_cq* send_cq,
                              ibv_cq* recv_cq, int max_send_wr, int max_recv_wr, int port, const EfaDevice& device,
                              const std::string& who);

// An address handle for the peer with `gid` on `port`; throws TransportError beginning with `who`.
ibv_ah* create_srd_address(const VerbsLibrary& ibv, ibv_pd* pd, int port, const ibv_gid& gid, const std::string& who);

// Posts a signaled RDMA write (with `imm` where given) of `length` bytes at `local_address` (key `lkey`)
// to `remote_address` (key `rkey`) of the peer at `ah` / `remote_qpn`. Returns 0 or the errno.
int post_srd_write(const VerbsLibrary& ibv, ibv_qp* qp, ibv_ah* ah, uint32_t remote_qpn, uint64_t wr_id,
                   uint64_t local_address, uint32_t lkey, uint32_t length, uint64_t remote_address, uint32_t rkey,
                   std::optional<uint32_t> imm);

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
