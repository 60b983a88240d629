// libibverbs, loaded at run time (dlopen of libibverbs.so.1) so that one build serves hosts with and
// without RDMA. Built against the rdma-core headers; the data-path calls (ibv_post_send,
// ibv_poll_cq, ibv_post_recv) are inline in those headers and go through the device's own function
// table, so only the control-path functions below are looked up.
#pragma once

#if defined(UCCL_EP_WITH_VERBS)
#include <infiniband/verbs.h>

#include <string>

namespace uccl_ep {

struct VerbsLibrary {
  decltype(&::ibv_get_device_list) get_device_list;
  decltype(&::ibv_free_device_list) free_device_list;
  decltype(&::ibv_get_device_name) get_device_name;
  decltype(&::ibv_open_device) open_device;
  decltype(&::ibv_close_device) close_device;
  decltype(&::ibv_query_device) query_device;
  decltype(&::ibv_query_port) query_port;
  decltype(&::ibv_query_gid) query_gid;
  decltype(&::_ibv_query_gid_table) query_gid_table;  // null before rdma-core 32 (GID types unknown then)
  decltype(&::ibv_alloc_pd) alloc_pd;
  decltype(&::ibv_dealloc_pd) dealloc_pd;
  decltype(&::ibv_reg_mr) reg_mr;
  decltype(&::ibv_reg_dmabuf_mr) reg_dmabuf_mr;  // null before rdma-core 34 (no DMA-BUF registration)
  decltype(&::ibv_dereg_mr) dereg_mr;
  decltype(&::ibv_create_cq) create_cq;
  decltype(&::ibv_destroy_cq) destroy_cq;
  decltype(&::ibv_create_qp) create_qp;
  decltype(&::ibv_modify_qp) modify_qp;
  decltype(&::ibv_destroy_qp) destroy_qp;
  decltype(&::ibv_create_ah) create_ah;         // EFA's SRD queue pairs address each request
  decltype(&::ibv_destroy_ah) destroy_ah;
  decltype(&::ibv_qp_to_qp_ex) qp_to_qp_ex;     // null before rdma-core 22 (no EFA writes)
  decltype(&::ibv_wc_status_str) wc_status_str;

  // The library, loaded once per process. Throws TransportError saying that libibverbs is missing
  // (and what to install, or which transport to use instead) when it cannot be loaded.
  static const VerbsLibrary& get();
  // Whether libibverbs can be loaded here (no exception).
  static bool available();
};

// ibv_query_port as the header's inline does it: the provider's extended entry point, else the
// exported compat one.
inline int verbs_query_port(const VerbsLibrary& ibv, ibv_context* context, int port, ibv_port_attr* attr) {
  verbs_context* extended = verbs_get_ctx_op(context, query_port);
  if (extended != nullptr) return extended->query_port(context, static_cast<uint8_t>(port), attr, sizeof(*attr));
  *attr = ibv_port_attr{};
  return ibv.query_port(context, static_cast<uint8_t>(port), reinterpret_cast<_compat_ibv_port_attr*>(attr));
}

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
