// Python bindings of the GPU-driven rail hop of normal mode across hosts (kernels/rail.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "kernels/rail.h"
#include "python/arguments.h"

namespace py = pybind11;

void bind_rail(py::module_& m) {
  m.def("rail_control_bytes", &uccl_ep::rail_control_bytes, py::arg("num_hosts"),
        "Bytes at the start of a GPU-driven rail's region that hold its control words, for num_hosts hosts.");
  m.def("rail_counters_offset", &uccl_ep::rail_counters_offset, py::arg("num_hosts"),
        "Where a GPU-driven rail's region keeps the proxies' counter (its ProxyConfig.counters_offset).");
  m.def("rail_flags_offset", &uccl_ep::rail_flags_offset, py::arg("num_hosts"),
        "Where a GPU-driven rail's region keeps the count flags (its ProxyConfig.flags_offset).");
#if defined(UCCL_EP_WITH_GPU)
  using uccl_ep::DeviceRail;
  using namespace uccl_ep::bindings;
  py::class_<DeviceRail>(m, "DeviceRail",
                         "The rail hop between hosts driven by the GPU: one kernel per exchange copies the rows into "
                         "send slots and hands the proxy the writes; its receiving blocks wait for each source's "
                         "count and copy the rows out.")
      .def(py::init([](std::uintptr_t region, int64_t region_bytes, int host, int num_hosts, std::uintptr_t fifos,
                       int num_fifos, double timeout_s, int device) {
             return new DeviceRail(ptr<uint8_t>(region), region_bytes, host, num_hosts,
                                   ptr<const uccl_ep::FifoView>(fifos), num_fifos, timeout_s, device);
           }),
           py::arg("region"), py::arg("region_bytes"), py::arg("host"), py::arg("num_hosts"), py::arg("fifos"),
           py::arg("num_fifos"), py::arg("timeout_s"), py::arg("device"))
      .def_property_readonly("slot_bytes", &DeviceRail::slot_bytes)
      .def_property_readonly("exchanges", &DeviceRail::exchanges)
      .def(
          "exchange",
          [](DeviceRail& rail, std::uintptr_t rows, std::uintptr_t out, int64_t width,
             const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts, std::uintptr_t stream) {
            return rail.exchange(ptr<const uint8_t>(rows), ptr<uint8_t>(out), width, send_counts, recv_counts,
                                 as_stream(stream));
          },
          py::arg("rows"), py::arg("out"), py::arg("width"), py::arg("send_counts"), py::arg("recv_counts"),
          py::arg("stream"), "Launch one exchange on `stream`; returns the transport writes it asks of the proxy.")
      .def(
          "failure",
          [](const DeviceRail& rail) -> py::object {
            const uccl_ep::RailFailure f = rail.failure();
            if (f.failed == 0) return py::none();
            static const char* const kWaits[] = {"", "freed", "arrived", "bad_count", "fifo_full"};
            py::dict d;
            d["what"] = (f.phase >= 1 && f.phase <= 4) ? kWaits[f.phase] : "unknown";
            d["peer"] = f.peer;
            d["exchange"] = f.exchange;
            d["expected"] = f.expected;
            d["seen"] = f.seen;
            return d;
          },
          "The first failed wait the kernels recorded (a dict), or None.")
      .def("release", &DeviceRail::release, "Wait for the device and free the rail's memory (idempotent).");
#endif
}
