// What the RDMA devices of this host offer, through libibverbs (verbs_library.h): their ports, link
// layers and GID tables, and whether they do atomics. The verbs transport picks its GID here, and
// `uccl-ep doctor` lists the same facts.
#pragma once

#if defined(UCCL_EP_WITH_VERBS)
#include <infiniband/verbs.h>

#include <string>
#include <vector>

#include "transport/verbs_library.h"

namespace uccl_ep {

struct VerbsGid {
  int index;
  int type;  // IBV_GID_TYPE_IB / _ROCE_V1 / _ROCE_V2; -1 where the library cannot tell
  ibv_gid gid;
};

// The non-empty entries of a port's GID table: one call where the library has _ibv_query_gid_table,
// else one query per entry.
std::vector<VerbsGid> verbs_gid_table(const VerbsLibrary& ibv, ibv_context* context, int port, int table_length);

// The index of the first RoCE v2 entry with an IPv4-mapped address (an entry of unknown type counts
// when its address is IPv4-mapped), or -1.
int verbs_roce_v2_ipv4_gid(const std::vector<VerbsGid>& table);

// A GID as text: the IPv4 address of an IPv4-mapped one, else the IPv6 form.
std::string verbs_gid_text(const ibv_gid& gid);

struct VerbsPortInfo {
  int port;
  std::string state;       // "active", "down", ...
  std::string link_layer;  // "InfiniBand" or "Ethernet"
  int lid;
  std::vector<VerbsGid> gids;
  int chosen_gid;          // what the transport uses by default: verbs_roce_v2_ipv4_gid, -1 on InfiniBand, 0 on EFA
};

struct VerbsDeviceInfo {
  std::string name;
  std::string atomics;  // "none", "hca" (atomic among the NIC's own), "global"
  std::string queue_pairs;  // what the transport uses: "RC", or "SRD" on EFA ("SRD without RDMA write": unusable)
  std::vector<VerbsPortInfo> ports;
  std::string error;    // the device could not be opened or queried
};

// Every RDMA device of this host. Throws TransportError when libibverbs cannot be loaded.
std::vector<VerbsDeviceInfo> list_verbs_devices();

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
