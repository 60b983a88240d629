#if defined(UCCL_EP_WITH_VERBS)
#include "transport/verbs_devices.h"
#include "transport/verbs_srd.h"

#include <arpa/inet.h>

#include <cerrno>
#include <cstring>

namespace uccl_ep {

namespace {

bool ipv4_mapped(const ibv_gid& gid) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(gid.raw, prefix, sizeof(prefix)) == 0;
}

bool empty(const ibv_gid& gid) {
  static const ibv_gid zero{};
  return std::memcmp(gid.raw, zero.raw, sizeof(zero.raw)) == 0;
}

const char* port_state(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_DOWN: return "down";
    case IBV_PORT_INIT: return "init";
    case IBV_PORT_ARMED: return "armed";
    case IBV_PORT_ACTIVE: return "active";
    case IBV_PORT_ACTIVE_DEFER: return "active-defer";
    default: return "unknown";
  }
}

}  // namespace

std::vector<VerbsGid> verbs_gid_table(const VerbsLibrary& ibv, ibv_context* context, int port, int table_length) {
  std::vector<VerbsGid> table;
  if (ibv.query_gid_table != nullptr) {
    // The device's valid entries at once (a scan costs a system call per entry). Sized by this port's
    // table: a device with more ports and more valid entries than that fails, and the scan below serves.
    std::vector<ibv_gid_entry> entries(static_cast<size_t>(table_length));
    const ssize_t n = ibv.query_gid_table(context, entries.data(), entries.size(), 0, sizeof(ibv_gid_entry));
    for (ssize_t i = 0; i < n; ++i) {
      const ibv_gid_entry& e = entries[static_cast<size_t>(i)];
      if (static_cast<int>(e.port_num) == port && !empty(e.gid)) {
        table.push_back(VerbsGid{static_cast<int>(e.gid_index), static_cast<int>(e.gid_type), e.gid});
      }
    }
    if (n > 0) return table;
  }
  for (int i = 0; i < table_length; ++i) {
    ibv_gid gid{};
    if (ibv.query_gid(context, static_cast<uint8_t>(port), i, &gid) == 0 && !empty(gid)) {
      table.push_back(VerbsGid{i, -1, gid});
    }
  }
  return table;
}

int verbs_roce_v2_ipv4_gid(const std::vector<VerbsGid>& table) {
  for (const VerbsGid& entry : table) {
    if ((entry.type == IBV_GID_TYPE_ROCE_V2 || entry.type == -1) && ipv4_mapped(entry.gid)) return entry.index;
  }
  return -1;
}

std::string verbs_gid_text(const ibv_gid& gid) {
  char text[INET6_ADDRSTRLEN] = {};
  if (ipv4_mapped(gid)) {
    inet_ntop(AF_INET, gid.raw + 12, text, sizeof(text));
  } else {
    inet_ntop(AF_INET6, gid.raw, text, sizeof(text));
  }
  return text;
}

std::vector<VerbsDeviceInfo> list_verbs_devices() {
  const VerbsLibrary& ibv = VerbsLibrary::get();
  std::vector<VerbsDeviceInfo> devices;
  int count = 0;
  ibv_device** list = ibv.get_device_list(&count);
  if (list == nullptr) return devices;
  for (int d = 0; d < count; ++d) {
    VerbsDeviceInfo info;
    info.name = ibv.get_device_name(list[d]);
    ibv_context* context = ibv.open_device(list[d]);
    if (context == nullptr) {
      info.error = std::string("cannot open: ") + std::strerror(errno);
      devices.push_back(info);
      continue;
    }
    ibv_device_attr attr{};
    if (ibv.query_device(context, &attr) != 0) {
      info.error = "ibv_query_device failed";
    } else {
      info.atomics = attr.atomic_cap == IBV_ATOMIC_NONE ? "none" : attr.atomic_cap == IBV_ATOMIC_HCA ? "hca" : "global";
      const EfaDevice efa = query_efa_device(ibv, context);
      info.queue_pairs = !efa.efa ? "RC" : efa.rdma_write ? "SRD" : "SRD without RDMA write";
      for (int port = 1; port <= attr.phys_port_cnt; ++port) {
        ibv_port_attr port_attr{};
        if (verbs_query_port(ibv, context, port, &port_attr) != 0) continue;
        VerbsPortInfo p;
        p.port = port;
        p.state = port_state(port_attr.state);
        p.link_layer = port_attr.link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand" : "Ethernet";
        p.lid = port_attr.lid;
        p.gids = verbs_gid_table(ibv, context, port, port_attr.gid_tbl_len);
        p.chosen_gid = efa.efa ? 0
                       : port_attr.link_layer == IBV_LINK_LAYER_INFINIBAND ? -1
                                                                           : verbs_roce_v2_ipv4_gid(p.gids);
        info.ports.push_back(std::move(p));
      }
    }
    (void)ibv.close_device(context);
    devices.push_back(std::move(info));
  }
  ibv.free_device_list(list);
  return devices;
}

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
