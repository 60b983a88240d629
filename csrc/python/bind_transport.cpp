// Python binding of the transports: uccl_ep_plugin._C.TcpTransport (over host memory, or in CUDA
// builds device memory), and in CUDA builds uccl_ep_plugin._C.CudaCopyTransport. Both share one
// Python API (write, atomic_add, poll_*, quiet, close, listen_address, connect, outstanding).
//
// Regions are raw addresses (e.g. a torch tensor's data_ptr()) and sizes, or a PeerMemory; the
// caller keeps the memory alive until close(). Request ids are assigned here (0, 1, 2, ... per
// transport). Argument errors raise ValueError naming the argument; transport failures RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "transport/tcp_transport.h"
#if defined(UCCL_EP_WITH_VERBS)
#include "transport/verbs_devices.h"
#include "transport/verbs_registration.h"
#include "transport/verbs_transport.h"
#endif
#if defined(UCCL_EP_WITH_GPU)
#include "nvlink/peer_memory.h"
#include "transport/cuda_copy_transport.h"
#endif

#include "python/arguments.h"

namespace py = pybind11;

namespace {

using uccl_ep::bindings::non_negative;
using uccl_ep::bindings::region_at;

// A write's arguments as the transports take them.
struct WriteArgs {
  uint64_t local_offset;
  uint64_t remote_offset;
  uint64_t length;
  std::optional<uint32_t> imm;
};

WriteArgs write_args(int64_t local_offset, int64_t remote_offset, int64_t length, std::optional<int64_t> imm) {
  WriteArgs args{non_negative("local_offset", local_offset), non_negative("remote_offset", remote_offset),
                 non_negative("length", length), std::nullopt};
  if (imm) {
    if (*imm < 0 || *imm > 0xFFFFFFFFll) {
      throw std::invalid_argument("imm must fit in 32 bits, in [0, 2**32) (got " + std::to_string(*imm) + ")");
    }
    args.imm = static_cast<uint32_t>(*imm);
  }
  return args;
}

// What the Python classes of every transport share: argument conversion, request ids, and
// polling until the transport has nothing more to hand out.
template <typename T>
class PyTransport {
 public:
  T& impl() {
    if (!impl_) throw std::runtime_error("the transport is not initialised");
    return *impl_;
  }

  // Posts through `post_request(transport, id)` with the GIL released; the id is used up
  // only if posting succeeded.
  template <typename Post>
  uint64_t post(Post&& post_request) {
    const uint64_t id = next_id_;
    {
      py::gil_scoped_release no_gil;
      post_request(impl(), id);
    }
    ++next_id_;
    return id;
  }

  uint64_t write(int peer, int64_t local_offset, int64_t remote_offset, int64_t length, std::optional<int64_t> imm) {
    const WriteArgs a = write_args(local_offset, remote_offset, length, imm);
    return post([&](T& t, uint64_t id) { t.post_write(peer, a.local_offset, a.remote_offset, a.length, a.imm, id); });
  }

  uint64_t atomic_add(int peer, int64_t remote_offset, int64_t value) {
    const uint64_t ro = non_negative("remote_offset", remote_offset);
    return post([&](T& t, uint64_t id) { t.post_atomic_add(peer, ro, value, id); });
  }

  std::vector<uint64_t> poll_completions() {
    std::vector<uint64_t> out;
    uint64_t buf[1024];
    for (;;) {
      const size_t n = impl().poll_completions(buf, 1024);
      out.insert(out.end(), buf, buf + n);
      if (n < 1024) return out;
    }
  }

  std::vector<std::pair<uint32_t, uint32_t>> poll_immediates() {
    std::vector<std::pair<uint32_t, uint32_t>> out;
    uccl_ep::ImmediateEvent buf[1024];
    for (;;) {
      const size_t n = impl().poll_immediates(buf, 1024);
      for (size_t i = 0; i < n; ++i) out.emplace_back(buf[i].src_rank, buf[i].imm);
      if (n < 1024) return out;
    }
  }

  void close() {
    if (!impl_) return;
    py::gil_scoped_release no_gil;
    impl_->close();
  }

 protected:
  std::unique_ptr<T> impl_;

 private:
  uint64_t next_id_ = 0;
};

class PyTcpTransport : public PyTransport<uccl_ep::TcpTransport> {
 public:
  PyTcpTransport(int rank, int num_ranks, int64_t region_ptr, int64_t region_bytes, int64_t reorder_seed,
                 double timeout_s, int listen_port, std::optional<int> device, std::optional<int64_t> staging_bytes,
                 bool stage_host_region) {
    const uccl_ep::MemoryRegion region = region_at(region_ptr, region_bytes);
    uccl_ep::TcpTransportOptions options;
    options.reorder_seed = reorder_seed;
    options.timeout_s = timeout_s;
    options.listen_port = listen_port;
    if (device) options.device = static_cast<int>(non_negative("device", *device));
    if (staging_bytes) {
      options.staging_bytes = non_negative("staging_bytes", *staging_bytes);
      if (options.staging_bytes == 0) throw std::invalid_argument("staging_bytes must be > 0, or None for the default");
    }
    options.stage_host_region_for_test = stage_host_region;
    impl_ = std::make_unique<uccl_ep::TcpTransport>(rank, num_ranks, region, options);
  }

  uint64_t write_unchecked(int peer, int64_t local_offset, int64_t remote_offset, int64_t length,
                           std::optional<int64_t> imm) {
    const WriteArgs a = write_args(local_offset, remote_offset, length, imm);
    return post([&](uccl_ep::TcpTransport& t, uint64_t id) {
      t.post_write_unchecked_for_test(peer, a.local_offset, a.remote_offset, a.length, a.imm, id);
    });
  }
};

#if defined(UCCL_EP_WITH_GPU)
class PyCudaCopyTransport : public PyTransport<uccl_ep::CudaCopyTransport> {
 public:
  PyCudaCopyTransport(int rank, int num_ranks, const uccl_ep::PeerMemory& peer_memory, int64_t reorder_seed,
                      double timeout_s) {
    uccl_ep::CudaCopyTransportOptions options;
    options.reorder_seed = reorder_seed;
    options.timeout_s = timeout_s;
    impl_ = std::make_unique<uccl_ep::CudaCopyTransport>(rank, num_ranks, peer_memory, options);
  }
};
#endif

#if defined(UCCL_EP_WITH_VERBS)
class PyVerbsTransport : public PyTransport<uccl_ep::VerbsTransport> {
 public:
  PyVerbsTransport(int rank, int num_ranks, int64_t region_ptr, int64_t region_bytes, const std::string& device,
                   int gid_index, int service_level, int traffic_class, int64_t reorder_seed, double timeout_s,
                   int64_t max_inflight_bytes, int64_t max_inflight_requests, int qps_per_peer, int gpu) {
    const uccl_ep::VerbsTransportOptions options{device,       gid_index, service_level,      traffic_class,
                                                 reorder_seed, timeout_s, max_inflight_bytes, max_inflight_requests,
                                                 qps_per_peer, gpu};
    const uccl_ep::MemoryRegion region = region_at(region_ptr, region_bytes);
    py::gil_scoped_release no_gil;
    impl_ = std::make_unique<uccl_ep::VerbsTransport>(rank, num_ranks, region, options);
  }
};
#endif

// The methods every transport class has.
template <typename W>
void def_transport_api(py::class_<W>& cls) {
  cls.def("listen_address", [](W& t) { return t.impl().listen_address(); },
          "The address that the peers pass to connect().")
      .def(
          "connect",
          [](W& t, const std::vector<std::string>& addresses) {
            py::gil_scoped_release no_gil;
            t.impl().connect(addresses);
          },
          py::arg("addresses"), "Connect to every rank from its listen_address(), indexed by rank.")
      .def("write", &W::write, py::arg("peer"), py::arg("local_offset"), py::arg("remote_offset"), py::arg("length"),
           py::arg("imm") = py::none(),
           "Post a write of local [local_offset, +length) to the peer's [remote_offset, +length), with an optional "
           "32-bit immediate delivered to the peer after the bytes; returns the request id.")
      .def("atomic_add", &W::atomic_add, py::arg("peer"), py::arg("remote_offset"), py::arg("value"),
           "Post an atomic add of value to the 8-byte aligned int64 at the peer's remote_offset; returns the "
           "request id.")
      .def("poll_completions", &W::poll_completions,
           "Ids of requests completed since the last call. Raises RuntimeError if a peer rejected a request or "
           "a connection with requests in flight failed.")
      .def("poll_immediates", &W::poll_immediates,
           "(src_rank, imm) of the writes with immediates that landed since the last call.")
      .def(
          "quiet",
          [](W& t) {
            py::gil_scoped_release no_gil;
            t.impl().quiet();
          },
          "Release held requests and wait until every posted request completed (RuntimeError on failure or "
          "timeout).")
      .def("close", &W::close, "Flush, say goodbye, join the I/O thread, release every handle. Idempotent.")
      .def("outstanding", [](W& t) { return t.impl().outstanding(); })
      .def("fence", [](W& t) { return t.impl().fence(); },
           "Order later writes after earlier ones on the device without waiting: False where the transport "
           "cannot (tcp), or while a request with an immediate or an atomic add is unfinished.")
      .def("oldest_outstanding", [](W& t) { return t.impl().oldest_outstanding(); },
           "Where the unfinished requests stand (what a proxy's timeout reports), or '' when none is.")
      .def_property_readonly("rank", [](W& t) { return t.impl().rank(); })
      .def_property_readonly("num_ranks", [](W& t) { return t.impl().num_ranks(); })
      .def_property_readonly("reorder_seed",
                             [](W& t) -> py::object {
                               const auto& c = t.impl().reorder_config();
                               return c.enabled ? py::object(py::int_(c.seed)) : py::object(py::none());
                             })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](W& t, py::args) { t.close(); });
}

}  // namespace

void bind_transport(py::module_& m) {
  py::class_<PyTcpTransport> tcp(m, "TcpTransport", R"doc(
The tcp transport: a full mesh of TCP connections between num_ranks ranks over one registered
memory region per rank (region_ptr, region_bytes; e.g. a uint8 tensor's data_ptr() and numel()):
host memory, or with `device` (GPU builds) memory of that GPU, staged through staging_bytes of
pinned host memory (None: UCCL_EP_TCP_STAGING_BYTES, else 64 MiB). Listens on UCCL_SOCKET_IFNAME's
IPv4 address (else 127.0.0.1) on an OS-chosen port (or listen_port). Bootstrap: all-gather
listen_address() and call connect(addresses). reorder_seed >= 0 (or UCCL_EP_TRANSPORT_REORDER=<seed>
when -1) delivers requests out of order. _stage_host_region (a test hook) stages a host region the
way a device one is. Blocking calls release the GIL.)doc");
  tcp.def(py::init<int, int, int64_t, int64_t, int64_t, double, int, std::optional<int>, std::optional<int64_t>,
                   bool>(),
          py::arg("rank"), py::arg("num_ranks"), py::arg("region_ptr"), py::arg("region_bytes"),
          py::arg("reorder_seed") = -1, py::arg("timeout_s") = 30.0, py::arg("listen_port") = 0,
          py::arg("device") = py::none(), py::arg("staging_bytes") = py::none(), py::arg("_stage_host_region") = false)
      .def("_write_unchecked", &PyTcpTransport::write_unchecked, py::arg("peer"), py::arg("local_offset"),
           py::arg("remote_offset"), py::arg("length"), py::arg("imm") = py::none(),
           "Test hook: write without the sender's check of the remote range.")
      .def("rejected_requests", [](PyTcpTransport& t) { return t.impl().rejected_requests(); })
      .def_property_readonly(
          "staging_bytes",
          [](PyTcpTransport& t) -> py::object {
            const uint64_t bytes = t.impl().staging_bytes();
            return bytes ? py::object(py::int_(bytes)) : py::object(py::none());
          },
          "Bytes of staging of a device region (None for a host region).")
      .def_property_readonly("region_is_host_memory",
                             [](PyTcpTransport& t) { return t.impl().region_is_host_memory(); });
  def_transport_api(tcp);

#if defined(UCCL_EP_WITH_VERBS)
  py::class_<PyVerbsTransport> verbs(m, "VerbsTransport", R"doc(
The verbs transport: RDMA reliable-connected queue pairs to each peer over libibverbs (loaded at run
time), on one registered region per rank (region_ptr, region_bytes): host memory, or memory of GPU
`gpu` (>= 0; registered through DMA-BUF where the drivers offer it, else peer memory). device: "name"
or "name:port" ("" : UCCL_IB_HCA, else the first device); gid_index -2: UCCL_IB_GID_INDEX, else -1:
the first RoCE v2 IPv4 GID; service_level / traffic_class -1: UCCL_IB_SL / UCCL_IB_TC, else 0.
max_inflight_bytes (-1: UCCL_IB_MAX_INFLIGHT_BYTES, else none; 0: none) and max_inflight_requests (0:
none) cap what the NIC has in flight over all peers. qps_per_peer (0: UCCL_IB_QPS_PER_PEER, else 1;
the same on every rank): the queue pairs to each peer, which requests take in turn.
Bootstrap: all-gather listen_address() (this rank's connection record) and call connect(addresses),
then pass a barrier before posting. reorder_seed >= 0 (or UCCL_EP_TRANSPORT_REORDER=<seed> when -1)
posts requests out of order. Blocking calls release the GIL.)doc");
  verbs.def(py::init<int, int, int64_t, int64_t, const std::string&, int, int, int, int64_t, double, int64_t,
                     int64_t, int, int>(),
            py::arg("rank"), py::arg("num_ranks"), py::arg("region_ptr"), py::arg("region_bytes"),
            py::arg("device") = "", py::arg("gid_index") = -2, py::arg("service_level") = -1,
            py::arg("traffic_class") = -1, py::arg("reorder_seed") = -1, py::arg("timeout_s") = 30.0,
            py::arg("max_inflight_bytes") = -1, py::arg("max_inflight_requests") = 0, py::arg("qps_per_peer") = 0,
            py::arg("gpu") = -1)
      .def_property_readonly("peak_inflight_bytes", [](PyVerbsTransport& t) { return t.impl().peak_inflight_bytes(); },
                             "The most bytes the NIC had in flight at once so far.")
      .def_property_readonly("peak_inflight_requests",
                             [](PyVerbsTransport& t) { return t.impl().peak_inflight_requests(); })
      .def_property_readonly("device_name", [](PyVerbsTransport& t) { return t.impl().device_name(); })
      .def_property_readonly("port", [](PyVerbsTransport& t) { return t.impl().port(); })
      .def_property_readonly("gid_index", [](PyVerbsTransport& t) { return t.impl().gid_index(); },
                             "The GID table entry used (-1: none, InfiniBand LID routing).")
      .def_property_readonly("native_atomics", [](PyVerbsTransport& t) { return t.impl().native_atomics(); },
                             "Whether the device does RDMA atomics (atomic adds to peers need them).")
      .def_property_readonly("qps_per_peer", [](PyVerbsTransport& t) { return t.impl().qps_per_peer(); },
                             "The queue pairs to each peer.")
      .def_property_readonly("srd", [](PyVerbsTransport& t) { return t.impl().srd(); },
                             "Whether the device is EFA and the queue pairs are SRD (unordered, no atomics).")
      .def_property_readonly("registration", [](PyVerbsTransport& t) { return t.impl().registration(); },
                             "How the region was registered: 'host memory', 'DMA-BUF' or 'peer memory'.")
      .def_property_readonly("region_is_host_memory",
                             [](PyVerbsTransport& t) { return t.impl().region_is_host_memory(); });
  def_transport_api(verbs);
  m.def("verbs_gpu_registration_failure", &uccl_ep::gpu_registration_failure, py::arg("bytes"), py::arg("dmabuf"),
        py::arg("peer_errno"),
        "The message of a GPU region neither DMA-BUF nor peer memory could register (what each said, what to do).");
  m.def("verbs_available", &uccl_ep::VerbsLibrary::available,
        "Whether libibverbs.so.1 can be loaded here (the verbs transport needs it, and an RDMA device).");
  m.def(
      "verbs_devices",
      [] {
        static const char* gid_types[] = {"IB", "RoCE v1", "RoCE v2"};
        py::list devices;
        for (const uccl_ep::VerbsDeviceInfo& device : uccl_ep::list_verbs_devices()) {
          py::list ports;
          for (const uccl_ep::VerbsPortInfo& port : device.ports) {
            py::list gids;
            for (const uccl_ep::VerbsGid& gid : port.gids) {
              gids.append(py::dict(py::arg("index") = gid.index,
                                   py::arg("type") = gid.type >= 0 && gid.type <= 2 ? gid_types[gid.type] : "unknown",
                                   py::arg("address") = uccl_ep::verbs_gid_text(gid.gid)));
            }
            ports.append(py::dict(py::arg("port") = port.port, py::arg("state") = port.state,
                                  py::arg("link_layer") = port.link_layer, py::arg("lid") = port.lid,
                                  py::arg("gids") = gids, py::arg("gid_index") = port.chosen_gid));
          }
          devices.append(py::dict(py::arg("name") = device.name, py::arg("atomics") = device.atomics,
                                  py::arg("queue_pairs") = device.queue_pairs, py::arg("ports") = ports,
                                  py::arg("error") = device.error));
        }
        return devices;
      },
      "This host's RDMA devices through libibverbs: name, atomics ('none', 'hca', 'global'), queue_pairs ('RC', or "
      "'SRD' on EFA), error (''), and per "
      "port its state, link layer, LID, non-empty GID entries (index, type, address) and gid_index, the entry the "
      "verbs transport uses by default (the first RoCE v2 IPv4 one; -1: none, or InfiniBand). RuntimeError "
      "without libibverbs.");
#endif

#if defined(UCCL_EP_WITH_GPU)
  py::class_<PyCudaCopyTransport> cuda_copy(m, "CudaCopyTransport", R"doc(
The cuda-copy transport: writes go through the copy engines (cudaMemcpyAsync into the peers'
buffers, which peer_memory has mapped with CUDA IPC), atomic adds through a one-thread kernel,
immediates and acknowledgements through a tcp transport used for control only.
peer_memory (a PeerMemory whose open_peers() was called with this rank) is the region, and
stays referenced until this object goes. Bootstrap: all-gather listen_address() (it also
carries this rank's region size) and call connect(addresses). reorder_seed >= 0 (or
UCCL_EP_TRANSPORT_REORDER=<seed> when -1) issues copies and delivers immediates out of order.
Coalesce writes: each costs about 2.3 us of CPU. Blocking calls release the GIL.)doc");
  cuda_copy.def(py::init<int, int, const uccl_ep::PeerMemory&, int64_t, double>(), py::arg("rank"),
                py::arg("num_ranks"), py::arg("peer_memory"), py::arg("reorder_seed") = -1,
                py::arg("timeout_s") = 30.0, py::keep_alive<1, 4>());
  def_transport_api(cuda_copy);
#endif
}
