#if defined(UCCL_EP_WITH_VERBS)
#include "transport/verbs_srd.h"

#include <arpa/inet.h>
#include <dlfcn.h>

#include <cerrno>
#include <cstring>
#include <mutex>

#include "transport/transport.h"

namespace uccl_ep {

namespace {

// rdma-core 45's EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE; Debian 12's headers (rdma-core 44) predate it.
constexpr uint32_t kEfaCapsRdmaWrite = 1u << 3;

struct Efadv {
  decltype(&::efadv_query_device) query_device = nullptr;
  decltype(&::efadv_create_qp_ex) create_qp_ex = nullptr;
};

// libefa's two entry points, or nulls where it is not installed (then no device is EFA).
const Efadv& efadv() {
  static Efadv library;
  static std::once_flag flag;
  std::call_once(flag, [] {
    void* handle = dlopen("libefa.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (handle == nullptr) return;
    library.query_device = reinterpret_cast<decltype(library.query_device)>(dlsym(handle, "efadv_query_device"));
    library.create_qp_ex = reinterpret_cast<decltype(library.create_qp_ex)>(dlsym(handle, "efadv_create_qp_ex"));
  });
  return library;
}

}  // namespace

EfaDevice query_efa_device(const VerbsLibrary& ibv, ibv_context* context) {
  EfaDevice device;
  const Efadv& library = efadv();
  // Writes on SRD go through the extended work-request interface (ibv_qp_to_qp_ex).
  if (library.query_device == nullptr || library.create_qp_ex == nullptr || ibv.qp_to_qp_ex == nullptr) {
    return device;
  }
  efadv_device_attr attr{};
  if (library.query_device(context, &attr, sizeof(attr)) != 0) return device;  // not an EFA device
  device.efa = true;
  device.rdma_write = (attr.device_caps & kEfaCapsRdmaWrite) != 0;
  device.rnr_retry = (attr.device_caps & EFADV_DEVICE_ATTR_CAPS_RNR_RETRY) != 0;
  device.max_rdma_bytes = attr.max_rdma_size;
  return device;
}

ibv_qp* create_srd_queue_pair(const VerbsLibrary& ibv, ibv_context* context, ibv_pd* pd, ibv_cq* send_cq,
                              ibv_cq* recv_cq, int max_send_wr, int max_recv_wr, int port, const EfaDevice& device,
                              const std::string& who) {
  if (!device.rdma_write) {
    throw TransportError(who + ": this EFA device does not offer RDMA write (EFA's first generation); the verbs "
                         "transport needs it: choose UCCL_EP_PROXY_TRANSPORT=tcp");
  }
  ibv_qp_init_attr_ex init{};
  init.qp_type = IBV_QPT_DRIVER;
  init.send_cq = send_cq;
  init.recv_cq = recv_cq;
  init.cap.max_send_wr = static_cast<uint32_t>(max_send_wr);
  init.cap.max_recv_wr = static_cast<uint32_t>(max_recv_wr);
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.pd = pd;
  init.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  init.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
  efadv_qp_init_attr efa{};
  efa.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
  ibv_qp* qp = efadv().create_qp_ex(context, &init, &efa, sizeof(efa));
  if (qp == nullptr) throw TransportError(who + ": efadv_create_qp_ex (SRD) failed: " + std::strerror(errno));
  // No peer is needed to reach ready-to-send: every request carries its destination.
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = static_cast<uint8_t>(port);
  attr.qkey = kSrdQueueKey;
  int failed = ibv.modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
  if (failed == 0) {
    attr = ibv_qp_attr{};
    attr.qp_state = IBV_QPS_RTR;
    failed = ibv.modify_qp(qp, &attr, IBV_QP_STATE);
  }
  if (failed == 0) {
    attr = ibv_qp_attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = 0;
    attr.rnr_retry = 7;  // as long as it takes, where the device retries at all
    failed = ibv.modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN | (device.rnr_retry ? IBV_QP_RNR_RETRY : 0));
  }
  if (failed != 0) {
    const int error = errno;
    (void)ibv.destroy_qp(qp);
    throw TransportError(who + ": bringing an SRD queue pair to ready-to-send failed: " + std::strerror(error));
  }
  return qp;
}

ibv_ah* create_srd_address(const VerbsLibrary& ibv, ibv_pd* pd, int port, const ibv_gid& gid, const std::string& who) {
  ibv_ah_attr attr{};
  attr.is_global = 1;
  attr.grh.dgid = gid;
  attr.port_num = static_cast<uint8_t>(port);
  ibv_ah* ah = ibv.create_ah(pd, &attr);
  if (ah == nullptr) throw TransportError(who + ": ibv_create_ah for a peer failed: " + std::strerror(errno));
  return ah;
}

int post_srd_write(const VerbsLibrary& ibv, ibv_qp* qp, ibv_ah* ah, uint32_t remote_qpn, uint64_t wr_id,
                   uint64_t local_address, uint32_t lkey, uint32_t length, uint64_t remote_address, uint32_t rkey,
                   std::optional<uint32_t> imm) {
  ibv_qp_ex* qpx = ibv.qp_to_qp_ex(qp);
  ibv_wr_start(qpx);
  qpx->wr_id = wr_id;
  qpx->wr_flags = IBV_SEND_SIGNALED;
  if (imm) {
    ibv_wr_rdma_write_imm(qpx, rkey, remote_address, htonl(*imm));
  } else {
    ibv_wr_rdma_write(qpx, rkey, remote_address);
  }
  if (length > 0) {
    ibv_wr_set_sge(qpx, lkey, local_address, length);
  } else {
    ibv_wr_set_sge_list(qpx, 0, nullptr);
  }
  ibv_wr_set_ud_addr(qpx, ah, remote_qpn, kSrdQueueKey);
  return ibv_wr_complete(qpx);
}

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
