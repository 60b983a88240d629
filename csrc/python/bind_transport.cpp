// Python binding of the transports: uccl_ep_plugin._C.TcpTransport.
//
// Regions are raw addresses (e.g. a torch tensor's data_ptr()) and sizes; the caller keeps the
// memory alive until close(). Request ids are assigned here (0, 1, 2, ... per transport).
// Argument errors raise ValueError naming the argument; transport failures RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "transport/tcp_transport.h"

namespace py = pybind11;

namespace {

uint64_t non_negative(const char* name, int64_t value) {
  if (value < 0) throw std::invalid_argument(std::string(name) + " must be >= 0 (got " + std::to_string(value) + ")");
  return static_cast<uint64_t>(value);
}

class PyTcpTransport {
 public:
  PyTcpTransport(int rank, int num_ranks, int64_t region_ptr, int64_t region_bytes, int64_t reorder_seed,
                 double timeout_s, int listen_port) {
    uccl_ep::MemoryRegion region;
    region.base = reinterpret_cast<void*>(static_cast<uintptr_t>(non_negative("region_ptr", region_ptr)));
    region.bytes = non_negative("region_bytes", region_bytes);
    uccl_ep::TcpTransportOptions options;
    options.reorder_seed = reorder_seed;
    options.timeout_s = timeout_s;
    options.listen_port = listen_port;
    impl_ = std::make_unique<uccl_ep::TcpTransport>(rank, num_ranks, region, options);
  }

  uccl_ep::TcpTransport& impl() {
    if (!impl_) throw std::runtime_error("TcpTransport is not initialised");
    return *impl_;
  }

  uint64_t write(int peer, int64_t local_offset, int64_t remote_offset, int64_t length, std::optional<int64_t> imm,
                 bool unchecked) {
    const uint64_t lo = non_negative("local_offset", local_offset);
    const uint64_t ro = non_negative("remote_offset", remote_offset);
    const uint64_t len = non_negative("length", length);
    std::optional<uint32_t> imm32;
    if (imm) {
      if (*imm < 0 || *imm > 0xFFFFFFFFll) {
        throw std::invalid_argument("imm must fit in 32 bits, in [0, 2**32) (got " + std::to_string(*imm) + ")");
      }
      imm32 = static_cast<uint32_t>(*imm);
    }
    const uint64_t id = next_id_;
    {
      py::gil_scoped_release no_gil;
      if (unchecked) {
        impl().post_write_unchecked_for_test(peer, lo, ro, len, imm32, id);
      } else {
        impl().post_write(peer, lo, ro, len, imm32, id);
      }
    }
    ++next_id_;
    return id;
  }

  uint64_t atomic_add(int peer, int64_t remote_offset, int64_t value) {
    const uint64_t ro = non_negative("remote_offset", remote_offset);
    const uint64_t id = next_id_;
    {
      py::gil_scoped_release no_gil;
      impl().post_atomic_add(peer, ro, value, id);
    }
    ++next_id_;
    return id;
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

 private:
  std::unique_ptr<uccl_ep::TcpTransport> impl_;
  uint64_t next_id_ = 0;
};

}  // namespace

void bind_transport(py::module_& m) {
  py::class_<PyTcpTransport>(m, "TcpTransport", R"doc(
The tcp transport: a full mesh of TCP connections between num_ranks ranks over one registered
host memory region per rank (region_ptr, region_bytes; e.g. a uint8 tensor's data_ptr() and
numel()). Listens on UCCL_SOCKET_IFNAME's IPv4 address (else 127.0.0.1) on an OS-chosen port
(or listen_port). Bootstrap: all-gather listen_address() and call connect(addresses).
reorder_seed >= 0 (or UCCL_EP_TRANSPORT_REORDER=<seed> when -1) delivers requests out of order.
Blocking calls release the GIL.)doc")
      .def(py::init<int, int, int64_t, int64_t, int64_t, double, int>(), py::arg("rank"), py::arg("num_ranks"),
           py::arg("region_ptr"), py::arg("region_bytes"), py::arg("reorder_seed") = -1, py::arg("timeout_s") = 30.0,
           py::arg("listen_port") = 0)
      .def("listen_address", [](PyTcpTransport& t) { return t.impl().listen_address(); },
           "'ip:port' that the peers dial.")
      .def(
          "connect",
          [](PyTcpTransport& t, const std::vector<std::string>& addresses) {
            py::gil_scoped_release no_gil;
            t.impl().connect(addresses);
          },
          py::arg("addresses"), "Build the mesh from every rank's listen_address(), indexed by rank.")
      .def(
          "write",
          [](PyTcpTransport& t, int peer, int64_t local_offset, int64_t remote_offset, int64_t length,
             std::optional<int64_t> imm) { return t.write(peer, local_offset, remote_offset, length, imm, false); },
          py::arg("peer"), py::arg("local_offset"), py::arg("remote_offset"), py::arg("length"),
          py::arg("imm") = py::none(),
          "Post a write of local [local_offset, +length) to the peer's [remote_offset, +length), with an optional "
          "32-bit immediate delivered to the peer after the bytes; returns the request id.")
      .def(
          "_write_unchecked",
          [](PyTcpTransport& t, int peer, int64_t local_offset, int64_t remote_offset, int64_t length,
             std::optional<int64_t> imm) { return t.write(peer, local_offset, remote_offset, length, imm, true); },
          py::arg("peer"), py::arg("local_offset"), py::arg("remote_offset"), py::arg("length"),
          py::arg("imm") = py::none(), "Test hook: write without the sender's check of the remote range.")
      .def("atomic_add", &PyTcpTransport::atomic_add, py::arg("peer"), py::arg("remote_offset"), py::arg("value"),
           "Post an atomic add of value to the 8-byte aligned int64 at the peer's remote_offset; returns the "
           "request id.")
      .def("poll_completions", &PyTcpTransport::poll_completions,
           "Ids of requests completed since the last call. Raises RuntimeError if a peer rejected a request or "
           "a connection with requests in flight failed.")
      .def("poll_immediates", &PyTcpTransport::poll_immediates,
           "(src_rank, imm) of the writes with immediates that landed since the last call.")
      .def(
          "quiet",
          [](PyTcpTransport& t) {
            py::gil_scoped_release no_gil;
            t.impl().quiet();
          },
          "Release held requests and wait until every posted request completed (RuntimeError on failure or "
          "timeout).")
      .def("close", &PyTcpTransport::close, "Say goodbye, join the I/O thread, close every socket. Idempotent.")
      .def("outstanding", [](PyTcpTransport& t) { return t.impl().outstanding(); })
      .def("rejected_requests", [](PyTcpTransport& t) { return t.impl().rejected_requests(); })
      .def_property_readonly("rank", [](PyTcpTransport& t) { return t.impl().rank(); })
      .def_property_readonly("num_ranks", [](PyTcpTransport& t) { return t.impl().num_ranks(); })
      .def_property_readonly("reorder_seed",
                             [](PyTcpTransport& t) -> py::object {
                               const auto& c = t.impl().reorder_config();
                               return c.enabled ? py::object(py::int_(c.seed)) : py::object(py::none());
                             })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyTcpTransport& t, py::args) { t.close(); });
}
