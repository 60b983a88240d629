#if defined(UCCL_EP_WITH_VERBS)
#include "transport/verbs_library.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "transport/transport.h"

namespace uccl_ep {

namespace {

// Loads the library and every symbol; the message says what failed (empty on success).
std::string load(VerbsLibrary& lib) {
  void* handle = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return std::string("libibverbs.so.1 could not be loaded (") + (why ? why : "unknown error") +
           "): install rdma-core's libibverbs (Debian/Ubuntu: libibverbs1 ibverbs-providers) and the NIC's "
           "driver, or choose UCCL_EP_PROXY_TRANSPORT=tcp";
  }
  std::string missing;
  const auto find = [&](auto& slot, const char* name, bool required) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(handle, name));
    if (slot == nullptr && required) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  find(lib.get_device_list, "ibv_get_device_list", true);
  find(lib.free_device_list, "ibv_free_device_list", true);
  find(lib.get_device_name, "ibv_get_device_name", true);
  find(lib.open_device, "ibv_open_device", true);
  find(lib.close_device, "ibv_close_device", true);
  find(lib.query_device, "ibv_query_device", true);
  find(lib.query_port, "ibv_query_port", true);
  find(lib.query_gid, "ibv_query_gid", true);
  find(lib.query_gid_table, "_ibv_query_gid_table", false);
  find(lib.alloc_pd, "ibv_alloc_pd", true);
  find(lib.dealloc_pd, "ibv_dealloc_pd", true);
  find(lib.reg_mr, "ibv_reg_mr", true);
  find(lib.reg_dmabuf_mr, "ibv_reg_dmabuf_mr", false);
  find(lib.dereg_mr, "ibv_dereg_mr", true);
  find(lib.create_cq, "ibv_create_cq", true);
  find(lib.destroy_cq, "ibv_destroy_cq", true);
  find(lib.create_qp, "ibv_create_qp", true);
  find(lib.modify_qp, "ibv_modify_qp", true);
  find(lib.destroy_qp, "ibv_destroy_qp", true);
  find(lib.create_ah, "ibv_create_ah", true);
  find(lib.destroy_ah, "ibv_destroy_ah", true);
  find(lib.qp_to_qp_ex, "ibv_qp_to_qp_ex", false);
  find(lib.wc_status_str, "ibv_wc_status_str", true);
  if (!missing.empty()) return "libibverbs.so.1 lacks " + missing + " (rdma-core too old?)";
  return {};
}

struct Loaded {
  VerbsLibrary library{};
  std::string error;
};

const Loaded& loaded() {
  static Loaded once;
  static std::once_flag flag;
  std::call_once(flag, [] { once.error = load(once.library); });
  return once;
}

}  // namespace

const VerbsLibrary& VerbsLibrary::get() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw TransportError("verbs transport: " + l.error);
  return l.library;
}

bool VerbsLibrary::available() { return loaded().error.empty(); }

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
